-- Attention modifications written in Lua on CUDA (tag #gpu): the flash
-- kernels compiled at run time for a mod (kernels/attention/rtc.cu, NVRTC).
-- The built-in variants rewritten as mods give the built-ins' results on
-- the GPU to rounding, forward and backward; mods that have no built-in
-- (a learned relative bias, FlexAttention's document and prefix-LM masks)
-- follow the f64 CPU running the same mod; the kernels come from the
-- memory cache, then from the disk cache in a new process; bad uses are
-- clear errors. ctest runs it again with FT_NO_WGMMA=1 (the mma.sync
-- kernels). Pending, with the reason, where there is no GPU.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local FIELDS = { "out", "lse", "dq", "dk", "dv" }

local function randn(shape)
  return ft.randn(shape, { dtype = "f64", seed = h.next_seed() })
end

local function cpu64(x) return x:cpu():double() end

-- out, lse, dq, dk, dv, and the gradients of the tensors the mods read
local function run(q, k, v, dout, opts)
  local out, lse = ft.attention(q, k, v, opts)
  local r = h.pack(ft.attention_backward(dout, q, k, v, out, lse, opts))
  return { out = out, lse = lse, dq = r[1], dk = r[2], dv = r[3], grads = { h.unpack(r, 4, r.n) } }
end

--- max |a - b| over each result, relative to the largest |b| (+1).
local function assert_close(label, got, want, tol)
  for _, f in ipairs(FIELDS) do
    local scale = ft.max_abs_diff(cpu64(want[f]), cpu64(want[f]) * 0) + 1
    local diff = ft.max_abs_diff(cpu64(got[f]), cpu64(want[f]))
    assert.is_true(diff == diff and diff <= tol * scale,
      ("%s %s: %g (scale %g)"):format(label, f, diff, scale))
  end
end

-- relative tolerances: the same kernels with the same scores but for float
-- rounding (GPU mod against GPU built-in); and against the f64 cpu (the
-- 16-bit inputs round P and dS, as the variants spec allows)
local SAME = { f16 = 4e-3, bf16 = 2e-2 }
local CPU = { f16 = 1e-2, bf16 = 6e-2 }

describe("attention mods written in Lua on CUDA #gpu", function()
  local B, N, H, Hk = 2, 200, 4, 2
  local slopes64 = ft.tensor({ 0.5, 0.25, 0.125, 0.0625 }, { dtype = "f64" })

  local function builtins(slopes)
    return {
      { "causal", { causal = true },
        { mask = function(b, hh, i, j) return j:le(i) end } },
      { "sliding window 37, causal", { causal = true, window_left = 37 },
        { mask = function(b, hh, i, j) return ft.all(j:le(i), j:ge(i - 37)) end } },
      { "ALiBi + causal", { causal = true, alibi_slopes = slopes },
        { score = function(s, b, hh, i, j) return s - slopes[hh] * (i - j):abs() end,
          mask = function(b, hh, i, j) return j:le(i) end } },
      { "softcap 2", { softcap = 2 },
        { score = function(s) return (s / 2):tanh() * 2 end } },
    }
  end

  -- each case compiles three kernels (forward, dK/dV, dQ): a few seconds each
  for _, c in ipairs { { "bf16", 128, 4 }, { "f16", 64, 2 } } do
    local dtype, d, ncases = c[1], c[2], c[3]
    do
      gpu_it(("the built-in variants as mods: the built-ins' results, %s, d %d, forward and backward"):format(dtype, d), function()
        local slopes = slopes64:float():cuda()
        local q, k, v, dout = randn { B, N, H, d }, randn { B, N, Hk, d }, randn { B, N, Hk, d },
            randn { B, N, H, d }
        local function g(t) return t:to(dtype):cuda() end
        for n, case in ipairs(builtins(slopes)) do
          if n > ncases then break end
          local want = run(g(q), g(k), g(v), g(dout), case[2])
          local mods = ft.attention_mods(case[3])
          local got = run(g(q), g(k), g(v), g(dout), { mods = mods, mod_grads = false })
          assert_close(case[1], got, want, SAME[dtype])
        end
      end)
    end
  end

  gpu_it("mods without a built-in follow the f64 cpu running the same mod, with the gradients of the tables they read: a relative-bias table, a per-head gain, a document mask, a prefix-LM mask; f16 and bf16, d 32, 96 and 256", function()
    local Nq = 150
    local rel64 = randn { H, 2 * Nq }
    local gain64 = ft.tensor({ 0.8, 1.1, 1.3, 0.6 }, { dtype = "f64" })
    local doc64 = ft.tensor((function()
      local t = {}
      for i = 1, Nq do t[i] = i <= 40 and 1 or i <= 41 and 2 or i <= 120 and 3 or 4 end
      return t
    end)(), { dtype = "i32" })
    local function mods_for(rel, doc, gain)
      return {
        { "relative bias", { score = function(s, b, hh, i, j) return s + rel[hh][i - j + Nq] end } },
        { "document mask", { mask = function(b, hh, i, j) return ft.all(doc[i]:eq(doc[j]), j:le(i)) end } },
        { "prefix-LM mask", { mask = function(b, hh, i, j) return ft.any(j:le(i), j:le(17)) end } },
        { "gain, bias, tanh and a mask together", {
            score = function(s, b, hh, i, j) return (s * gain[hh] + rel[hh][i - j + Nq] * 0.5):tanh() * 4 end,
            mask = function(b, hh, i, j) return ft.negate(ft.all(j:gt(i), ((i + j) % 3):eq(0))) end } },
      }
    end
    local cpu_cases = mods_for(rel64, doc64, gain64)
    -- (dtype, head dim, batch, which mods)
    for _, c in ipairs { { "f16", 32, 2, { 1, 2 } }, { "bf16", 256, 1, { 1, 3 } }, { "bf16", 96, 2, { 4 } } } do
      local dtype, d, B1 = c[1], c[2], c[3]
      local q, k, v, dout = randn { B1, Nq, H, d }, randn { B1, Nq, Hk, d }, randn { B1, Nq, Hk, d },
          randn { B1, Nq, H, d }
      local gpu_cases = mods_for(rel64:float():cuda(), doc64:cuda(), gain64:to("bf16"):cuda())
      local function g(t) return t:to(dtype):cuda() end
      for _, n in ipairs(c[4]) do
        local case = gpu_cases[n]
        local label = ("%s, %s, d %d"):format(case[1], dtype, d)
        local want = run(q, k, v, dout, { mods = ft.attention_mods(cpu_cases[n][2]), impl = "tiled" })
        local got = run(g(q), g(k), g(v), g(dout), { mods = ft.attention_mods(case[2]) })
        assert_close(label, got, want, CPU[dtype])
        -- the tables' gradients, each in its tensor's dtype on the GPU
        assert.are.equal(#want.grads, #got.grads, label)
        for t = 1, #want.grads do
          assert.are.equal("cuda:0", got.grads[t].device, label)
          -- relative to the largest entry (a gradient of all zeros fails)
          local scale = ft.max_abs_diff(want.grads[t], want.grads[t] * 0)
          local diff = ft.max_abs_diff(cpu64(got.grads[t]), want.grads[t])
          assert.is_true(scale > 0, label)
          assert.is_true(diff == diff and diff <= CPU[dtype] * scale,
            ("%s: gradient %d off by %g (scale %g)"):format(label, t, diff, scale))
        end
      end
    end
  end)

  -- a Lua mod's kernels are compiled for what else the call does: with the
  -- built-in score variants' code or without, with dropout's or without
  gpu_it("mods with built-in variants in the same call (softcap, ALiBi, dropout, causal) follow the f64 cpu: bf16 d 128 and f16 d 64, forward and backward, with a table's gradient", function()
    local Nq = 130
    local rel64 = randn { H, 2 * Nq }
    local function mods_for(rel)
      return {
        { "relative bias + softcap + ALiBi + causal",
          { score = function(s, b, hh, i, j) return s + rel[hh][i - j + Nq] end },
          { softcap = 3, causal = true } },
        { "prefix-LM mask + tanh score + dropout",
          { score = function(s) return (s * 0.5):tanh() * 2 end,
            mask = function(b, hh, i, j) return ft.any(j:le(i), j:le(17)) end },
          { dropout_p = 0.15, seed = 11, offset = 2 } },
        { "a score of -inf (log 0), doubled, + ALiBi + dropout",
          { score = function(s, b, hh, i, j) return (s + ft.where(j:le(i), 1, 0):log()) * 2 end },
          { dropout_p = 0.1, seed = 3 } },
      }
    end
    local cpu_cases, gpu_cases = mods_for(rel64), mods_for(rel64:float():cuda())
    for _, c in ipairs { { "bf16", 128 }, { "f16", 64 } } do
      local dtype, d = c[1], c[2]
      local q, k, v, dout = randn { 1, Nq, H, d }, randn { 1, Nq, Hk, d }, randn { 1, Nq, Hk, d },
          randn { 1, Nq, H, d }
      local function g(t) return t:to(dtype):cuda() end
      for n, case in ipairs(gpu_cases) do
        local label = ("%s, %s, d %d"):format(case[1], dtype, d)
        local copts = h.merge({ mods = ft.attention_mods(cpu_cases[n][2]), impl = "tiled" }, case[3])
        local gopts = h.merge({ mods = ft.attention_mods(case[2]) }, case[3])
        if n == 3 then
          copts.alibi_slopes, gopts.alibi_slopes = slopes64, slopes64:float():cuda()
        end
        local want, got = run(q, k, v, dout, copts), run(g(q), g(k), g(v), g(dout), gopts)
        assert_close(label, got, want, CPU[dtype])
        assert.are.equal(#want.grads, #got.grads, label)
        for t = 1, #want.grads do
          local scale = ft.max_abs_diff(want.grads[t], want.grads[t] * 0)
          local diff = ft.max_abs_diff(cpu64(got.grads[t]), want.grads[t])
          assert.is_true(scale > 0 and diff == diff and diff <= CPU[dtype] * scale,
            ("%s: gradient %d off by %g (scale %g)"):format(label, t, diff, scale))
        end
      end
    end
  end)

  gpu_it("block masks made on CUDA: the tiles counted on the GPU, and the same results with the kernels skipping the tiles outside the mask's band (tiles of 64 x 64 and of 48 x 80); mods that change nothing run as calls without them", function()
    local Nq = 200
    local doc64 = ft.tensor((function()
      local t = {}
      for i = 1, Nq do t[i] = math.floor((i - 1) / 90) end -- documents of 90: some full tiles
      return t
    end)(), { dtype = "i32" })
    local doc = doc64:cuda()
    local cases = {
      { "causal", { mask = function(b, hh, i, j) return j:le(i) end }, { causal = true } },
      { "sliding window 37, causal", { mask = function(b, hh, i, j) return ft.all(j:le(i), j:ge(i - 37)) end },
        { causal = true, window_left = 37 } },
      { "document mask", { mask = function(b, hh, i, j) return ft.all(doc[i]:eq(doc[j]), j:le(i)) end } },
      { "ALiBi and causal", { score = function(s, b, hh, i, j) return s - (i - j) * 0.05 end,
                              mask = function(b, hh, i, j) return j:le(i) end } },
    }
    local q, k, v, dout = randn { B, Nq, H, 64 }, randn { B, Nq, Hk, 64 }, randn { B, Nq, Hk, 64 },
        randn { B, Nq, H, 64 }
    local function g(t) return t:to("bf16"):cuda() end
    for _, tiles in ipairs { { 64, 64 }, { 48, 80 } } do
      for _, case in ipairs(cases) do
        local label = ("%s with its block mask of %d x %d tiles"):format(case[1], tiles[1], tiles[2])
        local mods = ft.attention_mods(case[2])
        local bm = ft.block_mask(mods, B, H, Nq, Nq, { device = "cuda", block_q = tiles[1], block_k = tiles[2] })
        local want = run(g(q), g(k), g(v), g(dout), case[3] or { mods = mods, mod_grads = false })
        local got = run(g(q), g(k), g(v), g(dout), { mods = mods, block_mask = bm, mod_grads = false })
        assert_close(label, got, want, SAME.bf16)
        -- the same counts as the cpu's block mask of the same mask
        local cpu_mods = ft.attention_mods(case[1] == "document mask"
          and { mask = function(b, hh, i, j) return ft.all(doc64[i]:eq(doc64[j]), j:le(i)) end } or case[2])
        local cbm = ft.block_mask(cpu_mods, B, H, Nq, Nq, { block_q = tiles[1], block_k = tiles[2] })
        assert.are.same({ cbm:counts() }, { bm:counts() }, label)
      end
    end
    -- mods that change nothing run the kernels of a call without them: the
    -- same bits (an empty mod; a causal mask with its block mask, its band)
    local cm = ft.attention_mods(cases[1][2])
    local pairs_ = {
      { "an empty mod", { mods = ft.attention_mods { score = function(s) return s end } }, {} },
      { "a causal mask that is its band",
        { mods = cm, block_mask = ft.block_mask(cm, B, H, Nq, Nq, { device = "cuda" }) }, { causal = true } },
    }
    for _, pr in ipairs(pairs_) do
      local got, want = run(g(q), g(k), g(v), g(dout), pr[2]), run(g(q), g(k), g(v), g(dout), pr[3])
      for _, f in ipairs(FIELDS) do
        assert.are.equal(0, ft.max_abs_diff(cpu64(got[f]), cpu64(want[f])), pr[1] .. ": " .. f)
      end
    end
    -- causal over 200 x 200 in 64 x 64 tiles: 6 hidden, 4 on the diagonal, 6 whole, per (b, h)
    local causal = ft.attention_mods(cases[1][2])
    local e, p, f = ft.block_mask(causal, B, H, Nq, Nq, { device = "cuda", block_q = 64, block_k = 64 }):counts()
    assert.are.same({ 6 * B * H, 4 * B * H, 6 * B * H }, { e, p, f })
    -- made on the cpu, used on CUDA: an error that says so
    local cbm = ft.block_mask(causal, B, H, Nq, Nq)
    h.assert_error(function() ft.attention(g(q), g(k), g(v), { mods = causal, block_mask = cbm }) end,
      "block_mask was made for the cpu, the call runs on cuda:0")
  end)

  gpu_it("compiled kernels are kept: in memory within a process, on disk across processes", function()
    local before = ft.cuda.mods_stats()
    local q = ft.randn({ 1, 64, 2, 64 }, { dtype = "bf16", device = "cuda", seed = 3 })
    local mods = ft.attention_mods { score = function(s, b, hh, i, j) return s * 0.5 + (i - j) * 0.01 end }
    ft.attention(q, q, q, { mods = mods })
    ft.attention(q, q, q, { mods = mods })
    local after = ft.cuda.mods_stats()
    assert.is_true(after.memory_hits >= before.memory_hits + 1)
    -- a new process: the same mod loads from disk and compiles nothing
    local script = [[
      local ft = require "flashtile"
      local q = ft.randn({ 1, 64, 2, 64 }, { dtype = "bf16", device = "cuda", seed = 3 })
      local mods = ft.attention_mods { score = function(s, b, hh, i, j) return s * 0.5 + (i - j) * 0.01 end }
      ft.attention(q, q, q, { mods = mods })
      local st = ft.cuda.mods_stats()
      io.write(st.compiles, " ", st.disk_loads, " ", st.last_load_s, "\n")
    ]]
    local out = h.run_lua(script)
    local compiles, loads, load_s = out:match("^(%d+) (%d+) (%S+)")
    assert.are.equal("0", compiles, out)
    assert.are.equal("1", loads, out)
    assert.is_true(tonumber(load_s) < 0.05, out) -- the bar: a cached mod loads in under 50 ms
  end)

  gpu_it("a read out of range: with FT_MODS_DEBUG=1 a clear error at the call, and the session goes on", function()
    -- the index comes from a tensor, so only the kernel's bounds check can see it
    local script = [==[
      local ft = require "flashtile"
      local N = 64
      local q = ft.randn({ 1, N, 2, 64 }, { dtype = "bf16", device = "cuda", seed = 3 })
      local bias = ft.randn({ N }, { device = "cuda", seed = 4 })
      local t = {}
      for n = 1, N do t[n] = n end
      t[40] = N + 7
      local idx = ft.tensor(t, { dtype = "i32" }):cuda()
      local bad = ft.attention_mods { score = function(s, b, hh, i, j) return s + bias[idx[j]] end }
      local ok, e = pcall(ft.attention, q, q, q, { mods = bad })
      io.write(tostring(ok), "\n", tostring(e), "\n")
      local good = ft.attention_mods { score = function(s, b, hh, i, j) return s + bias[j] end }
      io.write("after ", tostring(ft.is_tensor((ft.attention(q, q, q, { mods = good })))), "\n")
    ]==]
    local out = h.run_lua(script, { FT_MODS_DEBUG = "1" })
    assert.is_truthy(out:find("^false\n"), out)
    assert.is_truthy(out:find("out of range", 1, true), out)
    assert.is_truthy(out:find("after true", 1, true), out)
  end)

  gpu_it("bad uses are clear errors: f32, the naive impl, deterministic gradients of read tensors, a cpu tensor read", function()
    local q32 = ft.randn({ 1, 16, 2, 64 }, { device = "cuda", seed = 1 })
    local q = q32:to("bf16")
    local slopes = slopes64:float():cuda()
    local alibi = ft.attention_mods { score = function(s, b, hh, i, j) return s - slopes[hh] * (i - j) end }
    h.assert_error(function() ft.attention(q32, q32, q32, { mods = alibi }) end, "f16 or bf16")
    h.assert_error(function() ft.attention(q, q, q, { mods = alibi, impl = "naive" }) end,
      "impl 'flash' or 'auto'")
    local out, lse = ft.attention(q, q, q, { mods = alibi })
    h.assert_error(function()
      ft.attention_backward(out, q, q, q, out, lse, { mods = alibi, deterministic = true })
    end, "deterministic: on CUDA the gradients of the float tensors mods read are summed with atomics")
    local r = h.pack(ft.attention_backward(out, q, q, q, out, lse, { mods = alibi, mod_grads = false }))
    assert.are.equal(3, r.n)
    r = h.pack(ft.attention_backward(out, q, q, q, out, lse, { mods = alibi }))
    assert.are.equal(4, r.n)
    assert.are.same({ 4 }, r[4].shape)
    local cpu_slopes = ft.attention_mods { score = function(s, b, hh, i, j) return s - slopes64[hh] end }
    h.assert_error(function() ft.attention(q, q, q, { mods = cpu_slopes }) end, "not on q's device")
  end)
end)
