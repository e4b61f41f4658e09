-- flashtile.nn and flashtile.optim on CUDA (tag #gpu) against the same
-- modules on the CPU: each module is built on the CPU, cloned and moved with
-- to("cuda"), and both copies run forward and backward on the same inputs;
-- outputs, input grads and parameter grads must agree. Pending, with the
-- reason, where there is no GPU.
local h = require "helper"
local ft = h.ft
local nn = require "flashtile.nn"
local optim = require "flashtile.optim"

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

--- Asserts that cpu (on the CPU) and gpu (on cuda:0) hold the same values.
local function same(cpu, gpu, tol, what)
  assert.are.equal("cpu", cpu.device, what)
  assert.are.equal("cuda:0", gpu.device, what)
  assert.are.same(cpu.shape, gpu.shape, what)
  assert.are.equal(cpu.dtype, gpu.dtype, what)
  local d = ft.max_abs_diff(cpu, gpu:cpu())
  assert.is_true(d <= tol, ("%s: |cpu - gpu| = %g > %g"):format(what, d, tol))
end

--- Runs forward and backward of a CPU module and of its clone on the GPU
-- on the same input (a float tensor, or ids) and a random grad_output,
-- and compares output, grad_input and every parameter grad.
local function compare(cpu, x, tol, what)
  local gpu = cpu:clone():to("cuda")
  local _, gdev = gpu:type()
  assert.is_true(gdev == nil or gdev == "cuda:0", what)
  local y = cpu:forward(x)
  local gy = gpu:forward(x:cuda())
  same(y, gy, tol, what .. " output")
  local dy = ft.randn(y.shape, { dtype = y.dtype, seed = h.next_seed() })
  cpu:zero_grad(); gpu:zero_grad()
  cpu:forward(x); gpu:forward(x:cuda())
  local dx = cpu:backward(x, dy)
  local gdx = gpu:backward(x:cuda(), dy:cuda())
  if dx then same(dx, gdx, tol, what .. " grad_input") else assert.is_nil(gdx) end
  local _, cg = cpu:parameters()
  local _, gg = gpu:parameters()
  assert.are.equal(#cg, #gg)
  for i = 1, #cg do same(cg[i], gg[i], tol, what .. " grad of parameter " .. i) end
end

local TOL = { f64 = 1e-10, f32 = 2e-4 }

describe("nn on CUDA #gpu", function()
  for _, dtype in ipairs { "f64", "f32" } do
    local tol = TOL[dtype]
    local function randn(shape) return ft.randn(shape, { dtype = dtype, seed = h.next_seed() }) end
    local function o(extra)
      local r = { dtype = dtype, seed = h.next_seed() }
      for k, v in pairs(extra or {}) do r[k] = v end
      return r
    end

    gpu_it(dtype .. ": Linear (with and without bias), GELU, SiLU, RMSNorm, LayerNorm", function()
      compare(nn.Linear(16, 24, o()), randn({ 3, 5, 16 }), tol, "Linear")
      compare(nn.Linear(16, 8, o({ bias = false })), randn({ 7, 16 }), tol, "Linear without bias")
      compare(nn.GELU(), randn({ 4, 33 }) * 3, tol, "GELU")
      compare(nn.SiLU(), randn({ 4, 33 }) * 3, tol, "SiLU")
      compare(nn.RMSNorm(32, o()), randn({ 2, 6, 32 }), tol, "RMSNorm")
      compare(nn.LayerNorm(32, o()), randn({ 2, 6, 32 }), tol, "LayerNorm")
    end)

    gpu_it(dtype .. ": Embedding (repeated ids) and PositionalEmbedding", function()
      local ids = ft.tensor({ { 1, 5, 5, 9 }, { 9, 2, 1, 1 } }, { dtype = "i64" })
      compare(nn.Embedding(9, 16, o()), ids, tol, "Embedding")
      compare(nn.PositionalEmbedding(8, 16, o()), randn({ 2, 5, 16 }), tol, "PositionalEmbedding")
    end)

    gpu_it(dtype .. ": MultiheadAttention, packed and GQA, causal or not", function()
      for _, a in ipairs {
        { dim = 64, heads = 4 },
        { dim = 64, heads = 4, causal = true, bias = true },
        { dim = 64, heads = 8, kv_heads = 2, causal = true },
        { dim = 128, heads = 2, kv_heads = 1 },
      } do
        local what = ("MultiheadAttention dim %d heads %d kv %d%s"):format(a.dim, a.heads,
          a.kv_heads or a.heads, a.causal and " causal" or "")
        compare(nn.MultiheadAttention(o(a)), randn({ 2, 37, a.dim }), tol, what)
      end
    end)

    gpu_it(dtype .. ": a small transformer and CrossEntropy", function()
      local model = nn.Sequential(
        nn.Embedding(11, 32, o()), nn.PositionalEmbedding(16, 32, o()),
        nn.TransformerBlock(o({ dim = 32, heads = 4, causal = true })),
        nn.TransformerBlock(o({ dim = 32, heads = 4, kv_heads = 2, norm = "layer" })),
        nn.RMSNorm(32, o()), nn.Linear(32, 11, o()))
      local ids = (ft.rand({ 3, 16 }, { dtype = "f64", seed = h.next_seed() }) * 11):to("i64") + 1
      compare(model, ids, tol * 5, "transformer")

      local logits = randn({ 40, 11 }) * 4
      local targets = (ft.rand({ 40 }, { dtype = "f64", seed = h.next_seed() }) * 11):to("i64") + 1
      local crit, gcrit = nn.CrossEntropy(), nn.CrossEntropy()
      local loss = crit:forward(logits, targets)
      local gloss = gcrit:forward(logits:cuda(), targets:cuda())
      assert.is_true(math.abs(loss - gloss) <= tol * 10, ("loss %g against %g"):format(loss, gloss))
      same(crit:backward(logits, targets), gcrit:backward(logits:cuda(), targets:cuda()), tol, "CrossEntropy grad")
    end)
  end

  gpu_it("to('cuda') moves parameters and grads; a CPU input is a clear error", function()
    local m = nn.Sequential(nn.Linear(4, 4, { seed = 1 }), nn.RMSNorm(4)):to("cuda")
    local params, grads = m:parameters()
    for i = 1, #params do
      assert.are.equal("cuda:0", params[i].device)
      assert.are.equal("cuda:0", grads[i].device)
    end
    h.assert_error(function() return m:forward(ft.randn({ 2, 4 })) end,
      "nn.Linear: input is on cpu but the parameters are on cuda:0")
    m:to("cpu")
    assert.are.equal("cpu", m.modules[1].weight.device)
  end)

  gpu_it("SGD and AdamW steps on the GPU match the CPU's, state on the GPU", function()
    for _, name in ipairs { "SGD", "AdamW" } do
      local cpu = nn.Linear(8, 8, { seed = 3 })
      local gpu = cpu:clone():to("cuda")
      local opts = { lr = 0.05 }
      if name == "SGD" then opts.momentum = 0.9 end
      local oc, og = optim[name](cpu, opts), optim[name](gpu, opts)
      for step = 1, 3 do
        local x = ft.randn({ 5, 8 }, { seed = 100 + step })
        for _, pair in ipairs { { cpu, oc, x }, { gpu, og, x:cuda() } } do
          local m, opt, input = pair[1], pair[2], pair[3]
          opt:zero_grad()
          m:forward(input)
          m:backward(input, m.output * 1)
          opt:step()
        end
      end
      same(cpu.weight, gpu.weight, 1e-5, name .. " weight")
      same(cpu.bias, gpu.bias, 1e-5, name .. " bias")
      local state = name == "SGD" and og.state[1] or og.state[1].m
      assert.are.equal("cuda:0", state.device)
    end
  end)

  gpu_it("train_tiny on the GPU learns the copy task, the control does not", function()
    local train = assert(loadfile("scripts/train_tiny.lua"))({})
    local t0 = ft.clock()
    local r = train.run { steps = 80, device = "cuda", quiet = true }
    assert.is_true(r.loss < 0.3, r.summary)
    assert.is_true(r.control > r.chance - 0.15, r.summary)
    print(("\n  train_tiny, 80 steps each on cuda: %s (%.1f s)"):format(r.summary, ft.clock() - t0))
  end)
end)
