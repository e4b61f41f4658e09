-- Attention variants on the CPU (lib/attn_mod.h): sliding windows, softcap,
-- ALiBi, sinks, dropout and variable-length batches, alone and combined,
-- naive and tiled, forward and backward.
--
-- Checked against a plain-Lua f64 reference written from the definitions,
-- against f64 finite differences (gradcheck), against each other (tiled ==
-- naive within rounding, whatever the block sizes), varlen against one call
-- per sequence, and dropout's mask against an independent Philox in Lua and
-- against the keep rate it promises.
local h = require "helper"
local ft = h.ft
local gradcheck = require "flashtile.gradcheck"

local IMPLS = { "naive", "tiled" }

local copy = h.merge

local function describe_opts(o)
  local parts = {}
  for k, v in pairs(o) do
    parts[#parts + 1] = k .. "=" .. (ft.is_tensor(v) and "tensor" or tostring(v))
  end
  table.sort(parts)
  return "{" .. table.concat(parts, ", ") .. "}"
end

local reference = h.attention_reference
local assert_close = h.assert_table_close

local function inputs(c, dtype)
  dtype = dtype or "f64"
  local function r(shape) return ft.randn(shape, { dtype = dtype, seed = h.next_seed() }) end
  return r { c.B, c.Nq, c.H, c.d }, r { c.B, c.Nk, c.Hk, c.d }, r { c.B, c.Nk, c.Hk, c.d },
      r { c.B, c.Nq, c.H, c.d }
end

local run = h.attention_both

describe("attention variants (cpu)", function()
  local slopes_h = ft.tensor({ 0.5, 0.25, 0.125, 0.0625 }, { dtype = "f64" })
  local slopes_bh = ft.tensor({ { 0.3, 0.2, 0.1, 0.05 }, { 0.7, 0.01, 0.4, 0.0 } }, { dtype = "f64" })
  local sink = ft.tensor({ 0.5, -1.0, 2.0, 0.0 }, { dtype = "f64" })

  describe("equal the plain-Lua reference to 1e-12 in f64", function()
    -- B = 2, H = 4 everywhere (the slopes and sinks above)
    local cases = {
      { c = { Nq = 9, Nk = 11, Hk = 2, d = 5 }, o = { window_left = 2, window_right = 1 } },
      { c = { Nq = 11, Nk = 7, Hk = 1, d = 4 }, o = { causal = true, window_left = 3 } },
      { c = { Nq = 6, Nk = 13, Hk = 4, d = 3 }, o = { window_left = 0, window_right = 0 } },
      { c = { Nq = 8, Nk = 8, Hk = 2, d = 6 }, o = { softcap = 0.8 } },
      { c = { Nq = 7, Nk = 10, Hk = 2, d = 4 }, o = { alibi = "h", causal = true } },
      { c = { Nq = 7, Nk = 5, Hk = 4, d = 4 }, o = { alibi = "bh" } },
      { c = { Nq = 9, Nk = 6, Hk = 2, d = 5 }, o = { sink = true, causal = true } },
      { c = { Nq = 10, Nk = 12, Hk = 2, d = 4 }, o = { dropout_p = 0.3, seed = 11, offset = 2 } },
      { c = { Nq = 12, Nk = 9, Hk = 1, d = 4 },
        o = { causal = true, window_left = 4, softcap = 1.5, alibi = "bh", sink = true,
              dropout_p = 0.2, seed = 5 } },
    }
    for _, case in ipairs(cases) do
      local c = copy(case.c, { B = 2, H = 4 })
      for _, impl in ipairs(IMPLS) do
        it(impl .. " " .. describe_opts(case.o), function()
          local q, k, v, dout = inputs(c)
          local opts = copy(case.o, { impl = impl, alibi = false, sink = false })
          opts.alibi, opts.sink = nil, nil
          if case.o.alibi then opts.alibi_slopes = case.o.alibi == "h" and slopes_h or slopes_bh end
          if case.o.sink then opts.sink = sink end
          if impl == "tiled" then opts.block_q, opts.block_k = 3, 4 end
          local ref_opts = copy(case.o, { slopes = opts.alibi_slopes, sink = opts.sink })
          if case.o.dropout_p then
            ref_opts.mask = ft.attention_dropout_mask(c.B, c.H, c.Nq, c.Nk,
              { dropout_p = case.o.dropout_p, seed = case.o.seed, offset = case.o.offset })
            ref_opts.p = case.o.dropout_p
          end
          local got, want = run(q, k, v, dout, opts), reference(q, k, v, dout, ref_opts)
          for _, f in ipairs { "out", "lse", "dq", "dk", "dv" } do
            assert_close(got[f], want[f], 1e-12, f)
          end
          if case.o.sink then
            assert_close(got.dsink, want.dsink, 1e-11, "dsink")
          else
            assert.is_nil(got.dsink)
          end
        end)
      end
    end
  end)

  it("tiled equals naive for any block sizes, every variant at once", function()
    local c = { B = 2, Nq = 13, Nk = 17, H = 4, Hk = 2, d = 7 }
    local q, k, v, dout = inputs(c)
    local opts = { causal = true, window_left = 6, softcap = 2.0, alibi_slopes = slopes_bh,
                   sink = sink, dropout_p = 0.25, seed = 99, offset = 7 }
    local naive = run(q, k, v, dout, copy(opts, { impl = "naive" }))
    for _, blocks in ipairs { { 1, 1 }, { 2, 5 }, { 4, 3 }, { 16, 16 }, { 64, 64 } } do
      local tiled = run(q, k, v, dout, copy(opts, { impl = "tiled", block_q = blocks[1],
                                                    block_k = blocks[2] }))
      for _, f in ipairs { "out", "lse", "dq", "dk", "dv", "dsink" } do
        local diff = ft.max_abs_diff(naive[f], tiled[f])
        assert.is_true(diff < 1e-12, ("%s with blocks %d x %d: %g"):format(f, blocks[1],
          blocks[2], diff))
      end
    end
  end)

  it("the same bits on 1 and 2 threads, every variant, mods and their tensors' gradients included",
    function()
      local c = { B = 2, Nq = 130, Nk = 140, H = 4, Hk = 2, d = 32 }
      local q, k, v, dout = inputs(c, "f32")
      local bias = ft.randn({ 4, 300 }, { seed = 4 })
      local mods = ft.attention_mods {
        score = function(s, b, hh, i, j) return s + bias[hh][i - j + 150] end,
      }
      local opts = { causal = true, window_left = 60, softcap = 5.0, alibi_slopes = slopes_h,
                     sink = sink, dropout_p = 0.1, seed = 3, mods = mods }
      local before = ft.get_num_threads()
      local results = {}
      for _, n in ipairs { 1, 2 } do
        ft.set_num_threads(n)
        assert.is_true(ft.get_num_threads() <= n)
        local r = {}
        for _, impl in ipairs(IMPLS) do
          local out, lse = ft.attention(q, k, v, copy(opts, { impl = impl }))
          r[impl] = h.pack(out, lse,
            ft.attention_backward(dout, q, k, v, out, lse, copy(opts, { impl = impl })))
        end
        results[n] = r
      end
      ft.set_num_threads(0)
      assert.are.equal(before, ft.get_num_threads())
      for _, impl in ipairs(IMPLS) do
        local a, b = results[1][impl], results[2][impl]
        assert.are.equal(7, a.n) -- out, lse, dq, dk, dv, dsink, dbias
        for i = 1, a.n do
          assert.are.equal(0, ft.max_abs_diff(a[i], b[i]), impl .. " result " .. i)
        end
      end
    end)

  it("a row that sees no key gets out 0 and LSE = -inf, or LSE = sink with a sink", function()
    local c = { B = 1, Nq = 6, Nk = 3, H = 4, Hk = 4, d = 4 }
    local q, k, v = inputs(c)
    for _, impl in ipairs(IMPLS) do
      -- causal with Nq > Nk: the first 3 queries see nothing
      local out, lse = ft.attention(q, k, v, { impl = impl, causal = true })
      local out2, lse2 = ft.attention(q, k, v, { impl = impl, causal = true, sink = sink })
      for hh = 1, 4 do
        for i = 1, 3 do
          assert.are.equal(-math.huge, lse:get(1, hh, i))
          assert.are.equal(sink:get(hh), lse2:get(1, hh, i))
          for e = 1, 4 do
            assert.are.equal(0, out:get(1, i, hh, e))
            assert.are.equal(0, out2:get(1, i, hh, e))
          end
        end
      end
    end
  end)

  it("f32 follows the f64 reference within 1e-5 relative, every variant at once", function()
    local c = { B = 2, Nq = 40, Nk = 50, H = 4, Hk = 2, d = 16 }
    local q, k, v, dout = inputs(c)
    local opts = { causal = true, window_left = 20, softcap = 3.0, alibi_slopes = slopes_bh,
                   sink = sink, dropout_p = 0.1, seed = 3 }
    local ref = run(q, k, v, dout, copy(opts, { impl = "naive" }))
    local f32 = copy(opts, { alibi_slopes = slopes_bh:float(), sink = sink:float() })
    for _, impl in ipairs(IMPLS) do
      local got = run(q:float(), k:float(), v:float(), dout:float(), copy(f32, { impl = impl }))
      for _, f in ipairs { "out", "lse", "dq", "dk", "dv", "dsink" } do
        local scale = ft.max_abs_diff(ref[f], ref[f] * 0) + 1
        local diff = ft.max_abs_diff(ref[f], got[f]:double())
        assert.is_true(diff <= 1e-5 * scale, ("%s %s: %g"):format(impl, f, diff))
      end
      assert.are.equal("f32", got.dsink.dtype)
    end
  end)

  describe("gradients against f64 finite differences", function()
    local function check(c, opts, with_sink)
      local q, k, v = inputs(c)
      local xs = { q, k, v }
      if with_sink then xs[4] = sink:clone() end
      local function options(s) return s and copy(opts, { sink = s }) or opts end
      local function forward(q_, k_, v_, s)
        return (ft.attention(q_, k_, v_, options(s)))
      end
      local function backward(dy, q_, k_, v_, s)
        local o = options(s)
        local out, lse = ft.attention(q_, k_, v_, o)
        return ft.attention_backward(dy, q_, k_, v_, out, lse, o)
      end
      local ok, report = gradcheck.check(forward, backward, xs)
      assert.is_true(ok, report.message)
    end

    local c = { B = 1, Nq = 4, Nk = 5, H = 4, Hk = 2, d = 3 }
    local cases = {
      { "window", { window_left = 1, window_right = 1 } },
      { "window + causal + GQA", { causal = true, window_left = 2 } },
      { "softcap", { softcap = 0.7 } },
      { "ALiBi", { alibi_slopes = slopes_h } },
      { "dropout", { dropout_p = 0.3, seed = 4 } },
      { "sink", {}, true },
      { "sink + dropout", { dropout_p = 0.4, seed = 8, causal = true }, true },
    }
    for _, impl in ipairs(IMPLS) do
      for _, case in ipairs(cases) do
        it(case[1] .. ", " .. impl, function()
          local opts = copy(case[2], { impl = impl })
          if impl == "tiled" then opts.block_q, opts.block_k = 2, 3 end
          check(c, opts, case[3])
        end)
      end
    end
  end)

  describe("a window side that reaches every key is no bound", function()
    -- math.maxinteger once overflowed i + Nk - Nq + window (no key seen)
    local huge = math.maxinteger or 2 ^ 53
    local shapes = { { B = 1, Nq = 3, Nk = 7, H = 2, Hk = 1, d = 4 }, { B = 1, Nq = 7, Nk = 3, H = 2, Hk = 2, d = 4 } }
    for _, impl in ipairs(IMPLS) do
      for _, c in ipairs(shapes) do
        it(("%s, Nq %d, Nk %d, forward and backward"):format(impl, c.Nq, c.Nk), function()
          local q, k, v, dout = inputs(c)
          local wide = c.Nq + c.Nk
          local cases = {
            { { window_left = huge }, {} },
            { { window_right = huge }, {} },
            { { window_left = huge, window_right = huge }, {} },
            { { window_left = wide, window_right = wide - 1 }, {} },
            { { causal = true, window_left = huge }, { causal = true } },
            { { window_left = 1, window_right = huge }, { window_left = 1 } },
          }
          for _, case in ipairs(cases) do
            local got = run(q, k, v, dout, copy(case[1], { impl = impl }))
            local want = run(q, k, v, dout, copy(case[2], { impl = impl }))
            for _, f in ipairs { "out", "lse", "dq", "dk", "dv" } do
              assert_close(got[f], want[f]:totable(), 1e-14, describe_opts(case[1]) .. " " .. f)
            end
          end
        end)
      end
    end
  end)

  describe("NaN in, NaN out (as PyTorch's softmax), not a row that sees no key", function()
    local function is_nan(x) return x ~= x end
    for _, dtype in ipairs({ "f64", "f32" }) do
      for _, impl in ipairs(IMPLS) do
        it(impl .. ", " .. dtype, function()
          local c = { B = 1, Nq = 4, Nk = 6, H = 2, Hk = 2, d = 4 }
          local q, k, v, dout = inputs(c, dtype)
          local o = { impl = impl, block_q = 2, block_k = 4 }
          if impl == "naive" then o.block_q, o.block_k = nil, nil end
          local clean_out, clean_lse = ft.attention(q, k, v, o)
          -- a NaN in query 2 of head 1: that row is NaN, every other the same
          local qn = q:clone()
          qn:set(1, 2, 1, 3, 0 / 0)
          local out, lse = ft.attention(qn, k, v, o)
          local O, L, CO, CL = out:totable(), lse:totable(), clean_out:totable(), clean_lse:totable()
          for i = 1, c.Nq do
            for hh = 1, c.H do
              local bad = i == 2 and hh == 1
              assert.are.equal(bad, is_nan(L[1][hh][i]), ("lse row %d head %d"):format(i, hh))
              for e = 1, c.d do
                if bad then
                  assert.is_true(is_nan(O[1][i][hh][e]))
                else
                  assert.are.equal(CO[1][i][hh][e], O[1][i][hh][e])
                end
              end
              if not bad then assert.are.equal(CL[1][hh][i], L[1][hh][i]) end
            end
          end
          local dq = ft.attention_backward(dout, qn, k, v, out, lse, o)
          assert.is_true(is_nan(dq:totable()[1][2][1][1]), "dq of the NaN row")
          -- a NaN key (seen by every query) and a NaN sink: whole heads NaN
          local kn = k:clone()
          kn:set(1, 5, 2, 1, 0 / 0)
          local _, lk = ft.attention(q, kn, v, o)
          local sink = ft.tensor({ 0.5, 0 / 0 }, { dtype = dtype })
          local _, ls = ft.attention(q, k, v, h.merge(o, { sink = sink }))
          for i = 1, c.Nq do
            assert.is_false(is_nan(lk:totable()[1][1][i]))
            assert.is_true(is_nan(lk:totable()[1][2][i]), "the NaN key's head")
            assert.is_false(is_nan(ls:totable()[1][1][i]))
            assert.is_true(is_nan(ls:totable()[1][2][i]), "the NaN sink's head")
          end
        end)
      end
    end
  end)

  describe("variable-length batches", function()
    local function cu(t) return ft.tensor(t, { dtype = "i32" }) end

    --- Packed inputs of sequences with these (Nq, Nk) lengths.
    local function packed(lens, H, Hk, d)
      local tq, tk, offq, offk = 0, 0, { 0 }, { 0 }
      for b, l in ipairs(lens) do
        tq, tk = tq + l[1], tk + l[2]
        offq[b + 1], offk[b + 1] = tq, tk
      end
      local function r(shape) return ft.randn(shape, { dtype = "f64", seed = h.next_seed() }) end
      return r { tq, H, d }, r { tk, Hk, d }, r { tk, Hk, d }, r { tq, H, d }, cu(offq), cu(offk),
          offq, offk
    end

    local lens = { { 5, 7 }, { 0, 3 }, { 4, 0 }, { 1, 1 }, { 6, 2 }, { 3, 9 } }

    for _, impl in ipairs(IMPLS) do
      it("each sequence as its own call, " .. impl, function()
        local q, k, v, dout, cq, ck, offq, offk = packed(lens, 4, 2, 5)
        local base = { impl = impl, causal = true, window_left = 3, softcap = 2.0,
                       alibi_slopes = slopes_h, sink = sink }
        if impl == "tiled" then base.block_q, base.block_k = 2, 3 end
        local all = run(q, k, v, dout, copy(base, { cu_seqlens_q = cq, cu_seqlens_k = ck }))
        assert.are.same({ 4, q:size(1) }, { all.lse:size(1), all.lse:size(2) })
        local dsink = ft.zeros({ 4 }, { dtype = "f64" })
        for b, l in ipairs(lens) do
          local function rows(t, off, n)
            return t:narrow(1, off + 1, n):view({ 1, n, t:size(2), t:size(3) })
          end
          local nq, nk = l[1], l[2]
          local one = run(rows(q, offq[b], nq), rows(k, offk[b], nk), rows(v, offk[b], nk),
            rows(dout, offq[b], nq), base)
          local what = ("sequence %d (%d x %d)"):format(b, nq, nk)
          assert.are.equal(0, ft.max_abs_diff(one.out, rows(all.out, offq[b], nq)), what)
          assert.are.equal(0, ft.max_abs_diff(one.dq, rows(all.dq, offq[b], nq)), what)
          assert.are.equal(0, ft.max_abs_diff(one.dk, rows(all.dk, offk[b], nk)), what)
          assert.are.equal(0, ft.max_abs_diff(one.dv, rows(all.dv, offk[b], nk)), what)
          local lse = all.lse:narrow(2, offq[b] + 1, nq):view({ 1, 4, nq })
          assert.are.equal(0, ft.max_abs_diff(one.lse, lse), what)
          dsink = dsink + one.dsink
        end
        assert.is_true(ft.max_abs_diff(dsink, all.dsink) < 1e-12)
      end)
    end

    local grad_cases = {
      { "empty and length-1 sequences", { { 2, 3 }, { 0, 2 }, { 1, 1 }, { 3, 0 }, { 1, 4 } }, {} },
      { "ALiBi + softcap + varlen", { { 3, 4 }, { 2, 2 }, { 1, 3 } },
        { alibi_slopes = slopes_bh:narrow(1, 1, 1):expand({ 3, 4 }):contiguous(), softcap = 0.9,
          causal = true } },
    }
    for _, impl in ipairs(IMPLS) do
      for _, case in ipairs(grad_cases) do
        it("gradcheck, " .. case[1] .. ", " .. impl, function()
          local q, k, v, _, cq, ck = packed(case[2], 4, 2, 3)
          local opts = copy(case[3], { impl = impl, cu_seqlens_q = cq, cu_seqlens_k = ck })
          if impl == "tiled" then opts.block_q, opts.block_k = 2, 2 end
          local function forward(q_, k_, v_) return (ft.attention(q_, k_, v_, opts)) end
          local function backward(dy, q_, k_, v_)
            local out, lse = ft.attention(q_, k_, v_, opts)
            return ft.attention_backward(dy, q_, k_, v_, out, lse, opts)
          end
          local ok, report = gradcheck.check(forward, backward, { q, k, v })
          assert.is_true(ok, report.message)
        end)
      end
    end

    it("max_seqlen above the longest is accepted", function()
      local q, k, v = packed({ { 2, 3 }, { 4, 1 } }, 2, 1, 4)
      local cq, ck = cu { 0, 2, 6 }, cu { 0, 3, 4 }
      local a = ft.attention(q, k, v, { cu_seqlens_q = cq, cu_seqlens_k = ck })
      local b = ft.attention(q, k, v, { cu_seqlens_q = cq, cu_seqlens_k = ck, max_seqlen_q = 100,
                                        max_seqlen_k = 3 })
      assert.are.equal(0, ft.max_abs_diff(a, b))
    end)
  end)

  describe("dropout's mask", function()
    it("keeps 1 - p of the scores, within 4 sigma over 10^6 draws", function()
      for _, p in ipairs { 0.1, 0.5, 0.9 } do
        local m = ft.attention_dropout_mask(2, 5, 200, 500, { dropout_p = p, seed = 2026 })
        local n = 2 * 5 * 200 * 500
        local kept = m:sum() / m:max()
        local sigma = math.sqrt(n * p * (1 - p))
        assert.is_true(math.abs(kept - n * (1 - p)) < 4 * sigma,
          ("p = %g: %d kept of %d, expected %g +- %g"):format(p, kept, n, n * (1 - p), 4 * sigma))
        assert.is_true(math.abs(m:max() - 1 / (1 - p)) < 1e-6 * m:max())
      end
    end)

    it("depends on seed and offset, and on nothing else", function()
      local o = { dropout_p = 0.5, seed = 1, offset = 0 }
      local a = ft.attention_dropout_mask(2, 3, 7, 9, o)
      assert.are.equal(0, ft.max_abs_diff(a, ft.attention_dropout_mask(2, 3, 7, 9, o)))
      assert.is_true(ft.max_abs_diff(a, ft.attention_dropout_mask(2, 3, 7, 9, copy(o, { seed = 2 }))) > 0)
      assert.is_true(ft.max_abs_diff(a, ft.attention_dropout_mask(2, 3, 7, 9, copy(o, { offset = 1 }))) > 0)
      -- a smaller call's mask is the corner of a larger one: (b, h, i, j) alone decide
      local big = ft.attention_dropout_mask(3, 3, 20, 30, o)
      assert.are.equal(0, ft.max_abs_diff(a, big:narrow(1, 1, 2):narrow(3, 1, 7):narrow(4, 1, 9)))
    end)

    it("is what attention applies (out = (softmax * mask) V)", function()
      local c = { B = 1, Nq = 5, Nk = 6, H = 2, Hk = 2, d = 3 }
      local q, k, v = inputs(c)
      local o = { dropout_p = 0.5, seed = 77, offset = 1 }
      local mask = ft.attention_dropout_mask(1, 2, 5, 6, o)
      local out = ft.attention(q, k, v, o)
      local want = reference(q, k, v, q, { mask = mask, p = 0.5 }).out
      assert_close(out, want, 1e-12, "out")
    end)

    it("follows the documented Philox counters, bit for bit", function()
      if not h.has_int64 then
        pending("needs 64-bit integers (Lua 5.3 or later) to compute Philox in Lua")
        return
      end
      -- Philox 4x32-10 written out in Lua, from the description in
      -- lib/attn_mod.h; loaded from a string, since Lua 5.1 and 5.2 cannot
      -- parse the integer operators
      local rule_in_lua = assert((loadstring or load)([[
        local M32 = 0xffffffff
        local function mulhilo(a, b)
          local p = a * b -- wraps modulo 2^64: the low 64 bits are exact
          return (p >> 32) & M32, p & M32
        end
        local function philox(c, key)
          local k0, k1 = key[1], key[2]
          for r = 1, 10 do
            if r > 1 then k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32 end
            local hi0, lo0 = mulhilo(0xD2511F53, c[1])
            local hi1, lo1 = mulhilo(0xCD9E8D57, c[3])
            c = { hi1 ~ c[2] ~ k0, lo1, hi0 ~ c[4] ~ k1, lo0 }
          end
          return c
        end
        -- u of (seed, offset, bh, i, j): byte j % 16 of the primary call on
        -- top, the top 24 bits of word j % 4 of the secondary below
        return function(seed, offset, bh, i, j)
          local key = { seed & M32, seed >> 32 }
          local words = philox({ j >> 4, i, bh, offset | 0x80000000 }, key)
          local top = (words[((j >> 2) & 3) + 1] >> (8 * (j & 3))) & 0xff
          local low = philox({ j >> 2, i | 0x80000000, bh, offset | 0x80000000 }, key)
          return (top << 24) | (low[(j & 3) + 1] >> 8)
        end
      ]]))()
      local p, seed, offset, H, Nq, Nk = 0.3, 0x123456789, 5, 3, 24, 70
      local threshold = math.floor(p * 2 ^ 32)
      local mask = ft.attention_dropout_mask(2, H, Nq, Nk, { dropout_p = p, seed = seed, offset = offset })
      local ties = 0
      for b = 0, 1 do
        for hh = 0, H - 1 do
          for i = 0, Nq - 1 do
            for j = 0, Nk - 1 do
              local u = rule_in_lua(seed, offset, b * H + hh, i, j)
              if math.floor(u / 2 ^ 24) == math.floor(threshold / 2 ^ 24) then ties = ties + 1 end
              assert.are.equal(u >= threshold, mask:get(b + 1, hh + 1, i + 1, j + 1) > 0,
                ("b %d h %d i %d j %d"):format(b, hh, i, j))
            end
          end
        end
      end
      -- the secondary words decided some of them (about 1 in 256 of 10080)
      assert.is_true(ties >= 10, ("only %d scores took the secondary words"):format(ties))
    end)
  end)
end)
