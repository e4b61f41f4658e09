-- flashtile's main job: the comparison at the heart of the project, the
-- traditional (materialised) attention against the tiled FlashAttention
-- algorithm, on the same inputs in the same run: peak extra memory,
-- forward and backward time. Then a short tour of the tensors.
--
--   lua scripts/demo.lua [B H N d]      (scripts/demo builds first)
--
-- Runs under Lua 5.1 to 5.4 and LuaJIT; from a clone it finds flashtile in
-- lua/ and build/ (or $FT_BUILD_DIR) by itself (scripts/lib/paths.lua).
local usage = "usage: lua scripts/demo.lua [B H N d]   (batch, heads, seqlen, head dim: positive integers)"
local args = arg or {}
if args[1] == "-h" or args[1] == "--help" then
  print(usage)
  os.exit(0)
end
local sizes
if #args > 0 then
  sizes = {}
  for i = 1, #args do
    local n = tonumber(args[i])
    if #args ~= 4 or not (n and n >= 1 and n == math.floor(n)) then
      io.stderr:write(("demo.lua: bad arguments '%s'\n%s\n"):format(table.concat(args, " "), usage))
      os.exit(2)
    end
    sizes[i] = n
  end
end

local ok, ft = pcall(require, "flashtile")
if not ok then
  local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
  ft = dofile(here .. "lib/paths.lua").require("demo.lua", here)
end
local bench = require "flashtile.bench"
local unpack = table.unpack or unpack
local function pack(...) return { n = select("#", ...), ... } end

-- On a GPU: the seed article's headline size (batch 8, 32 heads, seqlen 4096, head
-- dim 128, f16). On the CPU: a size that runs in seconds.
local on_gpu = ft.cuda.is_available()
local device = on_gpu and "cuda" or "cpu"
local B, H, N, d = 2, 4, 1024, 64
local dtype = "f32"
if on_gpu then B, H, N, d, dtype = 8, 32, 4096, 128, "f16" end
if sizes then B, H, N, d = sizes[1], sizes[2], sizes[3], sizes[4] end
local fast = on_gpu and "flash" or "tiled"

local function mib(bytes) return bytes / 2^20 end

--- Peak bytes beyond what was in use before fn ran.
local function peak_extra(fn)
  collectgarbage()
  if device ~= "cpu" then ft.cuda.synchronize() end
  ft.reset_peak_memory(device)
  local before = ft.memory_stats(device).in_use
  local r = pack(fn())
  if device ~= "cpu" then ft.cuda.synchronize() end
  return ft.memory_stats(device).peak - before, unpack(r, 1, r.n)
end

print(("flashtile %s: attention on %s, batch %d, heads %d, seqlen %d, head dim %d, %s")
      :format(ft.version, device, B, H, N, d, dtype))
local q = ft.randn({B, N, H, d}, {dtype = dtype, seed = 1}):to(device)
local k = ft.randn({B, N, H, d}, {dtype = dtype, seed = 2}):to(device)
local v = ft.randn({B, N, H, d}, {dtype = dtype, seed = 3}):to(device)
local dout = ft.randn({B, N, H, d}, {dtype = dtype, seed = 4}):to(device)
local timing = on_gpu and {warmup = 2, reps = 10, device = device} or {warmup = 1, reps = 3}

local rows, outs = {}, {}
for _, impl in ipairs {"naive", fast} do
  local opts = {impl = impl}
  local mem_f, out, lse = peak_extra(function() return ft.attention(q, k, v, opts) end)
  local mem_b = peak_extra(function() return ft.attention_backward(dout, q, k, v, out, lse, opts) end)
  local fwd = bench.run(function() ft.attention(q, k, v, opts) end, timing)
  local bwd = bench.run(function() ft.attention_backward(dout, q, k, v, out, lse, opts) end, timing)
  outs[impl] = out
  rows[#rows + 1] = {impl, mib(mem_f), mib(mem_b), fwd.median, bwd.median,
    bench.tflops(bench.attention_flops(B, H, N, N, d, false, "fwd"), fwd.median) * 1e3,
    bench.tflops(bench.attention_flops(B, H, N, N, d, false, "bwd"), bwd.median) * 1e3}
end

print()
local unit = on_gpu and "TFLOP/s" or "GFLOP/s"
local per = on_gpu and 1e-3 or 1
print(("| implementation | peak memory fwd | peak memory bwd | forward | backward | fwd %s | bwd %s |")
      :format(unit, unit))
print("| --- | --- | --- | --- | --- | --- | --- |")
for _, r in ipairs(rows) do
  r[6], r[7] = r[6] * per, r[7] * per
  print(("| %s | %.1f MiB | %.1f MiB | %.2f ms | %.2f ms | %.1f | %.1f |"):format(unpack(r)))
end
print("(peak memory: beyond the inputs, outputs included: out and lse forward, dq, dk, dv backward)")
print(("\nmax |naive - %s| of the output: %.2e"):format(fast, ft.max_abs_diff(outs.naive, outs[fast])))
print(("the naive path holds N x N scores and probabilities (%.1f MiB per head in f32);")
      :format(mib(N * N * 4)))
print(("the %s path holds one block of them, whatever N is."):format(fast))
print(("ran on: %s (%s)"):format(device, on_gpu and ft.cuda.device_name(0) or "CPU, OpenMP threads"))

-- ---- a short tour of the tensors ----
print("\n== tensors ==")
local x = ft.randn({2, 3}, {dtype = "f64", seed = 7})
print("x = ft.randn({2, 3}, {dtype = 'f64', seed = 7})")
print(x)
print("x:transpose() shares storage:", x:transpose():is_same_storage(x))
print("x:half() rounds to nearest even:")
print(x:half())
print("(2 * x + 1):sum(2) =")
print((2 * x + 1):sum(2))
print("x:softmax(2) =")
print(x:softmax(2))
