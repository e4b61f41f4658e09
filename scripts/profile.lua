-- One forward and one backward call of one configuration on the GPU, for a
-- profiler to look at (ncu -k <kernel> -c 1 ...; nothing is timed here).
--
--   lua scripts/profile.lua [d] [seqlen] [dtype] [causal]
--   e.g. ncu --clock-control none -k regex:wgmma -c 2 lua scripts/profile.lua 64 4096
--
-- Defaults: d 64, seqlen 4096, f16, not causal; batch 16384 / seqlen and
-- 2048 / d heads, as in scripts/bench.lua. Runs under Lua 5.1 to 5.4 and
-- LuaJIT; from a clone it finds flashtile in lua/ and build/ (or
-- $FT_BUILD_DIR) by itself (scripts/lib/paths.lua).
local usage = "usage: lua scripts/profile.lua [d] [seqlen] [f16|bf16|f32] [true|false]"
local args = arg or {}
local function fail(status, msg)
  io.stderr:write("profile.lua: ", msg, "\n")
  os.exit(status)
end
if args[1] == "-h" or args[1] == "--help" then
  print(usage)
  os.exit(0)
end
local function positive_int(s, what)
  local n = tonumber(s)
  if not (n and n >= 1 and n == math.floor(n) and n < math.huge) then
    fail(2, ("%s must be a positive integer, got '%s'\n%s"):format(what, s, usage))
  end
  return n
end
local d = positive_int(args[1] or "64", "d")
local n = positive_int(args[2] or "4096", "seqlen")
local dtype = args[3] or "f16"
if dtype ~= "f16" and dtype ~= "bf16" and dtype ~= "f32" then
  fail(2, ("dtype must be f16, bf16 or f32, got '%s'\n%s"):format(dtype, usage))
end
if args[4] ~= nil and args[4] ~= "true" and args[4] ~= "false" then
  fail(2, ("causal must be true or false, got '%s'\n%s"):format(args[4], usage))
end
local causal = args[4] == "true"
if args[5] ~= nil then fail(2, ("too many arguments\n%s"):format(usage)) end

local ok, ft = pcall(require, "flashtile")
if not ok then
  local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
  ft = dofile(here .. "lib/paths.lua").require("profile.lua", here)
end
if not ft.cuda.is_available() then
  fail(1, ft.cuda.is_built() and "no CUDA GPU is available (ft.cuda.is_available() is false)"
    or "flashtile was built without CUDA")
end

local B, H = math.max(1, math.floor(16384 / n)), math.max(1, math.floor(2048 / d))
local function input(seed)
  return ft.randn({B, n, H, d}, {dtype = dtype, device = "cuda", seed = seed})
end
local q, k, v, dout = input(1), input(2), input(3), input(4)
local opts = {causal = causal}
local out, lse = ft.attention(q, k, v, opts)
ft.attention_backward(dout, q, k, v, out, lse, opts)
ft.cuda.synchronize()
print(("B=%d H=%d N=%d d=%d %s causal=%s: done"):format(B, H, n, d, dtype, tostring(causal)))
