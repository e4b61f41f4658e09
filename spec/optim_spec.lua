-- flashtile.optim: SGD and AdamW steps against values worked out by hand
-- (and, for several steps, against the update rules in plain Lua), state on
-- the parameters' dtype, in-place updates, and option errors.
local h = require "helper"
local ft = h.ft
local optim = require "flashtile.optim"
local nn = require "flashtile.nn"

local F64 = { dtype = "f64" }

--- A parameter [1, -2] and its grad [0.5, 0.25] (f64).
local function one_param()
  return ft.tensor({ 1, -2 }, F64), ft.tensor({ 0.5, 0.25 }, F64)
end

describe("optim.SGD", function()
  it("one plain step: p - lr g", function()
    local p, g = one_param()
    local opt = optim.SGD({ p }, { g }, { lr = 0.1 })
    opt:step()
    h.assert_values(p, { 0.95, -2.025 }, 1e-15)
  end)

  it("weight decay adds wd p to the grad", function()
    local p, g = one_param()
    optim.SGD({ p }, { g }, { lr = 0.1, weight_decay = 0.1 }):step()
    -- d = [0.5 + 0.1, 0.25 - 0.2] = [0.6, 0.05]
    h.assert_values(p, { 0.94, -2.005 }, 1e-15)
  end)

  it("momentum: the buffer starts at the first grad, then b = m b + g", function()
    local p, g = one_param()
    local opt = optim.SGD({ p }, { g }, { lr = 0.1, momentum = 0.9 })
    opt:step()
    h.assert_values(p, { 0.95, -2.025 }, 1e-15, "step 1")
    opt:step()
    -- b = 0.9 [0.5, 0.25] + [0.5, 0.25] = [0.95, 0.475]
    h.assert_values(p, { 0.855, -2.0725 }, 1e-15, "step 2")
    assert.are.equal(2, opt.t)
  end)
end)

describe("optim.AdamW", function()
  it("the first step moves each parameter by lr against the grad's sign, after the decay", function()
    local p, g = one_param()
    optim.AdamW({ p }, { g }, { lr = 0.1 }):step()
    -- m/(1-b1) = g and v/(1-b2) = g^2, so the update is g / (|g| + eps)
    local want = { 1 * (1 - 0.1 * 0.01) - 0.1 * 0.5 / (0.5 + 1e-8),
                   -2 * (1 - 0.1 * 0.01) - 0.1 * 0.25 / (0.25 + 1e-8) }
    h.assert_values(p, want, 1e-15)
    assert.is_true(math.abs(p:get(1) - 0.899) < 1e-7)
  end)

  it("three steps with changing grads match the update rule in plain Lua", function()
    local lr, b1, b2, eps, wd = 0.05, 0.8, 0.95, 1e-6, 0.1
    local p = ft.tensor({ 0.3, -1.2, 2.0 }, F64)
    local g = ft.zeros({ 3 }, F64)
    local opt = optim.AdamW({ p }, { g }, { lr = lr, betas = { b1, b2 }, eps = eps, weight_decay = wd })
    local ref, m, v = { 0.3, -1.2, 2.0 }, { 0, 0, 0 }, { 0, 0, 0 }
    local grads = { { 1, -0.5, 0.25 }, { -2, 0.1, 0.3 }, { 0.5, 0.5, -1 } }
    for t, gt in ipairs(grads) do
      g:copy(ft.tensor(gt, F64))
      opt:step()
      for i = 1, 3 do
        ref[i] = ref[i] * (1 - lr * wd)
        m[i] = b1 * m[i] + (1 - b1) * gt[i]
        v[i] = b2 * v[i] + (1 - b2) * gt[i] ^ 2
        ref[i] = ref[i] - lr * (m[i] / (1 - b1 ^ t)) / (math.sqrt(v[i] / (1 - b2 ^ t)) + eps)
      end
      h.assert_values(p, ref, 1e-14, "step " .. t)
    end
  end)

  it("keeps its moments in the parameter's dtype and updates f32 parameters", function()
    local p = ft.tensor({ 1, 2 })
    local g = ft.tensor({ 1, -1 })
    local opt = optim.AdamW({ p }, { g }, { lr = 0.5, weight_decay = 0 })
    opt:step()
    assert.are.equal("f32", opt.state[1].m.dtype)
    assert.are.equal(p.device, opt.state[1].v.device)
    h.assert_values(p, { 0.5, 2.5 }, 1e-6)
  end)
end)

describe("optimisers and modules", function()
  it("step updates the module's own tensors in place; zero_grad clears the grads", function()
    for _, make in ipairs {
      function(ps, gs) return optim.SGD(ps, gs, { lr = 0.1, momentum = 0.5 }) end,
      function(ps, gs) return optim.AdamW(ps, gs, { lr = 0.1 }) end,
    } do
      local m = nn.Linear(3, 2, { dtype = "f64", seed = 1 })
      local w = m.weight
      local before = w:clone()
      local opt = make(m:parameters())
      local x = ft.randn({ 4, 3 }, { dtype = "f64", seed = 2 })
      m:forward(x)
      m:backward(x, ft.ones({ 4, 2 }, F64))
      opt:step()
      assert.are.equal(w, m.weight)
      assert.is_true(ft.max_abs_diff(before, m.weight) > 1e-3)
      opt:zero_grad()
      assert.are.equal(0, m.grad_weight:abs():max())
      assert.are.equal(0, m.grad_bias:abs():max())
    end
  end)

  it("a module in place of the lists takes its parameters()", function()
    local m = nn.Sequential(nn.Linear(2, 3, { seed = 1 }), nn.RMSNorm(3))
    local opt = optim.SGD(m, { lr = 0.5 })
    local params, grads = m:parameters()
    assert.are.same(params, opt.params)
    assert.are.same(grads, opt.grads)
    m.modules[2].grad_weight:fill(1)
    opt:step()
    h.assert_values(m.modules[2].weight, { 0.5, 0.5, 0.5 }, 0)
    assert.are.equal(0.25, optim.AdamW(m, { lr = 0.25 }).options.lr)
  end)

  it("SGD on a least-squares problem converges to the solution", function()
    -- y = x W*^T; the loss 0.5 |x W^T - y|^2 / N has its minimum at W*
    local m = nn.Linear(3, 1, { dtype = "f64", bias = false, seed = 4 })
    local target = ft.tensor({ { 1, -2, 0.5 } }, F64)
    local x = ft.randn({ 32, 3 }, { dtype = "f64", seed = 5 })
    local y = ft.matmul(x, target:transpose())
    local opt = optim.SGD({ m.weight }, { m.grad_weight }, { lr = 0.3, momentum = 0.5 })
    for _ = 1, 100 do
      opt:zero_grad()
      m:backward(x, (m:forward(x) - y) / 32)
      opt:step()
    end
    assert.is_true(ft.max_abs_diff(m.weight, target) < 1e-6)
  end)
end)

describe("optimiser errors", function()
  local p, g = one_param()
  local cases = {
    { "SGD without lr", function() return optim.SGD({ p }, { g }) end, { "optim.SGD: option 'lr' is required" } },
    { "SGD with a misspelt option", function() return optim.SGD({ p }, { g }, { lr = 0.1, momentun = 0.9 }) end,
      { "optim.SGD: unknown option 'momentun' (expected lr, momentum, weight_decay)" } },
    { "SGD with a negative lr", function() return optim.SGD({ p }, { g }, { lr = -1 }) end,
      { "option 'lr' must be a positive number, got -1" } },
    { "SGD with lr a string", function() return optim.SGD({ p }, { g }, { lr = "0.1" }) end,
      { "option 'lr' must be a positive number, got 0.1" } },
    { "SGD with momentum 1", function() return optim.SGD({ p }, { g }, { lr = 0.1, momentum = 1 }) end,
      { "option 'momentum' must be in [0, 1), got 1" } },
    { "SGD with a negative weight decay", function() return optim.SGD({ p }, { g }, { lr = 0.1, weight_decay = -0.1 }) end,
      { "option 'weight_decay' must be a number >= 0, got -0.1" } },
    { "SGD with Nesterov (not supported)", function() return optim.SGD({ p }, { g }, { lr = 0.1, nesterov = true }) end,
      { "unknown option 'nesterov'" } },
    { "AdamW with a misspelt option", function() return optim.AdamW({ p }, { g }, { beta = { 0.9, 0.99 } }) end,
      { "optim.AdamW: unknown option 'beta' (expected betas, eps, lr, weight_decay)" } },
    { "AdamW with one beta", function() return optim.AdamW({ p }, { g }, { betas = { 0.9 } }) end,
      { "option 'betas' must be two numbers in [0, 1), {beta1, beta2}" } },
    { "AdamW with beta2 = 1", function() return optim.AdamW({ p }, { g }, { betas = { 0.9, 1 } }) end,
      { "option 'betas' must be two numbers in [0, 1)" } },
    { "AdamW with eps 0", function() return optim.AdamW({ p }, { g }, { eps = 0 }) end,
      { "option 'eps' must be a positive number, got 0" } },
    { "AdamW with NaN lr", function() return optim.AdamW({ p }, { g }, { lr = 0 / 0 }) end,
      { "option 'lr' must be a positive number" } },
    { "options not a table", function() return optim.AdamW({ p }, { g }, 0.1) end,
      { "optim.AdamW: options must be a table, got number" } },
    { "lists of different lengths", function() return optim.AdamW({ p, p }, { g }) end,
      { "optim.AdamW: 2 params but 1 grads" } },
    { "a grad of another shape", function() return optim.SGD({ p }, { ft.zeros({ 3 }, F64) }, { lr = 1 }) end,
      { "grad 1 (f64 cpu {3}) does not match its param (f64 cpu {2})" } },
    { "a grad of another dtype", function() return optim.SGD({ p }, { g:float() }, { lr = 1 }) end,
      { "grad 1 (f32 cpu {2}) does not match its param (f64 cpu {2})" } },
    { "model:parameters() in the middle of the arguments", function()
        local m = nn.Linear(2, 2)
        return optim.AdamW(m:parameters(), { lr = 1 })
      end, { "optim.AdamW: grads is not a list; pass the module, or params, grads, opts" } },
    { "a module and three arguments", function() return optim.SGD(nn.Linear(2, 2), {}, { lr = 1 }) end,
      { "optim.SGD: with a module, the options come second: f(model, opts)" } },
    { "no lists at all", function() return optim.SGD() end,
      { "optim.SGD: expected a module, or two lists (params, grads) as model:parameters() returns" } },
  }
  for _, case in ipairs(cases) do
    it(case[1] .. " is a clear error", function()
      h.assert_error(case[2], h.unpack(case[3]))
    end)
  end

  it("a param or grad freed since the optimizer was made is an error naming it at step and zero_grad", function()
    for _, make in ipairs { optim.SGD, optim.AdamW } do
      local p1, g1 = one_param()
      local p2, g2 = one_param()
      local o = make({ p1, p2 }, { g1, g2 }, { lr = 0.1 })
      g2:free()
      h.assert_error(function() o:step() end, ": step: grad 2 has been freed")
      h.assert_error(function() o:zero_grad() end, ": zero_grad: grad 2 has been freed")
      p1:free()
      h.assert_error(function() o:step() end, ": step: param 1 has been freed")
    end
  end)

  it("errors point at the caller's line", function()
    local msg = h.error_of(function() local o = optim.SGD({ p }, { g }, { lr = 0 }); return o end)
    assert.is_truthy(msg:find("optim_spec.lua:%d+: optim.SGD"), msg)
    msg = h.error_of(function() local o = optim.AdamW({ p }, {}); return o end)
    assert.is_truthy(msg:find("optim_spec.lua:%d+: optim.AdamW"), msg)
  end)
end)
