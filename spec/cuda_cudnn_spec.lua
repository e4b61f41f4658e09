-- impl "cudnn" (lib/attention_cudnn.c): cuDNN's fused attention, forward and
-- backward, against the CPU's f64 reference by flashtile's accuracy standard
-- (as cuda_attention_spec.lua judges the flash kernels: a 16-bit result passes
-- when its error is at most twice that of the naive path in the same
-- precision, plus a floor at the input's rounding unit, and is never NaN),
-- and the calls it refuses (tag #gpu: pending without a GPU, or in a build
-- without cuDNN). The errors an impl "cudnn" call gives on the CPU need
-- neither and always run.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

--- An it() for a GPU and a build with cuDNN.
local function cudnn_it(name, body)
  gpu_it(name, function()
    if not ft.cuda.cudnn_version() then
      pending("impl 'cudnn': this flashtile was built without cuDNN")
      return
    end
    body()
  end)
end

local inputs = h.attention_inputs
local run_gpu = h.attention_on_gpu

local NAMES = { "out", "lse", "dq", "dk", "dv" }

--- cudnn against the f64 reference, judged by the naive path's error.
local function check(dtype, B, Nq, Nk, H, Hk, d, opts)
  local q, k, v, dout = inputs(B, Nq, Nk, H, Hk, d)
  local ref = h.pack(ft.attention(q, k, v, h.merge(opts, { impl = "tiled" })))
  local grads = h.pack(ft.attention_backward(dout, q, k, v, ref[1], ref[2], h.merge(opts, { impl = "tiled" })))
  ref = { ref[1], ref[2], grads[1], grads[2], grads[3] }
  local c = run_gpu("cudnn", dtype, q, k, v, dout, opts)
  local n = run_gpu("naive", dtype, q, k, v, dout, opts)
  local where = ("%s B=%d Nq=%d Nk=%d H=%d Hk=%d d=%d causal=%s scale=%s"):format(dtype, B, Nq, Nk, H,
    Hk, d, tostring(opts.causal), tostring(opts.scale))
  for i, name in ipairs(NAMES) do
    assert.are.same(ref[i].shape, c[i].shape, where .. ": " .. name .. "'s shape")
  end
  h.assert_within_naive("cudnn", dtype, c, n, ref, where)
end

describe("impl 'cudnn' (cuDNN's fused attention) #gpu", function()
  for _, dtype in ipairs { "f16", "bf16" } do
    for _, d in ipairs { 64, 128 } do
      for _, causal in ipairs { false, true } do
        cudnn_it(("%s d=%d causal=%s against the f64 reference: odd lengths, GQA, MQA, Nq ~= Nk"):format(
          dtype, d, tostring(causal)), function()
          check(dtype, 2, 77, 93, 4, 2, d, { causal = causal })
          check(dtype, 1, 93, 77, 4, 4, d, { causal = causal })
          check(dtype, 1, 130, 130, 2, 1, d, { causal = causal })
        end)
      end
    end
  end

  cudnn_it("other head dims cuDNN takes (multiples of 8), longer sequences, the scale option", function()
    for _, d in ipairs { 32, 96 } do
      check("f16", 1, 200, 200, 2, 2, d, { causal = true })
      check("bf16", 1, 150, 170, 4, 2, d, { causal = false })
    end
    check("bf16", 1, 600, 700, 4, 2, 128, { causal = true })
    check("f16", 2, 300, 300, 2, 1, 64, { causal = true, scale = 0.3 })
    check("bf16", 1, 100, 120, 2, 2, 64, { scale = 0.05 })
  end)

  cudnn_it("rows that see no key (causal, Nq > Nk) give zeros, lse = -inf and a zero dq", function()
    local q, k, v, dout = inputs(1, 40, 10, 2, 2, 64)
    local r = run_gpu("cudnn", "f16", q, k, v, dout, { causal = true })
    local out, lse, dq = r[1]:cpu(), r[2]:cpu(), r[3]:cpu()
    for i = 1, 30 do -- query i (1-based) sees keys up to i - 30
      assert.are.equal(-math.huge, lse:get(1, 1, i))
      assert.are.equal(0, out:select(2, i):abs():max())
      assert.are.equal(0, dq:select(2, i):abs():max())
    end
    assert.is_true(lse:get(1, 1, 31) > -math.huge)
    -- and no key at all: zeros and -inf forward, zero gradients backward
    local e = ft.zeros({ 1, 0, 2, 64 }, { dtype = "f16", device = "cuda" })
    local qg = q:half():cuda()
    local o0, l0 = ft.attention(qg, e, e, { impl = "cudnn" })
    assert.are.equal(0, o0:abs():max())
    assert.are.equal(-math.huge, l0:max())
    local g = h.pack(ft.attention_backward(dout:half():cuda(), qg, e, e, o0, l0, { impl = "cudnn" }))
    assert.are.equal(0, g[1]:abs():max())
    assert.are.same({ 1, 0, 2, 64 }, g[2].shape)
  end)

  cudnn_it("strided q, k, v (views of one packed qkv) and views cuDNN cannot read (copied first)", function()
    local B, N, H, d = 2, 100, 4, 64
    local qkv = ft.randn({ B, N, 3, H, d }, { dtype = "bf16", seed = h.next_seed() }):cuda()
    local q, k, v = qkv:select(3, 1), qkv:select(3, 2), qkv:select(3, 3)
    assert.is_false(q:is_contiguous())
    local o = { impl = "cudnn", causal = true }
    local dout = ft.randn({ B, N, H, d }, { dtype = "bf16", seed = h.next_seed() }):cuda()
    local function both(a, b, c)
      local out, lse = ft.attention(a, b, c, o)
      local g = h.pack(ft.attention_backward(dout, a, b, c, out, lse, o))
      return { out, lse, g[1], g[2], g[3] }
    end
    -- the same sums, possibly in another order (dQ is summed with
    -- atomics): within a few of bf16's rounding units
    local function close(x, y)
      for i = 1, 5 do
        local tol = 2^-6 * math.max(1, y[i]:float():abs():max())
        local e = ft.max_abs_diff(x[i]:float(), y[i]:float())
        assert.is_true(e <= tol, ("%s differs by %.3e"):format(NAMES[i], e))
      end
    end
    close(both(q, k, v), both(q:contiguous(), k:contiguous(), v:contiguous()))
    -- rows of d + 1 elements, the view starting one element in: neither
    -- the strides nor the address suit cuDNN, so it reads a contiguous copy
    local wide = ft.randn({ B, N, H, d + 1 }, { dtype = "bf16", seed = h.next_seed() }):cuda()
    local odd = wide:narrow(4, 2, d)
    local a, b = both(odd, k, v), both(odd:contiguous(), k, v)
    assert.are.equal(0, ft.max_abs_diff(a[1], b[1])) -- the same plan: the forward is deterministic
    close(a, b)
    -- contiguous, but starting one element into its storage: the address
    -- alone does not suit cuDNN, and the copy must be a new allocation
    local n = B * N * H * d
    local flat = ft.randn({ n + 1 }, { dtype = "bf16", seed = h.next_seed() }):cuda()
    local shifted = flat:narrow(1, 2, n):view(B, N, H, d)
    assert.is_true(shifted:is_contiguous())
    a, b = both(shifted, k, v), both(shifted:clone(), k, v)
    assert.are.equal(0, ft.max_abs_diff(a[1], b[1]))
    close(a, b)
  end)

  cudnn_it("LSE rows that start off 16 bytes (B = H = 1, causal, Nq - Nk rows see no key)", function()
    -- 13 blind rows: the backward's LSE of the other rows starts 52 bytes in
    check("f16", 1, 90, 77, 1, 1, 64, { causal = true })
    check("bf16", 1, 67, 64, 1, 1, 128, { causal = true })
  end)

  cudnn_it("repeated calls reuse the plan and give the same forward, bit for bit", function()
    local q = ft.randn({ 2, 256, 4, 64 }, { dtype = "f16", seed = h.next_seed() }):cuda()
    local first = ft.attention(q, q, q, { impl = "cudnn", causal = true })
    for _ = 1, 3 do
      assert.are.equal(0, ft.max_abs_diff(first, ft.attention(q, q, q, { impl = "cudnn", causal = true })))
    end
  end)

  cudnn_it("refuses what cuDNN's fused attention does not do, naming the option", function()
    local q = ft.randn({ 1, 16, 2, 64 }, { dtype = "f16" }):cuda()
    local out, lse = ft.attention(q, q, q, { impl = "cudnn" })
    local function fwd(o) return function() ft.attention(q, q, q, h.merge(o, { impl = "cudnn" })) end end
    h.assert_error(fwd { window_left = 4 }, "bad argument #4 to 'attention'",
      "impl 'cudnn' takes causal and scale, not a sliding window")
    h.assert_error(fwd { window_right = 3 }, "not a sliding window")
    h.assert_error(fwd { softcap = 30 }, "not softcap")
    h.assert_error(fwd { alibi_slopes = ft.ones({ 2 }, { device = "cuda" }) }, "not alibi_slopes")
    h.assert_error(fwd { sink = ft.zeros({ 2 }, { device = "cuda" }) }, "not sink")
    h.assert_error(fwd { dropout_p = 0.1, seed = 1, offset = 0 }, "not dropout_p")
    h.assert_error(fwd { mods = ft.attention_mods { mask = function(b, hh, i, j) return j:le(i) end } },
      "not mods")
    local cu = ft.tensor({ 0, 16 }, { dtype = "i32", device = "cuda" })
    local packed = q:view(16, 2, 64)
    h.assert_error(function()
      ft.attention(packed, packed, packed, { impl = "cudnn", cu_seqlens_q = cu, cu_seqlens_k = cu })
    end, "not cu_seqlens (variable lengths)")
    -- causal's own window_right = 0 is causal, not a window
    ft.attention(q, q, q, { impl = "cudnn", causal = true, window_right = 0 })
    h.assert_error(function() ft.attention(q:float(), q:float(), q:float(), { impl = "cudnn" }) end,
      "impl 'cudnn' takes f16 or bf16 tensors (cuDNN's fused attention), got f32")
    local q36 = ft.randn({ 1, 16, 2, 36 }, { dtype = "bf16" }):cuda()
    h.assert_error(function() ft.attention(q36, q36, q36, { impl = "cudnn" }) end,
      "bad argument #1 to 'attention'", "impl 'cudnn' takes head_dim a multiple of 8 up to 256", "got 36")
    h.assert_error(function()
      ft.attention_backward(q, q, q, q, out, lse, { impl = "cudnn", deterministic = true })
    end, "bad argument #7 to 'attention_backward'", "cuDNN's backward (impl 'cudnn') sums dQ with atomics")
    local one = ft.randn({ 1, 1, 2, 64 }, { dtype = "f16" }):cuda()
    local o1, l1 = ft.attention(one, one, one, { impl = "cudnn" })
    h.assert_error(function() ft.attention_backward(one, one, one, one, o1, l1, { impl = "cudnn" }) end,
      "does not take seqlen_q = seqlen_k = 1")
    -- the session goes on
    assert.are.same({ 1, 16, 2, 64 }, ft.attention(q, q, q, { impl = "cudnn" }).shape)
  end)
end)

describe("impl 'cudnn' without a GPU", function()
  it("is a known impl; on cpu tensors it is an error naming the problem (and a build without cuDNN)", function()
    local v = ft.cuda.cudnn_version()
    assert.is_true(v == nil or (math.type == nil or math.type(v) == "integer") and v >= 90000, tostring(v))
    local q = ft.randn({ 1, 8, 2, 16 }, { dtype = "f32" })
    local msg = h.assert_error(function() ft.attention(q, q, q, { impl = "cudnn" }) end,
      "bad argument #4 to 'attention'", "impl 'cudnn' runs on CUDA tensors; these are on the cpu")
    assert.are.equal(v == nil, msg:find("flashtile was built without cuDNN", 1, true) ~= nil, msg)
    local out, lse = ft.attention(q, q, q)
    h.assert_error(function() ft.attention_backward(q, q, q, q, out, lse, { impl = "cudnn" }) end,
      "bad argument #7 to 'attention_backward'", "impl 'cudnn' runs on CUDA tensors")
    h.assert_error(function() ft.attention(q, q, q, { impl = "cuDNN" }) end,
      "unknown impl 'cuDNN' (expected auto, naive, tiled, flash or cudnn)")
  end)
end)
