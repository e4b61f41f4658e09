--- flashtile: tiled attention kernels and the tensors that feed them.
--
--   local ft = require "flashtile"
--   local t = ft.randn({2, 3}, {dtype = "f64"})
--   print(t * 2 + 1)
--
-- The C half is flashtile.core; this file adds what is easier said in Lua:
-- dtype shorthands and the printed form of a tensor.
local core = require "flashtile.core"

local ft = {}
-- (flashtile.mods alone uses the graph functions and op codes of the core)
local internal = { Tensor_methods = true, attention_mods_graph = true, attention_mods_eval = true,
                   attention_mods_bound = true,
                   mod_ops = true, attention_block_mask = true, attention_block_mask_counts = true,
                   attention_mods_compile = true, dist = true }
for k, v in pairs(core) do
  if not internal[k] then ft[k] = v end
end

local methods = core.Tensor_methods
local Tensor = core.Tensor

-- t:double(), t:float(), t:half(), t:bf16(), t:int(), t:long(), t:cpu() and
-- t:cuda([index]) are C methods (flashtile.core), so that their errors
-- name them.
local unpack = table.unpack or unpack -- 5.1 and LuaJIT: the global

--- The shape as a string, "{2, 3}".
local function shape_string(t)
  return "{" .. table.concat(t.shape, ", ") .. "}"
end

-- ---- printing ---------------------------------------------------------------

local EDGE = 3          -- elements shown at each end of an elided dim
local SUMMARIZE = 1000  -- tensors with more elements are elided

--- The positions shown along a dim of size n: all, or the first and last
-- EDGE with false standing for "...".
local function shown(n, elide)
  local idx = {}
  if elide and n > 2 * EDGE then
    for i = 1, EDGE do idx[#idx + 1] = i end
    idx[#idx + 1] = false
    for i = n - EDGE + 1, n do idx[#idx + 1] = i end
  else
    for i = 1, n do idx[i] = i end
  end
  return idx
end

--- Collects the shown values (in order) to choose one format for all.
local function collect(t, elide)
  local vals, index, nd = {}, {}, t:dim()
  local function rec(d)
    if d > nd then
      vals[#vals + 1] = t:get(unpack(index, 1, nd))
      return
    end
    for _, i in ipairs(shown(t:size(d), elide)) do
      if i then index[d] = i; rec(d + 1) end
    end
  end
  rec(1)
  return vals
end

--- A formatter shared by all values: integers as such, otherwise fixed
-- point with 4 decimals when the magnitudes allow, else scientific.
local function formatter(vals, is_float)
  if not is_float then
    -- below 5.3 an i64 arrives as a double, which %d cannot take past 2^63
    local ifmt = math.type and "%d" or "%.0f"
    return function(v) return string.format(ifmt, v) end
  end
  local maxabs, minabs, integral = 0, math.huge, true
  for _, v in ipairs(vals) do
    if v == v and v ~= math.huge and v ~= -math.huge then
      local a = math.abs(v)
      if a > maxabs then maxabs = a end
      if a ~= 0 and a < minabs then minabs = a end
      if v ~= math.floor(v) then integral = false end
    end
  end
  local fmt
  if integral and maxabs < 1e8 then
    fmt = "%.0f."
  elseif maxabs < 1e5 and minabs >= 1e-4 then
    fmt = "%.4f"
  else
    fmt = "%.4e"
  end
  return function(v)
    if v ~= v then return "nan" end
    if v == math.huge then return "inf" end
    if v == -math.huge then return "-inf" end
    return string.format(fmt, v)
  end
end

local function render(t)
  local nd, n = t:dim(), t:numel()
  if n == 0 then return "[]" end
  local elide = n > SUMMARIZE
  -- a small device tensor comes over in one copy; a big one element by
  -- element, only the elements shown
  if t.device ~= "cpu" and not elide then t = t:cpu() end
  local vals = collect(t, elide)
  local fmt = formatter(vals, t.dtype ~= "i32" and t.dtype ~= "i64")
  local width = 0
  for i, v in ipairs(vals) do
    vals[i] = fmt(v)
    if #vals[i] > width then width = #vals[i] end
  end
  local k = 0
  local function nextval()
    k = k + 1
    return string.rep(" ", width - #vals[k]) .. vals[k]
  end
  if nd == 0 then return nextval() end
  local function rec(d, indent)
    local parts = {}
    if d == nd then
      for _, i in ipairs(shown(t:size(d), elide)) do
        parts[#parts + 1] = i and nextval() or "..."
      end
      return "[" .. table.concat(parts, ", ") .. "]"
    end
    for _, i in ipairs(shown(t:size(d), elide)) do
      parts[#parts + 1] = i and rec(d + 1, indent .. " ") or "..."
    end
    local sep = "," .. string.rep("\n", nd - d) .. indent .. " "
    return "[" .. table.concat(parts, sep) .. "]"
  end
  return rec(1, "")
end

Tensor.__tostring = function(t)
  -- a tensor freed before or while it is printed prints as freed
  local ok, s = pcall(function()
    return string.format("%s\n[flashtile.Tensor %s %s %s]", render(t), t.dtype, t.device,
                         shape_string(t))
  end)
  return ok and s or "[flashtile.Tensor (freed)]"
end

-- ---- attention modifications written in Lua (flashtile.mods) --------------------

do
  local mods = require "flashtile.mods"
  for _, name in ipairs { "attention_mods", "block_mask", "where", "all", "any", "negate", "min",
                          "max" } do
    ft[name] = mods[name]
  end
  ft.cuda.compile_mods = mods.compile_mods
end

-- ---- several GPUs (flashtile.dist) ----------------------------------------------

ft.dist = require "flashtile.dist"
ft.ring_attention = ft.dist.ring_attention
ft.ring_attention_backward = ft.dist.ring_attention_backward

return ft
