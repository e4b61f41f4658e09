-- One rank's job for spec/dist_spec.lua, started by scripts/ftrun -n 2
-- (one process per GPU): ft.dist.init() from ftrun's environment, an
-- all_reduce, then ring attention (forward and backward, causal, GQA) of
-- this rank's zigzag shard against attention of the whole sequence on
-- this rank's GPU, and nn.MultiheadAttention with context_parallel against
-- the same layer over the whole sequence. Prints "rank R ok" and exits 0,
-- or raises.
local ft = require "flashtile"

local comm = ft.dist.init { timeout = 60 }
local rank, W = comm:rank(), comm:world_size()
local dev = "cuda:" .. comm:devices()[1]

local x = ft.full({ 4 }, rank + 1, { dtype = "f32", device = dev })
comm:all_reduce(x)
assert(x:cpu():totable()[1] == W * (W + 1) / 2, "all_reduce")

-- the same inputs on every rank (the same seeds)
local B, N, H, Hk, d = 1, 256 * W, 4, 2, 64
local function input(shape, seed)
  return ft.randn(shape, { seed = seed }):to("bf16"):to(dev)
end
local q, k, v, dout = input({ B, N, H, d }, 1), input({ B, N, Hk, d }, 2), input({ B, N, Hk, d }, 3),
                      input({ B, N, H, d }, 4)
local o = { causal = true }
local out, lse = ft.attention(q, k, v, o)
local dq, dk, dv = ft.attention_backward(dout, q, k, v, out, lse, o)

local function shard(t) return ft.dist.shard(t, rank, W) end
local rout, rlse = ft.ring_attention(shard(q), shard(k), shard(v), { comm = comm, causal = true })
local rdq, rdk, rdv = ft.ring_attention_backward(shard(dout), shard(q), shard(k), shard(v), rout, rlse,
                                                 { comm = comm, causal = true })
for name, pair in pairs { out = { rout, out }, dq = { rdq, dq }, dk = { rdk, dk }, dv = { rdv, dv } } do
  local want = shard(pair[2]):double()
  local e = ft.max_abs_diff(pair[1]:double(), want)
  local largest = want:abs():max()
  if type(largest) ~= "number" then largest = largest:item() end
  local scale = math.max(1, largest)
  assert(e <= 2^-6 * scale, ("rank %d: %s differs from one GPU's by %g (largest %g)"):format(rank,
    name, e, scale))
end

-- nn.MultiheadAttention with context_parallel (rotary, causal, GQA) on this
-- rank's shard against the same layer over the whole sequence: outputs,
-- input gradients, and weight gradients summed over the ranks
local nn = require "flashtile.nn"
local dim = 64
local function layer(cp)
  return nn.MultiheadAttention { dim = dim, heads = 4, kv_heads = 2, causal = true, rotary = true,
                                 seed = 7, dtype = "f32", device = dev, context_parallel = cp }
end
local whole, part = layer(nil), layer(comm)
local x = ft.randn({ 2, N, dim }, { seed = 5 }):to(dev)
local gy = ft.randn({ 2, N, dim }, { seed = 6 }):to(dev)
local y, gx = whole:forward(x), whole:backward(x, gy)
local ys, gxs = part:forward(shard(x)), part:backward(shard(x), shard(gy))
local function close(a, b, what)
  local e = ft.max_abs_diff(a:double(), b:double())
  assert(e < 1e-3, ("rank %d: nn %s differs by %g"):format(rank, what, e))
end
close(ys, shard(y), "output")
close(gxs, shard(gx), "input gradient")
ft.dist.all_reduce_grads(part, comm, "sum")
local _, g1 = whole:parameters()
local _, g2 = part:parameters()
for i = 1, #g1 do close(g2[i], g1[i], "weight gradient " .. i) end
comm:free()
print(("rank %d ok"):format(rank))
