-- Attention modifications written in Lua, at the REPL's level of effort:
-- three research-style mods (a learned relative bias with its gradient, a
-- document mask, a soft-cap), each checked against what it should equal
-- and timed against the built-in path. On the CPU so far (the GPU answers
-- that mods do not run there yet).
--
--   lua scripts/mods_demo.lua
local ok, ft = pcall(require, "flashtile")
if not ok then
  local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
  ft = dofile(here .. "lib/paths.lua").require("mods_demo.lua", here)
end
local bench = require "flashtile.bench"

local B, N, H, d = 2, 256, 4, 32
local function input(seed) return ft.randn({ B, N, H, d }, { seed = seed }) end
local q, k, v, dout = input(1), input(2), input(3), input(4)

local function time(fn)
  return bench.run(fn, { warmup = 1, reps = 3 }).median
end

local function report(name, mods, builtin)
  local t_mod = time(function() return ft.attention(q, k, v, { mods = mods }) end)
  local t_builtin = builtin and time(function() return ft.attention(q, k, v, builtin) end)
  print(("%-34s forward %7.2f ms%s"):format(name, t_mod,
    t_builtin and ("   (built-in %7.2f ms)"):format(t_builtin) or ""))
end

-- 1. A learned relative-position bias, one value per head and distance,
-- with its gradient (T5-style).
local rel = ft.zeros({ H, 2 * N - 1 })
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
report("relative bias (zero table)", relative, {})

-- 2. A document mask: tokens attend within their own document, causally.
local doc = ft.zeros({ N })
for i = 1, N do doc[i] = math.floor((i - 1) / 64) + 1 end -- four documents of 64
local documents = ft.attention_mods {
  mask = function(b, h, i, j) return ft.all(doc[i]:eq(doc[j]), j:le(i)) end,
}
local o1 = ft.attention(q, k, v, { mods = documents })
local o2 = ft.attention(q:narrow(2, 65, 64), k:narrow(2, 65, 64), v:narrow(2, 65, 64), { causal = true })
print(("document mask: document 2 equals it alone, causal: %g"):format(
  ft.max_abs_diff(o1:narrow(2, 65, 64), o2)))
report("document mask", documents, { causal = true })

-- 3. A soft-cap on the scores (Gemma 2), against the built-in softcap.
local capped = ft.attention_mods {
  score = function(s) return (s / 30):tanh() * 30 end,
}
print(("softcap 30: equals the built-in: %g"):format(
  ft.max_abs_diff((ft.attention(q, k, v, { mods = capped })), (ft.attention(q, k, v, { softcap = 30 })))))
report("softcap 30", capped, { softcap = 30 })

-- A Lua branch on a traced value is caught:
local caught, err = pcall(ft.attention_mods, {
  score = function(s, b, h, i, j) if j:gt(i) then return s - 1 end return s end,
})
print("a Lua if on a traced value: " .. (caught and "not caught" or err:match("gives .*")))
