--- flashtile.dist: several GPUs through NCCL (lib/dist.c), and ring
-- attention over them (context parallelism). Reached as ft.dist.
--
--   -- one process driving two GPUs
--   local comm = ft.dist.init{devices = {0, 1}}
--   -- one process per GPU, started by scripts/ftrun -n 2 script.lua
--   local comm = ft.dist.init()      -- rank, world_size, id_file, device from ftrun
--
-- Ranks and devices count from 0, as in "cuda:0". Calls take a tensor
-- when the process has one local rank, or a list of tensors, one per local
-- rank (device) in order; they are ordered with the flash kernels on each
-- device like any kernel, and run on a stream of their own. NVLink
-- multicast stays off (NCCL_NVLS_ENABLE=0).
local core = require "flashtile.core"
local C = core.dist

local M = {}

local function is_integer(v)
  return type(v) == "number" and v == math.floor(v) and v >= -2 ^ 31 and v < 2 ^ 31
end

local function check_opts(ctx, opts, allowed)
  for k in pairs(opts) do
    if not allowed[k] then
      local names = {}
      for n in pairs(allowed) do names[#names + 1] = n end
      table.sort(names)
      error(("%s: unknown option '%s' (expected %s)"):format(ctx, tostring(k),
        table.concat(names, ", ")), 3)
    end
  end
end

--- Whether this flashtile was built with NCCL.
function M.built() return C.built() end

local function env_int(name)
  local v = os.getenv(name)
  return v and tonumber(v) or nil
end

--- A communicator.
--   ft.dist.init{devices = {0, 1}}: this process drives the listed devices,
--     ranks 0 .. #devices - 1.
--   ft.dist.init{rank = r, world_size = n, id_file = path [, device = d]
--     [, timeout = seconds]}: this process is rank r of n on device d
--     (default: FT_DEVICE, else r modulo the devices); rank 0 writes NCCL's
--     id into id_file and the others read it; a rank that is not there
--     within timeout seconds (default 60) makes every rank that is fail
--     with an error, instead of waiting forever.
--   ft.dist.init() (or fields left out) under scripts/ftrun: FT_RANK,
--     FT_WORLD_SIZE, FT_ID_FILE, FT_DEVICE.
function M.init(opts)
  local ctx = "ft.dist.init"
  if opts ~= nil and type(opts) ~= "table" then
    error(ctx .. ": opts must be a table", 2)
  end
  opts = opts or {}
  check_opts(ctx, opts, { devices = true, rank = true, world_size = true, id_file = true,
                          device = true, timeout = true })
  if opts.devices ~= nil then
    if type(opts.devices) ~= "table" or #opts.devices < 1 then
      error(ctx .. ": devices must be a list of device numbers, e.g. {0, 1}", 2)
    end
    for k in pairs(opts) do
      if k ~= "devices" then
        error(ctx .. ": devices (one process, several GPUs) takes no " .. k, 2)
      end
    end
    for i, d in ipairs(opts.devices) do
      if not is_integer(d) or d < 0 then
        error(("%s: devices[%d] must be a device number (0, 1, ...), got %s"):format(ctx, i,
          tostring(d)), 2)
      end
    end
    return C.init_devices(opts.devices)
  end
  local rank = opts.rank or env_int("FT_RANK")
  local world = opts.world_size or env_int("FT_WORLD_SIZE")
  local id_file = opts.id_file or os.getenv("FT_ID_FILE")
  if rank == nil or world == nil or id_file == nil then
    error(ctx .. ": give devices = {...} (one process, several GPUs), or rank, world_size and "
      .. "id_file (one process per GPU; scripts/ftrun sets them)", 2)
  end
  if not is_integer(world) or world < 1 then
    error(ctx .. ": world_size must be an integer >= 1, got " .. tostring(world), 2)
  end
  if not is_integer(rank) or rank < 0 or rank >= world then
    error(("%s: rank must be an integer from 0 to %d, got %s"):format(ctx, world - 1,
      tostring(rank)), 2)
  end
  if type(id_file) ~= "string" or id_file == "" then
    error(ctx .. ": id_file must be a path every rank can read", 2)
  end
  local device = opts.device or env_int("FT_DEVICE")
  if device == nil then
    local n = core.cuda.device_count()
    device = n > 0 and rank % n or 0
  end
  if not is_integer(device) or device < 0 then
    error(ctx .. ": device must be a device number, got " .. tostring(device), 2)
  end
  local timeout = opts.timeout or 60
  if type(timeout) ~= "number" or not (timeout > 0) then
    error(ctx .. ": timeout must be a number of seconds > 0, got " .. tostring(timeout), 2)
  end
  return C.init_rank(rank, world, device, id_file, timeout)
end

-- ---- the communicator's methods ----------------------------------------------

local Comm = debug.getregistry()["flashtile.Comm"].__index

--- A list of one per local rank from a tensor (one local rank) or a list.
local function as_list(comm, ctx, v, what)
  local n = #comm:ranks()
  if type(v) == "table" then
    if #v ~= n then
      error(("%s: %s: %d entries for %d local ranks"):format(ctx, what, #v, n), 3)
    end
    return v, true
  end
  if n ~= 1 then
    error(("%s: %s: this process has %d local ranks: give a list, one per device"):format(ctx,
      what, n), 3)
  end
  return { v }, false
end

--- The rank of a process with one local rank (the first otherwise).
function Comm:rank() return self:ranks()[1] end

--- Reduces in place over every rank (op "sum", "mean", "max", "min";
-- default "sum"); returns what it was given.
function Comm:all_reduce(ts, op)
  local list = as_list(self, "comm:all_reduce", ts, "tensors")
  self:all_reduce_list(list, op or "sum")
  return ts
end

--- Rank root's tensor into every rank's, in place.
function Comm:broadcast(ts, root)
  local list = as_list(self, "comm:broadcast", ts, "tensors")
  self:broadcast_list(list, root or 0)
  return ts
end

--- Every rank's tensor stacked along dim 1, in rank order (new tensors).
function Comm:all_gather(ts)
  local list, was_list = as_list(self, "comm:all_gather", ts, "tensors")
  local out = self:all_gather_list(list)
  return was_list and out or out[1]
end

--- The reduction over every rank, cut along dim 1 into world_size parts:
-- rank r gets part r + 1 (new tensors).
function Comm:reduce_scatter(ts, op)
  local list, was_list = as_list(self, "comm:reduce_scatter", ts, "tensors")
  local out = self:reduce_scatter_list(list, op or "sum")
  return was_list and out or out[1]
end

--- One exchange: {send = t, to = rank, recv = t, from = rank, async = bool}
-- (lists for several local ranks; false where a local rank sends or
-- receives nothing). With async the result is a Pending: the devices'
-- kernels queued before p:wait() run beside the exchange; send must not be
-- written nor recv read before it.
function Comm:sendrecv(a)
  local ctx = "comm:sendrecv"
  if type(a) ~= "table" then error(ctx .. ": takes a table {send =, to =, recv =, from =}", 2) end
  check_opts(ctx, a, { send = true, to = true, recv = true, from = true, async = true })
  local n = #self:ranks()
  local function side(v, what)
    if v == nil then
      local none = {}
      for i = 1, n do none[i] = false end
      return none
    end
    return (as_list(self, ctx, v, what))
  end
  local send, recv = side(a.send, "send"), side(a.recv, "recv")
  local to_in = type(a.to) == "table" and a.to or { a.to }
  local from_in = type(a.from) == "table" and a.from or { a.from }
  local to, from = {}, {} -- copies: the caller's lists stay as they were
  for i = 1, n do to[i], from[i] = to_in[i], from_in[i] end
  for i = 1, n do
    if send[i] and not is_integer(to[i]) then
      error(("%s: to[%d] must be a rank"):format(ctx, i), 2)
    end
    if recv[i] and not is_integer(from[i]) then
      error(("%s: from[%d] must be a rank"):format(ctx, i), 2)
    end
    to[i], from[i] = to[i] or -1, from[i] or -1
  end
  return self:sendrecv_list(send, to, recv, from, a.async and true or false)
end

-- ---- ring attention -------------------------------------------------------------

--- The merge of two partial attentions over disjoint keys by their LSE:
-- o [B, n, H, d] f32, lse [B, H, n] f32.
local function merge(o1, l1, o2, l2)
  local m = l1:maximum(l2)
  local e1, e2 = (l1 - m):exp(), (l2 - m):exp()
  local s = e1 + e2
  local lse = m + s:log()
  local B, H, n = l1:size(1), l1:size(2), l1:size(3)
  local sh = o1.shape
  local function w(e)
    return (e / s):permute(1, 3, 2):contiguous():view(B, n, H, 1):expand(sh)
  end
  return o1 * w(e1) + o2 * w(e2), lse
end

--- Which part of the keys of rank j's shard the queries of rank r see
-- (zigzag: each shard is chunks r and 2W - 1 - r of 2W):
-- "all" (no mask), "causal" (its own shard), "first" (all queries, the
-- first half of the keys), "second" (the second half of the queries, all
-- keys). Contiguous shards ("contiguous"): "all", "causal" or nil (none).
local function visible(layout, causal, r, j)
  if not causal then return "all" end
  if j == r then return "causal" end
  if layout == "zigzag" then return j < r and "first" or "second" end
  return j < r and "all" or nil
end

local function half(t, which, dim)
  local n = math.floor(t:size(dim) / 2)
  return which == 1 and t:narrow(dim, 1, n) or t:narrow(dim, n + 1, t:size(dim) - n)
end

--- The attention of q over one block of keys as the step needs it: out (in
-- the LSE's dtype: f32, f64 for f64) and lse for the rows it covers, and those rows ("all" or 2 for the
-- second half).
local function block_forward(q, k, v, how, opts)
  local o = {}
  for key, val in pairs(opts) do o[key] = val end
  if how == "causal" then
    o.causal = true
    local out, lse = core.attention(q, k, v, o)
    return out:to(lse.dtype), lse, nil
  end
  o.causal = false
  if how == "first" then
    local out, lse = core.attention(q, half(k, 1, 2), half(v, 1, 2), o)
    return out:to(lse.dtype), lse, nil
  elseif how == "second" then
    local out, lse = core.attention(half(q, 2, 2), k, v, o)
    return out:to(lse.dtype), lse, 2
  end
  local out, lse = core.attention(q, k, v, o)
  return out:to(lse.dtype), lse, nil
end

local DTYPE_CODE = { f64 = 1, f32 = 2, f16 = 3, bf16 = 4 }

--- Every rank's shards must have the same shapes and dtype: the keys a
-- rank receives land in a buffer shaped like its own, and NCCL waits for
-- ever on a size that does not match. One small all_gather of each rank's
-- shapes finds the rank that differs first.
local function same_everywhere(comm, ctx, qs, ks, vs)
  if comm:world_size() == 1 then return end
  local sigs = {}
  for i = 1, #qs do
    local sig = { DTYPE_CODE[qs[i].dtype] or 0 }
    for _, t in ipairs { qs[i], ks[i], vs[i] } do
      for dd = 1, 4 do sig[#sig + 1] = t:size(dd) end
    end
    sigs[i] = core.tensor(sig, { dtype = "i64", device = qs[i].device })
  end
  local all = comm:all_gather_list(sigs)[1]:cpu():totable()
  local per = #all / comm:world_size()
  for r = 1, comm:world_size() - 1 do
    for e = 1, per do
      if all[r * per + e] ~= all[e] then
        error(("%s: rank %d's q, k, v (shapes or dtype) differ from rank 0's: every rank holds a "
          .. "shard of the same size"):format(ctx, r), 4)
      end
    end
  end
end

local function check_ring(ctx, comm, q, k, v, opts)
  opts = opts or {}
  check_opts(ctx, opts, { causal = true, scale = true, layout = true, exchange = true })
  local layout = opts.layout or "zigzag"
  if layout ~= "zigzag" and layout ~= "contiguous" then
    error(ctx .. ": layout must be \"zigzag\" or \"contiguous\"", 3)
  end
  local qs = as_list(comm, ctx, q, "q")
  local ks = as_list(comm, ctx, k, "k")
  local vs = as_list(comm, ctx, v, "v")
  for i = 1, #qs do
    if qs[i]:dim() ~= 4 or ks[i]:dim() ~= 4 or vs[i]:dim() ~= 4 then
      error(ctx .. ": q, k, v shards must be [batch, seqlen, heads, head_dim]", 3)
    end
    if layout == "zigzag" and (qs[i]:size(2) % 2 ~= 0 or ks[i]:size(2) % 2 ~= 0) then
      error(ctx .. ": zigzag shards hold two chunks: their seqlen must be even", 3)
    end
    if not (ks[i].dtype == qs[i].dtype and vs[i].dtype == qs[i].dtype and ks[i].device == qs[i].device
            and vs[i].device == qs[i].device) then
      error(ctx .. ": q, k and v of a rank must share a dtype and a device", 3)
    end
  end
  same_everywhere(comm, ctx, qs, ks, vs)
  return qs, ks, vs, layout, opts.causal and true or false, opts.scale, opts.exchange ~= false
end

--- The ring's neighbours of each local rank: to (rank + 1) and from
-- (rank - 1), modulo the world.
local function neighbours(comm)
  local W, to, from = comm:world_size(), {}, {}
  for i, r in ipairs(comm:ranks()) do to[i], from[i] = (r + 1) % W, (r - 1) % W end
  return to, from
end

--- Starts passing the lists a and b (one tensor per local rank) one step
-- around the ring; returns the lists they arrive in and a function that
-- makes the devices wait for them.
local function pass_on(comm, a, b)
  local to, from = neighbours(comm)
  local ra, rb = {}, {}
  for i = 1, #a do
    ra[i] = core.empty(a[i].shape, { dtype = a[i].dtype, device = a[i].device })
    rb[i] = core.empty(b[i].shape, { dtype = b[i].dtype, device = b[i].device })
  end
  local p = { comm:sendrecv_list(a, to, ra, from, true), comm:sendrecv_list(b, to, rb, from, true) }
  return ra, rb, function()
    p[1]:wait()
    p[2]:wait()
  end
end

--- Ring attention over the communicator's ranks: q, k, v are this
-- process's shards ([B, n, H, d] each; lists of them for several local
-- ranks) of one sequence of world_size x n rows, laid out by
-- ft.dist.shard (opts.layout, default "zigzag": rank r holds chunks r and
-- 2W - 1 - r of 2W, which evens out causal work). Keys and values go
-- around the ring (rank r sends to r + 1) on the communication streams
-- while the flash kernels attend the block they hold; the partial results
-- are merged by their LSE. Returns out (q's dtype) and lse (f32 [B, H, n]),
-- shards again; opts: causal, scale, layout, and exchange = false (for
-- measuring only: every step attends this rank's own keys, with no
-- exchange, so that the time the exchanges add can be told apart).
function Comm:ring_attention(q, k, v, opts)
  local ctx = "comm:ring_attention"
  local qs, ks, vs, layout, causal, scale, exchange = check_ring(ctx, self, q, k, v, opts)
  local W, ranks, n = self:world_size(), self:ranks(), #qs
  local base = { scale = scale }
  local acc_o, acc_l = {}, {}
  local cur_k, cur_v = {}, {}
  for i = 1, n do cur_k[i], cur_v[i] = ks[i], vs[i] end
  for step = 0, W - 1 do
    local nxt_k, nxt_v, arrived
    if step < W - 1 and exchange then nxt_k, nxt_v, arrived = pass_on(self, cur_k, cur_v) end
    for i = 1, n do
      local r = ranks[i]
      local j = (r - step) % W
      local how = visible(layout, causal, r, j)
      if how then
        local o, l, rows = block_forward(qs[i], cur_k[i], cur_v[i], how, base)
        if not acc_o[i] then
          acc_o[i], acc_l[i] = o, l -- step 0: the own block, every row
        elseif rows == 2 then
          local ao, al = half(acc_o[i], 2, 2), half(acc_l[i], 2, 3)
          local mo, ml = merge(ao:contiguous(), al:contiguous(), o, l)
          ao:copy(mo)
          al:copy(ml)
        else
          acc_o[i], acc_l[i] = merge(acc_o[i], acc_l[i], o, l)
        end
      end
    end
    if arrived then
      arrived()
      cur_k, cur_v = nxt_k, nxt_v
    end
  end
  local outs = {}
  for i = 1, n do outs[i] = acc_o[i]:to(qs[i].dtype) end
  if type(q) == "table" then return outs, acc_l end
  return outs[1], acc_l[1]
end

--- The backward of comm:ring_attention: dq, dk, dv (shards, q's dtype)
-- from dout and the forward's out and lse. Keys and values go around the
-- ring again, and with them the f32 sums of their gradients, which are
-- back at their rank after world_size steps.
function Comm:ring_attention_backward(dout, q, k, v, out, lse, opts)
  local ctx = "comm:ring_attention_backward"
  local qs, ks, vs, layout, causal, scale, exchange = check_ring(ctx, self, q, k, v, opts)
  local dos = as_list(self, ctx, dout, "dout")
  local os_ = as_list(self, ctx, out, "out")
  local ls = as_list(self, ctx, lse, "lse")
  local W, ranks, n = self:world_size(), self:ranks(), #qs
  local dq = {}
  local acc = qs[1].dtype == "f64" and "f64" or "f32" -- the sums' dtype
  local cur_k, cur_v, cur_dk, cur_dv = {}, {}, {}, {}
  for i = 1, n do
    cur_k[i], cur_v[i] = ks[i], vs[i]
    cur_dk[i] = core.zeros(ks[i].shape, { dtype = acc, device = ks[i].device })
    cur_dv[i] = core.zeros(vs[i].shape, { dtype = acc, device = vs[i].device })
    dq[i] = core.zeros(qs[i].shape, { dtype = acc, device = qs[i].device })
  end
  -- sums_arrived: the exchange of the gradient sums started at the end of
  -- the last step, whose result (in_dk, in_dv: the sums of this step's
  -- block) is waited for only after this step's kernels are queued
  local sums_arrived, in_dk, in_dv
  for step = 0, W - 1 do
    local nxt_k, nxt_v, arrived
    if step < W - 1 and exchange then nxt_k, nxt_v, arrived = pass_on(self, cur_k, cur_v) end
    local grads = {}
    for i = 1, n do
      local r = ranks[i]
      local j = (r - step) % W
      local how = visible(layout, causal, r, j)
      if how then
        local o = { scale = scale, causal = how == "causal" }
        local qq, dd, oo, ll, kk, vv = qs[i], dos[i], os_[i], ls[i], cur_k[i], cur_v[i]
        if how == "first" then
          kk, vv = half(kk, 1, 2), half(vv, 1, 2)
        elseif how == "second" then
          qq, dd, oo, ll = half(qq, 2, 2), half(dd, 2, 2), half(oo, 2, 2), half(ll, 2, 3)
        end
        local gq, gk, gv = core.attention_backward(dd, qq, kk, vv, oo, ll:contiguous(), o)
        if how == "second" then
          local dst = half(dq[i], 2, 2)
          dst:copy(dst + gq:to(acc))
        else
          dq[i] = dq[i] + gq:to(acc)
        end
        grads[i] = { how, gk, gv }
      end
    end
    if sums_arrived then
      sums_arrived()
      cur_dk, cur_dv, sums_arrived = in_dk, in_dv, nil
    end
    for i = 1, n do
      local g = grads[i]
      if g and g[1] == "first" then
        local dk1, dv1 = half(cur_dk[i], 1, 2), half(cur_dv[i], 1, 2)
        dk1:copy(dk1 + g[2]:to(acc))
        dv1:copy(dv1 + g[3]:to(acc))
      elseif g then
        cur_dk[i] = cur_dk[i] + g[2]:to(acc)
        cur_dv[i] = cur_dv[i] + g[3]:to(acc)
      end
    end
    -- the gradient sums follow their keys to the next rank (after the last
    -- step: home; a world of one has no next rank)
    if exchange and W > 1 then in_dk, in_dv, sums_arrived = pass_on(self, cur_dk, cur_dv) end
    if arrived then
      arrived()
      cur_k, cur_v = nxt_k, nxt_v
    end
  end
  if sums_arrived then
    sums_arrived()
    cur_dk, cur_dv = in_dk, in_dv
  end
  local dqs, dks, dvs = {}, {}, {}
  for i = 1, n do
    dqs[i], dks[i], dvs[i] = dq[i]:to(qs[i].dtype), cur_dk[i]:to(ks[i].dtype), cur_dv[i]:to(vs[i].dtype)
  end
  if type(q) == "table" then return dqs, dks, dvs end
  return dqs[1], dks[1], dvs[1]
end

--- ft.ring_attention(q, k, v, {comm = comm, causal =, scale =, layout =}):
-- comm:ring_attention with the communicator among the options.
function M.ring_attention(q, k, v, opts)
  if type(opts) ~= "table" or opts.comm == nil then
    error("ft.ring_attention: opts.comm must be a communicator (ft.dist.init)", 2)
  end
  local o = {}
  for key, val in pairs(opts) do if key ~= "comm" then o[key] = val end end
  return opts.comm:ring_attention(q, k, v, o)
end

--- ft.ring_attention_backward(dout, q, k, v, out, lse, {comm = comm, ...})
function M.ring_attention_backward(dout, q, k, v, out, lse, opts)
  if type(opts) ~= "table" or opts.comm == nil then
    error("ft.ring_attention_backward: opts.comm must be a communicator (ft.dist.init)", 2)
  end
  local o = {}
  for key, val in pairs(opts) do if key ~= "comm" then o[key] = val end end
  return opts.comm:ring_attention_backward(dout, q, k, v, out, lse, o)
end

-- ---- data parallelism -------------------------------------------------------------

--- Averages (op "mean", or "sum") every gradient of module over the ranks,
-- in place: after each rank's backward on its own batch, before the
-- optimiser's step, so that every replica takes the same step.
function M.all_reduce_grads(module, comm, op)
  if type(module) ~= "table" or type(module.parameters) ~= "function" then
    error("ft.dist.all_reduce_grads: module must be an nn module", 2)
  end
  if comm == nil then error("ft.dist.all_reduce_grads: comm must be a communicator", 2) end
  local _, grads = module:parameters()
  for _, g in ipairs(grads) do comm:all_reduce(g, op or "mean") end
  return module
end

-- ---- sharding ----------------------------------------------------------------------

--- Rank r's shard (0-based r of world) of a [B, N, ...] tensor along dim 2:
-- layout "zigzag" (chunks r and 2W - 1 - r of 2W, N a multiple of 2W) or
-- "contiguous" (rows r N / W .. (r + 1) N / W - 1).
function M.shard(t, rank, world, layout)
  layout = layout or "zigzag"
  local N = t:size(2)
  if layout == "contiguous" then
    if N % world ~= 0 then error("ft.dist.shard: seqlen " .. N .. " is not a multiple of world " .. world, 2) end
    local n = math.floor(N / world)
    return t:narrow(2, rank * n + 1, n):contiguous()
  elseif layout ~= "zigzag" then
    error("ft.dist.shard: layout must be \"zigzag\" or \"contiguous\"", 2)
  end
  if N % (2 * world) ~= 0 then
    error(("ft.dist.shard: seqlen %d is not a multiple of 2 x world (%d)"):format(N, 2 * world), 2)
  end
  local c = math.floor(N / (2 * world))
  local a = t:narrow(2, rank * c + 1, c)
  local b = t:narrow(2, (2 * world - 1 - rank) * c + 1, c)
  local shape = t.shape
  shape[2] = 2 * c
  local out = core.empty(shape, { dtype = t.dtype, device = t.device })
  out:narrow(2, 1, c):copy(a)
  out:narrow(2, c + 1, c):copy(b)
  return out
end

--- The whole [B, N, ...] tensor from every rank's shard (a list in rank
-- order, on any devices), on the device of the first.
function M.unshard(shards, layout)
  layout = layout or "zigzag"
  local W = #shards
  local n = shards[1]:size(2)
  local shape = shards[1].shape
  shape[2] = n * W
  local out = core.empty(shape, { dtype = shards[1].dtype, device = shards[1].device })
  for r = 0, W - 1 do
    local s = shards[r + 1]:to(shards[1].device)
    if layout == "contiguous" then
      out:narrow(2, r * n + 1, n):copy(s)
    else
      local c = math.floor(n / 2)
      out:narrow(2, r * c + 1, c):copy(s:narrow(2, 1, c))
      out:narrow(2, (2 * W - 1 - r) * c + 1, c):copy(s:narrow(2, c + 1, c))
    end
  end
  return out
end

return M
