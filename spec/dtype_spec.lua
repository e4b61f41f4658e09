-- dtypes: f16/bf16 rounding, f32 round trips, float-to-int conversion,
-- 64-bit integers and dtype names.
local h = require "helper"
local ft = h.ft

local inf, nan = math.huge, 0 / 0
-- -0.0 computed, not written: Lua 5.1 keeps one constant for 0 and -0 in a
-- function, so a literal -0.0 next to a 0 would read as +0
local neg_zero = -1 / inf

--- x stored into a one-element tensor of dtype (through set, as ft.tensor
-- does) and read back.
local function via_set(x, dtype)
  return ft.tensor({ x }, { dtype = dtype }):get(1)
end

--- x converted from an f64 tensor by copy (the to() path).
local function via_copy(x, dtype)
  return ft.tensor({ x }, { dtype = "f64" }):to(dtype):get(1)
end

--- Both paths must agree; returns the value.
local function convert(x, dtype)
  local a, b = via_set(x, dtype), via_copy(x, dtype)
  assert.is_true(a == b or (a ~= a and b ~= b),
    string.format("set gives %.17g, copy gives %.17g for %.17g -> %s", a, b, x, dtype))
  return a
end

local function is_neg_zero(x) return x == 0 and 1 / x == -inf end
local function is_pos_zero(x) return x == 0 and 1 / x == inf end

-- The value of a binary16 / bfloat16 bit pattern, decoded in plain Lua.
local function decode(bits, exp_bits, mant_bits)
  local bias = 2 ^ (exp_bits - 1) - 1
  local m = bits % 2 ^ mant_bits
  local above = (bits - m) / 2 ^ mant_bits -- sign and exponent
  local e = above % 2 ^ exp_bits
  local sign = (above - e) / 2 ^ exp_bits % 2
  local v
  if e == 2 ^ exp_bits - 1 then
    v = m == 0 and inf or nan
  elseif e == 0 then
    v = m * 2.0 ^ (1 - bias - mant_bits)
  else
    v = (m + 2 ^ mant_bits) * 2.0 ^ (e - bias - mant_bits)
  end
  return sign == 1 and -v or v
end

--- Checks every finite positive pattern of a small float format: its value
-- converts exactly, and the midpoint to the next pattern rounds to the one
-- with the even mantissa (checked on both signs).
local function check_all_patterns(dtype, exp_bits, mant_bits)
  local last = (2 ^ exp_bits - 1) * 2 ^ mant_bits - 1 -- largest finite
  local values, mids, want_mid = {}, {}, {}
  for bits = 0, last do
    local v = decode(bits, exp_bits, mant_bits)
    values[#values + 1] = v
    values[#values + 1] = -v
    if bits < last then
      local mid = (v + decode(bits + 1, exp_bits, mant_bits)) / 2
      local even = bits % 2 == 0 and v or decode(bits + 1, exp_bits, mant_bits)
      mids[#mids + 1] = mid
      want_mid[#want_mid + 1] = even
      mids[#mids + 1] = -mid
      want_mid[#want_mid + 1] = -even
    end
  end
  local got = ft.tensor(values, { dtype = "f64" }):to(dtype):totable()
  for i, v in ipairs(values) do
    if got[i] ~= v then
      assert.are.equal(v, got[i], string.format("%s: %.17g converts to %.17g", dtype, v, got[i]))
    end
  end
  got = ft.tensor(mids, { dtype = "f64" }):to(dtype):totable()
  for i, v in ipairs(mids) do
    if got[i] ~= want_mid[i] then
      assert.are.equal(want_mid[i], got[i], string.format("%s: the tie %.17g rounds to %.17g, expected %.17g",
        dtype, v, got[i], want_mid[i]))
    end
  end
end

describe("dtypes", function()
  describe("f16", function()
    it("is exact for representable values", function()
      for _, x in ipairs { 1, 0.5, -2, 65504, -65504, 2 ^ -24, 2 ^ -14, 0.333251953125, 1 + 2 ^ -10, 1023.5 } do
        assert.are.equal(x, convert(x, "f16"))
      end
    end)

    it("rounds to nearest, ties to even", function()
      assert.are.equal(1, convert(1 + 2 ^ -11, "f16"))
      assert.are.equal(1 + 2 ^ -9, convert(1 + 3 * 2 ^ -11, "f16"))
      assert.are.equal(-1, convert(-(1 + 2 ^ -11), "f16"))
      -- just above a tie goes up
      assert.are.equal(1 + 2 ^ -10, convert(1 + 2 ^ -11 + 2 ^ -30, "f16"))
      -- nearest f16 of 0.1
      assert.are.equal(0.0999755859375, convert(0.1, "f16"))
      -- subnormal ties: 2^-25 is halfway between 0 and 2^-24
      assert.is_true(is_pos_zero(convert(2 ^ -25, "f16")))
      assert.are.equal(2 ^ -23, convert(3 * 2 ^ -25, "f16"))
    end)

    it("rounds every pattern and every midpoint correctly", function()
      check_all_patterns("f16", 5, 10)
    end)

    it("overflows to inf past the largest finite value", function()
      assert.are.equal(inf, convert(65520, "f16"))
      assert.are.equal(-inf, convert(-65520, "f16"))
      assert.are.equal(65504, convert(65519, "f16"))
      assert.are.equal(inf, convert(1e300, "f16"))
      assert.are.equal(inf, convert(inf, "f16"))
      assert.are.equal(-inf, convert(-inf, "f16"))
    end)

    it("keeps NaN and the sign of zero", function()
      local v = convert(nan, "f16")
      assert.is_true(v ~= v)
      assert.is_true(is_neg_zero(convert(neg_zero, "f16")))
      assert.is_true(is_pos_zero(convert(0.0, "f16")))
      assert.is_true(is_neg_zero(convert(-(2 ^ -26), "f16")))
    end)
  end)

  describe("bf16", function()
    it("is exact for representable values", function()
      for _, x in ipairs { 1, 0.5, -2, 3.140625, 2 ^ -133, 2 ^ -126, 255, 3.3895313892515355e38 } do
        assert.are.equal(x, convert(x, "bf16"))
      end
    end)

    it("rounds to nearest, ties to even", function()
      assert.are.equal(1, convert(1 + 2 ^ -8, "bf16"))
      assert.are.equal(1 + 2 ^ -6, convert(1 + 3 * 2 ^ -8, "bf16"))
      assert.are.equal(3.140625, convert(math.pi, "bf16"))
      assert.are.equal(-(1 + 2 ^ -6), convert(-(1 + 3 * 2 ^ -8), "bf16"))
    end)

    it("rounds every pattern and every midpoint correctly", function()
      check_all_patterns("bf16", 8, 7)
    end)

    it("converts contiguous tensors to and from f32 with the bits of the element loop (strided views take that)", function()
      local function same(a, b, what)
        for i = 1, #a do
          local x, y = a[i], b[i]
          if not ((x ~= x and y ~= y and tostring(x) == tostring(y)) or (x == y and 1 / x == 1 / y)) then
            error(("%s: element %d is %s contiguous, %s strided"):format(what, i, tostring(x), tostring(y)))
          end
        end
      end
      local function strided(n, dtype) return ft.empty({ n, 2 }, { dtype = dtype }):select(2, 1) end
      -- every bf16 pattern's value (and NaNs of both signs) to f32
      local values = {}
      for bits = 0, 65535 do values[#values + 1] = decode(bits, 8, 7) end
      values[#values + 1] = -nan
      local b = ft.tensor(values, { dtype = "f64" }):to("bf16")
      local slow = strided(#values, "f32")
      slow:copy(b)
      same(b:to("f32"):totable(), slow:totable(), "bf16 -> f32")
      -- f32 values around every rounding case to bf16: the patterns, their
      -- midpoints, one f32 ulp either side, f32's largest, the infinities, NaNs
      local f = {}
      for bits = 0, 32639 do
        local v, w = decode(bits, 8, 7), decode(bits + 1, 8, 7)
        local mid = (v + w) / 2
        for _, x in ipairs { v, mid, mid * (1 + 2 ^ -23), mid * (1 - 2 ^ -24) } do
          f[#f + 1] = x
          f[#f + 1] = -x
        end
      end
      for _, x in ipairs { 3.4028234663852886e38, -3.4028234663852886e38, inf, -inf, nan, -nan, 2 ^ -149 } do
        f[#f + 1] = x
      end
      local x32 = ft.tensor(f, { dtype = "f64" }):to("f32")
      local slow16 = strided(#f, "bf16")
      slow16:copy(x32)
      same(x32:to("bf16"):totable(), slow16:totable(), "f32 -> bf16")
      -- fp8: the 256 patterns, 16 times (enough to take the table)
      local bytes = {}
      for r = 1, 16 do for v = 0, 255 do bytes[#bytes + 1] = decode(v, 4, 3) end end
      local e = ft.tensor(bytes, { dtype = "f64" }):to("fp8_e4m3")
      for _, to in ipairs { "f32", "f64", "bf16" } do
        local s8 = strided(#bytes, to)
        s8:copy(e)
        same(e:to(to):totable(), s8:totable(), "fp8_e4m3 -> " .. to)
      end
    end)

    it("overflows to inf, keeps NaN and the sign of zero", function()
      assert.are.equal(inf, convert(3.4028234663852886e38, "bf16"))
      assert.are.equal(-inf, convert(-1e39, "bf16"))
      local v = convert(nan, "bf16")
      assert.is_true(v ~= v)
      assert.is_true(is_neg_zero(convert(neg_zero, "bf16")))
    end)
  end)

  describe("f32", function()
    local f32 = h.f32

    it("round trips f32-representable values through f64", function()
      local vals = {}
      for i = 1, 200 do vals[i] = f32((math.random() - 0.5) * 10.0 ^ math.random(-30, 30)) end
      vals[#vals + 1] = 3.4028234663852886e38
      vals[#vals + 1] = 2 ^ -149
      local t = ft.tensor(vals, { dtype = "f64" })
      local back = t:float():double()
      assert.are.same(vals, back:totable())
      assert.are.same(vals, ft.tensor(vals, { dtype = "f32" }):totable())
    end)

    it("rounds doubles as C does (nearest even)", function()
      local vals = {}
      for i = 1, 200 do vals[i] = (math.random() - 0.5) * 10.0 ^ math.random(-20, 20) end
      local got = ft.tensor(vals, { dtype = "f64" }):float():totable()
      for i, v in ipairs(vals) do assert.are.equal(f32(v), got[i]) end
    end)
  end)

  describe("float to integer", function()
    it("truncates toward zero", function()
      local src = { 2.9, -2.9, 0.5, -0.5, 7.0, -1e-300 }
      for _, dtype in ipairs { "i32", "i64" } do
        assert.are.same({ 2, -2, 0, 0, 7, 0 }, ft.tensor(src, { dtype = "f64" }):to(dtype):totable())
        assert.are.same({ 2, -2, 0, 0, 7, 0 }, ft.tensor(src, { dtype = dtype }):totable())
      end
    end)

    it("saturates i32, and NaN gives 0", function()
      local src = { 3e9, -3e9, inf, -inf, nan, 2147483647.5, -2147483648.9, 2147483648.0 }
      local want = { 2147483647, -2147483648, 2147483647, -2147483648, 0, 2147483647,
        -2147483648, 2147483647 }
      assert.are.same(want, ft.tensor(src, { dtype = "f64" }):int():totable())
      assert.are.same(want, ft.tensor(src, { dtype = "i32" }):totable())
      assert.are.equal(2147483647, ft.tensor({ 3e9 }, { dtype = "f32" }):int():get(1))
    end)

    it("saturates i64, and NaN gives 0", function()
      local src = { 1e19, -1e19, inf, -inf, nan, 2.0 ^ 63, -2.0 ^ 63, 2.0 ^ 63 - 1024 }
      -- below 5.3 an i64 reads back as a double: 2^63 - 1 as 2^63
      local max = h.has_int64 and math.maxinteger or 2 ^ 63
      local min = h.has_int64 and math.mininteger or -2 ^ 63
      local want = { max, min, max, min, 0, max, min, 9223372036854774784 }
      assert.are.same(want, ft.tensor(src, { dtype = "f64" }):long():totable())
      assert.are.same(want, ft.tensor(src, { dtype = "i64" }):totable())
      -- the stored bits, exact in every version
      local MAX, MIN = h.i64_bytes(0x7FFFFFFF, 0xFFFFFFFF), h.i64_bytes(0x80000000, 0)
      local bytes = MAX .. MIN .. MAX .. MIN .. h.i64_bytes(0, 0) .. MAX .. MIN
        .. h.i64_bytes(0x7FFFFFFF, 0xFFFFFC00)
      assert.are.equal(bytes, h.saved_bytes(ft.tensor(src, { dtype = "f64" }):long()))
      assert.are.equal(bytes, h.saved_bytes(ft.tensor(src, { dtype = "i64" })))
    end)

    it("saturates a Lua integer stored into i32", function()
      assert.are.same({ 2147483647, -2147483648 },
        ft.tensor({ 3000000000, -3000000000 }, { dtype = "i32" }):totable())
      assert.are.same({ 2147483647 },
        ft.tensor({ 3000000000 }, { dtype = "i64" }):int():totable())
    end)
  end)

  describe("i64", function()
    -- 2^53 + 1, -(2^53 + 1), 2^63 - 1 and -2^63 as bits
    local big_bytes = h.i64_bytes(0x200000, 1) .. h.i64_bytes(0xFFDFFFFF, 0xFFFFFFFF)
      .. h.i64_bytes(0x7FFFFFFF, 0xFFFFFFFF) .. h.i64_bytes(0x80000000, 0)

    it("keeps integers above 2^53", function()
      if not h.has_int64 then
        pending("Lua integers above 2^53 need 5.3 (" .. _VERSION .. " numbers are doubles); "
          .. "the bits and the doubles up to 2^53 are checked below")
      end
      local big = { 9007199254740993, -9007199254740993, math.maxinteger, math.mininteger }
      local t = ft.tensor(big, { dtype = "i64" })
      for i, v in ipairs(big) do
        assert.are.equal(v, t:get(i))
        assert.are.equal("integer", math.type(t:get(i)))
      end
      assert.are.same(big, t:totable())
      assert.are.same(big, t:clone():totable())
      assert.are.same(big, ft.zeros(4, { dtype = "i64" }):copy(t):totable())
      assert.are.equal(big_bytes, h.saved_bytes(t))
    end)

    it("keeps the 64 bits of values beyond 2^53 through clone and copy", function()
      local t = h.from_bytes("i64", { 4 }, big_bytes)
      assert.are.equal(big_bytes, h.saved_bytes(t))
      assert.are.equal(big_bytes, h.saved_bytes(t:clone()))
      assert.are.equal(big_bytes, h.saved_bytes(ft.zeros(4, { dtype = "i64" }):copy(t)))
      -- read as the nearest Lua number: exact with 5.3's integers, the
      -- nearest double below 5.3
      local want = h.has_int64 and { 9007199254740993, -9007199254740993, math.maxinteger, math.mininteger }
        or { 2 ^ 53, -2 ^ 53, 2 ^ 63, -2 ^ 63 }
      assert.are.same(want, t:totable())
    end)

    it("round trips every integer up to 2^53 and the doubles beyond it exactly", function()
      local vals = { 2 ^ 53, -2 ^ 53, 2 ^ 53 - 1, -(2 ^ 53 - 1), 2 ^ 52 + 1, 2 ^ 62, -2 ^ 63,
        2 ^ 62 + 2 ^ 10, 123456789012345, -987654321098765, 2 ^ 63 - 1024 }
      local t = ft.tensor(vals, { dtype = "i64" })
      for i, v in ipairs(vals) do assert.are.equal(v, t:get(i)) end
      assert.are.same(vals, t:totable())
      assert.are.same(vals, t:clone():totable())
      assert.are.same(vals, ft.tensor(vals, { dtype = "f64" }):long():totable())
      local bytes = {}
      for i, v in ipairs(vals) do bytes[i] = h.bpack("<i8", v) end
      assert.are.equal(table.concat(bytes), h.saved_bytes(t))
    end)

    it("set keeps all 64 bits", function()
      local t = ft.zeros(2, { dtype = "i64" })
      if h.has_int64 then
        t:set(2, 9007199254740993)
        assert.are.equal(9007199254740993, t:get(2))
        assert.are.equal(9007199254740993, t:narrow(1, 2, 1):item())
        assert.are.equal(h.i64_bytes(0, 0) .. h.i64_bytes(0x200000, 1), h.saved_bytes(t))
      end
      -- a double beyond 2^53 (the 5.1 spelling of a large integer)
      t:set(1, 2 ^ 62 + 2 ^ 10)
      assert.are.equal(2 ^ 62 + 2 ^ 10, t:get(1))
      assert.are.equal(2 ^ 62 + 2 ^ 10, t:narrow(1, 1, 1):item())
      assert.are.equal(h.i64_bytes(0x40000000, 0x400), h.saved_bytes(t):sub(1, 8))
    end)
  end)

  describe("names", function()
    it("accepts the aliases of each dtype", function()
      local aliases = {
        double = "f64", float64 = "f64", float = "f32", float32 = "f32",
        half = "f16", float16 = "f16", bfloat16 = "bf16", int = "i32",
        int32 = "i32", long = "i64", int64 = "i64",
      }
      for alias, dtype in pairs(aliases) do
        assert.are.equal(dtype, ft.zeros(1, { dtype = alias }).dtype, alias)
        assert.are.equal(dtype, ft.zeros(1, { dtype = "f64" }):to(alias):to(dtype).dtype, alias)
        local c = ft.ones(1, { dtype = dtype == "f64" and "f32" or "f64" }):to(alias)
        assert.are.equal(dtype, c.dtype, alias)
      end
    end)

    it("accepts the short names", function()
      for _, dtype in ipairs(h.DTYPES) do
        assert.are.equal(dtype, ft.zeros(1, { dtype = dtype }).dtype)
      end
    end)
  end)

  describe("copies of strided views", function()
    -- values every dtype holds exactly (small integers and halves), and some
    -- that round, NaN, infinities and -0 where the dtype has them
    local function source()
      local v = {}
      for i = 1, 2 * 3 * 5 do v[i] = (i % 7) * 0.5 - 1.5 + (i % 3 == 0 and 1e-3 or 0) end
      return ft.tensor(v, { dtype = "f64" }):view(2, 3, 5)
    end
    local FLOATS = { f64 = true, f32 = true, f16 = true, bf16 = true, fp8_e4m3 = true }

    it("move a permuted view's elements in order, every dtype, and convert them as contiguous tensors do", function()
      local DT = { "f64", "f32", "f16", "bf16", "i32", "i64", "fp8_e4m3" }
      for _, from in ipairs(DT) do
        local x = source():to(from)
        if FLOATS[from] and from ~= "fp8_e4m3" then
          x:set(1, 1, 1, 0 / 0)
          x:set(1, 1, 2, 1 / 0)
          x:set(1, 1, 3, -1 / inf)
        end
        local p = x:permute(3, 1, 2) -- [5, 2, 3], no stride 1 at the end
        -- the same dtype: element (k, i, j) is x's (i, j, k)
        local got, want = p:contiguous():totable(), x:totable()
        for k = 1, 5 do for i = 1, 2 do for j = 1, 3 do
          local a, b = got[k][i][j], want[i][j][k]
          assert.is_true(a == b or (a ~= a and b ~= b), ("%s (%d, %d, %d)"):format(from, i, j, k))
        end end end
        -- a transpose of the last two dims (copied by tiles of 16 rows; 17 and
        -- 40 rows leave partial tiles)
        for _, rc in ipairs { { 17, 20 }, { 40, 3 } } do
          local vals = {}
          for i = 1, 2 * rc[1] * rc[2] do vals[i] = (i * 37) % 101 - 50 end
          local y = ft.tensor(vals, { dtype = "f64" }):view(2, rc[2], rc[1]):to(from)
          local t, yt = y:transpose(2, 3):contiguous():totable(), y:totable()
          for b = 1, 2 do for i = 1, rc[1] do for j = 1, rc[2] do
            assert.are.equal(yt[b][j][i], t[b][i][j], ("%s transposed (%d, %d, %d)"):format(from, b, i, j))
          end end end
        end
        -- to every dtype: strided rows against the contiguous conversion
        for _, to in ipairs(DT) do
          local a = p:to(to):totable()
          local b = x:to(to):permute(3, 1, 2):contiguous():totable()
          for k = 1, 5 do for i = 1, 2 do for j = 1, 3 do
            local u, w = a[k][i][j], b[k][i][j]
            assert.is_true((u ~= u and w ~= w) or (u == w and 1 / u == 1 / w),
              ("%s -> %s (%d, %d, %d): %s strided, %s contiguous"):format(from, to, i, j, k, tostring(u), tostring(w)))
          end end end
        end
      end
    end)
  end)
end)
