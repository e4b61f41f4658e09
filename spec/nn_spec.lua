-- flashtile.nn: every module's backward against finite differences (f64,
-- CPU), parameter grads included; forward values against plain Lua;
-- parameters(), zero_grad(), to(), clone(), replace() and printing; errors.
--
-- A module's parameters are checked as inputs of a wrapper: gradcheck
-- perturbs the module's own parameter tensors in place, and the wrapper's
-- backward returns grad_input followed by the parameter grads in
-- parameters() order.
local h = require "helper"
local ft = h.ft
local nn = require "flashtile.nn"
local gradcheck = require "flashtile.gradcheck"

local F64 = { dtype = "f64" }

local function opts64(extra)
  local o = { dtype = "f64", seed = h.next_seed() }
  for k, v in pairs(extra or {}) do o[k] = v end
  return o
end

--- Checks d sum(m(x) * dy) / d{x, parameters} against central differences.
-- x = nil checks the parameters only (for ids and other fixed inputs, pass
-- fixed_input). Fails with gradcheck's message, which names the input (1 is
-- x, 2.. the parameters in parameters() order) and the index.
local function check_module(m, x, opts, fixed_input)
  local params = m:parameters()
  local inputs = {}
  if x then inputs[1] = x end
  for _, p in ipairs(params) do inputs[#inputs + 1] = p end
  local function input_of(...)
    if x then return (...) end
    return fixed_input
  end
  local function forward(...)
    return m:forward(input_of(...))
  end
  local function backward(dy, ...)
    local input = input_of(...)
    m:zero_grad()
    m:forward(input)
    local gx = m:backward(input, dy)
    local _, grads = m:parameters()
    local out, n = {}, 0
    if x then n = 1; out[1] = gx:clone() end
    for _, g in ipairs(grads) do n = n + 1; out[n] = g:clone() end
    return h.unpack(out, 1, n)
  end
  local ok, report = gradcheck.check(forward, backward, inputs, opts or { fast = true })
  assert.is_true(ok, report.message)
  return report
end

--- Replaces every parameter by random values (norm weights start at ones and
-- biases at zeros, which would hide mistakes that a 1 or a 0 cancels).
local function randomize(m)
  for _, p in ipairs((m:parameters())) do
    p:copy(ft.randn(p.shape, { dtype = "f64", seed = h.next_seed() }) * 0.5 + 0.3)
  end
  return m
end

-- ---- gradients ----------------------------------------------------------------

describe("nn gradients (finite differences, f64)", function()
  it("Linear with bias: input, weight and bias, full Jacobian", function()
    local m = nn.Linear(3, 4, opts64())
    local x = h.randn({ 2, 3 })
    local report = check_module(m, x, { fast = false })
    assert.are.equal(0, report.failures)
  end)

  it("Linear without bias on a 3-d input: input and weight", function()
    local m = nn.Linear(5, 3, opts64({ bias = false }))
    assert.are.equal(1, #m:parameters())
    check_module(m, h.randn({ 2, 3, 5 }))
  end)

  it("Linear on a 1-d input", function()
    local m = nn.Linear(4, 2, opts64())
    local y = m:forward(h.randn({ 4 }))
    assert.are.same({ 2 }, y.shape)
    check_module(m, h.randn({ 4 }), { fast = false })
  end)

  it("a wrong parameter grad is caught and named", function()
    -- the harness must see parameter grads: corrupt the bias grad only
    local m = nn.Linear(3, 2, opts64())
    local backward = m.backward
    m.backward = function(self, input, dy)
      local gx = backward(self, input, dy)
      self.grad_bias:copy(self.grad_bias * 1.01)
      return gx
    end
    local ok, report = gradcheck.check(
      function(x) return m:forward(x) end,
      function(dy, x)
        m:zero_grad(); m:forward(x)
        return m:backward(x, dy), m.grad_weight:clone(), m.grad_bias:clone()
      end,
      { h.randn({ 2, 3 }), m.weight, m.bias }, { fast = true })
    assert.is_false(ok)
    assert.are.equal(3, report.worst.input)
    local caught = pcall(check_module, m, h.randn({ 2, 3 }))
    assert.is_false(caught)
  end)

  for _, case in ipairs {
    { name = "MultiheadAttention", o = { dim = 8, heads = 2 } },
    { name = "MultiheadAttention causal", o = { dim = 8, heads = 2, causal = true } },
    { name = "MultiheadAttention with bias", o = { dim = 6, heads = 3, bias = true } },
    { name = "MultiheadAttention GQA causal (4 heads, 2 kv heads)", o = { dim = 8, heads = 4, kv_heads = 2, causal = true } },
    { name = "MultiheadAttention MQA with bias", o = { dim = 8, heads = 4, kv_heads = 1, bias = true } },
    { name = "MultiheadAttention with a window, softcap, ALiBi and sinks",
      o = { dim = 8, heads = 4, kv_heads = 2, causal = true, window_left = 2, softcap = 1.5,
            alibi = true, sink = true } },
    { name = "MultiheadAttention with a two-sided window and 3 heads of ALiBi",
      o = { dim = 6, heads = 3, window_left = 1, window_right = 1, alibi = true } },
  } do
    it(case.name .. ": input and every projection", function()
      local o = opts64(case.o)
      local m = nn.MultiheadAttention(o)
      check_module(m, h.randn({ 2, 5, o.dim }))
    end)
  end

  it("MultiheadAttention with dropout: a fresh mask each training forward, its backward the same", function()
    local o = opts64 { dim = 8, heads = 2, dropout = 0.3, sink = true }
    local m = nn.MultiheadAttention(o)
    local x = h.randn({ 2, 5, 8 })
    local a, b = m:forward(x):clone(), m:forward(x):clone()
    assert.is_true(ft.max_abs_diff(a, b) > 0)
    m:evaluate()
    local c, d = m:forward(x):clone(), m:forward(x):clone()
    assert.are.equal(0, ft.max_abs_diff(c, d))
    m:train()
    -- with the offset pinned, forward and backward see one mask: gradcheck holds
    local function pinned() m.dropout_offset = 11 end
    local params = m:parameters()
    local inputs = { x }
    for _, p in ipairs(params) do inputs[#inputs + 1] = p end
    local ok, report = gradcheck.check(function(x_) pinned(); return m:forward(x_) end,
      function(dy, x_)
        m:zero_grad(); pinned(); m:forward(x_)
        local out = { m:backward(x_, dy):clone() }
        local _, grads = m:parameters()
        for _, g in ipairs(grads) do out[#out + 1] = g:clone() end
        return h.unpack(out)
      end, inputs, { fast = true })
    assert.is_true(ok, report.message)
  end)

  it("alibi_slopes: the ALiBi paper's slopes", function()
    local s8 = nn.alibi_slopes(8)
    for i = 1, 8 do assert.are.equal(2 ^ -i, s8[i]) end
    -- 6 heads: the 4-head slopes, then every other one of the 8-head slopes
    assert.are.same({ 2 ^ -2, 2 ^ -4, 2 ^ -6, 2 ^ -8, 2 ^ -1, 2 ^ -3 }, nn.alibi_slopes(6))
  end)

  it("RMSNorm: input and weight", function()
    local m = randomize(nn.RMSNorm(6, opts64()))
    check_module(m, h.randn({ 2, 3, 6 }))
    check_module(m, h.randn({ 3, 6 }), { fast = false })
  end)

  it("LayerNorm: input, weight and bias", function()
    local m = randomize(nn.LayerNorm(5, opts64()))
    check_module(m, h.randn({ 3, 5 }), { fast = false })
    check_module(m, h.randn({ 2, 3, 5 }))
  end)

  it("GELU and SiLU", function()
    for _, m in ipairs { nn.GELU(), nn.SiLU() } do
      check_module(m, h.randn({ 3, 4 }) * 2, { fast = false })
    end
  end)

  it("Embedding: the weight grad, repeated ids accumulating", function()
    local m = nn.Embedding(5, 3, opts64())
    local ids = ft.tensor({ { 2, 5, 2 }, { 1, 2, 4 } }, { dtype = "i64" })
    check_module(m, nil, { fast = false }, ids)
  end)

  it("Residual around a Linear", function()
    check_module(nn.Residual(nn.Linear(4, 4, opts64())), h.randn({ 3, 4 }))
  end)

  it("Sequential of Linear, GELU, LayerNorm, SiLU, Linear", function()
    local m = nn.Sequential(nn.Linear(4, 6, opts64()), nn.GELU(), randomize(nn.LayerNorm(6, opts64())),
                            nn.SiLU(), nn.Linear(6, 3, opts64()))
    check_module(m, h.randn({ 2, 2, 4 }))
  end)

  it("Sequential starting with an Embedding: parameter grads through the whole chain", function()
    local m = nn.Sequential(nn.Embedding(7, 4, opts64()), nn.PositionalEmbedding(5, 4, opts64()),
                            nn.Linear(4, 3, opts64()))
    local ids = ft.tensor({ { 1, 7, 3 }, { 3, 3, 6 } }, { dtype = "i64" })
    check_module(m, nil, { fast = true }, ids)
  end)

  it("PositionalEmbedding: input and the rows used", function()
    check_module(nn.PositionalEmbedding(6, 3, opts64()), h.randn({ 2, 4, 3 }))
  end)

  for _, case in ipairs {
    { name = "TransformerBlock (RMSNorm, causal)", o = { dim = 8, heads = 2, hidden = 12, causal = true } },
    { name = "TransformerBlock (LayerNorm, GQA)", o = { dim = 8, heads = 4, kv_heads = 2, hidden = 8, norm = "layer" } },
  } do
    it(case.name .. ": input and every parameter", function()
      local m = randomize(nn.TransformerBlock(opts64(case.o)))
      check_module(m, h.randn({ 2, 4, 8 }))
    end)
  end

  it("CrossEntropy: grad logits, full Jacobian", function()
    local crit = nn.CrossEntropy()
    local targets = ft.tensor({ 3, 1, 4, 3 }, { dtype = "i64" })
    local ok, report = gradcheck.check(
      function(logits) return ft.tensor(crit:forward(logits, targets), F64) end,
      function(dy, logits)
        crit:forward(logits, targets)
        return crit:backward(logits, targets) * dy:item()
      end,
      { h.randn({ 4, 5 }) * 3 }, { fast = false })
    assert.is_true(ok, report.message)
  end)
end)

-- ---- forward values against plain Lua ------------------------------------------------

local function rows(t) return t:totable() end

describe("nn forward values", function()
  it("Linear: x W^T + b", function()
    local m = nn.Linear(3, 2, opts64())
    local x = h.randn({ 4, 3 })
    local want = h.matmul_ref(rows(x), rows(m.weight:transpose():contiguous()))
    local b = m.bias:totable()
    for i = 1, 4 do for j = 1, 2 do want[i][j] = want[i][j] + b[j] end end
    h.assert_values(m:forward(x), want, 1e-12, "Linear")
  end)

  it("RMSNorm and LayerNorm", function()
    local x = h.randn({ 3, 4 })
    local rms = randomize(nn.RMSNorm(4, opts64({ eps = 1e-3 })))
    local ln = randomize(nn.LayerNorm(4, opts64({ eps = 1e-3 })))
    local w, lw, lb = rms.weight:totable(), ln.weight:totable(), ln.bias:totable()
    local want_rms, want_ln = {}, {}
    for i, r in ipairs(rows(x)) do
      local ms, mean = 0, 0
      for _, v in ipairs(r) do ms = ms + v * v / 4; mean = mean + v / 4 end
      local var = 0
      for _, v in ipairs(r) do var = var + (v - mean) ^ 2 / 4 end
      want_rms[i], want_ln[i] = {}, {}
      for j, v in ipairs(r) do
        want_rms[i][j] = v / math.sqrt(ms + 1e-3) * w[j]
        want_ln[i][j] = (v - mean) / math.sqrt(var + 1e-3) * lw[j] + lb[j]
      end
    end
    h.assert_values(rms:forward(x), want_rms, 1e-12, "RMSNorm")
    h.assert_values(ln:forward(x), want_ln, 1e-12, "LayerNorm")
  end)

  it("GELU (tanh approximation) and SiLU", function()
    local xs = { -3, -1, -0.5, 0, 0.25, 1, 2.5 }
    local x = ft.tensor(xs, F64)
    local gelu, silu = {}, {}
    for i, v in ipairs(xs) do
      gelu[i] = 0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ^ 3)))
      silu[i] = v / (1 + math.exp(-v))
    end
    h.assert_values(nn.GELU():forward(x), gelu, 1e-14, "GELU")
    h.assert_values(nn.SiLU():forward(x), silu, 1e-14, "SiLU")
    -- known values: GELU(1) ~ 0.8412 (tanh form), SiLU(1) = 0.7311
    assert.is_true(math.abs(nn.GELU():forward(ft.tensor({ 1 }, F64)):get(1) - 0.841192) < 1e-5)
  end)

  it("Embedding: rows of the weight, for ids of any shape (i64 or i32)", function()
    local m = nn.Embedding(6, 3, opts64())
    local ids = ft.tensor({ { { 6, 1 } }, { { 2, 6 } } }, { dtype = "i64" })
    local y = m:forward(ids)
    assert.are.same({ 2, 1, 2, 3 }, y.shape)
    local w = rows(m.weight)
    h.assert_values(y, { { { w[6], w[1] } }, { { w[2], w[6] } } }, 0, "Embedding")
    h.assert_values(m:forward(ids:to("i32")), { { { w[6], w[1] } }, { { w[2], w[6] } } }, 0, "i32 ids")
    assert.is_nil(m:backward(ids, y))
  end)

  it("Residual and Identity", function()
    local x = h.randn({ 2, 3 })
    local lin = nn.Linear(3, 3, opts64())
    local r = nn.Residual(lin)
    assert.are.equal(0, ft.max_abs_diff(r:forward(x), x + lin:forward(x)))
    local id = nn.Identity()
    assert.are.equal(x, id:forward(x))
    assert.are.equal(x, id:backward(x, x))
  end)

  it("MultiheadAttention: the projections around ft.attention, packed or GQA", function()
    for _, o in ipairs { { dim = 8, heads = 2, causal = true, bias = true }, { dim = 8, heads = 4, kv_heads = 2 } } do
      local m = nn.MultiheadAttention(opts64(o))
      local x = h.randn({ 2, 5, 8 })
      local H, Hk, d = o.heads, o.kv_heads or o.heads, h.idiv(8, o.heads)
      -- the same computation spelt out, with contiguous q, k, v
      local q, k, v
      if m.qkv then
        local qkv = m.qkv:forward(x)
        q = qkv:narrow(3, 1, 8):contiguous():view(2, 5, H, d)
        k = qkv:narrow(3, 9, 8):contiguous():view(2, 5, Hk, d)
        v = qkv:narrow(3, 17, 8):contiguous():view(2, 5, Hk, d)
      else
        q = m.q_proj:forward(x):view(2, 5, H, d)
        local kv = m.kv_proj:forward(x)
        k = kv:narrow(3, 1, Hk * d):contiguous():view(2, 5, Hk, d)
        v = kv:narrow(3, Hk * d + 1, Hk * d):contiguous():view(2, 5, Hk, d)
      end
      local attn = ft.attention(q, k, v, { causal = o.causal or false, impl = "naive" })
      local want = m.out_proj:forward(attn:reshape(2, 5, 8))
      local got = m:forward(x)
      assert.are.same({ 2, 5, 8 }, got.shape)
      assert.is_true(ft.max_abs_diff(got, want) < 1e-12)
    end
  end)

  it("MultiheadAttention causal: the first position depends on itself only", function()
    local m = nn.MultiheadAttention(opts64({ dim = 4, heads = 2, causal = true }))
    local x = h.randn({ 1, 3, 4 })
    local y1 = m:forward(x):clone()
    x:narrow(2, 2, 2):copy(h.randn({ 1, 2, 4 }))
    local y2 = m:forward(x)
    assert.are.equal(0, ft.max_abs_diff(y1:narrow(2, 1, 1), y2:narrow(2, 1, 1)))
    assert.is_true(ft.max_abs_diff(y1:narrow(2, 3, 1), y2:narrow(2, 3, 1)) > 1e-6)
  end)

  it("CrossEntropy: mean of -log softmax at the targets, stable for large logits", function()
    local crit = nn.CrossEntropy()
    local lg = { { 1, 2, 3 }, { 1000, -1000, 0 } }
    local targets = { 2, 1 }
    local want = 0
    for i, r in ipairs(lg) do
      local m = math.max(h.unpack(r))
      local s = 0
      for _, v in ipairs(r) do s = s + math.exp(v - m) end
      want = want + (m + math.log(s) - r[targets[i]]) / 2
    end
    local loss = crit:forward(ft.tensor(lg, F64), ft.tensor(targets, { dtype = "i64" }))
    assert.is_true(math.abs(loss - want) < 1e-12, ("loss %.17g, expected %.17g"):format(loss, want))
    local g = crit:backward(ft.tensor(lg, F64), ft.tensor(targets, { dtype = "i64" }))
    -- rows of the grad sum to zero; the target entry is (p - 1) / N
    h.assert_values(g:sum(2), { 0, 0 }, 1e-15, "grad rows")
    assert.is_true(math.abs(g:get(2, 1) - 0) < 1e-15)
    local p12 = math.exp(2 - 3) / (math.exp(-2) + math.exp(-1) + 1)
    assert.is_true(math.abs(g:get(1, 2) - (p12 - 1) / 2) < 1e-15)
  end)
end)

-- ---- the module API ------------------------------------------------------------------

describe("nn modules", function()
  it("parameters() lists params and grads in the documented order", function()
    local lin = nn.Linear(3, 4, opts64())
    local p, g = lin:parameters()
    assert.are.equal(2, #p)
    assert.are.equal(lin.weight, p[1]); assert.are.equal(lin.bias, p[2])
    assert.are.equal(lin.grad_weight, g[1]); assert.are.equal(lin.grad_bias, g[2])
    assert.are.same({ 4, 3 }, p[1].shape)

    local mha = nn.MultiheadAttention(opts64({ dim = 8, heads = 4, kv_heads = 2 }))
    p = mha:parameters()
    assert.are.equal(3, #p)
    assert.are.same({ 8, 8 }, p[1].shape)   -- q
    assert.are.same({ 8, 8 }, p[2].shape)   -- k and v, 2 heads of 2 each
    assert.are.same({ 8, 8 }, p[3].shape)   -- out
    assert.are.equal(mha.kv_proj.weight, p[2])
    local packed = nn.MultiheadAttention(opts64({ dim = 8, heads = 2, bias = true }))
    p = packed:parameters()
    assert.are.equal(4, #p)
    assert.are.same({ 24, 8 }, p[1].shape)
    assert.are.same({ 24 }, p[2].shape)

    local block = nn.TransformerBlock(opts64({ dim = 8, heads = 2, hidden = 16, norm = "layer" }))
    local shapes = {}
    for i, t in ipairs((block:parameters())) do shapes[i] = table.concat(t.shape, "x") end
    assert.are.same({ "8", "8", "24x8", "8x8", "8", "8", "16x8", "16", "8x16", "8" }, shapes)
    assert.are.equal(8 + 8 + 24 * 8 + 64 + 8 + 8 + 16 * 8 + 16 + 8 * 16 + 8, block:n_parameters())
  end)

  it("backward accumulates parameter grads; zero_grad clears them", function()
    local m = nn.Sequential(nn.Linear(3, 4, opts64()), nn.GELU(), nn.Linear(4, 2, opts64()))
    local x, dy = h.randn({ 5, 3 }), h.randn({ 5, 2 })
    m:forward(x); m:backward(x, dy)
    local _, grads = m:parameters()
    local once = {}
    for i, g in ipairs(grads) do once[i] = g:clone() end
    m:forward(x); m:backward(x, dy)
    for i, g in ipairs(grads) do
      assert.is_true(g:abs():max() > 0)
      assert.is_true(ft.max_abs_diff(g, once[i] * 2) < 1e-12, "grad " .. i)
    end
    assert.are.equal(m, m:zero_grad())
    for _, g in ipairs(grads) do assert.are.equal(0, g:abs():max()) end
  end)

  it("the same seed gives the same parameters, another seed others; the counter differs per module", function()
    local a = nn.TransformerBlock { dim = 8, heads = 2, seed = 5 }
    local b = nn.TransformerBlock { dim = 8, heads = 2, seed = 5 }
    local c = nn.TransformerBlock { dim = 8, heads = 2, seed = 6 }
    local pa, pb, pc = a:parameters(), b:parameters(), c:parameters()
    for i = 1, #pa do assert.are.equal(0, ft.max_abs_diff(pa[i], pb[i])) end
    assert.is_true(ft.max_abs_diff(pa[3], pc[3]) > 0)
    nn.manual_seed(100)
    local l1, l2 = nn.Linear(4, 4), nn.Linear(4, 4)
    assert.is_true(ft.max_abs_diff(l1.weight, l2.weight) > 0)
    nn.manual_seed(100)
    assert.are.equal(0, ft.max_abs_diff(nn.Linear(4, 4).weight, l1.weight))
    -- the weights and biases of one Linear are different streams
    local sq = nn.Linear(4, 4, { seed = 1 })
    assert.is_true(ft.max_abs_diff(sq.weight:select(1, 1), sq.bias) > 0)
  end)

  it("initial scales follow PyTorch", function()
    local lin = nn.Linear(64, 256, { seed = 3 })
    local bound = 1 / 8
    assert.is_true(lin.weight:abs():max() <= bound)
    assert.is_true(lin.weight:abs():max() > 0.95 * bound)
    assert.is_true(math.abs(lin.weight:mean()) < 0.01)
    assert.is_true(lin.bias:abs():max() <= bound)
    local emb = nn.Embedding(100, 64, { seed = 3 })
    local std = math.sqrt((emb.weight * emb.weight):mean())
    assert.is_true(math.abs(std - 1) < 0.05, tostring(std))
    local norm = nn.LayerNorm(4)
    h.assert_values(norm.weight, { 1, 1, 1, 1 }, 0)
    h.assert_values(norm.bias, { 0, 0, 0, 0 }, 0)
    assert.are.equal("f32", lin.weight.dtype)
  end)

  it("to(dtype) converts parameters and grads in place and returns the module", function()
    local m = nn.Sequential(nn.Linear(3, 4, { seed = 1 }), nn.RMSNorm(4), nn.Embedding(5, 2, { seed = 2 }))
    local before = m:parameters()
    local w32 = before[1]
    assert.are.equal(m, m:to("f64"))
    local p, g = m:parameters()
    assert.are.equal(#before, #p)
    for i = 1, #p do
      assert.are.equal("f64", p[i].dtype)
      assert.are.equal("f64", g[i].dtype)
      assert.are_not.equal(before[i], p[i])
    end
    assert.are.equal(m.modules[1].weight, p[1])
    assert.are.equal(0, ft.max_abs_diff(p[1], w32:double()))
    assert.are.equal("f64", (m:type()))
    -- forward works in the new dtype
    local y = m.modules[1]:forward(h.randn({ 2, 3 }))
    assert.are.equal("f64", y.dtype)
    m:to("f32")
    assert.are.equal("f32", m.modules[3].grad_weight.dtype)
  end)

  it("train() and evaluate() set the flag on every module", function()
    local m = nn.Sequential(nn.Linear(2, 2), nn.Residual(nn.GELU()))
    assert.is_true(m.modules[2].modules[1].training)
    assert.are.equal(m, m:evaluate())
    m:apply(function(x) assert.is_false(x.training) end)
    m:train()
    m:apply(function(x) assert.is_true(x.training) end)
  end)

  it("clone() copies parameters, independent of the original", function()
    local m = nn.Sequential(nn.Linear(3, 3, { seed = 1 }), nn.GELU())
    local x = ft.randn({ 2, 3 }, { seed = 2 })
    m:forward(x)
    local c = m:clone()
    assert.is_nil(c.output)
    assert.are.equal(0, ft.max_abs_diff(c:forward(x), m:forward(x)))
    c.modules[1].weight:fill(0)
    assert.is_true(m.modules[1].weight:abs():max() > 0)
    assert.are.equal("nn.Linear", c.modules[1].__typename)
  end)

  it("replace() swaps attention for an identity (the control model), find() finds modules", function()
    local m = nn.Sequential(nn.TransformerBlock { dim = 8, heads = 2 }, nn.TransformerBlock { dim = 8, heads = 2 })
    assert.are.equal(2, #m:find("MultiheadAttention"))
    local n = m:n_parameters()
    m:replace(function(x)
      if x.__typename == "nn.MultiheadAttention" then return nn.Identity() end
      return x
    end)
    assert.are.equal(0, #m:find("nn.MultiheadAttention"))
    assert.are.equal(2, #m:find("Identity"))
    assert.are.equal(n - 2 * (24 * 8 + 8 * 8), m:n_parameters())
    local x = ft.randn({ 1, 3, 8 }, { seed = 1 })
    assert.are.same({ 1, 3, 8 }, m:forward(x).shape)
    -- a named reference in the parent follows the replacement
    local mha = nn.MultiheadAttention { dim = 4, heads = 2, kv_heads = 1 }
    local lin = nn.Linear(4, 4)
    mha:replace(function(x) return x == mha.q_proj and lin or x end)
    assert.are.equal(lin, mha.q_proj)
    assert.are.equal(lin, mha.modules[1])
  end)

  it("m(x) is m:forward(x)", function()
    local m = nn.Linear(2, 3, { seed = 1 })
    local x = ft.randn({ 4, 2 }, { seed = 1 })
    assert.are.equal(0, ft.max_abs_diff(m(x), m:forward(x)))
  end)

  it("tostring shows the nested structure, like torch7", function()
    local m = nn.Sequential(nn.Embedding(10, 8), nn.TransformerBlock { dim = 8, heads = 2, kv_heads = 1, causal = true },
                            nn.RMSNorm(8), nn.Linear(8, 10, { bias = false }))
    local want = [[
nn.Sequential {
  [input -> (1) -> (2) -> (3) -> (4) -> output]
  (1): nn.Embedding(10, 8)
  (2): nn.TransformerBlock(dim 8, hidden 32) {
    [input -> (1) -> (2) -> output]
    (1): nn.Residual {
      [input -> (1) -> + input -> output]
      (1): nn.Sequential {
        [input -> (1) -> (2) -> output]
        (1): nn.RMSNorm(8, eps 1e-06)
        (2): nn.MultiheadAttention(dim 8, heads 2, kv_heads 1, causal) {
          (1): nn.Linear(8 -> 8) without bias
          (2): nn.Linear(8 -> 8) without bias
          (3): nn.Linear(8 -> 8) without bias
        }
      }
    }
    (2): nn.Residual {
      [input -> (1) -> + input -> output]
      (1): nn.Sequential {
        [input -> (1) -> (2) -> (3) -> (4) -> output]
        (1): nn.RMSNorm(8, eps 1e-06)
        (2): nn.Linear(8 -> 32)
        (3): nn.GELU
        (4): nn.Linear(32 -> 8)
      }
    }
  }
  (3): nn.RMSNorm(8, eps 1e-06)
  (4): nn.Linear(8 -> 10) without bias
}]]
    assert.are.equal(want, tostring(m))
    assert.are.equal("nn.CrossEntropy", tostring(nn.CrossEntropy()))
  end)
end)

-- ---- errors ---------------------------------------------------------------------------

describe("nn errors", function()
  local cases = {
    { "Linear with 0 inputs", function() return nn.Linear(0, 3) end, { "nn.Linear", "in_features must be a positive integer, got 0" } },
    { "Linear with 2.5 outputs", function() return nn.Linear(2, 2.5) end, { "out_features must be a positive integer, got 2.5" } },
    { "Linear with a misspelt option", function() return nn.Linear(2, 2, { biass = false }) end, { "unknown option 'biass'", "expected bias, device, dtype, seed" } },
    { "Linear with a non-boolean bias", function() return nn.Linear(2, 2, { bias = 1 }) end, { "option 'bias' must be a boolean" } },
    { "Linear with options not a table", function() return nn.Linear(2, 2, "f64") end, { "options must be a table, got string" } },
    { "Linear with an unknown dtype", function() return nn.Linear(2, 2, { dtype = "f8" }) end, { "f8" } },
    { "MultiheadAttention without a table", function() return nn.MultiheadAttention(8, 2) end, { "nn.MultiheadAttention: expected a table" } },
    { "MultiheadAttention without heads", function() return nn.MultiheadAttention { dim = 8 } end, { "heads must be a positive integer, got nil" } },
    { "MultiheadAttention heads not dividing dim", function() return nn.MultiheadAttention { dim = 10, heads = 4 } end, { "heads (4) must divide dim (10)" } },
    { "MultiheadAttention kv_heads not dividing heads", function() return nn.MultiheadAttention { dim = 12, heads = 4, kv_heads = 3 } end, { "kv_heads (3) must divide heads (4)" } },
    { "MultiheadAttention causal not a boolean", function() return nn.MultiheadAttention { dim = 8, heads = 2, causal = "yes" } end, { "option 'causal' must be a boolean" } },
    { "MultiheadAttention misspelt option", function() return nn.MultiheadAttention { dim = 8, heads = 2, casual = true } end, { "unknown option 'casual'" } },
    { "RMSNorm with a negative eps", function() return nn.RMSNorm(4, { eps = -1 }) end, { "nn.RMSNorm", "option 'eps' must be a positive number, got -1" } },
    { "LayerNorm of dim 0", function() return nn.LayerNorm(0) end, { "nn.LayerNorm: dim must be a positive integer" } },
    { "Embedding without dim", function() return nn.Embedding(10) end, { "nn.Embedding: dim must be a positive integer, got nil" } },
    { "TransformerBlock with an unknown norm", function() return nn.TransformerBlock { dim = 8, heads = 2, norm = "batch" } end, { "option 'norm' must be \"rms\" or \"layer\", got batch" } },
    { "TransformerBlock with bad heads", function() return nn.TransformerBlock { dim = 8, heads = 3 } end, { "heads (3) must divide dim (8)" } },
    { "Sequential of a number", function() return nn.Sequential(nn.GELU(), 3) end, { "nn.Sequential: child 2 must be a module, got number" } },
    { "Residual of nothing", function() return nn.Residual() end, { "nn.Residual: the wrapped module must be a module, got nil" } },
  }
  for _, case in ipairs(cases) do
    it(case[1] .. " is a clear error", function()
      h.assert_error(case[2], h.unpack(case[3]))
    end)
  end

  it("constructor errors point at the caller's line", function()
    -- (not a tail call: that would drop the caller's frame)
    local msg = h.error_of(function() local m = nn.Linear(0, 3); return m end)
    assert.is_truthy(msg:find("nn_spec.lua:%d+: nn.Linear"), msg)
    msg = h.error_of(function() local m = nn.MultiheadAttention { dim = 6, heads = 4 }; return m end)
    assert.is_truthy(msg:find("nn_spec.lua:%d+: nn.MultiheadAttention"), msg)
    local lin = nn.Linear(3, 3)
    msg = h.error_of(function() local y = lin:forward(ft.randn(2, 2)); return y end)
    assert.is_truthy(msg:find("nn_spec.lua:%d+: nn.Linear"), msg)
  end)

  it("bad inputs to forward are clear errors", function()
    local lin = nn.Linear(3, 2)
    h.assert_error(function() return lin:forward(ft.randn({ 2, 4 })) end,
      "nn.Linear: input {2, 4} must end in a dim of size 3")
    h.assert_error(function() return lin:forward(ft.randn({ 2, 3 }, F64)) end,
      "nn.Linear: input is f64 but the parameters are f32")
    h.assert_error(function() return lin:forward(ft.ones({ 2, 3 }, { dtype = "i64" })) end,
      "nn.Linear: input must be a float tensor, got i64")
    h.assert_error(function() return lin:forward({ 1, 2, 3 }) end, "nn.Linear: input must be a tensor, got table")
    local mha = nn.MultiheadAttention { dim = 4, heads = 2 }
    h.assert_error(function() return mha:forward(ft.randn({ 3, 4 })) end,
      "nn.MultiheadAttention: input {3, 4} must be [batch, seqlen, 4]")
    local emb = nn.Embedding(5, 2)
    h.assert_error(function() return emb:forward(ft.tensor({ 1, 6 }, { dtype = "i64" })) end,
      "nn.Embedding: ids must be 1 to 5, got 1 to 6")
    h.assert_error(function() return emb:forward(ft.tensor({ 0, 2 }, { dtype = "i64" })) end, "got 0 to 2")
    h.assert_error(function() return emb:forward(ft.tensor({ 1, 2 })) end,
      "nn.Embedding: input must be an i64 (or i32) tensor of 1-based ids, got f32 tensor")
    local pos = nn.PositionalEmbedding(3, 2)
    h.assert_error(function() return pos:forward(ft.randn({ 1, 4, 2 })) end,
      "nn.PositionalEmbedding: input {1, 4, 2} must be [..., seqlen <= 3, 2]")
    local crit = nn.CrossEntropy()
    local logits = ft.randn({ 2, 3 })
    h.assert_error(function() return crit:forward(logits, ft.tensor({ 1, 4 }, { dtype = "i64" })) end,
      "nn.CrossEntropy: targets must be 1 to 3, got 1 to 4")
    h.assert_error(function() return crit:forward(logits, ft.tensor({ 1, 2, 3 }, { dtype = "i64" })) end,
      "targets {3} must be [2], one per row of the logits")
    h.assert_error(function() return crit:forward(logits, ft.tensor({ 1, 2 })) end,
      "targets must be an i64 (or i32) tensor")
    h.assert_error(function() return crit:forward(ft.randn({ 2, 3, 1 }), ft.tensor({ 1, 2 }, { dtype = "i64" })) end,
      "logits {2, 3, 1} must be [N, classes]")
    local gone = ft.randn({ 2, 3 })
    gone:free()
    h.assert_error(function() return lin:forward(gone) end, "nn.Linear: input has been freed")
  end)

  it("bad calls of backward are clear errors naming the module, and the module works after them", function()
    local x = ft.randn({ 2, 3 }, { seed = 5 })
    local modules = {
      { nn.Linear(3, 2), "nn.Linear", { 2, 2 } },
      { nn.GELU(), "nn.GELU", { 2, 3 } },
      { nn.LayerNorm(3), "nn.LayerNorm", { 2, 3 } },
      { nn.Sequential(nn.Linear(3, 4), nn.SiLU()), "nn.Sequential", { 2, 4 } },
      { nn.Residual(nn.Linear(3, 3)), "nn.Residual", { 2, 3 } },
    }
    for _, c in ipairs(modules) do
      local m, name, out_shape = c[1], c[2], c[3]
      h.assert_error(function() return m:backward(x, ft.randn(out_shape)) end,
        name .. ": backward before forward")
      m:forward(x)
      h.assert_error(function() return m:backward(x) end, name .. ": grad_output must be a tensor, got nil")
      h.assert_error(function() return m:backward(x, ft.randn({ 5, 7 })) end,
        name .. ": grad_output {5, 7} must have the output's shape")
      h.assert_error(function() return m:backward(x, ft.randn(out_shape, F64)) end,
        name .. ": grad_output is f64", "but the")
      local gone = ft.randn(out_shape)
      gone:free()
      h.assert_error(function() return m:backward(x, gone) end, name .. ": grad_output has been freed")
      local g = m:backward(x, ft.ones(out_shape))
      assert.are.same({ 2, 3 }, g.shape)
    end
    local mha = nn.MultiheadAttention { dim = 4, heads = 2 }
    local xa = ft.randn({ 1, 3, 4 })
    h.assert_error(function() return mha:backward(xa, ft.randn({ 1, 3, 4 })) end,
      "nn.MultiheadAttention: backward before forward")
    mha:forward(xa)
    h.assert_error(function() return mha:backward(xa, ft.randn({ 1, 4, 4 })) end,
      "nn.MultiheadAttention: grad_output {1, 4, 4} must have the output's shape {1, 3, 4}")
    assert.are.same({ 1, 3, 4 }, mha:backward(xa, ft.ones({ 1, 3, 4 })).shape)
  end)
end)
