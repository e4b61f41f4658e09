-- flashtile.nn for decoding: nn.Rotary (values against plain Lua, its
-- backward and MultiheadAttention{rotary = true}'s against finite
-- differences), and nn.KVCache: a model fed its prompt, then one token at a
-- time with the cache, gives the logits of the full-sequence forward (f64,
-- CPU; on the GPU, tag gpu, f32 against the CPU).
local h = require "helper"
local ft = h.ft
local nn = require "flashtile.nn"
local gradcheck = require "flashtile.gradcheck"

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local function randn(shape, dtype) return ft.randn(shape, { dtype = dtype or "f64", seed = h.next_seed() }) end

--- A small decoder: embedding, two causal rotary TransformerBlocks (GQA), a
-- head; forward(ids [B, N]) -> logits [B, N, vocab].
local function decoder(dtype, device)
  local o = { dtype = dtype, device = device }
  nn.manual_seed(7)
  local model = nn.Sequential(
    nn.Embedding(50, 32, o),
    nn.TransformerBlock { dim = 32, heads = 4, kv_heads = 2, causal = true, rotary = true,
                          dtype = dtype, device = device },
    nn.TransformerBlock { dim = 32, heads = 4, kv_heads = 2, causal = true, rotary = 500,
                          dtype = dtype, device = device },
    nn.Linear(32, 50, o))
  model:evaluate()
  return model
end

local function ids(B, N, device)
  local t = {}
  for b = 1, B do
    t[b] = {}
    for n = 1, N do t[b][n] = (b * 7 + n * 13) % 50 + 1 end
  end
  return ft.tensor(t, { dtype = "i64", device = device })
end

describe("nn for decoding", function()
  it("Rotary turns each pair of a row by its position's angle (against plain Lua) and back", function()
    local r = nn.Rotary { head_dim = 6, base = 100 }
    local x = randn { 2, 3, 2, 6 }
    local y = r:rotate(x, 5)
    for b = 1, 2 do
      for n = 1, 3 do
        for hh = 1, 2 do
          for i = 1, 3 do
            local a = (5 + n - 1) * 100 ^ (-2 * (i - 1) / 6)
            local x1, x2 = x:get(b, n, hh, i), x:get(b, n, hh, i + 3)
            assert.is_true(math.abs(y:get(b, n, hh, i) - (x1 * math.cos(a) - x2 * math.sin(a))) < 1e-14)
            assert.is_true(math.abs(y:get(b, n, hh, i + 3) - (x2 * math.cos(a) + x1 * math.sin(a))) < 1e-14)
          end
        end
      end
    end
    assert.is_true(ft.max_abs_diff(r:rotate(y, 5, true), x) < 1e-14)
    for _, bad in ipairs { 1.5, -1, "2" } do
      h.assert_error(function() r:rotate(x, bad) end, "nn.Rotary:rotate: pos0 (the first row's position) must be a whole number >= 0")
    end
  end)

  it("Rotary's backward and MultiheadAttention{rotary = true}'s against finite differences", function()
    local r = nn.Rotary { head_dim = 4 }
    local ok, report = gradcheck.check(function(x) return r:forward(x) end,
      function(dy, x) r:forward(x); return r:backward(x, dy) end, { randn { 2, 3, 2, 4 } }, { fast = true })
    assert.is_true(ok, report.message)
    local m = nn.MultiheadAttention { dim = 8, heads = 4, kv_heads = 2, causal = true, rotary = true,
                                      dtype = "f64", seed = 3 }
    local x = randn { 2, 5, 8 }
    ok, report = gradcheck.check(function(xx) return m:forward(xx) end,
      function(dy, xx) m:forward(xx); return m:backward(xx, dy) end, { x }, { fast = true })
    assert.is_true(ok, report.message)
    assert.is_truthy(tostring(m):find("rotary 10000", 1, true))
  end)

  it("a prompt, then one token at a time with nn.KVCache, gives the full-sequence logits", function()
    local model = decoder("f64")
    local B, N, P = 2, 12, 5
    local all = ids(B, N)
    local full = model:forward(all):clone()
    local cache = nn.KVCache(model, { batch = B, capacity = 16 })
    local first = model:forward(all:narrow(2, 1, P))
    assert.are.equal(P, cache.len)
    assert.is_true(ft.max_abs_diff(first, full:narrow(2, 1, P)) < 1e-12)
    for n = P + 1, N do
      local step = model:forward(all:narrow(2, n, 1))
      local e = ft.max_abs_diff(step, full:narrow(2, n, 1))
      assert.is_true(e < 1e-12, ("position %d: error %g"):format(n, e))
    end
    assert.are.equal(N, cache.len)
    -- reset: the same again from the start
    cache:reset()
    model:forward(all:narrow(2, 1, N - 1))
    assert.is_true(ft.max_abs_diff(model:forward(all:narrow(2, N, 1)), full:narrow(2, N, 1)) < 1e-12)
    -- detach: the plain forward again
    cache:detach()
    assert.is_true(ft.max_abs_diff(model:forward(all), full) < 1e-12)
  end)

  it("refuses what a cache cannot take", function()
    local model = decoder("f64")
    local cache = nn.KVCache(model, { batch = 1, capacity = 4 })
    h.assert_error(function() model:forward(ids(2, 1)) end, "input batch 2, the cache holds 1")
    model:forward(ids(1, 3))
    h.assert_error(function() model:forward(ids(1, 2)) end, "exceed the capacity 4")
    model:train()
    h.assert_error(function() model:forward(ids(1, 1)) end, "call evaluate() first")
    h.assert_error(function() nn.KVCache(nil, { batch = 1, capacity = 4 }) end,
      "nn.KVCache: model must be an nn module, got nil")
    h.assert_error(function() nn.KVCache(5, { batch = 1, capacity = 4 }) end, "got number")
    h.assert_error(function() nn.KVCache(nn.Linear(2, 2), { batch = 1, capacity = 4 }) end,
      "no MultiheadAttention")
    h.assert_error(function() nn.MultiheadAttention { dim = 6, heads = 2, rotary = true } end, "even head_dim")
    h.assert_error(function() nn.MultiheadAttention { dim = 8, heads = 2, rotary = 0.5 } end, "option 'rotary'")
    cache:detach()
  end)

  gpu_it("decoding on CUDA follows the CPU (f32)", function()
    local cpu, gpu = decoder("f32"), decoder("f32", "cuda")
    local all = ids(2, 9)
    local want = cpu:forward(all)
    local cache = nn.KVCache(gpu, { batch = 2, capacity = 16 })
    gpu:forward(all:narrow(2, 1, 4):cuda())
    for n = 5, 9 do
      local step = gpu:forward(all:narrow(2, n, 1):cuda())
      local e = ft.max_abs_diff(step:cpu(), want:narrow(2, n, 1))
      assert.is_true(e < 1e-4, ("position %d: error %g"):format(n, e))
    end
    cache:detach()
  end)
end)
