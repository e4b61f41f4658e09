-- flashtile's attention benchmark: `lua scripts/bench.lua --help` prints
-- how to run it (the text of HELP below). Runs under Lua 5.1 to 5.4 and
-- LuaJIT; from a clone it finds flashtile in lua/ and build/ (or
-- $FT_BUILD_DIR) by itself (scripts/lib/paths.lua).

local HELP = [[
usage: lua scripts/bench.lua [options]

flashtile's attention benchmark. For each configuration (impl x dtype x
head dim x causal x pass x seqlen) it first checks the result against the
naive path on a slice of the same inputs (a wrong kernel never gets a
time), then times it (median of --reps runs after --warmup runs; CUDA
events on the GPU, the wall clock on the CPU) and prints a table:
milliseconds, TFLOP/s (FlashAttention's FLOP count), peak extra memory,
and the ratio to the rows of a reference file for the same configuration.
With two or more implementations it also gives each row's speed against
the last one listed, timed in the same run (--impl flash,cudnn: the flash
kernels against cuDNN's fused attention, flash/cudnn), and for each
other implementation and pass the lowest, median and highest of those
ratios. It writes a CSV and an SVG plot of TFLOP/s against seqlen.

The benchmark is made for a CUDA GPU. Without one (no GPU, or flashtile
built without CUDA) it stops at once with one line and exit status 1,
unless --device cpu is given: then it times the CPU implementations
(tiled and naive) instead, with smaller defaults (after the | below).

Options (LIST: comma-separated values, e.g. --hdim 64,128):
  --device DEVICE    cuda, cuda:N or cpu (default cuda)
  --impl LIST        flash, naive, cudnn (cuDNN's fused attention, in a
                     build with cuDNN) on cuda; tiled, naive on cpu
                     (default flash | tiled,naive); rows are also put
                     against the last one of the list, in this run;
                     IMPL+SWITCH takes IMPL with a kernel switch on
                     (ft.set_switch; several: flash+FT_WS+FT_PERSIST),
                     e.g. --impl flash+FT_NO_PERSIST,flash compares the
                     kernels in one process; the implementations and
                     variants of a configuration are timed one after the
                     other
  --dtype LIST       f16, bf16, f32, fp8_e4m3 (default f16,bf16 | f32;
                     fp8_e4m3: forward rows only, q, k and v drawn in bf16
                     and rounded to e4m3, checked against f32 attention of
                     those values within e4m3's rounding of P)
  --hdim LIST        head dims (default 64,128 | 64)
  --seqlen LIST      sequence lengths (default 1024,4096,16384 | 256,1024)
  --causal LIST      false, true (default false,true)
  --variant LIST     none, window:W (window_left = W), alibi (the paper's
                     slopes), softcap:C, sink, dropout:P, varlen (16
                     sequences of mixed length, N / 32 to 4 N, 16 N tokens
                     in all, packed with cu_seqlens; compare with none at
                     --tokens 16N), lua:V for none, window:W, alibi or
                     softcap:C written in Lua (ft.attention_mods, mod
                     tensors' gradients off; lua:alibi+grad takes the
                     slopes' gradient) (default none); TFLOP/s
                     count the visible scores only
  --pass LIST        fwd, bwd (default fwd,bwd)
  --tokens N         batch = tokens / seqlen (default 16384 | 2048)
  --width N          heads = width / head dim (default 2048 | 256)
  --warmup N         untimed runs before the timed ones (default 5 | 1)
  --reps N           timed runs, of which the median counts (default 20 | 5)
  --rounds N         times each configuration's implementations and
                     variants N times over, in the opposite order every
                     other round, and takes each row's median round, so
                     that a drift of the clock over the run favours none
                     of them (default 1); the check runs in the first
  --reference FILE   ratios against this CSV's flash and cudnn rows,
                     e.g. --reference bench/sdpa-h200.csv
  --csv FILE         the results as CSV (default bench-results.csv)
  --plot FILE        the SVG plot (default bench-results.svg)
  --no-check         skip the correctness check (not for published numbers)
  --decode           instead: decoding with a KV cache (one query row, GQA
                     32/8, head dim 128; B x Nk = 1x32768, 16x8192, 64x4096,
                     8x131072 | 1x4096, 4x2048, 1x32768), the cache read in GB/s
                     against a device-to-device copy timed in the same run,
                     contiguous and paged (page size 64); takes --dtype
                     (the first; default bf16 | f32), --impl (each with its
                     kernel switches, timed in turn: flash+FT_NO_DECODE,flash),
                     --warmup, --reps, --csv, and on cuda --splits LIST (the
                     decoding kernel's num_splits, 0: chosen from the shape;
                     default 0), a row each
  --ring             instead: ring attention over the first two CUDA devices
                     (one process, ft.dist.init{devices = {0, 1}}) against
                     attention of the whole sequence on one; 16 heads, head
                     dim 128, batch 1, N = --seqlen (default 32768, 131072,
                     524288), causal and not, forward and backward; the
                     scaling efficiency (one GPU's time / (2 x ring's)) and
                     the time the ring spends beyond its kernels (the same
                     ring with every exchange left out); takes --dtype,
                     --warmup, --reps, --csv
  --help, -h         this text

Exit status: 0 when every row ran, 1 when a row failed (its error is in
the table) or no GPU is there for a GPU run, 2 for a bad option.

Examples:
  lua scripts/bench.lua --dtype f16,bf16 --hdim 64,128 --reference bench/sdpa-h200.csv
  lua scripts/bench.lua --impl flash,cudnn --hdim 64,128
  lua scripts/bench.lua --device cpu --seqlen 128,256,512
]]

local unpack = table.unpack or unpack
local function pack(...) return { n = select("#", ...), ... } end
local function is_int(v) return type(v) == "number" and v == math.floor(v) end
local function log2(x) return math.log(x) / math.log(2) end

local function die(status, fmt, ...)
  io.stderr:write("bench.lua: ", fmt:format(...), "\n")
  os.exit(status)
end

-- ---- options ----------------------------------------------------------------

-- defaults on the GPU and on the CPU (a size that runs in about a minute on
-- two cores)
local GPU_DEFAULTS = {
  impl = "flash", dtype = "f16,bf16", hdim = "64,128", seqlen = "1024,4096,16384",
  causal = "false,true", pass = "fwd,bwd", tokens = "16384", width = "2048", warmup = "5", reps = "20",
  variant = "none", rounds = "1",
}
local CPU_DEFAULTS = {
  impl = "tiled,naive", dtype = "f32", hdim = "64", seqlen = "256,1024",
  causal = "false,true", pass = "fwd,bwd", tokens = "2048", width = "256", warmup = "1", reps = "5",
  variant = "none", rounds = "1",
}
local VALUED = { device = true, reference = true, csv = true, plot = true, splits = true }
for k in pairs(GPU_DEFAULTS) do VALUED[k] = true end

local given = { check = true }
do
  local args = arg or {}
  local i = 1
  while args[i] ~= nil do
    local a = args[i]
    if a == "-h" or a == "--help" then
      io.write(HELP)
      os.exit(0)
    elseif a == "--no-check" then
      given.check = false
      i = i + 1
    elseif a == "--decode" then
      given.decode = true
      i = i + 1
    elseif a == "--ring" then
      given.ring = true
      i = i + 1
    else
      local key, value = a:match("^%-%-([%w_-]+)=(.*)$")
      if not key then key = a:match("^%-%-([%w_-]+)$") end
      if not key or not VALUED[key] then
        die(2, "unknown option '%s' (try --help)", a)
      end
      if value == nil then
        value = args[i + 1]
        if value == nil then die(2, "option '--%s' needs a value (try --help)", key) end
        i = i + 2
      else
        i = i + 1
      end
      given[key] = value
    end
  end
end

if given.splits and not given.decode then die(2, "--splits goes with --decode") end
local device = given.device or "cuda"
if device ~= "cpu" and device ~= "cuda" and not device:match("^cuda:%d+$") then
  die(2, "--device must be cuda, cuda:N or cpu, got '%s'", device)
end
local on_gpu = device ~= "cpu"
local opts = {}
for k, v in pairs(on_gpu and GPU_DEFAULTS or CPU_DEFAULTS) do opts[k] = given[k] or v end
opts.reference = given.reference
opts.csv = given.csv or "bench-results.csv"
opts.plot = given.plot or "bench-results.svg"
opts.check = given.check

--- The comma-separated values of option key, each checked by conv (which
-- returns the value, or nil when it is not one).
local function list(key, what, conv)
  local r = {}
  for x in opts[key]:gmatch("[^,]+") do
    local v = x
    if conv then v = conv(x) end
    if v == nil then die(2, "--%s: '%s' is not %s", key, x, what) end
    r[#r + 1] = v
  end
  if #r == 0 then die(2, "--%s needs at least one value", key) end
  return r
end
local function one_of(...)
  local set = {}
  for i = 1, select("#", ...) do set[select(i, ...)] = true end
  return function(x) if set[x] then return x end end
end
local function positive_int(x)
  local n = tonumber(x)
  if is_int(n) and n >= 1 then return n end
end
local function nonneg_int(x)
  local n = tonumber(x)
  if is_int(n) and n >= 0 then return n end
end
local function bool(x)
  if x == "true" then return true elseif x == "false" then return false end
end

--- An implementation and the kernel switches it runs with: "flash" or
-- "flash+FT_NO_PERSIST" (the switch's name is checked once flashtile is
-- loaded).
local function split_impl(x)
  local base, rest = x:match("^([^+]+)(.*)$")
  local switches = {}
  for name in (rest or ""):gmatch("%+([^+]*)") do switches[#switches + 1] = name end
  return base, switches
end
local base_impl_of = on_gpu and one_of("flash", "naive", "cudnn") or one_of("tiled", "naive")
local impls = list("impl", on_gpu and "an implementation on cuda (flash, naive, cudnn, each with +SWITCH "
  .. "or not; tiled needs --device cpu)"
  or "an implementation on the cpu (tiled, naive, each with +SWITCH or not; flash and cudnn need a CUDA GPU)",
  function(x) if base_impl_of(split_impl(x) or "") then return x end end)
local dtypes = list("dtype", "a dtype (f16, bf16, f32, fp8_e4m3)", one_of("f16", "bf16", "f32", "fp8_e4m3"))
local hdims = list("hdim", "a positive integer", positive_int)
local seqlens = list("seqlen", "a positive integer", positive_int)
local causals = list("causal", "true or false", bool)
--- A variant: {name =, value =} from "none", "window:W", "alibi",
-- "softcap:C", "sink", "dropout:P" or "varlen".
local variant_of
function variant_of(x)
  -- lua:V: the variant V written as a mod (ft.attention_mods); lua:alibi+grad
  -- also takes the gradient of the slopes it reads
  local inner = x:match("^lua:(.+)$")
  if inner then
    local grad = inner == "alibi+grad"
    local v = variant_of(grad and "alibi" or inner)
    if v and (v.name == "none" or v.name == "window" or v.name == "alibi" or v.name == "softcap") then
      v.lua, v.label, v.grad = true, x, grad
      return v
    end
    return nil
  end
  local name, value = x:match("^(%a+):(.+)$")
  name = name or x
  local n = value and tonumber(value)
  if name == "none" or name == "alibi" or name == "sink" or name == "varlen" then
    if value == nil then return { name = name, label = name } end
  elseif name == "window" then
    if is_int(n) and n >= 0 then return { name = name, value = n, label = x } end
  elseif name == "softcap" then
    if n and n > 0 then return { name = name, value = n, label = x } end
  elseif name == "dropout" then
    if n and n > 0 and n < 1 then return { name = name, value = n, label = x } end
  end
end
local variants = list("variant", "a variant (none, window:W, alibi, softcap:C, sink, dropout:P, varlen, lua:V)",
  variant_of)
local passes = list("pass", "fwd or bwd", one_of("fwd", "bwd"))
local tokens = list("tokens", "a positive integer", positive_int)[1]
local width = list("width", "a positive integer", positive_int)[1]
local warmup = list("warmup", "an integer >= 0", nonneg_int)[1]
local reps = list("reps", "a positive integer", positive_int)[1]
local rounds = list("rounds", "a positive integer", positive_int)[1]


-- ---- flashtile, and the GPU when the run needs one ------------------------------

local ok, ft = pcall(require, "flashtile")
if not ok then
  local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
  ft = dofile(here .. "lib/paths.lua").require("bench.lua", here)
end
local bench = require "flashtile.bench"
--- fn()'s results with impl's kernel switches on, and off again after (an
-- error included).
local function with_switches(impl, fn)
  local _, switches = split_impl(impl)
  for _, name in ipairs(switches) do ft.set_switch(name, true) end
  local r = pack(pcall(fn))
  for _, name in ipairs(switches) do ft.set_switch(name, nil) end
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2, r.n)
end

if on_gpu then
  local why
  if not ft.cuda.is_built() then
    why = "flashtile was built without CUDA"
  elseif not ft.cuda.is_available() then
    why = "no CUDA GPU is available (ft.cuda.is_available() is false)"
  else
    local index = tonumber(device:match("^cuda:(%d+)$") or "0")
    local count = ft.cuda.device_count()
    if index >= count then why = ("there is no %s (%d CUDA device%s)"):format(device, count, count == 1 and "" or "s") end
  end
  if why then
    die(1, "%s; --device cpu times the CPU implementations (tiled, naive) instead", why)
  end
end
local timing = { warmup = warmup, reps = reps, device = on_gpu and device or nil }
do
  local known = {}
  for _, name in ipairs(ft.switch_names()) do known[name] = true end
  for _, impl in ipairs(impls) do
    for _, name in ipairs(select(2, split_impl(impl))) do
      if not known[name] then
        die(2, "--impl: '%s' in '%s' is not a kernel switch (%s)", name, impl,
          table.concat(ft.switch_names(), ", "))
      end
    end
  end
end

-- every file now, not after the run (a file that is not there yet is not
-- left behind)
if opts.reference then
  local f = io.open(opts.reference, "r")
  if not f then die(2, "--reference: cannot open '%s'", opts.reference) end
  f:close()
end
for _, key in ipairs { "csv", "plot" } do
  local path = opts[key]
  local existed = io.open(path, "r")
  if existed then existed:close() end
  local f = io.open(path, "a")
  if not f then die(2, "--%s: cannot write '%s'", key, path) end
  f:close()
  if not existed then os.remove(path) end
end

-- ---- --ring: ring attention over two GPUs --------------------------------------------

if given.ring then
  if not on_gpu or ft.cuda.device_count() < 2 or not ft.dist.built() then
    die(1, "--ring needs two CUDA devices and a build with NCCL (ft.dist.built())")
  end
  local dtype = given.dtype and given.dtype:match("^[^,]+") or "bf16"
  local H, d = 16, 128
  local Ns = {}
  for x in (given.seqlen or "32768,131072,524288"):gmatch("[^,]+") do Ns[#Ns + 1] = tonumber(x) end
  local comm = ft.dist.init { devices = { 0, 1 } }
  local reps_r, warm_r = tonumber(given.reps or 3), tonumber(given.warmup or 1)
  --- Median wall time (ms) of fn with both devices synchronised around it.
  local function wall(fn)
    for _ = 1, warm_r do fn() end
    local ts = {}
    for i = 1, reps_r do
      ft.cuda.synchronize(0); ft.cuda.synchronize(1)
      local t0 = ft.clock()
      fn()
      ft.cuda.synchronize(0); ft.cuda.synchronize(1)
      ts[i] = (ft.clock() - t0) * 1e3
      collectgarbage()
    end
    table.sort(ts)
    return ts[math.floor((#ts + 1) / 2)]
  end
  local rows = {}
  for _, N in ipairs(Ns) do
    for _, causal in ipairs { false, true } do
      local o = { causal = causal }
      local q = ft.randn({ 1, N, H, d }, { dtype = dtype, device = "cuda:0", seed = 1 })
      local k = ft.randn({ 1, N, H, d }, { dtype = dtype, device = "cuda:0", seed = 2 })
      local v = ft.randn({ 1, N, H, d }, { dtype = dtype, device = "cuda:0", seed = 3 })
      local dout = ft.randn({ 1, N, H, d }, { dtype = dtype, device = "cuda:0", seed = 4 })
      local out, lse = ft.attention(q, k, v, o)
      local one_f = wall(function() ft.attention(q, k, v, o) end)
      local one_b = wall(function() ft.attention_backward(dout, q, k, v, out, lse, o) end)
      local function shards(t)
        return { ft.dist.shard(t, 0, 2), ft.dist.shard(t, 1, 2):to("cuda:1") }
      end
      local qs, ks, vs, ds = shards(q), shards(k), shards(v), shards(dout)
      out, lse = nil, nil
      q, k, v, dout = nil, nil, nil, nil
      collectgarbage()
      local ro = { causal = causal }
      local rout, rlse = comm:ring_attention(qs, ks, vs, ro)
      local ring_f = wall(function() comm:ring_attention(qs, ks, vs, ro) end)
      local ring_b = wall(function() comm:ring_attention_backward(ds, qs, ks, vs, rout, rlse, ro) end)
      local nx = { causal = causal, exchange = false }
      local solo_f = wall(function() comm:ring_attention(qs, ks, vs, nx) end)
      local solo_b = wall(function() comm:ring_attention_backward(ds, qs, ks, vs, rout, rlse, nx) end)
      local row = { N = N, causal = causal, one_f = one_f, one_b = one_b, ring_f = ring_f,
                    ring_b = ring_b, wait_f = ring_f - solo_f, wait_b = ring_b - solo_b }
      rows[#rows + 1] = row
      io.stderr:write(("N %d causal %s: one GPU %.2f / %.2f ms, ring %.2f / %.2f ms, efficiency %.2f / %.2f\n")
        :format(N, tostring(causal), one_f, one_b, ring_f, ring_b, one_f / (2 * ring_f), one_b / (2 * ring_b)))
      qs, ks, vs, ds, rout, rlse = nil, nil, nil, nil, nil, nil
      collectgarbage()
    end
  end
  print(("\n%s and %s, %s, %s; ring attention over 2 GPUs (one process, zigzag shards), batch 1, "
    .. "%d heads, head dim %d; wall-clock ms, median of %d"):format(ft.cuda.device_name(0),
    ft.cuda.device_name(1), os.date("!%Y-%m-%d"), dtype, H, d, reps_r))
  print("| N | causal | one GPU fwd / bwd | ring fwd / bwd | efficiency fwd / bwd | beyond the kernels fwd / bwd |")
  print("| --- | --- | --- | --- | --- | --- |")
  local f = io.open(opts.csv, "w")
  if f then f:write("N,causal,dtype,one_fwd_ms,one_bwd_ms,ring_fwd_ms,ring_bwd_ms,wait_fwd_ms,wait_bwd_ms\n") end
  for _, r in ipairs(rows) do
    print(("| %d | %s | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f |"):format(r.N,
      tostring(r.causal), r.one_f, r.one_b, r.ring_f, r.ring_b, r.one_f / (2 * r.ring_f),
      r.one_b / (2 * r.ring_b), r.wait_f, r.wait_b))
    if f then
      f:write(("%d,%s,%s,%.3f,%.3f,%.3f,%.3f,%.3f,%.3f\n"):format(r.N, tostring(r.causal), dtype,
        r.one_f, r.one_b, r.ring_f, r.ring_b, r.wait_f, r.wait_b))
    end
  end
  if f then f:close() end
  comm:free()
  os.exit(0)
end

-- ---- --decode: the KV cache's read rate ------------------------------------------

if given.decode then
  local dtype = given.dtype and given.dtype:match("^[^,]+") or (on_gpu and "bf16" or "f32")
  local esize = ({ f16 = 2, bf16 = 2, f32 = 4 })[dtype]
  if not esize then die(2, "--dtype: '%s' is not f16, bf16 or f32", dtype) end
  local dev = on_gpu and device or "cpu"
  local H, Hk, d, PAGE = 32, 8, 128, 64
  local shapes = on_gpu and { { 1, 32768 }, { 16, 8192 }, { 64, 4096 }, { 8, 131072 } }
                        or { { 1, 4096 }, { 4, 2048 }, { 1, 32768 } }
  local name = on_gpu and ft.cuda.device_name(tonumber(device:match("^cuda:(%d+)$") or "0")) or "cpu"
  local o = { dtype = dtype, device = dev }
  -- the copy: read + write of 2 GiB (256 MiB on the cpu)
  local bytes = on_gpu and 2 ^ 31 or 2 ^ 28
  local src = ft.zeros({ bytes / esize }, o)
  local dst = ft.zeros({ bytes / esize }, o)
  local copy = bench.run(function() dst:copy(src) end, timing)
  local copy_rate = 2 * bytes / (copy.median / 1e3) / 1e9
  src:free(); dst:free()
  io.stderr:write(("decode on %s: copy %.0f GB/s\n"):format(name, copy_rate))
  local results = {}
  -- --impl: each its kernel switches (flash+FT_NO_DECODE,flash), timed in turn
  local decode_impls = given.impl and impls or { "" }
  local splits = { 0 }
  if given.splits then
    if not on_gpu then die(2, "--splits: the CPU's decoding chunks come from the shape (num_splits is the CUDA kernel's)") end
    opts.splits = given.splits
    splits = list("splits", "an integer from 0 to 4096",
      function(x) local n = nonneg_int(x); if n and n <= 4096 then return n end end)
  end
  for _, sh in ipairs(shapes) do
    local B, N = sh[1], sh[2]
    local kc = ft.randn({ B, N, Hk, d }, { dtype = dtype, device = dev, seed = 1 })
    local vc = ft.randn({ B, N, Hk, d }, { dtype = dtype, device = dev, seed = 2 })
    local q = ft.randn({ B, 1, H, d }, { dtype = dtype, device = dev, seed = 3 })
    local kn = ft.randn({ B, 1, Hk, d }, { dtype = dtype, device = dev, seed = 4 })
    local vn = ft.randn({ B, 1, Hk, d }, { dtype = dtype, device = dev, seed = 5 })
    -- lengths and pages on the host: the call checks them there, with no wait on the device
    local lens = ft.full({ B }, N - 1, { dtype = "i32" })
    local a = { causal = true, cache_seqlens = lens, k_new = kn, v_new = vn }
    -- the same caches as page pools, each sequence's pages in order
    local pages = ft.arange(1, B * N / PAGE + 1, { dtype = "i32" }):view(B, N / PAGE)
    local kp, vp = kc:view(B * N / PAGE, PAGE, Hk, d), vc:view(B * N / PAGE, PAGE, Hk, d)
    local ap = { causal = true, cache_seqlens = lens, k_new = kn, v_new = vn, block_table = pages }
    local kv = 2 * B * N * Hk * d * esize
    for _, impl in ipairs(decode_impls) do
      for _, ns in ipairs(splits) do
        a.num_splits, ap.num_splits = ns, ns
        local r, rp = with_switches(impl, function()
          return bench.run(function() return ft.attention(q, kc, vc, a) end, timing),
            bench.run(function() return ft.attention(q, kp, vp, ap) end, timing)
        end)
        local row = { B = B, N = N, impl = impl, splits = ns, ms = r.median, rate = kv / (r.median / 1e3) / 1e9,
                      paged_ms = rp.median, paged_rate = kv / (rp.median / 1e3) / 1e9 }
        results[#results + 1] = row
        io.stderr:write(("B %d Nk %d%s%s: %.3f ms, %.0f GB/s; paged %.3f ms\n"):format(B, N,
          impl ~= "" and " " .. impl or "", given.splits and " splits " .. ns or "", row.ms, row.rate,
          row.paged_ms))
      end
    end
    kc:free(); vc:free()
  end
  print(("\n%s, %s, %s; decoding: 1 query row, %d/%d heads, head dim %d, causal; a "
    .. "device-to-device copy in the same run: %.0f GB/s (%s, read + write)"):format(name,
    os.date("!%Y-%m-%d"), dtype, H, Hk, d, copy_rate, on_gpu and "2 GiB" or "256 MiB"))
  -- the impl and splits columns only where asked for
  local named, split_col = given.impl ~= nil, given.splits ~= nil
  local extra = (named and " impl |" or "") .. (split_col and " splits |" or "")
  print(("| B x Nk |%s ms | KV GB/s | of the copy | paged (64) ms | paged GB/s | paged / contiguous |")
    :format(extra))
  print("| --- |" .. extra:gsub("[^|]+|", " --- |") .. " --- | --- | --- | --- | --- | --- |")
  local f = io.open(opts.csv, "w")
  if f then f:write("B,Nk,H,Hk,d,dtype,ms,gbps,of_copy,paged_ms,paged_gbps,copy_gbps,impl,splits\n") end
  for _, r in ipairs(results) do
    print(("| %d x %d |%s%s %.3f | %.0f | %.2f | %.3f | %.0f | %.2f |"):format(r.B, r.N,
      named and " " .. r.impl .. " |" or "", split_col and " " .. r.splits .. " |" or "", r.ms, r.rate,
      r.rate / copy_rate, r.paged_ms, r.paged_rate, r.paged_rate / r.rate))
    if f then
      f:write(("%d,%d,%d,%d,%d,%s,%.4f,%.1f,%.3f,%.4f,%.1f,%.1f,%s,%d\n"):format(r.B, r.N, H, Hk, d, dtype,
        r.ms, r.rate, r.rate / copy_rate, r.paged_ms, r.paged_rate, copy_rate, r.impl, r.splits))
    end
  end
  if f then f:close() end
  os.exit(0)
end

-- ---- the reference numbers ------------------------------------------------------

local TORCH_DTYPE = { f16 = "float16", bf16 = "bfloat16", f32 = "float32" }
local reference = {}
if opts.reference then
  local function fields(line)
    local r = {}
    for x in line:gmatch("[^,]+") do r[#r + 1] = x end
    return r
  end
  local f = assert(io.open(opts.reference))
  local header = fields(f:read("*l") or "")
  for line in f:lines() do
    local row = {}
    for i, v in ipairs(fields(line)) do row[header[i] or i] = v end
    local key = table.concat({ row.impl or "", row.dtype or "", row.N or "", row.d or "", row.causal or "" }, "/")
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

--- ft.attention's options for a variant on H heads (slopes and sinks on
-- the device).
local function variant_opts(impl, causal, var, H, builtin, B, N)
  local o = { impl = impl, causal = causal }
  if var.lua and not builtin then -- check's references take the built-in
    local W, C = var.value, var.value
    local slopes
    if var.name == "alibi" then
      local t = {}
      for i = 1, H do t[i] = 2 ^ (-8 * i / H) end
      slopes = ft.tensor(t, { dtype = "f32", device = device })
    end
    local score, mask
    if var.name == "none" then
      score = function(s) return s end
    elseif var.name == "softcap" then
      score = function(s) return (s / C):tanh() * C end
    elseif var.name == "alibi" then
      score = function(s, b, h, i, j) return s - slopes[h] * (i - j):abs() end
    end
    if var.name == "window" then
      mask = causal and function(b, h, i, j) return ft.all(j:le(i), j:ge(i - W)) end
        or function(b, h, i, j) return j:ge(i - W) end
    elseif causal then
      mask = function(b, h, i, j) return j:le(i) end
    end
    local mods = ft.attention_mods { score = score, mask = mask }
    -- a mask on the GPU: its block mask, made once (the kernels skip the
    -- tiles outside the band it keeps)
    local bm = mask and on_gpu and ft.block_mask(mods, B, H, N, N, { device = device }) or nil
    return { impl = impl, mods = mods, block_mask = bm, mod_grads = var.grad }
  end
  if var.name == "window" then
    o.window_left = var.value
  elseif var.name == "softcap" then
    o.softcap = var.value
  elseif var.name == "dropout" then
    o.dropout_p, o.seed, o.offset = var.value, 1, 0
  elseif var.name == "alibi" then
    local slopes = {}
    for i = 1, H do slopes[i] = 2 ^ (-8 * i / H) end
    o.alibi_slopes = ft.tensor(slopes, { dtype = "f32", device = device })
  elseif var.name == "sink" then
    o.sink = ft.zeros({ H }, { dtype = "f32", device = device })
  end
  return o
end

--- The (query, key) pairs of an N x N attention that a query sees: N^2,
-- about half with causal, fewer under a window (bottom-right aligned).
local function visible_pairs(N, causal, var)
  local left = var.name == "window" and var.value or -1
  if left < 0 then return causal and N * (N + 1) / 2 or N * N end
  local n = 0
  for i = 0, N - 1 do
    local first = math.max(0, i - left)
    local last = causal and i or N - 1
    n = n + (last - first + 1)
  end
  return n
end

local function sync() if on_gpu then ft.cuda.synchronize() end end

--- Peak bytes allocated during fn beyond what was in use before.
local function peak_extra(fn)
  collectgarbage()
  sync()
  ft.reset_peak_memory(device)
  local before = ft.memory_stats(device).in_use
  local r = pack(fn())
  sync()
  return ft.memory_stats(device).peak - before, unpack(r, 1, r.n)
end

local FLOOR = { f16 = 2^-10, bf16 = 2^-7, f32 = 2^-21 }

--- Checks impl against the naive path on a slice (one batch, up to two kv
-- groups' heads) by flashtile's accuracy standard: the error against a reference in
-- a wider dtype (f32 for f16 and bf16, f64 for f32) is at most twice that
-- of the naive path in the same precision. Returns nil when fine, else a
-- message.
local function check(impl, dtype, q, k, v, dout, causal, pass, var)
  if dtype == "fp8_e4m3" then -- f32 attention of the e4m3 values: P's e4m3 rounding at most
    local qs, ks, vs = q:narrow(1, 1, 1), k:narrow(1, 1, 1), v:narrow(1, 1, 1)
    local o = variant_opts(impl, causal, var, q:size(3), false, 1, qs:size(2))
    local got = ft.attention(qs, ks, vs, o)
    o.impl = "naive"
    local ref = ft.attention(qs:to("f32"), ks:to("f32"), vs:to("f32"), o)
    local e, bound = ft.max_abs_diff(got:to("f32"), ref), vs:to("f32"):abs():max() * 2 ^ -4
    if e ~= e or e > bound then return ("fp8 error %.3e > %.3e"):format(e, bound) end
    return nil
  end
  local H, Hk = q:size(3), k:size(3)
  local hq = math.min(H, 2 * math.floor(H / Hk))
  local hk = math.max(1, math.floor(hq / math.floor(H / Hk)))
  local qs, ks, vs, ds = q:narrow(1, 1, 1):narrow(3, 1, hq), k:narrow(1, 1, 1):narrow(3, 1, hk),
    v:narrow(1, 1, 1):narrow(3, 1, hk), dout:narrow(1, 1, 1):narrow(3, 1, hq)
  local function run(which, dt)
    local o = variant_opts(which, causal, var, hq, which == "naive", 1, qs:size(2))
    local a, b, c = qs:to(dt), ks:to(dt), vs:to(dt)
    local out, lse = ft.attention(a, b, c, o)
    if pass == "fwd" then return { out } end
    return { ft.attention_backward(ds:to(dt), a, b, c, out, lse, o) }
  end
  local wide = dtype == "f32" and "f64" or "f32"
  local ref = run("naive", wide)
  local got = run(impl, dtype)
  local base = run("naive", dtype)
  for i = 1, #ref do
    local e = ft.max_abs_diff(got[i]:to(wide), ref[i])
    local eb = ft.max_abs_diff(base[i]:to(wide), ref[i])
    if e ~= e then return "NaN in the result" end
    if e > 2 * eb + 4 * (FLOOR[dtype] or 0) then
      return ("error %.3e > 2 x naive's %.3e (output %d)"):format(e, eb, i)
    end
  end
end

local function shape_of(d, N, var)
  local B = var and var.name == "varlen" and 16 or math.max(1, math.floor(tokens / N))
  return B, math.max(1, math.floor(width / d))
end

--- Times one pass of ft.attention (opts o) into row: peak memory, the
-- median milliseconds, and TFLOP/s for flops.
local function time_pass(row, q, k, v, dout, o, pass, flops)
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
  row.tflops = bench.tflops(flops, r.median)
  out:free()
  lse:free()
end

--- The varlen variant's 16 lengths for a mean of N: from N / 32 to 4 N
-- (64 to 8192 at N = 2048), 16 N tokens in all.
local VARLEN_SHAPE = { 4096, 3072, 2048, 1536, 1280, 1024, 768, 640, 512, 384, 320, 256, 192,
                       160, 64, 32 } -- in 1/1024ths of N; they add up to 16384
local function varlen_lengths(N)
  local lens, total = {}, 0
  for i, x in ipairs(VARLEN_SHAPE) do
    lens[i] = math.max(1, math.floor(x * N / 1024))
    total = total + lens[i]
  end
  lens[1] = lens[1] + 16 * N - total -- the rounding, on the longest
  return lens
end

--- cu_seqlens for lengths (i32, on the device), and the visible pairs.
local function varlen_offsets(lens, causal, var)
  local off, pairs_n = { 0 }, 0
  for i, n in ipairs(lens) do
    off[i + 1] = off[i] + n
    pairs_n = pairs_n + visible_pairs(n, causal, var)
  end
  return ft.tensor(off, { dtype = "i32", device = device }), pairs_n
end

--- measure for the varlen variant: q, k, v [16 N, H, d] packed.
local function measure_varlen(impl, dtype, d, N, causal, pass, var)
  local B, H = shape_of(d, N, var)
  local lens = varlen_lengths(N)
  local cu, visible = varlen_offsets(lens, causal, { name = "none" })
  local total = 16 * N
  local seed = 1
  local function input()
    seed = seed + 1
    return ft.randn({ total, H, d }, { dtype = dtype, seed = seed, device = device })
  end
  local q, k, v, dout = input(), input(), input(), input()
  local o = { impl = impl, causal = causal, cu_seqlens_q = cu, cu_seqlens_k = cu }
  local row = { impl = impl, dtype = dtype, B = B, H = H, N = N, d = d, causal = causal, pass = pass,
                variant = var.label }
  if opts.check and impl ~= "naive" then
    -- the first four sequences (the longest), two heads, against naive
    local n4, hq = 0, math.min(H, 2)
    for i = 1, 4 do n4 = n4 + lens[i] end
    local sub = { 0 }
    for i = 1, 4 do sub[i + 1] = sub[i] + lens[i] end
    local so = { causal = causal, cu_seqlens_q = ft.tensor(sub, { dtype = "i32", device = device }) }
    so.cu_seqlens_k = so.cu_seqlens_q
    local function cut(t) return t:narrow(1, 1, n4):narrow(2, 1, hq) end
    local function run(which, dt)
      so.impl = which
      local a, b, c = cut(q):to(dt), cut(k):to(dt), cut(v):to(dt)
      local out, lse = ft.attention(a, b, c, so)
      if pass == "fwd" then return { out } end
      return { ft.attention_backward(cut(dout):to(dt), a, b, c, out, lse, so) }
    end
    local wide = dtype == "f32" and "f64" or "f32"
    local ref, got, base = run("naive", wide), run(impl, dtype), run("naive", dtype)
    for i = 1, #ref do
      local e = ft.max_abs_diff(got[i]:to(wide), ref[i])
      local eb = ft.max_abs_diff(base[i]:to(wide), ref[i])
      if e ~= e or e > 2 * eb + 4 * (FLOOR[dtype] or 0) then
        row.error = ("error %.3e > 2 x naive's %.3e (output %d)"):format(e, eb, i)
        return row
      end
    end
  end
  time_pass(row, q, k, v, dout, o, pass, bench.attention_flops(1, H, 1, 1, d, false, pass) * visible)
  for _, t in ipairs { q, k, v, dout, cu } do t:free() end
  return row
end

local function measure(impl, dtype, d, N, causal, pass, var)
  if var.name == "varlen" and dtype == "fp8_e4m3" then
    return { impl = impl, dtype = dtype, N = N, d = d, causal = causal, pass = pass, variant = var.label,
             error = "varlen takes no fp8_e4m3 inputs here" }
  end
  if var.name == "varlen" then return measure_varlen(impl, dtype, d, N, causal, pass, var) end
  local B, H = shape_of(d, N)
  local seed = 1
  local fp8 = dtype == "fp8_e4m3"
  local function input(shape)
    seed = seed + 1
    if fp8 then return ft.randn(shape, { dtype = "bf16", seed = seed, device = device }):to(dtype) end
    return ft.randn(shape, { dtype = dtype, seed = seed, device = device })
  end
  local row = { impl = impl, dtype = dtype, B = B, H = H, N = N, d = d, causal = causal, pass = pass,
                variant = var.label }
  if fp8 and pass ~= "fwd" then row.error = "fp8_e4m3 attention is forward only" return row end
  local q, k, v = input { B, N, H, d }, input { B, N, H, d }, input { B, N, H, d }
  local dout = fp8 and q or input { B, N, H, d }
  local o = variant_opts(impl, causal, var, H, false, B, N)
  if opts.check and impl ~= "naive" then
    local bad = check(impl, dtype, q, k, v, dout, causal, pass, var)
    if bad then row.error = bad return row end
  end
  time_pass(row, q, k, v, dout, o, pass,
    bench.attention_flops(B, H, N, N, d, false, pass) * visible_pairs(N, causal, var) / (N * N))
  local rf, proxy, rc
  if var.name == "none" then
    rf, proxy = ref_tflops("flash", dtype, N, d, causal, pass)
    rc = ref_tflops("cudnn", dtype, N, d, causal, pass)
  end
  row.ref_flash = rf and row.tflops / rf or nil
  row.ref_cudnn = rc and row.tflops / rc or nil
  row.proxy = proxy
  for _, t in ipairs { q, k, v, dout } do if not (fp8 and t == dout) then t:free() end end
  return row
end

--- measure with impl's kernel switches on, and off again after (an error
-- included); the row names impl as given.
local function measure_switched(impl, ...)
  local args = pack(...)
  local row = with_switches(impl, function() return measure(split_impl(impl), unpack(args, 1, args.n)) end)
  row.impl = impl
  return row
end

-- ---- run everything -------------------------------------------------------------

--- TFLOP/s with the given decimals, or 4 significant digits below 1 (a CPU's).
local function fmt_tflops(t, decimals)
  return t >= 1 and ("%." .. decimals .. "f"):format(t) or ("%.4g"):format(t)
end

local device_name = on_gpu and ft.cuda.device_name(tonumber(device:match("^cuda:(%d+)$") or "0")) or "cpu"
local rows = {}
--- The passes a dtype is timed in: fp8_e4m3 attention is forward only,
-- so its other passes are left out (not failed).
local function passes_of(dtype)
  if dtype ~= "fp8_e4m3" then return passes end
  local fwd = {}
  for _, p in ipairs(passes) do if p == "fwd" then fwd[1] = p end end
  return fwd
end
local total = 0
for _, dtype in ipairs(dtypes) do
  total = total + #impls * #hdims * #seqlens * #causals * #passes_of(dtype) * #variants
end
io.stderr:write(("flashtile bench on %s (%s): %d configurations\n"):format(device, device_name, total))
-- An untimed pass over the first configuration: the GPU leaves its idle
-- clocks and the memory pool fills before the first row is timed (without
-- it the first row read up to 20% low on the H200).
if on_gpu then
  io.stderr:write("warming up\n")
  pcall(measure_switched, impls[1], dtypes[1], hdims[1], seqlens[1], causals[1],
    passes_of(dtypes[1])[1] or "fwd", variants[1])
end
-- the implementations and variants of one configuration one after the
-- other, so that their ratios are taken at the same moment of the run;
-- with --rounds, over again in the opposite order, each row's median
-- round kept (the check in the first round only)
local function median_round(list)
  local ok = {}
  for _, r in ipairs(list) do
    if r.error then return r end
    ok[#ok + 1] = r
  end
  table.sort(ok, function(a, b) return a.ms < b.ms end)
  local r = ok[math.floor((#ok + 1) / 2)]
  local first = list[1]
  -- the reference ratios were taken from the first round's TFLOP/s
  local k = r.tflops / first.tflops
  first.ref_flash = first.ref_flash and first.ref_flash * k
  first.ref_cudnn = first.ref_cudnn and first.ref_cudnn * k
  first.ms, first.tflops, first.rounds = r.ms, r.tflops, #list
  return first
end
for _, dtype in ipairs(dtypes) do
  for _, d in ipairs(hdims) do
    for _, causal in ipairs(causals) do
      for _, pass in ipairs(passes_of(dtype)) do
        for _, N in ipairs(seqlens) do
          local cells = {} -- (variant, impl) in order, each with its rounds
          for _, var in ipairs(variants) do
            for _, impl in ipairs(impls) do cells[#cells + 1] = { var = var, impl = impl, got = {} } end
          end
          for round = 1, rounds do
            opts.check = given.check and round == 1
            for n = 1, #cells do
              local at = round % 2 == 1 and n or #cells + 1 - n
              local c = cells[at]
              local var, impl = c.var, c.impl
              if not (c.got[1] and c.got[1].error) then -- a failed row is not timed again
                local ok_row, row = pcall(measure_switched, impl, dtype, d, N, causal, pass, var)
                if not ok_row then
                  local B, H = shape_of(d, N, var)
                  row = { impl = impl, dtype = dtype, d = d, N = N, causal = causal, pass = pass,
                          B = B, H = H, variant = var.label, error = tostring(row) }
                end
                c.got[#c.got + 1] = row
                io.stderr:write(("[%d/%d%s] %s %s %s d=%d N=%d causal=%s %s: %s\n"):format(
                  #rows + at, total, rounds > 1 and (", round %d"):format(round) or "",
                  var.label, impl, dtype, d, N, tostring(causal), pass,
                  row.error and ("FAILED " .. row.error)
                    or ("%.3f ms, %s TFLOP/s"):format(row.ms, fmt_tflops(row.tflops, 1))))
              end
            end
          end
          for _, c in ipairs(cells) do rows[#rows + 1] = median_round(c.got) end
        end
      end
    end
  end
end

-- ---- table, CSV, plot -----------------------------------------------------------

local function fmt_ratio(x, proxy) return x and ("%.2fx%s"):format(x, proxy and "*" or "") or "-" end
-- On the CPU each row is also put against ft.matmul at n = 2048 in its
-- dtype (CBLAS), timed in the same run: the share of that GEMM rate.
local gemm_rate = {}
if not on_gpu then
  for _, dtype in ipairs(dtypes) do
    if dtype == "f32" or dtype == "f64" then
      local a = ft.randn({ 2048, 2048 }, { dtype = dtype, seed = 1 })
      local r = bench.run(function() return ft.matmul(a, a) end, timing)
      gemm_rate[dtype] = bench.tflops(2 * 2048 ^ 3, r.median)
      io.stderr:write(("ft.matmul 2048 %s: %s TFLOP/s\n"):format(dtype, fmt_tflops(gemm_rate[dtype], 1)))
    end
  end
end
for _, r in ipairs(rows) do
  if r.tflops and gemm_rate[r.dtype] then r.of_gemm = r.tflops / gemm_rate[r.dtype] end
end
-- With two or more implementations, each row against the last one listed
-- in the same configuration, from this run (--impl flash,cudnn: flash/cudnn).
local base_impl = #impls >= 2 and impls[#impls] or nil
if base_impl then
  local function config(r)
    return table.concat({ r.variant, r.dtype, r.d, r.N, tostring(r.causal), r.pass }, "/")
  end
  local base = {}
  for _, r in ipairs(rows) do
    if r.impl == base_impl and r.tflops then base[config(r)] = r.tflops end
  end
  for _, r in ipairs(rows) do
    local b = base[config(r)]
    if r.tflops and b and b > 0 then r.ratio_run = r.tflops / b end
  end
end
-- mods written in Lua on CUDA: what their run-time compiles took
local st = on_gpu and ft.cuda.mods_stats()
if st and st.compiles + st.disk_loads > 0 then
  io.stderr:write(("mods: %d kernels compiled (NVRTC) in %.1f s, the last in %.2f s; %d loaded from "
    .. "the disk cache in %.2f ms, the last in %.2f ms; %d taken from memory\n"):format(st.compiles,
    st.compile_s, st.last_compile_s, st.disk_loads, st.load_s * 1e3, st.last_load_s * 1e3,
    st.memory_hits))
end
print(("\n%s, %s, %s"):format(device_name, os.date("!%Y-%m-%d"),
  opts.reference and ("ratios against " .. opts.reference) or "no reference file"))
for dtype, rate in pairs(gemm_rate) do
  print(("ft.matmul at n = 2048 in %s, the same run: %s TFLOP/s"):format(dtype, fmt_tflops(rate, 1)))
end
-- the column of this run's ratio, with two or more implementations
local run_head = base_impl and (" vs %s here |"):format(base_impl) or ""
local run_rule = base_impl and " --- |" or ""
local function run_cell(r)
  if not base_impl then return "" end
  return (" %s |"):format(r.ratio_run and ("%.2fx"):format(r.ratio_run) or "-")
end
print("| variant | impl | dtype | B | H | N | d | causal | pass | ms | TFLOP/s | peak MiB | vs flash | vs cudnn | of gemm |"
  .. run_head)
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" .. run_rule)
local any_proxy = false
for _, r in ipairs(rows) do
  if r.error then
    print(("| %s | %s | %s | %d | %d | %d | %d | %s | %s | FAILED: %s | | | | | |%s"):format(r.variant, r.impl, r.dtype,
      r.B, r.H, r.N, r.d, tostring(r.causal), r.pass, r.error, run_cell(r)))
  else
    any_proxy = any_proxy or (r.proxy and (r.ref_flash or r.ref_cudnn) ~= nil)
    print(("| %s | %s | %s | %d | %d | %d | %d | %s | %s | %.3f | %s | %.1f | %s | %s | %s |%s"):format(
      r.variant, r.impl, r.dtype, r.B, r.H, r.N, r.d, tostring(r.causal), r.pass, r.ms,
      fmt_tflops(r.tflops, 1), r.peak / 2^20,
      fmt_ratio(r.ref_flash, r.proxy), fmt_ratio(r.ref_cudnn, r.proxy),
      r.of_gemm and ("%.0f%%"):format(100 * r.of_gemm) or "-", run_cell(r)))
  end
end
if any_proxy then
  print("(* : no bf16 row in the reference file; compared with the f16 row of the same configuration)")
end
if base_impl then
  print(("(vs %s here: TFLOP/s over %s's in the same configuration, timed in this run)"):format(base_impl,
    base_impl))
  -- each other implementation's ratios by pass: lowest, median, highest
  local groups, order = {}, {}
  for _, r in ipairs(rows) do
    if r.ratio_run and r.impl ~= base_impl then
      local key = r.impl .. "\0" .. r.pass
      if not groups[key] then
        groups[key] = { impl = r.impl, pass = r.pass }
        order[#order + 1] = key
      end
      table.insert(groups[key], r)
    end
  end
  local function where(r)
    return ("%s%s d=%d N=%d%s"):format(r.variant == "none" and "" or r.variant .. " ", r.dtype, r.d, r.N,
      r.causal and " causal" or "")
  end
  for _, key in ipairs(order) do
    local g = groups[key]
    table.sort(g, function(a, b) return a.ratio_run < b.ratio_run end)
    local n, half = #g, math.floor(#g / 2)
    local median = n % 2 == 1 and g[half + 1].ratio_run or (g[half].ratio_run + g[half + 1].ratio_run) / 2
    print(("%s / %s here, %s: min %.2fx (%s), median %.2fx, max %.2fx (%s), %d rows"):format(g.impl,
      base_impl, g.pass, g[1].ratio_run, where(g[1]), median, g[n].ratio_run, where(g[n]), n))
  end
end

local csv = assert(io.open(opts.csv, "w"))
csv:write("variant,impl,dtype,B,H,N,d,causal,pass,ms,tflops,peak_bytes,ratio_flash,ratio_cudnn,error,of_gemm,"
  .. "ratio_run,ratio_run_impl\n")
for _, r in ipairs(rows) do
  csv:write(table.concat({ r.variant, r.impl, r.dtype, r.B, r.H, r.N, r.d, tostring(r.causal), r.pass,
    r.ms and ("%.4f"):format(r.ms) or "", r.tflops and fmt_tflops(r.tflops, 2) or "",
    r.peak and ("%d"):format(r.peak) or "", r.ref_flash and ("%.3f"):format(r.ref_flash) or "",
    r.ref_cudnn and ("%.3f"):format(r.ref_cudnn) or "",
    r.error and ('"' .. r.error:gsub('"', "'"):gsub("\n", " ") .. '"') or "",
    r.of_gemm and ("%.3f"):format(r.of_gemm) or "",
    r.ratio_run and ("%.3f"):format(r.ratio_run) or "", r.ratio_run and base_impl or "" }, ","), "\n")
end
csv:close()

-- SVG: TFLOP/s against log2(seqlen), one line per configuration; the
-- reference flash numbers dashed in the same colour.
local series, order = {}, {}
for _, r in ipairs(rows) do
  if r.tflops then
    local key = ("%s%s %s d=%d%s %s"):format(r.variant == "none" and "" or r.variant .. " ",
      r.impl, r.dtype, r.d, r.causal and " causal" or "", r.pass)
    if not series[key] then series[key] = { pts = {}, ref = {} } order[#order + 1] = key end
    table.insert(series[key].pts, { r.N, r.tflops })
    local rf = r.variant == "none" and ref_tflops("flash", r.dtype, r.N, r.d, r.causal, r.pass)
    if rf then table.insert(series[key].ref, { r.N, rf }) end
  end
end
local W, Hp, L, R, T, Bm = 900, 520, 70, 260, 40, 50
local ymax, xmin, xmax = 0, math.huge, -math.huge
for _, key in ipairs(order) do
  for _, set in ipairs { series[key].pts, series[key].ref } do
    for _, p in ipairs(set) do
      ymax = math.max(ymax, p[2])
      xmin, xmax = math.min(xmin, log2(p[1])), math.max(xmax, log2(p[1]))
    end
  end
end
if xmax < xmin then xmin, xmax = 0, 1 end
if xmax == xmin then xmin, xmax = xmin - 1, xmax + 1 end
-- the axis ends at 1, 2 or 5 times a power of ten above the largest value
-- (hundreds of TFLOP/s on a GPU, hundredths on a CPU)
do
  local top = ymax > 0 and ymax or 1
  local p = 10 ^ math.floor(math.log(top) / math.log(10))
  for _, m in ipairs { 1, 2, 5, 10 } do
    if m * p >= top * (1 - 1e-12) then ymax = m * p break end
  end
end
local function X(n) return L + (log2(n) - xmin) / (xmax - xmin) * (W - L - R) end
local function Y(t) return Hp - Bm - t / ymax * (Hp - T - Bm) end
local colors = { "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd" }
local svg = { ('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">'):format(W, Hp),
  ('<rect width="%d" height="%d" fill="white"/>'):format(W, Hp),
  ('<text x="%d" y="24" font-size="15">flashtile attention on %s, %s (dashed: reference flash)</text>'):format(L,
    device_name, os.date("!%Y-%m-%d")) }
for i = 0, 5 do
  local t = ymax * i / 5
  svg[#svg + 1] = ('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/><text x="%d" y="%.1f" text-anchor="end">%s</text>')
    :format(L, Y(t), W - R, Y(t), L - 6, Y(t) + 4, ("%.4g"):format(t))
end
for _, N in ipairs(seqlens) do
  svg[#svg + 1] = ('<text x="%.1f" y="%d" text-anchor="middle">%d</text>'):format(X(N), Hp - Bm + 18, N)
end
svg[#svg + 1] = ('<text x="%d" y="%d" text-anchor="middle">seqlen</text>'):format(math.floor((L + W - R) / 2), Hp - 12)
local mid = math.floor((T + Hp - Bm) / 2)
svg[#svg + 1] = ('<text x="16" y="%d" transform="rotate(-90 16 %d)" text-anchor="middle">TFLOP/s</text>')
  :format(mid, mid)
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
