-- Attention modifications written in Lua, at the REPL's level of effort:
-- three research-style mods (a learned relative bias with its gradient, a
-- document mask, a soft-cap), each checked against what it should equal
-- and timed, forward and backward, against the built-in path. On the GPU
-- when there is one (bf16, 2 x 4096 tokens, 16 heads of 128: the kernels
-- compiled for each mod with NVRTC on first use), else on the CPU (f32,
-- 2 x 256, 4 heads of 32).
--
--   lua scripts/mods_demo.lua [cpu|cuda]
local ok, ft = pcall(require, "flashtile")
if not ok then
  local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
  ft = dofile(here .. "lib/paths.lua").require("mods_demo.lua", here)
end
local bench = require "flashtile.bench"

local where = arg and arg[1]
if where ~= nil and where ~= "cpu" and where ~= "cuda" then
  io.stderr:write("usage: lua scripts/mods_demo.lua [cpu|cuda]\n")
  os.exit(2)
end
local on_gpu = where == "cuda" or (where == nil and ft.cuda.is_available())
local device = on_gpu and "cuda" or "cpu"
local B, N, H, d, dtype = 2, 256, 4, 32, "f32"
if on_gpu then B, N, H, d, dtype = 2, 4096, 16, 128, "bf16" end
print(("on %s: %s, B %d, N %d, H %d, d %d"):format(
  on_gpu and ft.cuda.device_name(0) or "the cpu", dtype, B, N, H, d))
local function input(seed) return ft.randn({ B, N, H, d }, { seed = seed, dtype = dtype, device = device }) end
local q, k, v, dout = input(1), input(2), input(3), input(4)

local function time(fn)
  return bench.run(fn, { warmup = 1, reps = on_gpu and 10 or 3, device = device }).median
end

--- Forward and backward of one set of options, milliseconds.
local function times(opts)
  local out, lse = ft.attention(q, k, v, opts)
  return time(function() return ft.attention(q, k, v, opts) end),
      time(function() return ft.attention_backward(dout, q, k, v, out, lse, opts) end)
end

local function report(name, opts, builtin, builtin_name)
  local f, b = times(opts)
  local line = ("%-28s forward %8.3f ms, backward %8.3f ms"):format(name, f, b)
  if builtin then
    local bf, bb = times(builtin)
    line = line .. ("\n%-28s forward %8.3f ms, backward %8.3f ms: the mod at %.2fx / %.2fx its speed"):format(
      "  " .. (builtin_name or "built-in"), bf, bb, bf / f, bb / b)
  end
  print(line)
end

-- 1. A learned relative-position bias, one value per head and distance,
-- with its gradient (T5-style).
local rel = ft.zeros({ H, 2 * N - 1 }, { device = device })
local relative = ft.attention_mods {
  score = function(s, b, h, i, j) return s + rel[h][i - j + N] end,
}
local out, lse = ft.attention(q, k, v, { mods = relative })
local dq, dk, dv, drel = ft.attention_backward(dout, q, k, v, out, lse, { mods = relative })
print(("relative bias: out %s, d(bias) %s, |d(bias)| max %.3g"):format(
  table.concat(out.shape, "x"), table.concat(drel.shape, "x"), drel:abs():max()))
-- with a zero table it is plain attention
print(("  equals plain attention with a zero table: %g"):format(
  ft.max_abs_diff(out, (ft.attention(q, k, v)))))
report("relative bias (zero table)", { mods = relative }, {}, "plain")

-- 2. A document mask: tokens attend within their own document, causally.
local docs = {}
for i = 1, N do docs[i] = math.floor((i - 1) / 64) + 1 end -- documents of 64
local doc = ft.tensor(docs, { dtype = "i32", device = device })
local documents = ft.attention_mods {
  mask = function(b, h, i, j) return ft.all(doc[i]:eq(doc[j]), j:le(i)) end,
}
local o1 = ft.attention(q, k, v, { mods = documents })
local o2 = ft.attention(q:narrow(2, 65, 64), k:narrow(2, 65, 64), v:narrow(2, 65, 64), { causal = true })
print(("document mask: document 2 against it alone, causal, max |difference|: %g"):format(
  ft.max_abs_diff(o1:narrow(2, 65, 64), o2)))
-- its block mask: the kernels skip the tiles it hides wholly
local bm = ft.block_mask(documents, B, H, N, N, on_gpu and { device = device } or nil)
report("document mask", { mods = documents, block_mask = bm }, { causal = true }, "causal")

-- 3. A soft-cap on the scores (Gemma 2), against the built-in softcap.
local capped = ft.attention_mods {
  score = function(s) return (s / 30):tanh() * 30 end,
}
print(("softcap 30: equals the built-in: %g"):format(
  ft.max_abs_diff((ft.attention(q, k, v, { mods = capped })), (ft.attention(q, k, v, { softcap = 30 })))))
report("softcap 30", { mods = capped }, { softcap = 30 })
if on_gpu then
  local st = ft.cuda.mods_stats()
  print(("NVRTC: %d kernels compiled in %.1f s, %d loaded from the disk cache in %.3f s"):format(
    st.compiles, st.compile_s, st.disk_loads, st.load_s))
end

-- A Lua branch on a traced value is caught:
local caught, err = pcall(ft.attention_mods, {
  score = function(s, b, h, i, j) if j:gt(i) then return s - 1 end return s end,
})
print("a Lua if on a traced value: " .. (caught and "not caught" or err:match("gives .*")))
