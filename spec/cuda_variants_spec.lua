-- Attention variants on CUDA (tag #gpu): windows, softcap, ALiBi, sinks,
-- dropout and varlen, alone and combined, forward and backward, against the
-- CPU's f64 tiled path (itself checked against a plain-Lua reference and
-- finite differences in variants_spec.lua), on fresh random inputs. The
-- flash kernels run every variant (windows, softcap, ALiBi, sinks, dropout,
-- varlen in one launch; slopes and sinks converted to contiguous f32 for
-- them), checked by FlashAttention's rule against the naive path (cuBLAS
-- and the row kernels of attention/naive.cu), which runs them all too.
-- Dropout's mask is the same bits on both devices and on every path.
-- Pending, with the reason, where there is no GPU.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local FIELDS = { "out", "lse", "dq", "dk", "dv", "dsink" }

local copy = h.merge

local run = h.attention_both

local function randn(shape)
  return ft.randn(shape, { dtype = "f64", seed = h.next_seed() })
end

--- opts with its tensors (slopes, sink, cu_seqlens) moved to the GPU and
-- the float ones converted to dtype's statistics type.
local function on_gpu(opts, dtype)
  local r = {}
  for key, val in pairs(opts) do
    if ft.is_tensor(val) then
      if val.dtype == "f64" and dtype ~= "f64" then val = val:float() end
      val = val:cuda()
    end
    r[key] = val
  end
  return r
end

local function cpu64(x) return x:cpu():double() end

--- opts for the f64 cpu reference: float tensors in f64.
local function on_cpu64(opts)
  local r = {}
  for key, val in pairs(opts) do
    r[key] = ft.is_tensor(val) and (val.dtype == "f32" or val.dtype == "f64") and val:double() or val
  end
  return r
end

--- FlashAttention's rule for every result the f64 reference has: the
-- flash kernels' error at most twice the naive path's in the same dtype
-- (plus a few 16-bit ulps at 1), and no NaN. label names the case.
local function assert_2x_naive(label, flash, naive, want)
  for _, f in ipairs(FIELDS) do
    if want[f] then
      local ef = ft.max_abs_diff(cpu64(flash[f]), want[f])
      local en = ft.max_abs_diff(cpu64(naive[f]), want[f])
      assert.is_true(ef == ef and ef <= 2 * en + 4 * 2 ^ -7,
        ("%s %s: flash error %g, naive %g"):format(label, f, ef, en))
    end
  end
end

describe("attention variants on CUDA #gpu", function()
  local slopes = ft.tensor({ { 0.3, 0.2, 0.1, 0.05 }, { 0.7, 0.01, 0.4, 0.0 } }, { dtype = "f64" })
  local sink = ft.tensor({ 0.5, -1.0, 2.0, 0.0 }, { dtype = "f64" })
  local cases = {
    { "window", { window_left = 5, window_right = 2 } },
    { "window + causal + GQA", { causal = true, window_left = 7 } },
    { "softcap", { softcap = 1.5 } },
    { "ALiBi + causal", { alibi_slopes = slopes, causal = true } },
    { "ALiBi per head", { alibi_slopes = slopes:select(1, 2):contiguous() } },
    { "sink", { sink = sink } },
    { "dropout", { dropout_p = 0.2, seed = 42, offset = 3 } },
    { "everything at once", { causal = true, window_left = 9, softcap = 2.0, alibi_slopes = slopes,
                              sink = sink, dropout_p = 0.15, seed = 7 } },
  }
  local c = { B = 2, Nq = 37, Nk = 45, H = 4, Hk = 2, d = 24 }

  for _, case in ipairs(cases) do
    gpu_it(case[1] .. ": f64 on CUDA equals the cpu to 1e-10", function()
      local q, k, v = randn { c.B, c.Nq, c.H, c.d }, randn { c.B, c.Nk, c.Hk, c.d },
          randn { c.B, c.Nk, c.Hk, c.d }
      local dout = randn { c.B, c.Nq, c.H, c.d }
      local want = run(q, k, v, dout, copy(case[2], { impl = "tiled" }))
      local got = run(q:cuda(), k:cuda(), v:cuda(), dout:cuda(), on_gpu(case[2], "f64"))
      for _, f in ipairs(FIELDS) do
        if want[f] then
          local diff = ft.max_abs_diff(cpu64(got[f]), want[f])
          assert.is_true(diff < 1e-10, ("%s: %g"):format(f, diff))
        end
      end
      assert.are.equal(want.dsink == nil, got.dsink == nil)
    end)

    gpu_it(case[1] .. ": f32, f16 and bf16 on CUDA follow the f64 cpu", function()
      local q, k, v = randn { c.B, c.Nq, c.H, c.d }, randn { c.B, c.Nk, c.Hk, c.d },
          randn { c.B, c.Nk, c.Hk, c.d }
      local dout = randn { c.B, c.Nq, c.H, c.d }
      local want = run(q, k, v, dout, copy(case[2], { impl = "tiled" }))
      -- relative to the largest value of each result: f32 computes in f32;
      -- f16 and bf16 inputs round P and dS like the naive method in them
      local TOL = { f32 = 1e-5, f16 = 1e-2, bf16 = 6e-2 }
      for _, dtype in ipairs { "f32", "f16", "bf16" } do
        local function g(t) return t:to(dtype):cuda() end
        local got = run(g(q), g(k), g(v), g(dout), on_gpu(case[2], dtype))
        for _, f in ipairs(FIELDS) do
          if want[f] then
            local scale = ft.max_abs_diff(want[f], want[f] * 0) + 1
            local diff = ft.max_abs_diff(cpu64(got[f]), want[f])
            assert.is_true(diff <= TOL[dtype] * scale,
              ("%s %s: %g (scale %g)"):format(dtype, f, diff, scale))
          end
        end
      end
    end)
  end

  gpu_it("varlen on CUDA equals the cpu, with empty and length-1 sequences", function()
    local lens = { { 5, 7 }, { 0, 3 }, { 4, 0 }, { 1, 1 }, { 30, 20 }, { 3, 9 } }
    local tq, tk, offq, offk = 0, 0, { 0 }, { 0 }
    for b, l in ipairs(lens) do
      tq, tk = tq + l[1], tk + l[2]
      offq[b + 1], offk[b + 1] = tq, tk
    end
    local q, k, v, dout = randn { tq, 4, 16 }, randn { tk, 2, 16 }, randn { tk, 2, 16 }, randn { tq, 4, 16 }
    local opts = { causal = true, window_left = 4, softcap = 3.0, sink = sink,
                   alibi_slopes = slopes:select(1, 1):contiguous(), dropout_p = 0.1, seed = 9,
                   cu_seqlens_q = ft.tensor(offq, { dtype = "i32" }),
                   cu_seqlens_k = ft.tensor(offk, { dtype = "i32" }) }
    local want = run(q, k, v, dout, copy(opts, { impl = "tiled" }))
    local got = run(q:cuda(), k:cuda(), v:cuda(), dout:cuda(), on_gpu(opts, "f64"))
    for _, f in ipairs(FIELDS) do
      local diff = ft.max_abs_diff(cpu64(got[f]), want[f])
      assert.is_true(diff < 1e-10, ("%s: %g"):format(f, diff))
    end
  end)

  gpu_it("varlen on the flash kernels (one launch), f16, bf16 and f32, head dims 32 to 256, with windows, softcap, ALiBi per sequence, sinks, dropout", function()
    local lens = { { 70, 90 }, { 0, 5 }, { 9, 0 }, { 1, 1 }, { 200, 130 }, { 33, 64 } }
    local tq, tk, offq, offk = 0, 0, { 0 }, { 0 }
    for b, l in ipairs(lens) do
      tq, tk = tq + l[1], tk + l[2]
      offq[b + 1], offk[b + 1] = tq, tk
    end
    local per_seq = {}
    for b = 1, #lens do per_seq[b] = { 0.5 / b, 0.25, 0.1 * b, 0.0 } end
    local slopes6 = ft.tensor(per_seq, { dtype = "f32" })
    local cases = {
      { causal = true, window_left = 40 },
      { alibi_slopes = slopes6, softcap = 5.0, sink = sink:float(), window_right = 17 },
      { dropout_p = 0.15, seed = 21, causal = true },
    }
    for _, d in ipairs { 32, 64, 128, 256 } do
      local q, k, v, dout = randn { tq, 4, d }, randn { tk, 2, d }, randn { tk, 2, d }, randn { tq, 4, d }
      for ci, o in ipairs(cases) do
        local opts = copy(o, { cu_seqlens_q = ft.tensor(offq, { dtype = "i32" }),
                               cu_seqlens_k = ft.tensor(offk, { dtype = "i32" }) })
        local want = run(q, k, v, dout, copy(on_cpu64(opts), { impl = "tiled" }))
        for _, dtype in ipairs { "f16", "bf16", "f32" } do
          local function g(t) return t:to(dtype):cuda() end
          local gopts = on_gpu(opts, dtype)
          local flash = run(g(q), g(k), g(v), g(dout), copy(gopts, { impl = "flash" }))
          local naive = run(g(q), g(k), g(v), g(dout), copy(gopts, { impl = "naive" }))
          assert_2x_naive(("%s d=%d case %d"):format(dtype, d, ci), flash, naive, want)
        end
      end
    end
  end)

  gpu_it("sinks on the flash kernels, by the 2x-naive rule: f16, bf16 and f32, head dims 32 to 256, rows that see no key", function()
    local s4 = sink:float()
    for _, dtype in ipairs { "f16", "bf16", "f32" } do
      for _, d in ipairs { 32, 64, 96, 128, 192, 256 } do
        for _, o in ipairs { { causal = true }, { window_left = 20 }, {} } do
          local q, k, v = randn { 2, 70, 4, d }, randn { 2, 50, 2, d }, randn { 2, 50, 2, d }
          local dout = randn { 2, 70, 4, d }
          local want = run(q, k, v, dout, copy(o, { impl = "tiled", sink = sink }))
          local function g(t) return t:to(dtype):cuda() end
          local gs = s4:cuda()
          local flash = run(g(q), g(k), g(v), g(dout), copy(o, { impl = "flash", sink = gs }))
          local naive = run(g(q), g(k), g(v), g(dout), copy(o, { impl = "naive", sink = gs }))
          assert_2x_naive(("%s d=%d"):format(dtype, d), flash, naive, want)
        end
      end
    end
  end)

  gpu_it("softcap, ALiBi and dropout on the flash kernels, by the 2x-naive rule: f16, bf16 and f32, head dims 32 to 256, with windows, sinks, GQA", function()
    local s4, sl4 = sink:float(), slopes:float()
    local mods = {
      { softcap = 1.5 },
      { softcap = 30, causal = true },
      { alibi_slopes = sl4:select(1, 1):contiguous(), causal = true },
      { alibi_slopes = sl4, window_left = 20, window_right = 3 },
      { alibi_slopes = sl4:transpose():contiguous():transpose(), softcap = 2.0, sink = s4, causal = true },
      { dropout_p = 0.2, seed = 11, offset = 5 },
      { dropout_p = 0.1, seed = 2 ^ 40 + 7, causal = true, window_left = 50, softcap = 3.0,
        alibi_slopes = sl4, sink = s4 },
    }
    for _, dtype in ipairs { "f16", "bf16", "f32" } do
      for _, d in ipairs { 32, 64, 96, 128, 192, 256 } do
        for mi, o in ipairs(mods) do
          -- two shapes: Nq > Nk (rows that see no key under causal) and
          -- several blocks each way
          local sh = mi % 2 == 1 and { 70, 50 } or { 300, 333 }
          local q, k, v = randn { 2, sh[1], 4, d }, randn { 2, sh[2], 2, d }, randn { 2, sh[2], 2, d }
          local dout = randn { 2, sh[1], 4, d }
          local want = run(q, k, v, dout, copy(on_cpu64(o), { impl = "tiled" }))
          local function g(t) return t:to(dtype):cuda() end
          local go = on_gpu(o, dtype)
          local flash = run(g(q), g(k), g(v), g(dout), copy(go, { impl = "flash" }))
          local naive = run(g(q), g(k), g(v), g(dout), copy(go, { impl = "naive" }))
          assert_2x_naive(("%s d=%d case %d"):format(dtype, d, mi), flash, naive, want)
        end
      end
    end
  end)

  gpu_it("block_q and block_k are the cpu's: on CUDA a clear error", function()
    local q = randn({ 1, 8, 2, 16 }):half():cuda()
    local ok, e = pcall(ft.attention, q, q, q, { block_q = 32 })
    assert.is_false(ok)
    assert.is_truthy(tostring(e):find("block_q and block_k set the cpu's tiles", 1, true), e)
  end)

  gpu_it("dropout's mask is the same bits on CUDA as on the cpu", function()
    for _, o in ipairs { { dropout_p = 0.1, seed = 1 }, { dropout_p = 0.5, seed = 2 ^ 40 + 3, offset = 17 },
                          { dropout_p = 0.9, seed = 5, offset = 2 ^ 31 - 1 } } do
      local cpu = ft.attention_dropout_mask(3, 5, 67, 129, o)
      local gpu = ft.attention_dropout_mask(3, 5, 67, 129, copy(o, { device = "cuda" }))
      assert.are.equal("cuda:0", gpu.device)
      assert.are.equal(0, ft.max_abs_diff(cpu, gpu:cpu()))
    end
  end)

  -- The flash kernels' own keep bits, read off exactly: with v the identity
  -- (keys j's value is e_j), out[i][j] = P_ij Z_ij, zero exactly where
  -- dropped; with dO the identity too, dV[j][i] = (P Z)_ij, which the dK/dV
  -- kernels' keys-as-rows bits give; with k the identity and dO all ones,
  -- dQ[i][j] = scale P_ij (Z_ij - D_i) is positive exactly where kept
  -- (D_i < 1 / (1 - p) unless a row keeps every key). q is random.
  gpu_it("the flash kernels drop exactly the mask's entries (forward, dK/dV, dQ)", function()
    local function eye(B, N, H, d)
      local r = h.zeros4(B, N, H, d)
      for b = 1, B do for i = 1, N do for hh = 1, H do r[b][i][hh][i] = 1 end end end
      return ft.tensor(r)
    end
    local function read(t) return t:cpu():float():totable() end
    for _, c in ipairs { { "bf16", 128, 128, 128 }, { "f16", 128, 64, 128 }, { "bf16", 64, 64, 64 } } do
      local dtype, d, Nq, Nk = c[1], c[2], c[3], c[4]
      local B, H = 2, 4
      local function g(t) return t:to(dtype):cuda() end
      for _, o in ipairs { { dropout_p = 0.3, seed = 11, offset = 3 }, { dropout_p = 0.5, seed = 2 ^ 33 + 1 } } do
        local what = ("%s d %d %dx%d p %g"):format(dtype, d, Nq, Nk, o.dropout_p)
        local mask = ft.attention_dropout_mask(B, H, Nq, Nk, o):totable()
        local q = g(randn { B, Nq, H, d })
        local opts = copy(o, { impl = "flash" })
        -- forward and dK/dV
        local id_k, id_q = g(eye(B, Nk, H, d)), g(eye(B, Nq, H, d))
        local kr = g(randn { B, Nk, H, d })
        local out, lse = ft.attention(q, kr, id_k, opts)
        local _, _, dv = ft.attention_backward(id_q, q, kr, id_k, out, lse, opts)
        -- dQ
        local ones = g(ft.ones({ B, Nq, H, d }, { dtype = "f64" }))
        local out2, lse2 = ft.attention(q, id_k, id_k, opts)
        local dq = ft.attention_backward(ones, q, id_k, id_k, out2, lse2, opts)
        local O, DV, DQ = read(out), read(dv), read(dq)
        local bad, kept = 0, 0
        for b = 1, B do
          for hh = 1, H do
            for i = 1, Nq do
              for j = 1, Nk do
                local keep = mask[b][hh][i][j] > 0
                if keep then kept = kept + 1 end
                if (O[b][i][hh][j] ~= 0) ~= keep or (DV[b][j][hh][i] ~= 0) ~= keep or
                    (DQ[b][i][hh][j] > 0) ~= keep then
                  bad = bad + 1
                end
              end
            end
          end
        end
        local n = B * H * Nq * Nk
        assert.are.equal(0, bad, what .. ": entries the kernels drop otherwise than the mask")
        assert.is_true(kept > 0 and kept < n, what)
      end
    end
  end)

  gpu_it("f64 slopes and f64 or strided sinks reach the flash kernels (as f32), for auto and flash alike", function()
    local q, k, v = randn { 2, 40, 4, 32 }, randn { 2, 50, 2, 32 }, randn { 2, 50, 2, 32 }
    local dout = randn { 2, 40, 4, 32 }
    local sl = ft.tensor({ { 0.3, 0.2, 0.1, 0.05 }, { 0.7, 0.01, 0.4, 0.0 } }, { dtype = "f64" })
    local sk = ft.tensor({ { 0.5, 9 }, { -1.0, 9 }, { 2.0, 9 }, { 0.0, 9 } }, { dtype = "f64" }):select(2, 1)
    local o = { alibi_slopes = sl, sink = sk, causal = true }
    local want = run(q, k, v, dout, copy(o, { impl = "tiled" }))
    local go = { alibi_slopes = sl:cuda(), sink = sk:cuda(), causal = true }
    local function g(t) return t:half():cuda() end
    local naive = run(g(q), g(k), g(v), g(dout), copy(go, { impl = "naive" }))
    for _, impl in ipairs { "flash", "auto" } do
      local got = run(g(q), g(k), g(v), g(dout), copy(go, { impl = impl }))
      assert_2x_naive("f16 " .. impl, got, naive, want)
      assert.are.equal("f64", got.dsink.dtype)
    end
  end)
end)
