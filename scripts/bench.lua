-- flashtile's attention benchmark.
--
--   lua scripts/bench.lua [options]         (scripts/ftlua scripts/bench.lua from a build tree)
--
-- For each configuration (dtype x head dim x seqlen x causal x pass x impl)
-- it first checks the result against a reference (a wrong kernel never gets
-- a time), then times it (CUDA events, warm-up, median), and prints a table:
-- milliseconds, TFLOP/s (FlashAttention's FLOP count), peak extra memory,
-- and the ratio to the reference file's rows for the same configuration.
-- It writes a CSV and an SVG plot of TFLOP/s against seqlen.
--
-- Options (comma-separated lists):
--   --dtype f16,bf16        --hdim 64,128           --seqlen 1024,4096,16384
--   --causal false,true     --pass fwd,bwd          --impl flash
--   --tokens 16384          batch = tokens / seqlen
--   --width 2048            heads = width / head dim
--   --reference FILE        a CSV like ../shared/anchors/sdpa-h200.csv
--   --csv FILE              (default bench-results.csv)
--   --plot FILE             (default bench-results.svg)
--   --warmup 5 --reps 20    --device cuda
--   --no-check              skip the correctness check (not for published numbers)
local ft = require "flashtile"
local bench = require "flashtile.bench"

-- ---- options ----------------------------------------------------------------

local opts = {
  dtype = "f16,bf16", hdim = "64,128", seqlen = "1024,4096,16384", causal = "false,true",
  pass = "fwd,bwd", impl = "flash", tokens = "16384", width = "2048", reference = nil,
  csv = "bench-results.csv", plot = "bench-results.svg", warmup = "5", reps = "20",
  device = nil, check = true,
}
do
  local i = 1
  while arg and i <= #arg do
    local a = arg[i]
    if a == "--no-check" then
      opts.check = false
      i = i + 1
    elseif a == "-h" or a == "--help" then
      io.write((io.open(arg[0]):read("a"):match("^(.-)\nlocal ft")):gsub("%-%- ?", ""), "\n")
      os.exit(0)
    else
      local key = a:match("^%-%-(.+)$")
      if not key or opts[key] == nil and key ~= "reference" and key ~= "device" then
        io.stderr:write(("bench.lua: unknown option '%s' (try --help)\n"):format(a))
        os.exit(2)
      end
      if arg[i + 1] == nil then
        io.stderr:write(("bench.lua: option '%s' needs a value\n"):format(a))
        os.exit(2)
      end
      opts[key] = arg[i + 1]
      i = i + 2
    end
  end
end

local function list(s, conv)
  local r = {}
  for x in s:gmatch("[^,]+") do
    if conv then r[#r + 1] = conv(x) else r[#r + 1] = x end
  end
  return r
end
local function bool(x)
  if x == "true" then return true elseif x == "false" then return false end
  error("expected true or false, got " .. x)
end

local device = opts.device or (ft.cuda.is_available() and "cuda" or "cpu")
local on_gpu = device ~= "cpu"
local dtypes, hdims, seqlens = list(opts.dtype), list(opts.hdim, tonumber), list(opts.seqlen, tonumber)
local causals, passes, impls = list(opts.causal, bool), list(opts.pass), list(opts.impl)
local tokens, width = tonumber(opts.tokens), tonumber(opts.width)
local timing = { warmup = tonumber(opts.warmup), reps = tonumber(opts.reps), device = on_gpu and device or nil }

-- ---- the reference numbers ------------------------------------------------------

local TORCH_DTYPE = { f16 = "float16", bf16 = "bfloat16", f32 = "float32" }
local reference = {}
if opts.reference then
  local f = assert(io.open(opts.reference), "cannot open " .. opts.reference)
  local header = list(f:read("l"))
  for line in f:lines() do
    local row = {}
    for i, v in ipairs(list(line)) do row[header[i]] = v end
    local key = table.concat({ row.impl, row.dtype, row.N, row.d, row.causal }, "/")
    reference[key] = row
  end
  f:close()
end
--- The reference TFLOP/s for a configuration (matched on impl, dtype,
-- seqlen, head dim, causal; the batch and heads follow from the tokens and
-- width, as in the reference file). A bf16 configuration the file lacks is
-- compared with the f16 row, and flagged: proxy = true.
local function ref_tflops(impl, dtype, N, d, causal, pass)
  local col = pass == "fwd" and "fwd_tflops" or "bwd_tflops"
  local function get(dt)
    local row = reference[table.concat({ impl, TORCH_DTYPE[dt] or dt, N, d, tostring(causal) }, "/")]
    return row and tonumber(row[col]) or nil
  end
  local r = get(dtype)
  if r or dtype ~= "bf16" then return r, false end
  r = get("f16")
  return r, r ~= nil
end

-- ---- one configuration ----------------------------------------------------------

local function sync() if on_gpu then ft.cuda.synchronize() end end

--- Peak bytes allocated during fn beyond what was in use before.
local function peak_extra(fn)
  collectgarbage()
  sync()
  ft.reset_peak_memory(device)
  local before = ft.memory_stats(device).in_use
  local r = table.pack(fn())
  sync()
  return ft.memory_stats(device).peak - before, table.unpack(r, 1, r.n)
end

local FLOOR = { f16 = 2^-10, bf16 = 2^-7, f32 = 2^-21 }

--- Checks impl against the naive path on a slice (one batch, up to two kv
-- groups' heads) by DESIGN.md's standard: the error against an f32 naive
-- reference is at most twice that of the naive path in the same precision.
-- Returns nil when fine, else a message.
local function check(impl, dtype, q, k, v, dout, causal, pass)
  local H, Hk = q:size(3), k:size(3)
  local hq = math.min(H, 2 * (H // Hk))
  local hk = math.max(1, hq // (H // Hk))
  local qs, ks, vs, ds = q:narrow(1, 1, 1):narrow(3, 1, hq), k:narrow(1, 1, 1):narrow(3, 1, hk),
    v:narrow(1, 1, 1):narrow(3, 1, hk), dout:narrow(1, 1, 1):narrow(3, 1, hq)
  local function run(which, dt)
    local o = { impl = which, causal = causal }
    local a, b, c = qs:to(dt), ks:to(dt), vs:to(dt)
    local out, lse = ft.attention(a, b, c, o)
    if pass == "fwd" then return { out } end
    return { ft.attention_backward(ds:to(dt), a, b, c, out, lse, o) }
  end
  local ref = run("naive", "f32")
  local got = run(impl, dtype)
  local base = run("naive", dtype)
  for i = 1, #ref do
    local e = ft.max_abs_diff(got[i]:float(), ref[i])
    local eb = ft.max_abs_diff(base[i]:float(), ref[i])
    if e ~= e then return "NaN in the result" end
    if e > 2 * eb + 4 * (FLOOR[dtype] or 0) then
      return ("error %.3e > 2 x naive's %.3e (output %d)"):format(e, eb, i)
    end
  end
end

local function measure(impl, dtype, d, N, causal, pass)
  local B, H = math.max(1, tokens // N), math.max(1, width // d)
  local seed = 1
  local function input(shape)
    seed = seed + 1
    return ft.randn(shape, { dtype = dtype, seed = seed, device = device })
  end
  local q, k, v, dout = input { B, N, H, d }, input { B, N, H, d }, input { B, N, H, d }, input { B, N, H, d }
  local o = { impl = impl, causal = causal }
  local row = { impl = impl, dtype = dtype, B = B, H = H, N = N, d = d, causal = causal, pass = pass }
  if opts.check and impl ~= "naive" then
    local bad = check(impl, dtype, q, k, v, dout, causal, pass)
    if bad then row.error = bad return row end
  end
  local out, lse = ft.attention(q, k, v, o)
  local fn
  if pass == "fwd" then
    fn = function() return ft.attention(q, k, v, o) end
  else
    fn = function() return ft.attention_backward(dout, q, k, v, out, lse, o) end
  end
  row.peak = peak_extra(fn)
  local r = bench.run(fn, timing)
  row.ms = r.median
  row.tflops = bench.tflops(bench.attention_flops(B, H, N, N, d, causal, pass), r.median)
  local rf, proxy = ref_tflops("flash", dtype, N, d, causal, pass)
  local rc = ref_tflops("cudnn", dtype, N, d, causal, pass)
  row.ref_flash = rf and row.tflops / rf or nil
  row.ref_cudnn = rc and row.tflops / rc or nil
  row.proxy = proxy
  for _, t in ipairs { q, k, v, dout, out, lse } do t:free() end
  return row
end

-- ---- run everything -------------------------------------------------------------

local rows = {}
local total = #impls * #dtypes * #hdims * #seqlens * #causals * #passes
io.stderr:write(("flashtile bench on %s (%s): %d configurations\n"):format(device,
  on_gpu and ft.cuda.device_name(0) or "cpu", total))
-- An untimed pass over the first configuration: the GPU leaves its idle
-- clocks and the memory pool fills before the first row is timed (without
-- it the first row read up to 20% low on the H200).
if on_gpu then
  io.stderr:write("warming up\n")
  pcall(measure, impls[1], dtypes[1], hdims[1], seqlens[1], causals[1], passes[1])
end
for _, impl in ipairs(impls) do
  for _, dtype in ipairs(dtypes) do
    for _, d in ipairs(hdims) do
      for _, causal in ipairs(causals) do
        for _, pass in ipairs(passes) do
          for _, N in ipairs(seqlens) do
            local ok, row = pcall(measure, impl, dtype, d, N, causal, pass)
            if not ok then
              row = { impl = impl, dtype = dtype, d = d, N = N, causal = causal, pass = pass,
                      B = math.max(1, tokens // N), H = math.max(1, width // d), error = tostring(row) }
            end
            rows[#rows + 1] = row
            io.stderr:write(("[%d/%d] %s %s d=%d N=%d causal=%s %s: %s\n"):format(#rows, total, impl,
              dtype, d, N, tostring(causal), pass,
              row.error and ("FAILED " .. row.error) or ("%.3f ms, %.1f TFLOP/s"):format(row.ms, row.tflops)))
          end
        end
      end
    end
  end
end

-- ---- table, CSV, plot -----------------------------------------------------------

local function fmt_ratio(x, proxy) return x and ("%.2fx%s"):format(x, proxy and "*" or "") or "-" end
print(("\n%s, %s, %s"):format(on_gpu and ft.cuda.device_name(0) or "cpu", os.date("!%Y-%m-%d"),
  opts.reference and ("ratios against " .. opts.reference) or "no reference file"))
print("| impl | dtype | B | H | N | d | causal | pass | ms | TFLOP/s | peak MiB | vs flash | vs cudnn |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for _, r in ipairs(rows) do
  if r.error then
    print(("| %s | %s | %d | %d | %d | %d | %s | %s | FAILED: %s | | | | |"):format(r.impl, r.dtype,
      r.B, r.H, r.N, r.d, tostring(r.causal), r.pass, r.error))
  else
    print(("| %s | %s | %d | %d | %d | %d | %s | %s | %.3f | %s | %.1f | %s | %s |"):format(r.impl,
      r.dtype, r.B, r.H, r.N, r.d, tostring(r.causal), r.pass, r.ms,
      r.tflops >= 1 and ("%.1f"):format(r.tflops) or ("%.4f"):format(r.tflops), r.peak / 2^20,
      fmt_ratio(r.ref_flash, r.proxy), fmt_ratio(r.ref_cudnn, r.proxy)))
  end
end

print("(* : no bf16 row in the reference file; compared with the f16 row of the same configuration)")

local csv = assert(io.open(opts.csv, "w"))
csv:write("impl,dtype,B,H,N,d,causal,pass,ms,tflops,peak_bytes,ratio_flash,ratio_cudnn,error\n")
for _, r in ipairs(rows) do
  csv:write(table.concat({ r.impl, r.dtype, r.B, r.H, r.N, r.d, tostring(r.causal), r.pass,
    r.ms and ("%.4f"):format(r.ms) or "", r.tflops and ("%.2f"):format(r.tflops) or "",
    r.peak or "", r.ref_flash and ("%.3f"):format(r.ref_flash) or "",
    r.ref_cudnn and ("%.3f"):format(r.ref_cudnn) or "", r.error and ('"' .. r.error:gsub('"', "'") .. '"') or "" }, ","), "\n")
end
csv:close()

-- SVG: TFLOP/s against log2(seqlen), one line per configuration; the
-- reference flash numbers dashed in the same colour.
local series, order = {}, {}
for _, r in ipairs(rows) do
  if r.tflops then
    local key = ("%s %s d=%d%s %s"):format(r.impl, r.dtype, r.d, r.causal and " causal" or "", r.pass)
    if not series[key] then series[key] = { pts = {}, ref = {} } order[#order + 1] = key end
    table.insert(series[key].pts, { r.N, r.tflops })
    local rf = ref_tflops("flash", r.dtype, r.N, r.d, r.causal, r.pass)
    if rf then table.insert(series[key].ref, { r.N, rf }) end
  end
end
local W, Hp, L, R, T, Bm = 900, 520, 70, 260, 40, 50
local ymax, xmin, xmax = 1, math.huge, -math.huge
for _, key in ipairs(order) do
  for _, set in ipairs { series[key].pts, series[key].ref } do
    for _, p in ipairs(set) do
      ymax = math.max(ymax, p[2])
      xmin, xmax = math.min(xmin, math.log(p[1], 2)), math.max(xmax, math.log(p[1], 2))
    end
  end
end
if xmax <= xmin then xmin, xmax = xmin - 1, xmax + 1 end
ymax = math.ceil(ymax / 100) * 100
local function X(n) return L + (math.log(n, 2) - xmin) / (xmax - xmin) * (W - L - R) end
local function Y(t) return Hp - Bm - t / ymax * (Hp - T - Bm) end
local colors = { "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd" }
local svg = { ('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">'):format(W, Hp),
  ('<rect width="%d" height="%d" fill="white"/>'):format(W, Hp),
  ('<text x="%d" y="24" font-size="15">flashtile attention on %s, %s (dashed: reference flash)</text>'):format(L,
    on_gpu and ft.cuda.device_name(0) or "cpu", os.date("!%Y-%m-%d")) }
for t = 0, ymax, ymax / 5 do
  svg[#svg + 1] = ('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/><text x="%d" y="%.1f" text-anchor="end">%d</text>')
    :format(L, Y(t), W - R, Y(t), L - 6, Y(t) + 4, t)
end
for _, N in ipairs(seqlens) do
  svg[#svg + 1] = ('<text x="%.1f" y="%d" text-anchor="middle">%d</text>'):format(X(N), Hp - Bm + 18, N)
end
svg[#svg + 1] = ('<text x="%d" y="%d" text-anchor="middle">seqlen</text>'):format((L + W - R) // 2, Hp - 12)
svg[#svg + 1] = ('<text x="16" y="%d" transform="rotate(-90 16 %d)" text-anchor="middle">TFLOP/s</text>')
  :format((T + Hp - Bm) // 2, (T + Hp - Bm) // 2)
for i, key in ipairs(order) do
  local c = colors[(i - 1) % #colors + 1]
  for _, which in ipairs { "pts", "ref" } do
    local pts = {}
    for _, p in ipairs(series[key][which]) do pts[#pts + 1] = ("%.1f,%.1f"):format(X(p[1]), Y(p[2])) end
    if #pts > 0 then
      svg[#svg + 1] = ('<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>'):format(c,
        which == "ref" and ' stroke-dasharray="5,4"' or "", table.concat(pts, " "))
    end
  end
  svg[#svg + 1] = ('<text x="%d" y="%d" fill="%s">%s</text>'):format(W - R + 10, T + 14 * i, c, key)
end
svg[#svg + 1] = "</svg>"
local f = assert(io.open(opts.plot, "w"))
f:write(table.concat(svg, "\n"), "\n")
f:close()
io.stderr:write(("wrote %s and %s\n"):format(opts.csv, opts.plot))
local failed = 0
for _, r in ipairs(rows) do if r.error then failed = failed + 1 end end
os.exit(failed == 0 and 0 or 1)
