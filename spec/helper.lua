-- spec/helper.lua - shared helpers of the flashtile specs.
--
--   local h = require "helper"
--   local ft = h.ft
--
-- busted's lpath (see .busted) includes spec/, so `require "helper"` finds
-- this file. Nothing here knows about the library's internals: it only
-- builds inputs, plain-Lua reference results and error-message checks.
local ft = require "flashtile"
-- required modules see the plain _G, not the spec environment of busted
local assert = require "luassert"

local h = { ft = ft }

-- ---- Lua versions -------------------------------------------------------------
--
-- The specs run under Lua 5.1, 5.2, 5.3, 5.4 and LuaJIT 2.1. Below 5.3 a
-- Lua number is a double: an i64 element reads back as a double, exact up
-- to 2^53. Checks that need 5.3's integers are guarded with h.has_int64.

--- true where Lua has a 64-bit integer subtype (5.3 and later).
h.has_int64 = math.type ~= nil
--- true under LuaJIT.
h.is_luajit = type(rawget(_G, "jit")) == "table"

--- table.unpack (5.2+) or unpack (5.1, LuaJIT).
h.unpack = table.unpack or unpack

--- table.pack: the arguments in a table with their count in n.
function h.pack(...)
  return { n = select("#", ...), ... }
end

--- floor(a / b): 5.3's a // b, spelled for every version.
function h.idiv(a, b)
  return math.floor(a / b)
end

-- ---- binary encodings -----------------------------------------------------------
--
-- Little- and big-endian bytes of f32, f64, i8/i16/i32/i64 and u8/u16/u32
-- values, computed with plain arithmetic so that every Lua version builds
-- the same bytes (string.pack exists only from 5.3 on; io_spec checks these
-- against it there). f32 rounds to nearest, ties to even, like a C cast.

local LOG2 = math.log(2)
local TWO32 = 4294967296

--- e with 2^e <= a < 2^(e + 1), for a finite a > 0.
local function exponent_of(a)
  local e = math.floor(math.log(a) / LOG2)
  while 2 ^ e > a do e = e - 1 end
  while 2 ^ (e + 1) <= a do e = e + 1 end
  return e
end

--- r (>= 0) rounded to the nearest integer, ties to the even one.
local function round_even(r)
  local f = math.floor(r)
  local d = r - f
  if d > 0.5 or (d == 0.5 and f % 2 == 1) then return f + 1 end
  return f
end

--- The bytes of a non-negative integer u < 2^(8 n), lowest first.
local function le_bytes(u, n)
  local out = {}
  for i = 1, n do
    local b = u % 256
    out[i] = b
    u = (u - b) / 256
  end
  return string.char(h.unpack(out))
end

--- The sign (0 or 1) of x, -0 and NaN included (a NaN counts as positive).
local function sign_of(x)
  if x < 0 or (x == 0 and 1 / x < 0) then return 1 end
  return 0
end

--- The binary32 bit pattern of x as a number in [0, 2^32).
local function f32_bits(x)
  if x ~= x then return 0x7FC00000 end
  local s = sign_of(x)
  local a = math.abs(x)
  local bits
  if a == math.huge then
    bits = 0x7F800000
  elseif a == 0 then
    bits = 0
  else
    local e = exponent_of(a)
    if e < -126 then -- subnormal (or rounds up to the smallest normal)
      bits = round_even(a / 2 ^ -149) -- 2^23 here is the smallest normal
    else
      local m = round_even(a / 2 ^ (e - 23))
      if m == 2 ^ 24 then m, e = 2 ^ 23, e + 1 end
      if e > 127 then
        bits = 0x7F800000
      else
        bits = (e + 127) * 2 ^ 23 + (m - 2 ^ 23)
      end
    end
  end
  return s * 2 ^ 31 + bits
end

--- The binary64 bit pattern of x as two numbers in [0, 2^32): high, low.
local function f64_words(x)
  if x ~= x then return 0x7FF80000, 0 end
  local s = sign_of(x)
  local a = math.abs(x)
  local ebits, mant
  if a == math.huge then
    ebits, mant = 2047, 0
  elseif a == 0 then
    ebits, mant = 0, 0
  else
    local e = exponent_of(a)
    if e < -1022 then
      ebits, mant = 0, a / 2 ^ -1074
    else
      ebits, mant = e + 1023, a / 2 ^ (e - 52) - 2 ^ 52
    end
  end
  local lo = mant % TWO32
  local hi = (mant - lo) / TWO32
  return s * 2 ^ 31 + ebits * 2 ^ 20 + hi, lo
end

--- Checks that v is an integer in [lo, hi); names the format otherwise.
local function check_int(v, lo, hi, what)
  if type(v) ~= "number" or v ~= math.floor(v) or v < lo or v >= hi then
    error(string.format("helper: %s value %s out of range or not an integer", what, tostring(v)), 3)
  end
end

--- Little-endian encoders by format letter and size.
local encode = {
  f = function(v) return le_bytes(f32_bits(v), 4) end,
  d = function(v)
    local hi, lo = f64_words(v)
    return le_bytes(lo, 4) .. le_bytes(hi, 4)
  end,
  i = function(v, n)
    if n == 8 then
      check_int(v, -2 ^ 63, 2 ^ 63, "i8")
      -- exact for 5.3 integers and for doubles alike: lo is v mod 2^32 and
      -- v - lo a multiple of 2^32 below 2^63, so the division is exact
      local lo = v % TWO32
      local hi = (v - lo) / TWO32
      return le_bytes(lo, 4) .. le_bytes(hi % TWO32, 4)
    end
    check_int(v, -2 ^ (8 * n - 1), 2 ^ (8 * n - 1), "i" .. n)
    return le_bytes(v % 2 ^ (8 * n), n)
  end,
  I = function(v, n)
    check_int(v, 0, 2 ^ (8 * n), "I" .. n)
    return le_bytes(v, n)
  end,
}

-- 256^n as integer literals: integers in 5.3 and later
local RANGE = { 256, 65536, 16777216, 4294967296 }

--- The integer value of n little-endian bytes of s at pos (n <= 4), and
-- with signed, two's complement (an integer in 5.3 and later).
local function le_value(s, pos, n, signed)
  local v = 0
  for i = n, 1, -1 do v = v * 256 + s:byte(pos + i - 1) end
  if signed and v >= RANGE[n] / 2 then v = v - RANGE[n] end
  return v
end

local decode = {
  f = function(s, pos)
    local bits = le_value(s, pos, 4)
    local sign = bits >= 2 ^ 31 and -1 or 1
    bits = bits % 2 ^ 31
    local m = bits % 2 ^ 23
    local e = (bits - m) / 2 ^ 23
    local v
    if e == 255 then
      v = m == 0 and math.huge or 0 / 0
    elseif e == 0 then
      v = m * 2 ^ -149
    else
      v = (m + 2 ^ 23) * 2 ^ (e - 150)
    end
    return sign * v
  end,
  d = function(s, pos)
    local lo = le_value(s, pos, 4)
    local hi = le_value(s, pos + 4, 4)
    local sign = hi >= 2 ^ 31 and -1 or 1
    hi = hi % 2 ^ 31
    local mhi = hi % 2 ^ 20
    local e = (hi - mhi) / 2 ^ 20
    local m = mhi * 2 ^ 32 + lo
    local v
    if e == 2047 then
      v = m == 0 and math.huge or 0 / 0
    elseif e == 0 then
      v = m * 2 ^ -1074
    else
      v = (m + 2 ^ 52) * 2 ^ (e - 1075)
    end
    return sign * v
  end,
  i = function(s, pos, n)
    if n == 8 then
      -- built from integer bytes: a 5.3 integer there, a double (exact to
      -- 2^53) below 5.3
      local lo, hi = 0, 0
      for i = 4, 1, -1 do lo = lo * 256 + s:byte(pos + i - 1) end
      for i = 8, 5, -1 do hi = hi * 256 + s:byte(pos + i - 1) end
      if hi >= 2147483648 then hi = hi - 4294967296 end
      return hi * 4294967296 + lo
    end
    return le_value(s, pos, n, true)
  end,
  I = function(s, pos, n) return le_value(s, pos, n, false) end,
}

--- The items of a string.pack-style format: { letter, size } pairs and the
-- byte order. Formats: "<" little and ">" big endian (the default is
-- little), then any of f (4 bytes), d (8), i1 i2 i4 i8, I1 I2 I4.
local function parse_format(fmt)
  local items, little = {}, true
  for opt, digits in fmt:gmatch("([<>fdiI])(%d*)") do
    if opt == "<" then
      little = true
    elseif opt == ">" then
      little = false
    else
      local n = tonumber(digits) or (opt == "f" and 4 or opt == "d" and 8 or nil)
      if n == nil or (opt == "f" and n ~= 4) or (opt == "d" and n ~= 8)
        or (opt == "i" and n ~= 1 and n ~= 2 and n ~= 4 and n ~= 8)
        or (opt == "I" and n ~= 1 and n ~= 2 and n ~= 4) then
        error("helper: unsupported format item " .. opt .. digits .. " in " .. fmt, 3)
      end
      items[#items + 1] = { opt, n, little }
    end
  end
  if fmt:gsub("[<>fdiI%d]", "") ~= "" then
    error("helper: unsupported format " .. fmt, 3)
  end
  return items
end

--- string.pack(fmt, ...) for the formats above, in every Lua version.
function h.bpack(fmt, ...)
  local items = parse_format(fmt)
  assert.are.equal(#items, select("#", ...), "h.bpack: one value per format item")
  local out = {}
  for i, item in ipairs(items) do
    local bytes = encode[item[1]]((select(i, ...)), item[2])
    out[i] = item[3] and bytes or bytes:reverse()
  end
  return table.concat(out)
end

--- string.unpack(fmt, s, pos): the values, then the position after them.
function h.bunpack(fmt, s, pos)
  pos = pos or 1
  local out = {}
  for i, item in ipairs(parse_format(fmt)) do
    local n = item[2]
    local piece = s:sub(pos, pos + n - 1)
    if #piece < n then error("helper: data string too short for " .. fmt, 2) end
    if not item[3] then piece = piece:reverse() end
    out[i] = decode[item[1]](piece, 1, n)
    pos = pos + n
  end
  out[#out + 1] = pos
  return h.unpack(out)
end

--- x rounded to binary32 (to nearest, ties to even): the value an f32
-- element holds after storing x.
function h.f32(x)
  return (h.bunpack("<f", h.bpack("<f", x)))
end

--- The 8 little-endian bytes of the i64 whose two's complement bits are
-- hi * 2^32 + lo (hi, lo in [0, 2^32)): exact in every Lua version, also
-- where a Lua number cannot hold the value.
function h.i64_bytes(hi, lo)
  return le_bytes(lo, 4) .. le_bytes(hi, 4)
end

-- ---- files ------------------------------------------------------------------

--- The whole content of a file ("*a": the spelling every version reads).
function h.read_file(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

function h.write_file(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

--- A .npy file in the given version with the given dict and data bytes,
-- padded as NumPy pads it.
function h.npy_bytes(dict, data, major)
  major = major or 1
  local pre = major == 1 and 10 or 12
  local len = #dict + 1
  local total = math.ceil((pre + len) / 64) * 64
  local header = dict .. string.rep(" ", total - pre - len) .. "\n"
  local lenfield = major == 1 and h.bpack("<I2", #header) or h.bpack("<I4", #header)
  return "\147NUMPY" .. string.char(major, 0) .. lenfield .. header .. data
end

local NPY_CODES = { f16 = "<f2", f32 = "<f4", f64 = "<f8", i32 = "<i4", i64 = "<i8" }

--- The bytes of t's elements, row-major and little-endian, as t:save
-- writes them: the exact bits in every Lua version.
function h.saved_bytes(t)
  local path = os.tmpname()
  t:save(path)
  local s = h.read_file(path)
  os.remove(path)
  local major = s:byte(7)
  local pre = major == 1 and 10 or 12
  local hlen = h.bunpack(major == 1 and "<I2" or "<I4", s, 9)
  return s:sub(pre + hlen + 1)
end

--- A tensor of the given dtype and shape (a list) holding the given
-- little-endian element bytes, loaded from a .npy file: values a Lua
-- number cannot hold (i64 beyond 2^53 below 5.3) reach a tensor this way.
function h.from_bytes(dtype, shape, data)
  local dims = {}
  for i, n in ipairs(shape) do dims[i] = tostring(n) end
  local tuple = #dims == 1 and "(" .. dims[1] .. ",)" or "(" .. table.concat(dims, ", ") .. ")"
  local path = os.tmpname()
  h.write_file(path, h.npy_bytes(string.format("{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
    assert(NPY_CODES[dtype], "h.from_bytes: no .npy code for " .. tostring(dtype)), tuple), data))
  local t = ft.load(path)
  os.remove(path)
  return t
end

-- ---- errors -----------------------------------------------------------------

--- Runs fn, asserts that it raised an error, and returns the message.
function h.error_of(fn, ...)
  local args = h.pack(...)
  local call = function() return fn(h.unpack(args, 1, args.n)) end
  assert.has_error(call, nil, "expected an error, but the call returned normally")
  local ok, msg = pcall(call)
  assert.is_false(ok)
  return tostring(msg)
end

--- Asserts that fn raises an error whose message contains every one of
-- the given strings (plain text, not patterns). Returns the message.
function h.assert_error(fn, ...)
  local msg = h.error_of(fn)
  for i = 1, select("#", ...) do
    local needle = select(i, ...)
    assert.is_truthy(string.find(msg, needle, 1, true),
      string.format("expected the error message to contain %q, got %q", needle, msg))
  end
  return msg
end

--- Runs a Lua script in a new process of the interpreter running this
-- spec, with this spec's module paths and the variables of env (a table
-- of names to strings, optional) set; returns its output (stdout and
-- stderr).
function h.run_lua(script, env)
  local path = os.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(script)
  f:close()
  local lua = "lua5.4"
  if type(arg) == "table" and arg[-1] then
    local i = -1
    while arg[i - 1] do i = i - 1 end
    lua = arg[i]
  end
  local vars = {}
  for name, value in pairs(env or {}) do vars[#vars + 1] = ("%s=%q"):format(name, value) end
  table.sort(vars)
  local cmd = ("%s LUA_PATH=%q LUA_CPATH=%q %q %q 2>&1"):format(table.concat(vars, " "),
    package.path, package.cpath, lua, path)
  local p = assert(io.popen(cmd))
  local out = p:read("*a")
  p:close()
  os.remove(path)
  return out
end

-- ---- inputs -----------------------------------------------------------------

local seed_counter = 1000

--- A fresh seed: each call differs, and a run is reproducible.
function h.next_seed()
  seed_counter = seed_counter + 1
  return seed_counter
end

--- A plain-Lua nested table of the given shape with values drawn by gen()
-- (default: uniform in [-2, 2), never exactly zero).
function h.random_table(shape, gen)
  gen = gen or function()
    local v
    repeat v = math.random() * 4 - 2 until v ~= 0
    return v
  end
  local function rec(d)
    local t = {}
    for i = 1, shape[d] do
      t[i] = d == #shape and gen() or rec(d + 1)
    end
    return t
  end
  if #shape == 0 then return gen() end
  return rec(1)
end

--- A tensor of the given shape with standard normal values from a fresh
-- seed (f64 unless opts says otherwise).
function h.randn(shape, opts)
  opts = opts or {}
  return ft.randn(shape, { dtype = opts.dtype or "f64", seed = h.next_seed() })
end

-- ---- comparisons --------------------------------------------------------------

--- The elements of a nested table (or a number) in row-major order.
function h.flatten(t, out)
  out = out or {}
  if type(t) ~= "table" then
    out[#out + 1] = t
    return out
  end
  for _, v in ipairs(t) do h.flatten(v, out) end
  return out
end

--- Max |a - b| over two equally long flat lists.
function h.max_diff(a, b)
  assert.are.equal(#a, #b)
  local m = 0
  for i = 1, #a do
    local d = math.abs(a[i] - b[i])
    if d ~= d then return d end
    if d > m then m = d end
  end
  return m
end

--- Asserts every element of tensor t is within tol of the flat list (or
-- nested table) expected.
function h.assert_values(t, expected, tol, what)
  local got = h.flatten(t:totable())
  local want = h.flatten(expected)
  assert.are.equal(#want, #got, (what or "values") .. ": element count")
  for i = 1, #want do
    local ok
    if tol == nil or tol == 0 then
      ok = got[i] == want[i]
    else
      ok = math.abs(got[i] - want[i]) <= tol
    end
    if not ok then
      assert.are.equal(want[i], got[i], string.format("%s: element %d is %.17g, expected %.17g (tolerance %s)",
        what or "values", i, got[i], want[i], tostring(tol or 0)))
    end
  end
end

--- Plain-Lua matrix product of two nested tables [m][k] x [k][n].
function h.matmul_ref(a, b)
  local m, k, n = #a, #b, #b[1]
  assert.are.equal(k, #a[1])
  local c = {}
  for i = 1, m do
    c[i] = {}
    for j = 1, n do
      local s = 0
      for p = 1, k do s = s + a[i][p] * b[p][j] end
      c[i][j] = s
    end
  end
  return c
end

--- Runs a full collection twice (finalisers of finalisers) and returns the
-- CPU bytes in use after it.
function h.in_use()
  collectgarbage()
  collectgarbage()
  return ft.memory_stats().in_use
end

h.DTYPES = { "f64", "f32", "f16", "bf16", "i32", "i64" }
h.FLOAT_DTYPES = { "f64", "f32", "f16", "bf16" }

-- ---- GPU specs --------------------------------------------------------------

--- Why specs tagged #gpu cannot run here, or nil when they can.
function h.no_gpu_reason()
  if type(ft.cuda) ~= "table" then
    return "no CUDA device: this flashtile build has no CUDA backend (ft.cuda is absent)"
  end
  if not ft.cuda.is_built() then
    return "no CUDA device: this flashtile build has no CUDA backend"
  end
  if not ft.cuda.is_available() then
    return "no CUDA device: ft.cuda.is_available() is false"
  end
  return nil
end

--- An it() for GPU specs: the body runs with a usable device, and is
-- reported pending, with the reason, without one. Pass busted's it, and
-- pending wrapped in a function of the spec file: a required module does
-- not see the spec environment, and busted's pending means "this test is
-- pending" only when looked up inside the running test (taken at load
-- time it would declare another, empty test and let this one pass):
--   local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)
local function guarded_it(it, pending, why_not)
  return function(name, body)
    it(name, function()
      local reason = why_not()
      if reason then
        pending(reason)
        return
      end
      body()
    end)
  end
end

function h.gpu_it(it, pending) return guarded_it(it, pending, h.no_gpu_reason) end

--- Why specs tagged #multigpu cannot run here, or nil when they can.
function h.no_multigpu_reason()
  local r = h.no_gpu_reason()
  if r then return r end
  if not ft.dist.built() then return "this flashtile build has no NCCL (ft.dist.built() is false)" end
  if ft.cuda.device_count() < 2 then
    return "needs two CUDA devices, this machine has " .. ft.cuda.device_count()
  end
  return nil
end

--- An it() for specs that need two GPUs, as h.gpu_it.
function h.multigpu_it(it, pending) return guarded_it(it, pending, h.no_multigpu_reason) end

-- ---- attention specs' shared pieces -------------------------------------------------

--- A new table: t's fields, then extra's over them.
function h.merge(t, extra)
  local r = {}
  for k, v in pairs(t or {}) do r[k] = v end
  for k, v in pairs(extra or {}) do r[k] = v end
  return r
end

--- Fresh random q [B, Nq, H, d], k and v [B, Nk, Hk, d], dout [B, Nq, H, d]
-- in dtype (default f64).
function h.attention_inputs(B, Nq, Nk, H, Hk, d, dtype)
  local function r(shape) return h.ft.randn(shape, { dtype = dtype or "f64", seed = h.next_seed() }) end
  return r { B, Nq, H, d }, r { B, Nk, Hk, d }, r { B, Nk, Hk, d }, r { B, Nq, H, d }
end

--- Forward and backward with opts and impl on the GPU in dtype, from
-- inputs anywhere: {out, lse, dq, dk, dv} on the GPU.
function h.attention_on_gpu(impl, dtype, q, k, v, dout, opts)
  local o = h.merge(opts, { impl = impl })
  local qg, kg, vg = q:to(dtype):cuda(), k:to(dtype):cuda(), v:to(dtype):cuda()
  local out, lse = h.ft.attention(qg, kg, vg, o)
  local dq, dk, dv = h.ft.attention_backward(dout:to(dtype):cuda(), qg, kg, vg, out, lse, o)
  return { out, lse, dq, dk, dv }
end

--- flashtile's accuracy standard for a GPU result in dtype (FlashAttention's):
-- got's error against the f64 reference ref is at most twice that of the
-- naive path in the same precision (naive), plus a floor at the input's
-- rounding unit (4 of them, 1 for LSE), and never NaN. got, naive, ref:
-- {out, lse, dq, dk, dv}; rows that see no key have lse = -inf in each.
local ROUNDING = { f16 = 2^-10, bf16 = 2^-7, f32 = 2^-21 }
local ATTENTION_RESULTS = { "out", "lse", "dq", "dk", "dv" }
function h.assert_within_naive(impl, dtype, got, naive, ref, where)
  for i, name in ipairs(ATTENTION_RESULTS) do
    local e = h.ft.max_abs_diff(got[i]:cpu():double(), ref[i])
    local en = h.ft.max_abs_diff(naive[i]:cpu():double(), ref[i])
    assert.is_true(e == e, ("%s: %s %s has NaN"):format(where, impl, name))
    assert.is_true(e <= 2 * en + ROUNDING[dtype] * (name == "lse" and 1 or 4),
      ("%s: %s %s error %.3e > 2 x naive error %.3e"):format(where, impl, name, e, en))
  end
end

--- Forward then backward of sum(out * dout) with opts: {out, lse, dq, dk,
-- dv, dsink (with a sink)}.
function h.attention_both(q, k, v, dout, opts)
  local out, lse = h.ft.attention(q, k, v, opts)
  local dq, dk, dv, dsink = h.ft.attention_backward(dout, q, k, v, out, lse, opts)
  return { out = out, lse = lse, dq = dq, dk = dk, dv = dv, dsink = dsink }
end

--- Zeros as nested Lua tables r[b][i][h][e] of a [B, N, H, d] shape.
function h.zeros4(B, N, H, d)
  local r = {}
  for b = 1, B do
    r[b] = {}
    for i = 1, N do
      r[b][i] = {}
      for hh = 1, H do
        local row = {}
        for e = 1, d do row[e] = 0 end
        r[b][i][hh] = row
      end
    end
  end
  return r
end

-- ---- a plain-Lua attention reference (every variant) ------------------------------

local function tanh(x) -- Lua 5.3 dropped math.tanh
  local e = math.exp(-2 * math.abs(x))
  local t = (1 - e) / (1 + e)
  return x < 0 and -t or t
end


local function read(t) return t:totable() end

local zeros = h.zeros4

--- Attention with every variant, from the definitions, by loops over Lua
-- numbers. o: causal, window_left, window_right, softcap, scale, slopes
-- (a tensor [H] or [B, H]), sink (a tensor [H]), mask (dropout's, a tensor
-- [B, H, Nq, Nk], nonzero where kept) with p (dropout_p). Returns nested tables out, lse [b][h][i], dq, dk, dv and
-- dsink [h].
function h.attention_reference(q, k, v, dout, o)
  local B, Nq, H, d = q:size(1), q:size(2), q:size(3), q:size(4)
  local Nk, Hk = k:size(2), k:size(3)
  local G = h.idiv(H, Hk)
  local scale = o.scale or 1 / math.sqrt(d)
  local left = o.window_left or -1
  local right = o.causal and 0 or (o.window_right or -1)
  local shift = Nk - Nq
  local Q, K, V, dO = read(q), read(k), read(v), read(dout)
  local slopes = o.slopes and read(o.slopes)
  local sink = o.sink and read(o.sink)
  local mask = o.mask and read(o.mask)
  local O, dQ = zeros(B, Nq, H, d), zeros(B, Nq, H, d)
  local dK, dV = zeros(B, Nk, Hk, d), zeros(B, Nk, Hk, d)
  local L, dsink = {}, {}
  for hh = 1, H do dsink[hh] = 0 end
  for b = 1, B do
    L[b] = {}
    for hh = 1, H do
      L[b][hh] = {}
      local hk = h.idiv(hh - 1, G) + 1
      local slope = slopes and (#o.slopes.shape == 1 and slopes[hh] or slopes[b][hh]) or 0
      local sk = sink and sink[hh]
      for i = 1, Nq do
        local x, g, m = {}, {}, sk or -math.huge
        for j = 1, Nk do
          local i0, j0 = i - 1, j - 1
          if (left < 0 or j0 >= i0 + shift - left) and (right < 0 or j0 <= i0 + shift + right) then
            local dot = 0
            for e = 1, d do dot = dot + Q[b][i][hh][e] * K[b][j][hk][e] end
            local s = scale * dot
            g[j] = 1
            if o.softcap then
              local t = tanh(s / o.softcap)
              s, g[j] = o.softcap * t, 1 - t * t
            end
            x[j] = s - slope * math.abs(i0 + shift - j0)
            if x[j] > m then m = x[j] end
          end
        end
        local P, sum = {}, 0
        for j = 1, Nk do
          P[j] = (x[j] and m > -math.huge) and math.exp(x[j] - m) or 0
          sum = sum + P[j]
        end
        if sk then sum = sum + math.exp(sk - m) end
        for j = 1, Nk do P[j] = sum > 0 and P[j] / sum or 0 end
        L[b][hh][i] = sum > 0 and m + math.log(sum) or -math.huge
        local z = {}
        for j = 1, Nk do z[j] = mask and (mask[b][hh][i][j] > 0 and 1 / (1 - o.p) or 0) or 1 end
        local out = O[b][i][hh]
        for j = 1, Nk do
          for e = 1, d do out[e] = out[e] + P[j] * z[j] * V[b][j][hk][e] end
        end
        local gr, D = dO[b][i][hh], 0
        for e = 1, d do D = D + gr[e] * out[e] end
        if sk then dsink[hh] = dsink[hh] - math.exp(sk - L[b][hh][i]) * D end
        for j = 1, Nk do
          if x[j] then
            local dP = 0
            for e = 1, d do dP = dP + gr[e] * V[b][j][hk][e] end
            local dS = P[j] * (dP * z[j] - D) * g[j]
            local dqi, dkj, dvj = dQ[b][i][hh], dK[b][j][hk], dV[b][j][hk]
            for e = 1, d do
              dvj[e] = dvj[e] + P[j] * z[j] * gr[e]
              dqi[e] = dqi[e] + scale * dS * K[b][j][hk][e]
              dkj[e] = dkj[e] + scale * dS * Q[b][i][hh][e]
            end
          end
        end
      end
    end
  end
  return { out = O, lse = L, dq = dQ, dk = dK, dv = dV, dsink = dsink }
end

--- Asserts tensor t equals the nested table want within tol (infinities
-- exactly), naming the first element that is not.
function h.assert_table_close(t, want, tol, what)
  local got, exp = h.flatten(t:totable()), h.flatten(want)
  assert.are.equal(#exp, #got, what .. ": element count")
  for i = 1, #exp do
    local ok = exp[i] == got[i] or
        (exp[i] == exp[i] and math.abs(exp[i]) < math.huge and math.abs(got[i] - exp[i]) <= tol)
    if not ok then
      assert.is_true(false, ("%s: flat element %d is %.17g, reference %.17g (tolerance %g)")
        :format(what, i, got[i], exp[i], tol))
    end
  end
end


-- ---- running scripts as a user does -------------------------------------------

--- s quoted for the shell.
function h.quote(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

function h.exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

function h.read_all(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

--- The output (stdout and stderr) of a shell command, its exit status and
-- its wall-clock seconds. (io.popen's close gives no status in Lua 5.1.)
function h.sh(cmd)
  local t0 = ft.clock()
  local p = assert(io.popen("(" .. cmd .. ") 2>&1; echo \"[exit status $?]\""))
  local out = p:read("*a")
  p:close()
  local body, status = out:match("^(.-)%[exit status (%d+)%]\n?$")
  return body or out, tonumber(status), ft.clock() - t0
end

function h.lines_of(s)
  local r = {}
  for line in s:gmatch("[^\n]+") do r[#r + 1] = line end
  return r
end

--- A fresh empty directory, and its removal.
function h.tmpdir()
  local d = os.tmpname()
  os.remove(d)
  assert(h.sh("mkdir -p " .. h.quote(d)))
  return d
end
function h.rmdir(d) h.sh("rm -rf " .. h.quote(d)) end

--- The repository's root (the specs run from it).
h.ROOT = (h.sh("pwd")):gsub("\n$", "")

function h.absolute(path)
  if path:sub(1, 1) == "/" then return path end
  return h.ROOT .. "/" .. path:gsub("^%./", "")
end

--- The build tree this spec's flashtile comes from: the package.cpath
-- entry that holds flashtile/core.so (nil if none does).
h.BUILD = (function()
  for entry in package.cpath:gmatch("[^;]+") do
    local file = entry:gsub("%?", "flashtile/core")
    if entry:match("/%?%.so$") and h.exists(file) then return h.absolute(entry:gsub("/%?%.so$", "")) end
  end
  return nil
end)()

return h
