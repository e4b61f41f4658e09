-- Attention over a KV cache (decoding; lib/attention_cache.c): the new keys
-- and values written into the cache in place after each sequence's
-- cache_seqlens rows, attention over the valid prefix, contiguous caches
-- and page pools with block_table (page numbers from 1), ragged lengths,
-- GQA, 1 to 64 query rows; checked against full attention of each sequence
-- on its keys alone (f64), and the errors. On the GPU (tag gpu) the same
-- calls against the CPU's.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local function randn(shape, dtype)
  return ft.randn(shape, { dtype = dtype or "f64", seed = h.next_seed() })
end

--- A contiguous cache [B, cap, Hk, d] holding random rows, NaN past each
-- sequence's first lens[b] rows (they must never be read).
local function nan_cache(B, cap, Hk, d, lens, dtype)
  local c = randn({ B, cap, Hk, d }, dtype)
  for b = 1, B do
    if lens[b] < cap then c[b]:narrow(1, lens[b] + 1, cap - lens[b]):fill(0 / 0) end
  end
  return c
end

--- Full attention of sequence b alone: q[b] against keys 1 .. n of kb/vb
-- ([1, n, Hk, d] tensors), with opts.
local function one_sequence(q, b, kb, vb, opts)
  local qb = q:narrow(1, b, 1):contiguous()
  return ft.attention(qb, kb, vb, h.merge(opts, { impl = "tiled" }))
end

--- Sequence b's keys after the append: the cache's first lens[b] rows, then
-- new[b], as a fresh [1, lens[b] + Nnew, Hk, d] tensor.
local function keys_of(cache, new, lens, b)
  local old = cache:narrow(1, b, 1):narrow(2, 1, math.max(lens[b], 0))
  if not new then return old:contiguous() end
  local Nnew = new.shape[2]
  local shape = old.shape
  local t = ft.empty({ 1, lens[b] + Nnew, shape[3], shape[4] }, { dtype = cache.dtype })
  if lens[b] > 0 then t:narrow(2, 1, lens[b]):copy(old) end
  t:narrow(2, lens[b] + 1, Nnew):copy(new:narrow(1, b, 1))
  return t
end

local function i32(values) return ft.tensor(values, { dtype = "i32" }) end

--- Whether every element of t is NaN; whether a and b agree everywhere,
-- NaN matching NaN.
local function all_nan(t)
  for _, x in ipairs(h.flatten(t:totable())) do
    if x == x then return false end
  end
  return true
end
local function same_or_nan(a, b)
  local x, y = h.flatten(a:totable()), h.flatten(b:totable())
  for i = 1, #x do
    if x[i] ~= y[i] and (x[i] == x[i] or y[i] == y[i]) then return false end
  end
  return #x == #y
end

--- Checks ft.attention with the cache against each sequence's full
-- attention: the caches (contiguous) before the call are kc0/vc0.
local function check_against_full(q, kc0, vc0, lens, knew, vnew, out, lse, opts, tol)
  local B = q.shape[1]
  for b = 1, B do
    local kb, vb = keys_of(kc0, knew, lens, b), keys_of(vc0, vnew, lens, b)
    local ro, rl = one_sequence(q, b, kb, vb, opts)
    local e = ft.max_abs_diff(out:narrow(1, b, 1):double(), ro:double())
    local el = ft.max_abs_diff(lse:narrow(1, b, 1):double(), rl:double())
    assert.is_true(e <= tol and el <= tol,
      ("sequence %d (cache %d, new %d): out error %g, lse error %g"):format(b, lens[b],
        knew and knew.shape[2] or 0, e, el))
  end
end

describe("attention over a KV cache", function()
  it("writes k_new and v_new after each sequence's rows and attends over the valid prefix: ragged lengths, GQA, causal and not, 1 to 64 query rows", function()
    for _, case in ipairs {
      { Nq = 1, Nnew = 1, causal = true },
      { Nq = 5, Nnew = 5, causal = true },
      { Nq = 64, Nnew = 64, causal = true },
      { Nq = 3, Nnew = 3, causal = false },
      { Nq = 7, Nnew = 2, causal = true },
    } do
      local B, H, Hk, d, cap = 3, 4, 2, 16, 80
      local lens = { 0, 9, 80 - case.Nnew }
      local kc, vc = nan_cache(B, cap, Hk, d, lens), nan_cache(B, cap, Hk, d, lens)
      local kc0, vc0 = kc:clone(), vc:clone()
      local q = randn { B, case.Nq, H, d }
      local knew, vnew = randn { B, case.Nnew, Hk, d }, randn { B, case.Nnew, Hk, d }
      local opts = { causal = case.causal }
      local out, lse = ft.attention(q, kc, vc, h.merge(opts, {
        cache_seqlens = i32(lens), k_new = knew, v_new = vnew }))
      assert.are.same({ B, case.Nq, H, d }, out.shape)
      assert.are.same({ B, H, case.Nq }, lse.shape)
      check_against_full(q, kc0, vc0, lens, knew, vnew, out, lse, opts, 1e-12)
      -- the cache now holds the new rows; the rows after them are untouched
      for b = 1, B do
        assert.are.equal(0, ft.max_abs_diff(kc:narrow(1, b, 1):narrow(2, lens[b] + 1, case.Nnew),
          knew:narrow(1, b, 1)))
        assert.are.equal(0, ft.max_abs_diff(vc:narrow(1, b, 1):narrow(2, lens[b] + 1, case.Nnew),
          vnew:narrow(1, b, 1)))
        local after = lens[b] + case.Nnew
        if after < cap then
          local rest = kc:narrow(1, b, 1):narrow(2, after + 1, cap - after)
          assert.is_true(all_nan(rest), "rows past the new ones stay as they were")
        end
      end
    end
  end)

  it("without k_new attends over the first cache_seqlens rows and leaves the cache alone; cache_seqlens is not changed", function()
    local B, Nq, H, Hk, d, cap = 2, 2, 2, 1, 8, 20
    local lens = { 13, 20 }
    local kc, vc = nan_cache(B, cap, Hk, d, lens), nan_cache(B, cap, Hk, d, lens)
    local kc0 = kc:clone()
    local q = randn { B, Nq, H, d }
    local seqlens = i32(lens)
    local out, lse = ft.attention(q, kc, vc, { causal = true, cache_seqlens = seqlens })
    check_against_full(q, kc0, vc:clone(), lens, nil, nil, out, lse, { causal = true }, 1e-12)
    assert.are.same(lens, seqlens:totable())
    assert.is_true(same_or_nan(kc, kc0))
  end)

  it("on the cpu gives the same bits on 1 and 2 threads (f32, GQA, many chunks of keys)", function()
    local B, Nq, H, Hk, d, cap = 2, 3, 8, 2, 64, 1500
    local lens = { 1400, 700 }
    local q = randn({ B, Nq, H, d }, "f32")
    local function run(n)
      ft.set_num_threads(n)
      local kc, vc = randn({ B, cap, Hk, d }, "f32"), randn({ B, cap, Hk, d }, "f32")
      return ft.attention(q, kc, vc, { causal = true, cache_seqlens = i32(lens) })
    end
    local seed = h.next_seed()
    local function again(n) -- the same caches each time
      local save = h.next_seed
      local k = 0
      h.next_seed = function() k = k + 1; return seed + k end
      local o, l = run(n)
      h.next_seed = save
      return o, l
    end
    local o1, l1 = again(1)
    local o2, l2 = again(2)
    ft.set_num_threads(0)
    assert.are.equal(0, ft.max_abs_diff(o1, o2))
    assert.are.equal(0, ft.max_abs_diff(l1, l2))
  end)

  it("a sequence with no key gives zeros and LSE -inf", function()
    local q = randn { 1, 2, 2, 8 }
    local kc, vc = randn { 1, 6, 2, 8 }, randn { 1, 6, 2, 8 }
    local out, lse = ft.attention(q, kc, vc, { cache_seqlens = i32 { 0 } })
    assert.are.equal(0, out:abs():max())
    assert.are.equal(-math.huge, lse:max())
  end)

  it("on the cpu a NaN query row is NaN (out and LSE), not a row that sees no key; the other rows keep their values", function()
    for _, dtype in ipairs { "f32", "f64" } do
      local q = randn({ 1, 1, 4, 8 }, dtype)
      local kc, vc = nan_cache(1, 900, 2, 8, { 700 }, dtype), randn({ 1, 900, 2, 8 }, dtype)
      local opts = { cache_seqlens = i32 { 700 }, causal = true }
      local out, lse = ft.attention(q, kc, vc, opts)
      local qn = q:clone()
      qn:set(1, 1, 2, 3, 0 / 0)
      local out2, lse2 = ft.attention(qn, kc, vc, opts)
      local L, L2, O, O2 = lse:totable(), lse2:totable(), out:totable(), out2:totable()
      for hh = 1, 4 do
        if hh == 2 then
          assert.is_true(L2[1][hh][1] ~= L2[1][hh][1], dtype .. " lse of the NaN row")
          assert.is_true(O2[1][1][hh][1] ~= O2[1][1][hh][1], dtype .. " out of the NaN row")
        else
          assert.are.equal(L[1][hh][1], L2[1][hh][1])
          assert.are.equal(O[1][1][hh][1], O2[1][1][hh][1])
        end
      end
    end
  end)

  gpu_it("on CUDA, the split-KV kernel: a NaN query row is NaN (out and LSE), a NaN key makes NaN the heads that see it, whatever the splits; the other rows keep their bits", function()
    for _, dtype in ipairs { "bf16", "f16" } do
      for _, splits in ipairs { 0, 1, 5 } do
        local function g(t) return t:to(dtype):cuda() end
        local q = randn({ 1, 1, 32, 128 })
        local kc, vc = nan_cache(1, 4000, 8, 128, { 3000 }), randn({ 1, 4000, 8, 128 })
        local opts = { cache_seqlens = i32 { 3000 }, causal = true, num_splits = splits }
        local out, lse = ft.attention(g(q), g(kc), g(vc), opts)
        local qn, kn = q:clone(), kc:clone()
        qn:set(1, 1, 6, 3, 0 / 0)   -- query head 6
        kn:set(1, 1500, 2, 9, 0 / 0) -- a key of kv head 2: query heads 5 to 8
        local out2, lse2 = ft.attention(g(qn), g(kc), g(vc), opts)
        local out3, lse3 = ft.attention(g(q), g(kn), g(vc), opts)
        local O, L = out:cpu():float():totable(), lse:cpu():totable()
        for _, r in ipairs { { out2, lse2, function(hh) return hh == 6 end },
                             { out3, lse3, function(hh) return hh >= 5 and hh <= 8 end } } do
          local O2, L2 = r[1]:cpu():float():totable(), r[2]:cpu():totable()
          for hh = 1, 32 do
            local where = ("%s splits %d head %d"):format(dtype, splits, hh)
            if r[3](hh) then
              assert.is_true(L2[1][hh][1] ~= L2[1][hh][1], where .. ": lse")
              assert.is_true(O2[1][1][hh][1] ~= O2[1][1][hh][1], where .. ": out")
            else
              assert.are.equal(L[1][hh][1], L2[1][hh][1], where)
              assert.are.same(O[1][1][hh], O2[1][1][hh], where)
            end
          end
        end
      end
    end
  end)

  it("paged caches (page pools with block_table, page numbers from 1, shuffled pages) give the contiguous result, with k_new across page boundaries", function()
    for _, ps in ipairs { 16, 4 } do
      local B, H, Hk, d, maxp = 3, 4, 2, 16, 5
      local cap = maxp * ps
      local Nnew = 6
      local lens = { 0, ps - 2, cap - Nnew }
      local kc, vc = nan_cache(B, cap, Hk, d, lens), nan_cache(B, cap, Hk, d, lens)
      -- the pool: every sequence's pages, in a shuffled order, plus spare pages
      local npages = B * maxp + 2
      local kpool, vpool = randn { npages, ps, Hk, d }, randn { npages, ps, Hk, d }
      local order = {}
      for i = 1, npages do order[i] = i end
      local gen = 12345
      for i = npages, 2, -1 do
        gen = (gen * 1103515245 + 12345) % 2147483648
        local j = gen % i + 1
        order[i], order[j] = order[j], order[i]
      end
      local table_ = {}
      for b = 1, B do
        table_[b] = {}
        for i = 1, maxp do
          local pg = order[(b - 1) * maxp + i]
          table_[b][i] = pg
          kpool[pg]:copy(kc[b]:narrow(1, (i - 1) * ps + 1, ps))
          vpool[pg]:copy(vc[b]:narrow(1, (i - 1) * ps + 1, ps))
        end
      end
      local q = randn { B, Nnew, H, d }
      local knew, vnew = randn { B, Nnew, Hk, d }, randn { B, Nnew, Hk, d }
      local o1, l1 = ft.attention(q, kc, vc, { causal = true, cache_seqlens = i32(lens),
                                                k_new = knew, v_new = vnew })
      local o2, l2 = ft.attention(q, kpool, vpool, { causal = true, cache_seqlens = i32(lens),
                                                      k_new = knew, v_new = vnew,
                                                      block_table = i32(table_) })
      assert.are.equal(0, ft.max_abs_diff(o1, o2), "page size " .. ps)
      assert.are.equal(0, ft.max_abs_diff(l1, l2), "page size " .. ps)
      -- the new rows landed in the right pages
      for b = 1, B do
        for r = 1, Nnew do
          local pos = lens[b] + r - 1 -- 0-based row of the sequence
          local pg = table_[b][h.idiv(pos, ps) + 1]
          assert.are.equal(0, ft.max_abs_diff(kpool[pg][pos % ps + 1], knew[b][r]))
        end
      end
    end
  end)

  it("f32, ALiBi per batch and a window follow the f64 result", function()
    local B, Nq, H, Hk, d, cap = 2, 3, 4, 4, 32, 40
    local lens = { 17, 30 }
    local kc, vc = nan_cache(B, cap, Hk, d, lens), nan_cache(B, cap, Hk, d, lens)
    local q = randn { B, Nq, H, d }
    local knew, vnew = randn { B, Nq, Hk, d }, randn { B, Nq, Hk, d }
    local slopes = ft.tensor({ { 0.5, 0.25, 0.125, 0.0625 }, { 0.1, 0.2, 0.3, 0.4 } }, { dtype = "f32" })
    local opts = { causal = true, window_left = 9, alibi_slopes = slopes }
    local kc0, vc0 = kc:clone(), vc:clone()
    local out, lse = ft.attention(q:float(), kc:float(), vc:float(), h.merge(opts, {
      cache_seqlens = i32(lens), k_new = knew:float(), v_new = vnew:float() }))
    for b = 1, B do
      local kb, vb = keys_of(kc0, knew, lens, b), keys_of(vc0, vnew, lens, b)
      local o = h.merge(opts, { alibi_slopes = slopes:double():narrow(1, b, 1) })
      local ro = one_sequence(q, b, kb, vb, o)
      local e = ft.max_abs_diff(out:narrow(1, b, 1):double(), ro)
      assert.is_true(e < 1e-5, ("sequence %d: error %g"):format(b, e))
    end
  end)

  it("refuses what a cache call cannot take, naming the argument", function()
    local q = randn { 2, 1, 2, 8 }
    local kc, vc = randn { 2, 10, 2, 8 }, randn { 2, 10, 2, 8 }
    local kn, vn = randn { 2, 1, 2, 8 }, randn { 2, 1, 2, 8 }
    h.assert_error(function() ft.attention(q, kc, vc, { cache_seqlens = i32 { 10, 3 }, k_new = kn, v_new = vn }) end,
      "cache_seqlens[1] = 10", "does not fit")
    h.assert_error(function() ft.attention(q, kc, vc, { cache_seqlens = i32 { -1, 3 } }) end, "negative")
    h.assert_error(function() ft.attention(q, kc, vc, { cache_seqlens = i32 { 1, 2, 3 } }) end,
      "cache_seqlens must be an i32 tensor {2}")
    h.assert_error(function() ft.attention(q, kc, vc, { cache_seqlens = ft.tensor({ 1, 2 }, { dtype = "i64" }) }) end,
      "cache_seqlens must be an i32 tensor")
    h.assert_error(function() ft.attention(q, kc, vc, { cache_seqlens = i32 { 1, 2 }, k_new = kn }) end,
      "k_new and v_new go together")
    h.assert_error(function() ft.attention(q, kc, vc, { k_new = kn, v_new = vn }) end, "cache_seqlens expected")
    h.assert_error(function() ft.attention(q, kc, vc, { cache_seqlens = i32 { 1, 2 }, dropout_p = 0.1 }) end,
      "takes no dropout")
    h.assert_error(function() ft.attention(q, kc, vc:narrow(3, 1, 1), { cache_seqlens = i32 { 1, 2 } }) end,
      "v_cache")
    local pool = randn { 3, 4, 2, 8 }
    h.assert_error(function() ft.attention(q, pool, pool, { cache_seqlens = i32 { 2, 5 },
                                                             block_table = i32 { { 1, 2 }, { 3, 4 } } }) end,
      "block_table[2][2] = 4 is not a page (pages 1 to 3)")
    h.assert_error(function() ft.attention(q, pool, pool, { cache_seqlens = i32 { 2, 5 },
                                                             block_table = i32 { { 1, 2 }, { 3, 0 } } }) end,
      "block_table[2][2] = 0 is not a page")
    h.assert_error(function() ft.attention(q, pool, pool, { cache_seqlens = i32 { 2, 5 } }) end,
      "block_table")
    local out, lse = ft.attention(q, kc, vc, { cache_seqlens = i32 { 1, 2 } })
    h.assert_error(function() ft.attention_backward(out, q, kc, vc, out, lse, { cache_seqlens = i32 { 1, 2 } }) end,
      "no backward")
  end)

  it("checks what plain attention checks before it appends: a refused call leaves the caches as they were", function()
    for _, dtype in ipairs { "f32", "f64", "f16" } do
      local kc, vc = randn({ 2, 10, 2, 8 }, dtype), randn({ 2, 10, 2, 8 }, dtype)
      local kc0, vc0 = kc:clone(), vc:clone()
      local kn, vn = randn({ 2, 1, 2, 8 }, dtype), randn({ 2, 1, 2, 8 }, dtype)
      local base = { cache_seqlens = i32 { 3, 5 }, k_new = kn, v_new = vn, causal = true }
      for _, case in ipairs {
        { randn({ 2, 1, 3, 8 }, dtype), {}, "k/v heads (2) must divide q heads (3)" },
        { randn({ 2, 1, 3, 8 }, dtype), { softcap = 5 }, "k/v heads (2) must divide q heads (3)" },
        { randn({ 2, 1, 2, 8 }, dtype), { scale = 0 / 0 }, "scale must be finite" },
        { randn({ 2, 1, 2, 8 }, dtype), { window_left = -7 }, "window_left and window_right must be -1" },
        { randn({ 2, 1, 2, 8 }, dtype), { alibi_slopes = ft.ones({ 5 }) }, "alibi_slopes must be [heads]" },
        { randn({ 2, 1, 2, 8 }, dtype), { sink = ft.ones({ 7 }) }, "sink must be [heads] = {2}, got {7}" },
        { randn({ 2, 1, 2, 8 }, dtype), { impl = "flash" }, "impl 'flash' runs on CUDA tensors" },
      } do
        h.assert_error(function() ft.attention(case[1], kc, vc, h.merge(base, case[2])) end, case[3])
        assert.are.equal(0, ft.max_abs_diff(kc, kc0), dtype .. " " .. case[3])
        assert.are.equal(0, ft.max_abs_diff(vc, vc0), dtype .. " " .. case[3])
      end
    end
    -- zero kv heads: an error, not a division by zero
    h.assert_error(function()
      ft.attention(randn { 1, 1, 2, 8 }, randn { 1, 6, 0, 8 }, randn { 1, 6, 0, 8 }, { cache_seqlens = i32 { 2 } })
    end, "k/v heads (0) must divide q heads (2)")
  end)

  it("refuses a paged call whose new keys would land twice on one row (a page two sequences append into)", function()
    local pool = ft.zeros({ 4, 4, 2, 8 }, { dtype = "f64" })
    local kn, vn = randn { 2, 1, 2, 8 }, randn { 2, 1, 2, 8 }
    h.assert_error(function()
      ft.attention(randn { 2, 1, 2, 8 }, pool, pool:clone(), { cache_seqlens = i32 { 1, 1 }, causal = true,
        block_table = i32 { { 1, 2 }, { 1, 3 } }, k_new = kn, v_new = vn })
    end, "block_table: row 2 of page 1 would take two of the new keys (sequences 1 and 2)")
    assert.are.equal(0, pool:abs():max())
    -- sharing a page that only holds old keys is reading, and allowed
    local out = ft.attention(randn { 2, 1, 2, 8 }, pool, pool:clone(), { cache_seqlens = i32 { 4, 4 }, causal = true,
      block_table = i32 { { 1, 2 }, { 1, 3 } }, k_new = kn, v_new = vn })
    assert.are.same({ 2, 1, 2, 8 }, out.shape)
  end)

  gpu_it("on CUDA, the split-KV kernel: 1 to 64 query rows, GQA groups of 1 to 8, ragged lengths with NaN past them, any number of splits, lengths on the host or the device, against the CPU in f64; paged (pages of 28 rows, in reverse order, the table on the host) gives the same bits and appends into the right pages", function()
    for n, case in ipairs {
      { Nq = 1, H = 32, Hk = 8, d = 128, splits = 0 }, { Nq = 1, H = 8, Hk = 8, d = 64, splits = 3 },
      { Nq = 4, H = 16, Hk = 2, d = 128, splits = 1 }, { Nq = 64, H = 8, Hk = 2, d = 128, splits = 0 },
      { Nq = 3, H = 4, Hk = 1, d = 256, splits = 5 }, { Nq = 1, H = 4, Hk = 4, d = 96, splits = 0 },
      { Nq = 2, H = 8, Hk = 2, d = 64, splits = 40 }, { Nq = 64, H = 8, Hk = 2, d = 128, splits = 4 },
      { Nq = 16, H = 16, Hk = 4, d = 256, splits = 0 },
    } do
      local B, cap, PS = 3, 700, 28
      local lens = { 0, 1, cap - case.Nq }
      local kc, vc = nan_cache(B, cap, case.Hk, case.d, lens), nan_cache(B, cap, case.Hk, case.d, lens)
      local q, kn, vn = randn { B, case.Nq, case.H, case.d }, randn { B, case.Nq, case.Hk, case.d },
                        randn { B, case.Nq, case.Hk, case.d }
      local function bf(t) return t:to("bf16"):double() end
      local kc_c = bf(kc)
      local want, wl = ft.attention(bf(q), kc_c, bf(vc), { causal = true, cache_seqlens = i32(lens),
                                                            k_new = bf(kn), v_new = bf(vn) })
      local function g(t) return t:to("bf16"):cuda() end
      local label = ("Nq %d H %d Hk %d d %d splits %d"):format(case.Nq, case.H, case.Hk, case.d, case.splits)
      local kg = g(kc)
      local lens_t = n % 2 == 1 and i32(lens):cuda() or i32(lens)
      local out, lse = ft.attention(g(q), kg, g(vc), { causal = true, cache_seqlens = lens_t,
                                                      k_new = g(kn), v_new = g(vn), num_splits = case.splits })
      local e = ft.max_abs_diff(out:cpu():double(), want)
      local el = ft.max_abs_diff(lse:cpu():double(), wl)
      assert.is_true(e < 2^-6 and el < 1e-3, ("%s: out error %g, lse %g"):format(label, e, el))
      assert.is_true(same_or_nan(kg:cpu():double(), kc_c), label .. ": the appended cache")
      -- the kernel without copying warps (FT_NO_DECODE_WS): the same bits
      ft.set_switch("FT_NO_DECODE_WS", true)
      local ok, out3, lse3 = pcall(ft.attention, g(q), g(kc), g(vc), { causal = true, cache_seqlens = lens_t,
                                   k_new = g(kn), v_new = g(vn), num_splits = case.splits })
      ft.set_switch("FT_NO_DECODE_WS", nil)
      assert(ok, out3)
      if case.splits > 0 then -- (the automatic count follows each kernel's occupancy)
        assert.are.equal(0, ft.max_abs_diff(out3:cpu():double(), out:cpu():double()), label .. ": FT_NO_DECODE_WS")
        assert.are.equal(0, ft.max_abs_diff(lse3:cpu():double(), lse:cpu():double()), label .. ": FT_NO_DECODE_WS lse")
      else
        assert.is_true(ft.max_abs_diff(out3:cpu():double(), want) < 2^-6, label .. ": FT_NO_DECODE_WS")
      end
      -- paged: sequence b's page i is pool page np * B + 1 - ((b - 1) * np + i)
      local np = h.idiv(cap, PS)
      local kp = g(kc):view { B * np, PS, case.Hk, case.d }:index_select(1, ft.arange(B * np, 0, -1, { dtype = "i32" }):cuda())
      local vp = g(vc):view { B * np, PS, case.Hk, case.d }:index_select(1, ft.arange(B * np, 0, -1, { dtype = "i32" }):cuda())
      local tbl = {}
      for b = 1, B do
        tbl[b] = {}
        for i = 1, np do tbl[b][i] = np * B + 1 - ((b - 1) * np + i) end
      end
      local out2, lse2 = ft.attention(g(q), kp, vp, { causal = true, cache_seqlens = lens_t,
                                                     k_new = g(kn), v_new = g(vn), num_splits = case.splits,
                                                     block_table = i32(tbl) })
      assert.are.equal(0, ft.max_abs_diff(out2:cpu():double(), out:cpu():double()), label .. ": paged")
      assert.are.equal(0, ft.max_abs_diff(lse2:cpu():double(), lse:cpu():double()), label .. ": paged lse")
      local back = kp:index_select(1, ft.arange(B * np, 0, -1, { dtype = "i32" }):cuda()):view { B, cap, case.Hk, case.d }
      assert.is_true(same_or_nan(back:cpu():double(), kc_c), label .. ": the appended pages")
    end
  end)

  gpu_it("on CUDA, more splits than the split kernel merges itself (a merge kernel then) and the automatic count agree with the CPU, and a call repeated gives the same bits", function()
    local B, cap, H, Hk, d = 2, 16384, 8, 2, 64
    local lens = { cap - 1, 3000 }
    local kc, vc = nan_cache(B, cap, Hk, d, lens), nan_cache(B, cap, Hk, d, lens)
    local q, kn, vn = randn { B, 1, H, d }, randn { B, 1, Hk, d }, randn { B, 1, Hk, d }
    local function bf(t) return t:to("bf16"):double() end
    local want, wl = ft.attention(bf(q), bf(kc), bf(vc), { causal = true, cache_seqlens = i32(lens),
                                                          k_new = bf(kn), v_new = bf(vn) })
    local function g(t) return t:to("bf16"):cuda() end
    local qg, kng, vng = g(q), g(kn), g(vn)
    for _, splits in ipairs { 0, 7, 200 } do
      local kg, vg = g(kc), g(vc)
      local o = { causal = true, cache_seqlens = i32(lens), k_new = kng, v_new = vng, num_splits = splits }
      local out, lse = ft.attention(qg, kg, vg, o)
      local e = ft.max_abs_diff(out:cpu():double(), want)
      local el = ft.max_abs_diff(lse:cpu():double(), wl)
      assert.is_true(e < 2^-6 and el < 1e-3, ("splits %d: out error %g, lse %g"):format(splits, e, el))
      for _ = 1, 3 do
        local out2, lse2 = ft.attention(qg, kg, vg, o)
        assert.are.equal(0, ft.max_abs_diff(out2:cpu():double(), out:cpu():double()), "splits " .. splits .. ": again")
        assert.are.equal(0, ft.max_abs_diff(lse2:cpu():double(), lse:cpu():double()), "splits " .. splits .. ": again, lse")
      end
    end
  end)

  gpu_it("on CUDA, a variant (softcap) runs sequence by sequence, with lengths and the block table on the host, as on the CPU", function()
    local B, H, Hk, d, PS, np, Nnew = 2, 4, 2, 64, 16, 4, 3
    local cap = PS * np
    local lens = { 5, cap - Nnew }
    local kc, vc = nan_cache(B, cap, Hk, d, lens), nan_cache(B, cap, Hk, d, lens)
    local q, kn, vn = randn { B, Nnew, H, d }, randn { B, Nnew, Hk, d }, randn { B, Nnew, Hk, d }
    local function bf(t) return t:to("bf16"):double() end
    local want = ft.attention(bf(q), bf(kc), bf(vc), { causal = true, softcap = 5, cache_seqlens = i32(lens),
                                                        k_new = bf(kn), v_new = bf(vn) })
    local function g(t) return t:to("bf16"):cuda() end
    local tbl = {}
    for b = 1, B do
      tbl[b] = {}
      for i = 1, np do tbl[b][i] = (b - 1) * np + i end
    end
    local kp, vp = g(kc):view { B * np, PS, Hk, d }, g(vc):view { B * np, PS, Hk, d }
    local out = ft.attention(g(q), kp, vp, { causal = true, softcap = 5, cache_seqlens = i32(lens),
                                             k_new = g(kn), v_new = g(vn), block_table = i32(tbl) })
    local e = ft.max_abs_diff(out:cpu():double(), want)
    assert.is_true(e < 2^-6, "error " .. e)
  end)

  gpu_it("on CUDA, plain attention of a few rows against many keys (no cache: the split-KV kernel's case) matches the CPU, forward and backward", function()
    for _, c in ipairs { { Nq = 1, H = 32, Hk = 8, Nk = 4096, causal = true }, { Nq = 4, H = 8, Hk = 2, Nk = 700, causal = false },
                         { Nq = 16, H = 4, Hk = 4, Nk = 2048, causal = true }, { Nq = 64, H = 4, Hk = 4, Nk = 2048, causal = true } } do
      local q, k, v = randn { 2, c.Nq, c.H, 128 }, randn { 2, c.Nk, c.Hk, 128 }, randn { 2, c.Nk, c.Hk, 128 }
      local dout = randn { 2, c.Nq, c.H, 128 }
      local function bf(t) return t:to("bf16"):double() end
      local o = { causal = c.causal }
      local want = h.attention_both(bf(q), bf(k), bf(v), bf(dout), o)
      local function g(t) return t:to("bf16"):cuda() end
      local got = h.attention_both(g(q), g(k), g(v), g(dout), o)
      for _, name in ipairs { "out", "lse", "dq", "dk", "dv" } do
        local e = ft.max_abs_diff(got[name]:cpu():double(), want[name])
        assert.is_true(e < (name == "lse" and 1e-3 or 2^-5), ("Nq %d Nk %d: %s error %g"):format(c.Nq, c.Nk, name, e))
      end
    end
  end)

  gpu_it("on CUDA (bf16, contiguous and paged) as on the CPU", function()
    local B, H, Hk, d, cap, Nnew = 3, 8, 2, 128, 96, 4
    local lens = { 0, 33, cap - Nnew }
    local kc, vc = randn { B, cap, Hk, d }, randn { B, cap, Hk, d }
    local q, knew, vnew = randn { B, Nnew, H, d }, randn { B, Nnew, Hk, d }, randn { B, Nnew, Hk, d }
    local function bf(t) return t:to("bf16"):double() end
    local kc_c, vc_c = bf(kc), bf(vc)
    local ref = ft.attention(bf(q), kc_c, vc_c, { causal = true, cache_seqlens = i32(lens),
                                                   k_new = bf(knew), v_new = bf(vnew), impl = "tiled" })
    local function g(t) return t:to("bf16"):cuda() end
    local kg, vg = g(kc), g(vc)
    local out = ft.attention(g(q), kg, vg, { causal = true, cache_seqlens = i32(lens):cuda(),
                                             k_new = g(knew), v_new = g(vnew) })
    local e = ft.max_abs_diff(out:cpu():double(), ref)
    assert.is_true(e < 2^-6, "contiguous: error " .. e)
    assert.are.equal(0, ft.max_abs_diff(kg:cpu():double(), kc_c))
    -- paged, page size 16: the same pool order as the cache
    local np = h.idiv(cap, 16)
    local kp, vp = g(kc):view { B * np, 16, Hk, d }, g(vc):view { B * np, 16, Hk, d }
    local tbl = {}
    for b = 1, B do
      tbl[b] = {}
      for i = 1, np do tbl[b][i] = (b - 1) * np + i end
    end
    local out2 = ft.attention(g(q), kp, vp, { causal = true, cache_seqlens = i32(lens):cuda(),
                                              k_new = g(knew), v_new = g(vnew),
                                              block_table = i32(tbl):cuda() })
    assert.are.equal(0, ft.max_abs_diff(out2:cpu():double(), out:cpu():double()))
  end)
end)
