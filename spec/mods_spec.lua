-- Attention modifications written in Lua (ft.attention_mods, lua/flashtile/mods.lua
-- and lib/mods.c) on the CPU: the built-in variants rewritten as mods give
-- the built-ins' results, forward and backward, naive and tiled; mods
-- against f64 finite differences; FlexAttention's document and prefix-LM
-- masks; the tracer's errors, including a Lua branch on a traced value.
local h = require "helper"
local ft = h.ft
local gradcheck = require "flashtile.gradcheck"

local IMPLS = { "naive", "tiled" }

local copy = h.merge

local inputs = h.attention_inputs

local run = h.attention_both

local function assert_same(a, b, tol, what)
  for _, f in ipairs { "out", "lse", "dq", "dk", "dv" } do
    local diff = ft.max_abs_diff(a[f], b[f])
    assert.is_true(diff <= tol, ("%s %s: %g"):format(what, f, diff))
  end
end

describe("attention mods written in Lua (cpu)", function()
  local B, Nq, Nk, H, Hk, d = 2, 13, 17, 4, 2, 6
  local slopes = ft.tensor({ 0.5, 0.25, 0.125, 0.0625 }, { dtype = "f64" })

  describe("the built-in variants as mods give the built-ins' results", function()
    local cases = {
      { "causal", { causal = true },
        { mask = function(b, hh, i, j) return j:le(i + Nk - Nq) end } },
      { "sliding window", { window_left = 3, window_right = 2 },
        { mask = function(b, hh, i, j)
            local p = i + Nk - Nq
            return ft.all(j:ge(p - 3), j:le(p + 2))
          end } },
      { "ALiBi", { alibi_slopes = slopes },
        { score = function(s, b, hh, i, j) return s - slopes[hh] * (i + Nk - Nq - j):abs() end } },
      { "softcap", { softcap = 0.9 },
        { score = function(s) return (s / 0.9):tanh() * 0.9 end } },
      { "causal + ALiBi + softcap", { causal = true, alibi_slopes = slopes, softcap = 2 },
        { score = function(s, b, hh, i, j)
            return (s / 2):tanh() * 2 - slopes[hh] * (i + Nk - Nq - j)
          end,
          mask = function(b, hh, i, j) return j:le(i + Nk - Nq) end } },
      -- a score of -inf (log 0) times a constant: the constant's zero
      -- derivative takes no part (-inf times 0 would make the gradients NaN)
      { "causal as a score of -inf, doubled", { causal = true, scale = 2 / math.sqrt(d) },
        { score = function(s, b, hh, i, j)
            return (s + ft.where(j:le(i + Nk - Nq), 1, 0):log()) * 2
          end } },
    }
    for _, case in ipairs(cases) do
      for _, impl in ipairs(IMPLS) do
        for _, dtype in ipairs { "f64", "f32" } do
          it(("%s, %s, %s"):format(case[1], impl, dtype), function()
            local q, k, v, dout = inputs(B, Nq, Nk, H, Hk, d, dtype)
            local base = { impl = impl }
            if impl == "tiled" then base.block_q, base.block_k = 4, 5 end
            local mods = ft.attention_mods(case[3])
            local want = run(q, k, v, dout, copy(base, case[2]))
            local got = run(q, k, v, dout, copy(base, { mods = mods }))
            assert_same(got, want, dtype == "f64" and 1e-13 or 1e-5, case[1])
          end)
        end
      end
    end
  end)

  describe("gradients against f64 finite differences", function()
    local cases = {
      { "a learned relative bias (a captured table) and tanh", function()
          local rel = ft.randn({ H, Nq + Nk }, { dtype = "f64", seed = 5 })
          return ft.attention_mods {
            score = function(s, b, hh, i, j) return (s + rel[hh][i - j + Nk]):tanh() * 3 end,
          }
        end },
      { "ALiBi as a mod with a causal mask", function()
          return ft.attention_mods {
            score = function(s, b, hh, i, j) return s - slopes[hh] * (i - j):abs() end,
            mask = function(b, hh, i, j) return j:le(i) end,
          }
        end },
      { "where, min, max, sigmoid and powers", function()
          return ft.attention_mods {
            score = function(s, b, hh, i, j)
              return ft.where(j:gt(i), ft.min(s, 1), ft.max(s * s:sigmoid(), s ^ 2 / 4))
            end,
          }
        end },
    }
    for _, case in ipairs(cases) do
      for _, impl in ipairs(IMPLS) do
        it(case[1] .. ", " .. impl, function()
          local q, k, v = inputs(1, 4, 5, 4, 2, 3)
          local opts = { impl = impl, mods = case[2]() }
          if impl == "tiled" then opts.block_q, opts.block_k = 2, 3 end
          local ok, report = gradcheck.check(
            function(a, b, c) return (ft.attention(a, b, c, opts)) end,
            function(dy, a, b, c)
              local out, lse = ft.attention(a, b, c, opts)
              return ft.attention_backward(dy, a, b, c, out, lse, opts)
            end, { q, k, v })
          assert.is_true(ok, report.message)
        end)
      end
    end
  end)

  describe("gradients of the tensors a mod reads", function()
    for _, impl in ipairs(IMPLS) do
      it("a learned relative-bias table and a per-group scale read through an i64 table, " .. impl,
        function()
          local Hh, q_n, k_n = 4, 4, 5
          local rel = ft.randn({ Hh, q_n + k_n }, { dtype = "f64", seed = 5 })
          local gain = ft.randn({ 2 }, { dtype = "f64", seed = 6 })
          local group = ft.tensor({ 1, 2, 1, 2 }, { dtype = "i64" })
          local m = ft.attention_mods {
            score = function(s, b, hh, i, j)
              return (s + rel[hh][i - j + k_n]):tanh() * gain[group[hh]]
            end,
            mask = function(b, hh, i, j) return j:le(i + 1) end,
          }
          local q, k, v = inputs(1, q_n, k_n, Hh, 2, 3)
          local opts = { impl = impl, mods = m }
          if impl == "tiled" then opts.block_q, opts.block_k = 2, 3 end
          local out, lse = ft.attention(q, k, v, opts)
          -- dq, dk, dv, then rel's and gain's (the i64 table has none)
          local r = h.pack(ft.attention_backward(ft.ones(out.shape, { dtype = "f64" }), q, k, v,
            out, lse, opts))
          assert.are.equal(5, r.n)
          assert.are.same(rel.shape, r[4].shape)
          assert.are.same(gain.shape, r[5].shape)
          local ok, report = gradcheck.check(
            function(a, b, c) return (ft.attention(a, b, c, opts)) end,
            function(dy, a, b, c)
              local o, l = ft.attention(a, b, c, opts)
              return ft.attention_backward(dy, a, b, c, o, l, opts)
            end, { q, k, v, rel, gain })
          assert.is_true(ok, report.message)
        end)
    end

    it("a varlen call sums every sequence's share, in a fixed order (run twice: the same bits)",
      function()
        local bias = ft.randn({ 9 }, { dtype = "f64", seed = 8 })
        local m = ft.attention_mods { score = function(s, b, hh, i, j) return s * bias[j] end }
        local q, k, v = ft.randn({ 12, 2, 4 }, { dtype = "f64", seed = 9 }),
            ft.randn({ 15, 2, 4 }, { dtype = "f64", seed = 10 }), ft.randn({ 15, 2, 4 }, { dtype = "f64", seed = 11 })
        local opts = { mods = m, cu_seqlens_q = ft.tensor({ 0, 5, 12 }, { dtype = "i32" }),
                       cu_seqlens_k = ft.tensor({ 0, 6, 15 }, { dtype = "i32" }) }
        local out, lse = ft.attention(q, k, v, opts)
        local dy = ft.randn(out.shape, { dtype = "f64", seed = 12 })
        local a = h.pack(ft.attention_backward(dy, q, k, v, out, lse, opts))
        local b = h.pack(ft.attention_backward(dy, q, k, v, out, lse, opts))
        assert.are.equal(4, a.n)
        assert.are.equal(0, ft.max_abs_diff(a[4], b[4]))
        assert.is_true(a[4]:abs():max() > 0)
      end)
  end)

  describe("FlexAttention's masks", function()
    it("a document mask equals each document on its own (varlen)", function()
      local lens = { 5, 1, 9, 4 }
      local doc, cu, n = {}, { 0 }, 0
      for dnum, l in ipairs(lens) do
        for _ = 1, l do n = n + 1; doc[n] = dnum end
        cu[#cu + 1] = n
      end
      local doc_t = ft.tensor(doc, { dtype = "f64" })
      local mods = ft.attention_mods {
        mask = function(b, hh, i, j) return ft.all(doc_t[i]:eq(doc_t[j]), j:le(i)) end,
      }
      local q, k, v, dout = inputs(1, n, n, 4, 2, 8)
      for _, impl in ipairs(IMPLS) do
        local got = run(q, k, v, dout, { impl = impl, mods = mods })
        local cq = ft.tensor(cu, { dtype = "i32" })
        local function flat(t) return t:select(1, 1) end
        local want = run(flat(q), flat(k), flat(v), flat(dout),
          { impl = impl, causal = true, cu_seqlens_q = cq, cu_seqlens_k = cq })
        for _, f in ipairs { "out", "dq", "dk", "dv" } do
          assert.is_true(ft.max_abs_diff(flat(got[f]), want[f]) < 1e-13, impl .. " " .. f)
        end
        assert.is_true(ft.max_abs_diff(got.lse:select(1, 1), want.lse) < 1e-13)
      end
    end)

    it("a prefix-LM mask equals the same mask read from a dense table", function()
      local N, prefix = 12, 4
      local dense = ft.zeros({ N, N }, { dtype = "f64" })
      for i = 1, N do
        for j = 1, N do
          if j <= prefix or j <= i then dense:set(i, j, 1) end
        end
      end
      local by_rule = ft.attention_mods {
        mask = function(b, hh, i, j) return ft.any(j:le(prefix), j:le(i)) end,
      }
      local by_table = ft.attention_mods { mask = function(b, hh, i, j) return dense[i][j]:ne(0) end }
      local q, k, v, dout = inputs(2, N, N, 2, 2, 4)
      for _, impl in ipairs(IMPLS) do
        local a = run(q, k, v, dout, { impl = impl, mods = by_rule })
        local b = run(q, k, v, dout, { impl = impl, mods = by_table })
        assert_same(a, b, 0, "prefix-LM " .. impl)
        -- and it differs from plain causal in the prefix rows
        local c = run(q, k, v, dout, { impl = impl, causal = true })
        assert.is_true(ft.max_abs_diff(a.out, c.out) > 1e-3)
      end
    end)
  end)

  describe("block masks", function()
    local N = 96
    local doc = ft.zeros({ N }, { dtype = "f64" })
    for i = 1, N do doc[i] = math.floor((i - 1) / 20) + 1 end
    local cases = {
      { "a document mask (mask only)", {
          mask = function(b, hh, i, j) return ft.all(doc[i]:eq(doc[j]), j:le(i)) end } },
      { "a sliding window with a relative bias (mask and score)", {
          score = function(s, b, hh, i, j) return s - (i - j) * 0.01 end,
          mask = function(b, hh, i, j) return ft.all(j:le(i), j:gt(i - 30)) end } },
    }
    for _, case in ipairs(cases) do
      it(case[1] .. ": the same results, forward and backward, with tiles skipped", function()
        local m = ft.attention_mods(case[2])
        local bm = ft.block_mask(m, 2, 2, N, N, { block_q = 16, block_k = 8 })
        local empty, partial, full = bm:counts()
        assert.are.equal(2 * 2 * 6 * 12, empty + partial + full)
        assert.is_true(empty > 0 and partial > 0)
        local q, k, v, dout = inputs(2, N, N, 2, 1, 8)
        local plain = run(q, k, v, dout, { mods = m, block_q = 16, block_k = 8 })
        local skipped = run(q, k, v, dout, { mods = m, block_q = 16, block_k = 8, block_mask = bm })
        assert_same(plain, skipped, 0, case[1])
        assert.is_truthy(tostring(bm):find("flashtile.BlockMask(2x2x96x96, 288 tiles", 1, true),
          tostring(bm))
      end)
    end

    it("made for another call, other tiles or other mods: a clear error", function()
      local m = ft.attention_mods { mask = function(b, hh, i, j) return j:le(i) end }
      local other = ft.attention_mods { mask = function(b, hh, i, j) return j:le(i) end }
      local bm = ft.block_mask(m, 1, 2, 16, 16, { block_q = 8, block_k = 8 })
      local q, k, v = inputs(1, 16, 16, 2, 2, 4)
      for _, case in ipairs {
        { { mods = m, block_mask = bm }, "this call is 1 x 2 x 16 x 16 in 128 x 128 tiles" },
        { { mods = other, block_mask = bm, block_q = 8, block_k = 8 }, "made for other mods" },
        { { block_mask = bm, block_q = 8, block_k = 8 }, "made for other mods" },
      } do
        local ok, e = pcall(ft.attention, q, k, v, case[1])
        assert.is_false(ok)
        assert.is_truthy(tostring(e):find(case[2], 1, true), tostring(e))
      end
      local ok, e = pcall(ft.block_mask, ft.attention_mods { score = function(s) return s end }, 1, 1, 4, 4)
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("the mods have no mask", 1, true), tostring(e))
      ok, e = pcall(ft.block_mask, {}, 1, 1, 4, 4)
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("must be made by ft.attention_mods", 1, true), tostring(e))
      -- sizes: named as ft.block_mask takes them
      for _, case in ipairs {
        { { 1, 2, 6.5, 6 }, "ft.block_mask: Nq must be a whole number, got 6.5" },
        { { 1, "x", 6, 6 }, "ft.block_mask: H must be a whole number, got string" },
        { { 1, 2, 6, 6, { block_k = 0.5 } }, "ft.block_mask: block_k must be a whole number, got 0.5" },
        { { -1, 2, 6, 6 }, "ft.block_mask: sizes must be 0 to 2^31 - 1, got -1" },
        { { 1, 2, 6, 6, { block_q = 0 } }, "ft.block_mask: block sizes must be 1 to 4096" },
      } do
        ok, e = pcall(ft.block_mask, m, h.unpack(case[1]))
        assert.is_false(ok)
        assert.is_truthy(tostring(e):find(case[2], 1, true), tostring(e))
      end
    end)
  end)

  describe("the tracer", function()
    it("plain values compute at once in ft.where, all, any, negate, min, max", function()
      assert.are.equal(2, ft.where(true, 2, 3))
      assert.are.equal(3, ft.where(0, 2, 3))
      assert.is_true(ft.all(true, 1))
      assert.is_false(ft.all(true, false))
      assert.is_true(ft.any(false, true))
      assert.is_true(ft.negate(false))
      assert.are.equal(1, ft.min(1, 2))
      assert.are.equal(2, ft.max(1, 2))
    end)

    it("finds the score's range where it is narrow (interval arithmetic over the graph)", function()
      local function bound(f) return ft.attention_mods { score = f }:score_bound() end
      local slopes = ft.tensor({ 0.5, 0.25 })
      -- a softcap of 30: [-30, 30]
      assert.are.equal(30, bound(function(s) return (s / 30):tanh() * 30 end))
      assert.are.equal(30, bound(function(s) return (s * (1 / 30)):tanh() * 30 end))
      -- shifted, and with a sigmoid: [-20, 40], [1, 9]
      assert.are.equal(40, bound(function(s) return (s / 30):tanh() * 30 + 10 end))
      assert.near(9, bound(function(s) return s:sigmoid() * 8 + 1 end), 1e-12)
      -- too wide (e^-100 would underflow a bf16 P) or unbounded: nil
      assert.is_nil(bound(function(s) return (s / 50):tanh() * 50 end))
      assert.is_nil(bound(function(s) return s end))
      assert.is_nil(bound(function(s, b, h, i, j) return s - slopes[h] * (i - j):abs() end))
      -- a bounded score past a read of a tensor: unbounded (any value)
      assert.is_nil(bound(function(s, b, h) return (s / 30):tanh() * 30 + slopes[h] end))
      -- a mask alone has no score
      assert.is_nil(ft.attention_mods { mask = function(b, h, i, j) return j:le(i) end }:score_bound())
    end)

    it("prints what it holds", function()
      local m = ft.attention_mods { mask = function(b, hh, i, j) return j:le(i) end }
      assert.is_truthy(tostring(m):find("flashtile.AttentionMods(mask,", 1, true), tostring(m))
    end)

    local errors = {
      { "a Lua if on a traced comparison",
        { mask = function(b, hh, i, j) if j:le(i) then return true end return false end },
        "a Lua if, and, or, not or comparison on a traced value" },
      { "Lua's and/or on a traced value",
        { score = function(s, b, hh, i, j) return j:gt(i) and s - 1 or s end },
        "a Lua if, and, or, not or comparison on a traced value" },
      { "Lua's < on traced values",
        { score = function(s, b, hh, i, j) return s + (i < j and 1 or 0) end },
        "use x:lt(y), x:gt(y)" },
      { "a mask that reads the score (smuggled out of the score function)",
        (function()
          local saved
          return { score = function(s) saved = s; return s end,
                   mask = function() return saved:gt(0) end }
        end)(),
        "the mask depends on the score s" },
      { "a string in the graph",
        { score = function(s) return s + "x" end },
        "cannot trace a string" },
      { "an unknown method",
        { score = function(s) return s:cosh() end },
        "cosh" },
      { "an unknown field", { scroe = function(s) return s end }, "unknown field 'scroe'" },
      { "no function", {}, "give a score function, a mask function or both" },
      { "a number for a function", { score = 3 }, "score must be a function, got number" },
    }
    for _, case in ipairs(errors) do
      it(case[1] .. " is a clear error", function()
        local ok, e = pcall(ft.attention_mods, case[2])
        assert.is_false(ok)
        assert.is_truthy(tostring(e):find(case[3], 1, true), tostring(e))
      end)
    end

    it("a mod that makes mods is an error; a trace abandoned by a yield is not in the way", function()
      local ok, e = pcall(ft.attention_mods, {
        score = function(s) ft.attention_mods { score = function(x) return x end } return s end,
      })
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("already tracing", 1, true), tostring(e))
      local co = coroutine.create(function()
        return ft.attention_mods { score = function(s) coroutine.yield() return s end }
      end)
      coroutine.resume(co) -- yields mid-trace (or, in 5.1, cannot yield there)
      local suspended = coroutine.status(co) == "suspended"
      local m = ft.attention_mods { score = function(s) return s * 2 end }
      assert.is_truthy(tostring(m):find("score", 1, true))
      if suspended then -- resumed, its traced values belong to no trace
        local resumed, err = coroutine.resume(co)
        assert.is_false(resumed)
        assert.is_truthy(tostring(err):find("another trace", 1, true), tostring(err))
      end
    end)

    it("a read with the wrong number of indices is a clear error", function()
      local t = ft.zeros({ 3, 4 }, { dtype = "f64" })
      local ok, e = pcall(ft.attention_mods, { score = function(s, b, hh, i, j) return s + t[i] end })
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("a tensor of 2 dims read with 1 indices", 1, true), tostring(e))
    end)

    it("functions that trace to more operations than a graph holds are an error under ft.attention_mods' name", function()
      local ok, e = pcall(ft.attention_mods, { score = function(s)
        local x = s
        for _ = 1, 5000 do x = x + 1 end
        return x
      end })
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("^ft.attention_mods: the functions trace to %d+ operations"), tostring(e))
      assert.is_truthy(tostring(e):find("at most 4096", 1, true), tostring(e))
    end)

    it("a read out of range at a call is an error, and the session goes on", function()
      local bias = ft.zeros({ 5 }, { dtype = "f64" })
      local m = ft.attention_mods { score = function(s, b, hh, i, j) return s + bias[j] end }
      local q, k, v = inputs(1, 4, 9, 2, 2, 4)
      local ok, e = pcall(ft.attention, q, k, v, { mods = m })
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("out of range", 1, true), tostring(e))
      -- within range it runs
      local q2, k2, v2 = inputs(1, 4, 5, 2, 2, 4)
      assert.is_true(ft.is_tensor((ft.attention(q2, k2, v2, { mods = m }))))
    end)

    it("a freed captured tensor is an error at the call", function()
      local bias = ft.zeros({ 9 }, { dtype = "f64" })
      local m = ft.attention_mods { score = function(s, b, hh, i, j) return s + bias[j] end }
      bias:free()
      local q, k, v = inputs(1, 4, 9, 2, 2, 4)
      local ok, e = pcall(ft.attention, q, k, v, { mods = m })
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("has been freed", 1, true), tostring(e))
    end)

    it("mods must come from ft.attention_mods", function()
      local q, k, v = inputs(1, 4, 4, 2, 2, 4)
      local ok, e = pcall(ft.attention, q, k, v, { mods = { graph = 1, tensors = {} } })
      assert.is_false(ok)
      assert.is_truthy(tostring(e):find("must be made by ft.attention_mods", 1, true), tostring(e))
    end)
  end)
end)
