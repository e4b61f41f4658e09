--- Timing for flashtile: median, min and max milliseconds of a function,
-- and attention FLOP counts in FlashAttention's convention.
--
--   local bench = require "flashtile.bench"
--   local r = bench.run(function() ft.attention(q, k, v) end, {warmup = 2, reps = 10})
--   print(r.median, r.min, r.max)
--
-- On the CPU the clock is the wall clock (ft.clock, monotonic): os.clock
-- would add up the CPU time of every OpenMP thread.
local ft = require "flashtile"

local function is_integer(v)
  return type(v) == "number" and v == math.floor(v) and v > -2 ^ 63 and v < 2 ^ 63
end

local bench = {}

local function median(xs)
  local s = {}
  for i, x in ipairs(xs) do s[i] = x end
  table.sort(s)
  local n = #s
  if n % 2 == 1 then return s[(n + 1) / 2] end
  return (s[n / 2] + s[n / 2 + 1]) / 2
end

--- Times reps runs of fn on a CUDA device, each between two events. The
-- events of all runs are queued before the first is read, so the host
-- prepares run i + 1 while the device does run i (as a training or
-- decoding loop runs): each time is the device's, not the host's
-- launch latency, unless the host is the slower of the two.
local function cuda_times(fn, device, reps)
  local starts, stops = {}, {}
  for i = 1, reps do
    starts[i], stops[i] = ft.cuda.Event(device), ft.cuda.Event(device)
  end
  for i = 1, reps do
    starts[i]:record()
    fn()
    stops[i]:record()
  end
  local times = {}
  for i = 1, reps do
    times[i] = starts[i]:elapsed(stops[i])
    starts[i]:free()
    stops[i]:free()
  end
  return times
end

--- Runs fn warmup times untimed, then reps times timed. Returns
-- {median = ms, min = ms, max = ms, reps = n, times = {ms...}}.
-- opts.device = "cuda" (or "cuda:N") times with CUDA events on that device:
-- the time the GPU spent between two points of its stream, not the host's.
function bench.run(fn, opts)
  if type(fn) ~= "function" then error("bench.run: fn must be a function", 2) end
  if opts ~= nil and type(opts) ~= "table" then error("bench.run: opts must be a table", 2) end
  opts = opts or {}
  for k in pairs(opts) do
    if k ~= "warmup" and k ~= "reps" and k ~= "device" then
      error(("bench.run: unknown option '%s' (expected warmup, reps or device)"):format(tostring(k)), 2)
    end
  end
  local warmup, reps = opts.warmup or 1, opts.reps or 5
  if not is_integer(warmup) or warmup < 0 then
    error("bench.run: warmup must be an integer >= 0", 2)
  end
  if not is_integer(reps) or reps < 1 then
    error("bench.run: reps must be an integer >= 1", 2)
  end
  local device = opts.device or "cpu"
  if type(device) ~= "string" then error("bench.run: device must be a string", 2) end
  local on_gpu = device:sub(1, 4) == "cuda"
  for _ = 1, warmup do fn() end
  local times = on_gpu and cuda_times(fn, device, reps) or {}
  for i = 1, on_gpu and 0 or reps do
    local t0 = ft.clock()
    fn()
    times[i] = (ft.clock() - t0) * 1e3
  end
  local mn, mx = math.huge, -math.huge
  for _, t in ipairs(times) do
    if t < mn then mn = t end
    if t > mx then mx = t end
  end
  return { median = median(times), min = mn, max = mx, reps = reps, times = times }
end

--- FLOPs of attention as FlashAttention's benchmarks count them: forward
-- 4 * B * H * Nq * Nk * d (two matrix products), halved when causal;
-- backward 2.5 times the forward; "fwd+bwd" the sum.
function bench.attention_flops(B, H, Nq, Nk, d, causal, pass)
  local f = 4.0 * B * H * Nq * Nk * d
  if causal then f = f / 2 end
  pass = pass or "fwd"
  if pass == "fwd" then return f end
  if pass == "bwd" then return 2.5 * f end
  if pass == "fwd+bwd" then return 3.5 * f end
  error(("bench.attention_flops: pass must be 'fwd', 'bwd' or 'fwd+bwd', got '%s'"):format(tostring(pass)), 2)
end

--- TFLOP/s of flops done in ms milliseconds.
function bench.tflops(flops, ms)
  return flops / (ms * 1e-3) / 1e12
end

return bench
