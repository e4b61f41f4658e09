-- Attention on CUDA (tag #gpu): the flash kernels and the naive cuBLAS path
-- against the CPU's f64 reference on fresh random inputs, by flashtile's accuracy
-- standard: a 16-bit (or f32) result passes when its error against f64 is
-- at most twice the error of the naive path run in the same input precision
-- (plus a floor at the input's rounding unit), and is never NaN. Pending,
-- with the reason, where there is no GPU.
local h = require "helper"
local ft = h.ft


local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

--- Runs forward and backward with impl on the GPU in dtype, from the f64
-- CPU inputs: {out, lse, dq, dk, dv} on the GPU.
local function run_gpu(impl, dtype, q, k, v, dout, opts)
  local o = { causal = opts.causal, window_left = opts.window_left, window_right = opts.window_right }
  return h.attention_on_gpu(impl, dtype, q, k, v, dout, o)
end

local function reference(q, k, v, dout, opts)
  local o = { impl = "tiled", causal = opts.causal, window_left = opts.window_left,
              window_right = opts.window_right }
  local out, lse = ft.attention(q, k, v, o)
  local dq, dk, dv = ft.attention_backward(dout, q, k, v, out, lse, o)
  return { out = out, dq = dq, dk = dk, dv = dv }, lse
end

local inputs = h.attention_inputs

--- causal: a boolean, or the options table (causal, window_left, window_right).
local function check_against_naive(dtype, B, Nq, Nk, H, Hk, d, causal)
  local q, k, v, dout = inputs(B, Nq, Nk, H, Hk, d)
  local opts = type(causal) == "table" and causal or { causal = causal }
  if type(causal) == "table" then
    causal = ("%s window %s, %s"):format(tostring(opts.causal), tostring(opts.window_left),
      tostring(opts.window_right))
  end
  local ref, ref_lse = reference(q, k, v, dout, opts)
  local f = run_gpu("flash", dtype, q, k, v, dout, opts)
  local n = run_gpu("naive", dtype, q, k, v, dout, opts)
  local where = ("%s B=%d Nq=%d Nk=%d H=%d Hk=%d d=%d causal=%s"):format(
    dtype, B, Nq, Nk, H, Hk, d, tostring(causal))
  h.assert_within_naive("flash", dtype, f, n, { ref.out, ref_lse, ref.dq, ref.dk, ref.dv }, where)
end

describe("attention on CUDA #gpu", function()
  describe("flash and naive against the f64 reference", function()
    for _, dtype in ipairs { "f16", "bf16", "f32" } do
      for _, d in ipairs { 32, 64, 96, 128, 192, 256 } do
        for _, causal in ipairs { false, true } do
          gpu_it(("%s d=%d causal=%s, odd lengths, GQA and MHA, Nq ~= Nk"):format(dtype, d, tostring(causal)),
            function()
              check_against_naive(dtype, 2, 77, 93, 4, 2, d, causal)
              check_against_naive(dtype, 1, 93, 77, 4, 4, d, causal)
              check_against_naive(dtype, 1, 130, 130, 2, 1, d, causal)
            end)
        end
      end
    end
    gpu_it("long sequences: many blocks each way, every pipeline stage reused, GQA across query blocks", function()
      for _, dtype in ipairs { "f16", "bf16" } do
        for _, d in ipairs { 32, 64, 128, 192, 256 } do
          check_against_naive(dtype, 1, 600, 700, 4, 2, d, true)
          check_against_naive(dtype, 1, 700, 600, 2, 2, d, false)
        end
      end
    end)
    gpu_it("more query tiles than twice the SMs: a persistent grid's CTAs each walk several (FT_PERSIST)", function()
      -- 5 query blocks of 128 x 32 heads x 3 = 480 tiles at d = 128
      check_against_naive("bf16", 3, 520, 600, 32, 8, 128, true)
      check_against_naive("bf16", 3, 600, 520, 32, 8, 128, false)
    end)
    local windows = {
      { window_left = 20, window_right = 5 },
      { causal = true, window_left = 30 },
      { window_left = 0, window_right = 0 },
      { window_right = 10 },
    }
    for _, dtype in ipairs { "f16", "bf16", "f32" } do
      for _, d in ipairs { 32, 64, 96, 128, 192, 256 } do
        gpu_it(("%s d=%d sliding windows (two-sided, causal, the diagonal alone, one-sided)"):format(
          dtype, d), function()
          for _, w in ipairs(windows) do
            check_against_naive(dtype, 2, 77, 93, 4, 2, d, w)
            check_against_naive(dtype, 1, 130, 120, 2, 1, d, w)
          end
        end)
      end
    end
    gpu_it("long sequences under a window: blocks skipped on both sides, every stage reused", function()
      for _, dtype in ipairs { "f16", "bf16" } do
        for _, d in ipairs { 64, 128, 256 } do
          check_against_naive(dtype, 1, 700, 600, 4, 2, d, { causal = true, window_left = 150 })
          check_against_naive(dtype, 1, 600, 700, 2, 2, d, { window_left = 90, window_right = 200 })
        end
      end
    end)
    gpu_it("head dims between the kernels' sizes (8, 16, 24, 40, 72, 88, 136, 176, 200) are padded with zero columns",
      function()
      for _, d in ipairs { 8, 16, 24, 40, 72, 88, 136, 176, 200 } do
        check_against_naive("f16", 1, 150, 170, 2, 1, d, true)
        check_against_naive("bf16", 2, 170, 150, 2, 2, d, false)
      end
    end)
    gpu_it("head dims the tensor-core path does not take (d = 36, 12) run on the simple path", function()
      check_against_naive("f16", 1, 50, 70, 2, 1, 36, true)
      check_against_naive("bf16", 1, 70, 50, 2, 2, 12, false)
    end)
  end)

  gpu_it("strided q, k, v (views of one packed qkv tensor) give the contiguous results", function()
    local B, N, H, d = 2, 100, 4, 64
    local qkv = ft.randn({ B, N, 3, H, d }, { dtype = "f16", seed = h.next_seed() }):cuda()
    local q, k, v = qkv:select(3, 1), qkv:select(3, 2), qkv:select(3, 3)
    assert.is_false(q:is_contiguous())
    local a = ft.attention(q, k, v, { causal = true })
    local b = ft.attention(q:contiguous(), k:contiguous(), v:contiguous(), { causal = true })
    assert.are.equal(0, ft.max_abs_diff(a, b))
    local dout = ft.randn(a.shape, { dtype = "f16", seed = h.next_seed() }):cuda()
    local _, lse = ft.attention(q, k, v, { causal = true })
    local g1 = h.pack(ft.attention_backward(dout, q, k, v, a, lse, { causal = true }))
    local g2 = h.pack(ft.attention_backward(dout, q:contiguous(), k:contiguous(), v:contiguous(), a, lse, { causal = true }))
    for i = 1, 3 do assert.are.equal(0, ft.max_abs_diff(g1[i], g2[i])) end
  end)

  gpu_it("rows that see no key (causal, Nq > Nk) give zeros and lse = -inf", function()
    local q, k, v = inputs(1, 40, 10, 2, 2, 64)
    local out, lse = ft.attention(q:half():cuda(), k:half():cuda(), v:half():cuda(), { causal = true })
    out, lse = out:cpu(), lse:cpu()
    for i = 1, 30 do -- query i (1-based) sees keys up to i - 30
      assert.are.equal(-math.huge, lse:get(1, 1, i))
      assert.are.equal(0, out:select(2, i):abs():max())
    end
    assert.is_true(lse:get(1, 1, 31) > -math.huge)
  end)

  gpu_it("NaN in, NaN out (as PyTorch and the CPU): a NaN query row is NaN (out, LSE, dq), a NaN key makes NaN the rows that see it; every other row keeps its bits (flash, each kernel family; naive)", function()
    local B, Nq, Nk, H, Hk = 1, 200, 300, 4, 2
    local function nan_rows(out, lse, bad)
      local O, L = out:cpu():float():totable(), lse:cpu():totable()
      for i = 1, Nq do
        for hh = 1, H do
          local want = bad(i, hh)
          assert.are.equal(want, L[1][hh][i] ~= L[1][hh][i], ("lse row %d head %d"):format(i, hh))
          assert.are.equal(want, O[1][i][hh][1] ~= O[1][i][hh][1], ("out row %d head %d"):format(i, hh))
        end
      end
    end
    local function same_rows(a, b, bad)
      local x, y = a:cpu():float():totable(), b:cpu():float():totable()
      for i = 1, Nq do
        for hh = 1, H do
          if not bad(i, hh) then
            assert.are.same(x[1][i][hh], y[1][i][hh], ("row %d head %d"):format(i, hh))
          end
        end
      end
    end
    for _, c in ipairs {
      { "bf16", 128, {} }, { "f16", 64, { causal = true } }, { "bf16", 256, { causal = true } },
      { "bf16", 128, { softcap = 30 } }, { "f16", 36, {} }, { "f32", 64, { causal = true } },
    } do
      local dtype, d, opts = c[1], c[2], c[3]
      local q, k, v, dout = inputs(B, Nq, Nk, H, Hk, d)
      local function g(t) return t:to(dtype):cuda() end
      for _, impl in ipairs { "flash", "naive" } do
        local o = h.merge(opts, { impl = impl })
        local where = ("%s d %d %s %s"):format(dtype, d, impl, opts.causal and "causal" or opts.softcap and "softcap" or "")
        local out0, lse0 = ft.attention(g(q), g(k), g(v), o)
        -- every score of query 50, head 3 is NaN
        local qn = q:clone()
        qn:set(1, 50, 3, 5, 0 / 0)
        local out, lse = ft.attention(g(qn), g(k), g(v), o)
        local function bad_q(i, hh) return i == 50 and hh == 3 end
        nan_rows(out, lse, bad_q)
        same_rows(out0, out, bad_q)
        local dq = ft.attention_backward(g(dout), g(qn), g(k), g(v), out, lse, o)
        local DQ = dq:cpu():float():totable()
        assert.is_true(DQ[1][50][3][1] ~= DQ[1][50][3][1], where .. ": dq of the NaN row")
        assert.is_true(DQ[1][49][3][1] == DQ[1][49][3][1], where .. ": dq of another row")
        -- key 250 of kv head 1 (query heads 1 and 2) is NaN: the rows that see it
        local kn = k:clone()
        kn:set(1, 250, 1, 7, 0 / 0)
        local outk, lsek = ft.attention(g(q), g(kn), g(v), o)
        local function bad_k(i, hh) return hh <= 2 and (not opts.causal or i + Nk - Nq >= 250) end
        nan_rows(outk, lsek, bad_k)
        same_rows(out0, outk, bad_k)
      end
    end
  end)

  gpu_it("deterministic: the backward gives bitwise-identical gradients run after run", function()
    local q, k, v, dout = inputs(2, 300, 300, 4, 2, 128)
    local opts = { causal = true, deterministic = true }
    local qg, kg, vg, dg = q:bf16():cuda(), k:bf16():cuda(), v:bf16():cuda(), dout:bf16():cuda()
    local out, lse = ft.attention(qg, kg, vg, opts)
    local first = h.pack(ft.attention_backward(dg, qg, kg, vg, out, lse, opts))
    for _ = 1, 3 do
      local again = h.pack(ft.attention_backward(dg, qg, kg, vg, out, lse, opts))
      for i = 1, 3 do assert.are.equal(0, ft.max_abs_diff(first[i], again[i])) end
    end
  end)

  gpu_it("flash's peak extra memory grows linearly with seqlen, naive's quadratically", function()
    local function peak(impl, N)
      local q = ft.randn({ 1, N, 8, 64 }, { dtype = "f16", seed = 1 }):cuda()
      local k = ft.randn({ 1, N, 8, 64 }, { dtype = "f16", seed = 2 }):cuda()
      local v = ft.randn({ 1, N, 8, 64 }, { dtype = "f16", seed = 3 }):cuda()
      collectgarbage()
      ft.cuda.synchronize()
      ft.reset_peak_memory("cuda")
      local before = ft.memory_stats("cuda").in_use
      local out, lse = ft.attention(q, k, v, { impl = impl })
      ft.cuda.synchronize()
      local p = ft.memory_stats("cuda").peak - before
      out:free(); lse:free(); q:free(); k:free(); v:free()
      return p
    end
    local f1, f2 = peak("flash", 2048), peak("flash", 4096)
    local n1, n2 = peak("naive", 2048), peak("naive", 4096)
    assert.is_true(f2 / f1 < 2.6, ("flash peak ratio %.2f (%d -> %d bytes)"):format(f2 / f1, f1, f2))
    assert.is_true(n2 / n1 > 3.2, ("naive peak ratio %.2f (%d -> %d bytes)"):format(n2 / n1, n1, n2))
    assert.is_true(n2 > 8 * f2)
  end)

  gpu_it("bad input on CUDA is a clear error and the session goes on", function()
    local q = ft.randn({ 1, 8, 2, 64 }, { dtype = "f16" }):cuda()
    h.assert_error(function() ft.attention(q, q:cpu(), q) end, "k is on cpu but q is on cuda:0")
    h.assert_error(function() ft.attention(q, q, q, { impl = "tiled" }) end, "cpu implementation")
    h.assert_error(function() ft.attention(q:double(), q:double(), q:double(), { impl = "flash" }) end, "naive")
    -- "auto" takes f64 to the naive path
    local o64 = ft.attention(q:double(), q:double(), q:double())
    assert.are.equal("f64", o64.dtype)
    local out = ft.attention(q, q, q)
    assert.are.same({ 1, 8, 2, 64 }, out.shape)
  end)
end)
