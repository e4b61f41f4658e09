-- Small attention calls on the GPU covering every kernel family, for
-- compute-sanitizer (scripts/gpu-check runs it under memcheck, racecheck,
-- synccheck and initcheck, again with FT_NO_WGMMA=1 for the mma.sync
-- kernels, FT_NO_WS=1 for the Hopper kernels that are not warp-specialised
-- and FT_WS=1 for the warp-specialised forward that is not persistent):
-- flash forward and backward for f16, bf16 (head dims 32
-- to 256, causal or not, GQA, odd lengths, Nq != Nk) and f32; the flash
-- kernels' variants (windows with sinks on the plain kernels; softcap and
-- ALiBi, and varlen in one launch with empty and length-1 sequences, on the
-- extended ones); the naive cuBLAS path with every attention variant at
-- once (f32, bf16, f64), the dropout mask kernel, and the tensor ops they
-- use, and (without a flash switch on) the decoding kernel in both its
-- forms and the fp8 forward. Checks each flash
-- result against the naive path loosely (the specs check accuracy); prints
-- one line, and one per configuration on stderr when FT_SANITIZE_VERBOSE
-- is set.
--
--   lua scripts/sanitize-attention.lua
local ok, ft = pcall(require, "flashtile")
if not ok then
  local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
  ft = dofile(here .. "lib/paths.lua").require("sanitize-attention.lua", here)
end
if not ft.cuda.is_available() then
  io.stderr:write("sanitize-attention.lua: no CUDA GPU is available\n")
  os.exit(1)
end

local calls, seed, started = 0, 0, os.time()
local function input(shape, dtype)
  seed = seed + 1
  return ft.randn(shape, { dtype = dtype, device = "cuda", seed = seed })
end

local function run(dtype, d, nq, nk, h, hk, causal)
  local q = input({ 2, nq, h, d }, dtype)
  local k, v = input({ 2, nk, hk, d }, dtype), input({ 2, nk, hk, d }, dtype)
  local opts = { causal = causal }
  local out, lse = ft.attention(q, k, v, opts)
  local dq, dk, dv = ft.attention_backward(input(out.shape, dtype), q, k, v, out, lse, opts)
  opts.impl = "naive"
  local ref = ft.attention(q, k, v, opts)
  local diff = ft.max_abs_diff(out:float(), ref:float())
  if not (diff < 0.1) then
    error(("%s d=%d nq=%d nk=%d causal=%s: |flash - naive| = %g"):format(
      dtype, d, nq, nk, tostring(causal), diff))
  end
  assert(dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype)
  calls = calls + 1
  if os.getenv("FT_SANITIZE_VERBOSE") then
    io.stderr:write(("%s d=%d nq=%d nk=%d causal=%s done at %d s\n"):format(
      dtype, d, nq, nk, tostring(causal), os.time() - started))
  end
end

for _, dtype in ipairs { "f16", "bf16" } do
  for _, d in ipairs { 32, 64, 96, 128, 192, 256 } do
    run(dtype, d, 130, 130, 4, 2, false)
    run(dtype, d, 77, 200, 4, 1, true)
  end
end
run("f16", 40, 65, 65, 2, 2, true)    -- a padded head dim

-- the flash kernels' variants: plain kernels with a window and sinks; the
-- extended ones with softcap and ALiBi, and with variable lengths
local sink4 = ft.tensor({ 0.5, -1, 2, 0 }, { dtype = "f32", device = "cuda" })
local lens = { { 70, 90 }, { 0, 5 }, { 9, 0 }, { 1, 1 }, { 130, 67 } }
local offq, offk = { 0 }, { 0 }
for b, l in ipairs(lens) do offq[b + 1], offk[b + 1] = offq[b] + l[1], offk[b] + l[2] end
local cu_q = ft.tensor(offq, { dtype = "i32", device = "cuda" })
local cu_k = ft.tensor(offk, { dtype = "i32", device = "cuda" })
local slopes_bh = ft.tensor({ { 0.5, 0.25, 0.1, 0 }, { 0.3, 0.2, 0.1, 0.05 }, { 0, 0, 0, 0 },
                              { 1, 1, 1, 1 }, { 0.01, 0.02, 0.03, 0.04 } },
                            { dtype = "f32", device = "cuda" })
local function run_flash(dtype, d, q, k, v, opts)
  opts.impl = "flash"
  local out, lse = ft.attention(q, k, v, opts)
  local g = { ft.attention_backward(input(out.shape, dtype), q, k, v, out, lse, opts) }
  opts.impl = "naive"
  local ref = ft.attention(q, k, v, opts)
  local diff = ft.max_abs_diff(out:float(), ref:float())
  if not (diff < 0.1) then error(("%s d=%d variants: |flash - naive| = %g"):format(dtype, d, diff)) end
  assert(g[1].dtype == dtype)
  calls = calls + 1
end
for _, dtype in ipairs { "f16", "bf16", "f32" } do
  for _, d in ipairs { 32, 128, 256 } do
    local q = input({ 2, 77, 4, d }, dtype)
    local k, v = input({ 2, 90, 2, d }, dtype), input({ 2, 90, 2, d }, dtype)
    run_flash(dtype, d, q, k, v, { window_left = 20, window_right = 5, sink = sink4 })
    run_flash(dtype, d, q, k, v, { causal = true, softcap = 4, alibi_slopes = sink4:abs() })
    local tq, tk = offq[#offq], offk[#offk]
    q, k, v = input({ tq, 4, d }, dtype), input({ tk, 2, d }, dtype), input({ tk, 2, d }, dtype)
    run_flash(dtype, d, q, k, v, { cu_seqlens_q = cu_q, cu_seqlens_k = cu_k, causal = true,
                                   window_left = 30, softcap = 6, alibi_slopes = slopes_bh,
                                   sink = sink4 })
    run_flash(dtype, d, q, k, v, { cu_seqlens_q = cu_q, cu_seqlens_k = cu_k })
  end
end
-- the variants (the naive path runs them on CUDA), every one at once
local slopes = ft.tensor({ 0.5, 0.25, 0.125, 0.0625 }, { dtype = "f32", device = "cuda" })
local sink = ft.tensor({ 0.5, -1, 2, 0 }, { dtype = "f32", device = "cuda" })
for _, dtype in ipairs { "f32", "bf16", "f64" } do
  local q = input({ 2, 50, 4, 32 }, dtype)
  local k, v = input({ 2, 70, 2, 32 }, dtype), input({ 2, 70, 2, 32 }, dtype)
  local opts = { causal = true, window_left = 20, softcap = 3, alibi_slopes = slopes, sink = sink,
                 dropout_p = 0.1, seed = 5 }
  local out, lse = ft.attention(q, k, v, opts)
  local dq, dk, dv, dsink = ft.attention_backward(input(out.shape, dtype), q, k, v, out, lse, opts)
  assert(dq.dtype == dtype and dsink.dtype == "f32")
  ft.attention_dropout_mask(2, 4, 50, 70, { dropout_p = 0.1, seed = 5, device = "cuda" })
  calls = calls + 1
end
-- decoding (the split-KV kernel): ragged cache lengths with k_new appended
-- in place, GQA, one CTA's rows (16) and more (WR 4), splits merged in the
-- split kernel and by the merge kernel, contiguous and paged (pages of 64
-- rows over the same storage); with the copying warps (the default on
-- sm_90) and without them (FT_NO_DECODE_WS), which must agree bit for bit
local function decode(dtype, d, nq, h, hk, splits, cap)
  local B = 3
  local kc, vc = input({ B, cap, hk, d }, dtype), input({ B, cap, hk, d }, dtype)
  local q = input({ B, nq, h, d }, dtype)
  local knew, vnew = input({ B, nq, hk, d }, dtype), input({ B, nq, hk, d }, dtype)
  local lensv = { 0, 200, cap - nq }
  local lens = ft.tensor(lensv, { dtype = "i32", device = "cuda" })
  local pages = math.floor(cap / 64)
  local tbl = {}
  for b = 1, B do
    tbl[b] = {}
    for i = 1, pages do tbl[b][i] = (b - 1) * (pages) + i end
  end
  tbl = ft.tensor(tbl, { dtype = "i32", device = "cuda" })
  local function call(ws, paged)
    ft.set_switch("FT_NO_DECODE_WS", not ws)
    local opts = { causal = true, cache_seqlens = lens, k_new = knew, v_new = vnew,
                   num_splits = splits }
    local k, v = kc, vc
    if paged then
      k, v = kc:view({ B * pages, 64, hk, d }), vc:view({ B * pages, 64, hk, d })
      opts.block_table = tbl
    end
    local out, lse = ft.attention(q, k, v, opts)
    ft.set_switch("FT_NO_DECODE_WS", nil)
    return out, lse
  end
  local o1, l1 = call(true, false)
  for _, form in ipairs { { false, false }, { true, true }, { false, true } } do
    local o2, l2 = call(form[1], form[2])
    if ft.max_abs_diff(o1, o2) ~= 0 or ft.max_abs_diff(l1, l2) ~= 0 then
      error(("decode %s d=%d nq=%d splits=%d: the forms differ"):format(dtype, d, nq, splits))
    end
  end
  -- against the flash kernels over each sequence's valid prefix
  for b = 1, B do
    local n = lensv[b] + nq
    local ref = ft.attention(q:narrow(1, b, 1), kc:narrow(1, b, 1):narrow(2, 1, n),
                             vc:narrow(1, b, 1):narrow(2, 1, n), { causal = true })
    local diff = ft.max_abs_diff(o1:narrow(1, b, 1):float(), ref:float())
    if not (diff < 0.05) then
      error(("decode %s d=%d nq=%d splits=%d: |decode - flash| = %g"):format(dtype, d, nq, splits, diff))
    end
  end
  calls = calls + 1
end
-- The flash kernels' switches (gpu-check's other modes) do not change the
-- decoding kernel: it runs in the default mode only.
local flash_mode = false
for _, name in ipairs { "FT_NO_WGMMA", "FT_NO_WS", "FT_WS", "FT_TURNS" } do
  flash_mode = flash_mode or ft.switch(name)
end
if not flash_mode then
  for _, dtype in ipairs { "bf16", "f16" } do
    for _, d in ipairs { 64, 128, 256 } do
      decode(dtype, d, 1, 8, 2, 0, 512)     -- 4 rows a kv head, automatic splits
      decode(dtype, d, 5, 8, 2, 3, 512)     -- 20 rows (WR 4), merged in the split kernel
    end
  end
  decode("bf16", 128, 1, 4, 4, 140, 9216)  -- more splits than the split kernel merges
  -- fp8_e4m3 at head dim 128: the fp8 tensor-core kernel on Hopper (V's
  -- transposing pass included), against the bf16 route loosely; the last
  -- two have more tiles than an H100 or H200 has SMs (the persistent
  -- walk's rounds; in the last, the first rows of each head see no key)
  for _, c in ipairs { { 300, 300, 4, 2, true }, { 65, 700, 4, 1, false }, { 200, 129, 2, 2, true },
                       { 200, 200, 36, 12, true }, { 300, 100, 24, 24, true } } do
    local function f8(shape, s) return ft.randn(shape, { seed = seed + s }):to("fp8_e4m3"):cuda() end
    seed = seed + 3
    local q, k, v = f8({ 2, c[1], c[3], 128 }, 1), f8({ 2, c[2], c[4], 128 }, 2), f8({ 2, c[2], c[4], 128 }, 3)
    local o = ft.attention(q, k, v, { causal = c[5] })
    ft.set_switch("FT_NO_FP8_MMA", true)
    local ob = ft.attention(q, k, v, { causal = c[5] })
    ft.set_switch("FT_NO_FP8_MMA", nil)
    local diff = ft.max_abs_diff(o:to("f32"), ob:to("f32"))
    if not (diff < 0.5) then
      error(("fp8 Nq=%d Nk=%d: |fp8 kernel - bf16 route| = %g"):format(c[1], c[2], diff))
    end
    calls = calls + 1
  end
end
run("f32", 64, 70, 90, 2, 2, true)    -- the f32 path
run("f32", 24, 33, 33, 2, 1, false)
ft.cuda.synchronize()
print(("sanitize-attention.lua: %d configurations, forward and backward, passed"):format(calls))
