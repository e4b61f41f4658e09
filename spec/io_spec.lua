-- Files: NumPy .npy save and load.
local h = require "helper"
local ft = h.ft

local read_file, write_file = h.read_file, h.write_file

--- A .npy file in the given version with the given dict and data bytes,
-- padded as NumPy pads it.
local npy_bytes = h.npy_bytes

-- Bytes are built with h.bpack and read with h.bunpack (string.pack and
-- string.unpack of 5.3, for every Lua version); the last describe checks
-- them against fixed bytes, and against string.pack where it exists.

--- Values representable in dtype, never all zero.
local function sample(shape, dtype)
  if dtype == "i32" or dtype == "i64" then
    return h.random_table(shape, function()
      local v = math.random(-100000, 100000)
      return v == 0 and 1 or v
    end)
  end
  return ft.tensor(h.random_table(shape), { dtype = "f64" }):to(dtype):totable()
end

describe("npy files", function()
  local path
  before_each(function() path = os.tmpname() end)
  after_each(function() os.remove(path) end)

  describe("round trips", function()
    local dtypes = { "f16", "f32", "f64", "i32", "i64" }
    local shapes = { { 2, 3, 4 }, { 7 }, {}, { 0 }, { 3, 0, 2 } }

    for _, dtype in ipairs(dtypes) do
      for _, shape in ipairs(shapes) do
        it(string.format("%s of shape {%s}", dtype, table.concat(shape, ", ")), function()
          local src = sample(shape, dtype)
          local t = ft.tensor(src, { dtype = dtype })
          if #shape > 0 and shape[#shape] == 0 then t = ft.zeros(shape, { dtype = dtype }) end
          assert.are.equal(t, t:save(path))
          local back = ft.load(path)
          assert.are.equal(dtype, back.dtype)
          assert.are.equal("cpu", back.device)
          assert.are.same(t.shape, back.shape)
          assert.are.same(t:totable(), back:totable())
          assert.is_true(back:is_contiguous())
        end)
      end

      it(dtype .. " of a transposed view, saved in its logical order", function()
        local base = ft.tensor(sample({ 3, 5 }, dtype), { dtype = dtype })
        local view = base:transpose()
        view:save(path)
        local back = ft.load(path)
        assert.are.same({ 5, 3 }, back.shape)
        assert.are.same(view:totable(), back:totable())
      end)
    end

    it("i64 keeps integers above 2^53", function()
      if not h.has_int64 then
        pending("Lua integers above 2^53 need 5.3 (" .. _VERSION .. " numbers are doubles); "
          .. "the next spec checks the bits")
      end
      local big = { 9007199254740993, math.mininteger, math.maxinteger }
      ft.tensor(big, { dtype = "i64" }):save(path)
      assert.are.same(big, ft.load(path):totable())
    end)

    it("i64 keeps the 64 bits of values beyond 2^53, and doubles up to 2^53 exactly", function()
      local bits = h.i64_bytes(0x200000, 1) .. h.i64_bytes(0x80000000, 0) .. h.i64_bytes(0x7FFFFFFF, 0xFFFFFFFF)
      h.from_bytes("i64", { 3 }, bits):save(path)
      assert.are.equal(bits, h.saved_bytes(ft.load(path)))
      local exact = { 2 ^ 53, -2 ^ 53, 2 ^ 53 - 1, 2 ^ 62 + 2 ^ 10, -2 ^ 63 }
      ft.tensor(exact, { dtype = "i64" }):save(path)
      assert.are.same(exact, ft.load(path):totable())
    end)

    it("f64 keeps every bit, NaN and infinities included", function()
      local v = { 0.1, -1 / 3, 2 ^ -1074, math.huge, -math.huge }
      ft.tensor(v, { dtype = "f64" }):save(path)
      local back = ft.load(path):totable()
      assert.are.same(v, back)
      ft.tensor({ 0 / 0 }, { dtype = "f64" }):save(path)
      local n = ft.load(path):item()
      assert.is_true(n ~= n)
    end)
  end)

  describe("the file written", function()
    it("has NumPy's exact header for a 2x3 f32", function()
      local t = ft.tensor({ { 1, 2, 3 }, { 4, 5, 6.5 } })
      t:save(path)
      local bytes = read_file(path)
      assert.are.equal("\147NUMPY", bytes:sub(1, 6))
      assert.are.equal("\1\0", bytes:sub(7, 8)) -- version 1.0
      local hlen = h.bunpack("<I2", bytes, 9)
      assert.are.equal(0, (10 + hlen) % 64)
      local header = bytes:sub(11, 10 + hlen)
      local dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
      assert.are.equal(dict, header:sub(1, #dict))
      assert.are.equal(string.rep(" ", hlen - #dict - 1) .. "\n", header:sub(#dict + 1))
      assert.are.equal(10 + hlen + 6 * 4, #bytes)
      assert.are.equal(h.bpack("<ffffff", 1, 2, 3, 4, 5, 6.5), bytes:sub(11 + hlen))
    end)

    it("writes 1-d shapes as (n,) and 0-d as ()", function()
      ft.tensor({ 1, 2, 3, 4, 5 }, { dtype = "i64" }):save(path)
      local bytes = read_file(path)
      assert.is_truthy(bytes:find("{'descr': '<i8', 'fortran_order': False, 'shape': (5,), }", 1, true))
      ft.tensor(2.5, { dtype = "f64" }):save(path)
      bytes = read_file(path)
      assert.is_truthy(bytes:find("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", 1, true))
      local hlen = h.bunpack("<I2", bytes, 9)
      assert.are.equal(h.bpack("<d", 2.5), bytes:sub(11 + hlen))
    end)

    it("uses the NumPy type codes of each dtype", function()
      local codes = { f16 = "<f2", f32 = "<f4", f64 = "<f8", i32 = "<i4", i64 = "<i8" }
      for dtype, code in pairs(codes) do
        ft.ones(2, { dtype = dtype }):save(path)
        assert.is_truthy(read_file(path):find("'descr': '" .. code .. "'", 1, true), dtype)
      end
    end)
  end)

  describe("loading files NumPy writes", function()
    it("reads a little-endian i8 file", function()
      write_file(path, npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 2), }",
        h.bpack("<i8i8i8i8", 1, -2, 3, 2 ^ 60)))
      local t = ft.load(path)
      assert.are.equal("i64", t.dtype)
      assert.are.same({ { 1, -2 }, { 3, 2 ^ 60 } }, t:totable())
    end)

    it("reads big-endian data", function()
      write_file(path, npy_bytes("{'descr': '>f8', 'fortran_order': False, 'shape': (3,), }",
        h.bpack(">ddd", 1.5, -0.25, 1e100)))
      assert.are.same({ 1.5, -0.25, 1e100 }, ft.load(path):totable())
    end)

    it("reads fortran_order data into row-major order", function()
      -- the 2x3 matrix {{1, 2, 3}, {4, 5, 6}} stored column by column
      write_file(path, npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
        h.bpack("<ffffff", 1, 4, 2, 5, 3, 6)))
      assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, ft.load(path):totable())
    end)

    it("reads format version 2.0", function()
      write_file(path, npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }",
        h.bpack("<i4i4", 7, -9), 2))
      assert.are.same({ 7, -9 }, ft.load(path):totable())
    end)
  end)

  describe("errors", function()
    it("saving bf16 is rejected with a clear message", function()
      local msg = h.assert_error(function() return ft.ones(2, { dtype = "bf16" }):save(path) end,
        "bf16")
      assert.is_truthy(msg:find("npy", 1, true), msg)
    end)

    it("loading a missing file names the path", function()
      os.remove(path)
      local missing = path .. "-does-not-exist.npy"
      h.assert_error(function() return ft.load(missing) end, missing)
    end)

    it("loading a file that is not .npy fails", function()
      write_file(path, "hello, this is not a numpy file\n")
      h.assert_error(function() return ft.load(path) end, path, "not a .npy file")
    end)

    it("loading a truncated file fails", function()
      write_file(path, npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (4,), }",
        h.bpack("<dd", 1, 2)))
      h.assert_error(function() return ft.load(path) end, path, "truncated")
    end)

    it("loading an unsupported dtype names it", function()
      write_file(path, npy_bytes("{'descr': '<c16', 'fortran_order': False, 'shape': (1,), }",
        string.rep("\0", 16)))
      h.assert_error(function() return ft.load(path) end, "c16")
    end)

    it("saving into a missing directory names the path", function()
      local bad = path .. ".d/no/such/dir/x.npy"
      h.assert_error(function() return ft.ones(2):save(bad) end, bad)
    end)

    it("save and load need a path", function()
      h.assert_error(function() return ft.load() end, "string expected")
      h.assert_error(function() return ft.ones(2):save() end, "string expected")
    end)
  end)
end)

describe("the specs' byte helpers", function()
  local function unhex(s)
    return (s:gsub("%x%x", function(x) return string.char(tonumber(x, 16)) end))
  end
  local function is_neg_zero(x) return x == 0 and 1 / x < 0 end

  -- bytes from string.pack of Lua 5.4 on x86-64
  local F32 = { -- bytes, value, the f32 it rounds to
    { "0000803f", 1, 1 }, { "000020c0", -2.5, -2.5 }, { "cdcccc3d", 0.1, 0.10000000149011612 },
    { "01000000", 2 ^ -149, 2 ^ -149 }, { "00000000", 2 ^ -150, 0 },             -- tie to even: 0
    { "02000000", 3 * 2 ^ -150, 2 ^ -148 },                                        -- tie to even: up
    { "0000803f", 1 + 2 ^ -24, 1 }, { "0200803f", 1 + 3 * 2 ^ -24, 1 + 2 ^ -22 },
    { "0000807f", 3.4028235677973366e38, math.huge },                              -- rounds past the largest
    { "ffff7f7f", 3.4028234663852886e38, 3.4028234663852886e38 },
    { "01000000", 1e-45, 2 ^ -149 }, { "0000807f", math.huge, math.huge },
    { "000080ff", -math.huge, -math.huge }, { "00e07f47", 65504, 65504 },
    { "00008000", 2 ^ -126 * (1 - 2 ^ -24), 2 ^ -126 },                          -- subnormal rounds up to normal
  }
  local F64 = {
    { "000000000000f03f", 1 }, { "00000000000004c0", -2.5 }, { "9a9999999999b93f", 0.1 },
    { "0100000000000000", 2 ^ -1074 }, { "0000000000001000", 2 ^ -1022 },
    { "ffffffffffffef7f", 1.7976931348623157e308 }, { "555555555555d53f", 1 / 3 },
    { "2be6708b68120080", -1e-310 }, { "000000000000f07f", math.huge },
  }
  local I64 = {
    { "0000000000000000", 0 }, { "ffffffffffffffff", -1 }, { "0000000000002000", 2 ^ 53 },
    { "000000000000e0ff", -2 ^ 53 }, { "0000000000000040", 2 ^ 62 }, { "0000000000000080", -2 ^ 63 },
    { "79df0d8648700000", 123456789012345 }, { "4f9721c5ffffffff", -987654321 },
  }
  local I32 = {
    { "00000000", 0 }, { "ffffffff", -1 }, { "ffffff7f", 2147483647 }, { "00000080", -2147483648 },
    { "07000000", 7 }, { "f7ffffff", -9 },
  }

  it("encode and decode fixed values to the bytes of string.pack", function()
    for _, c in ipairs(F32) do
      assert.are.equal(unhex(c[1]), h.bpack("<f", c[2]), string.format("%.17g as f32", c[2]))
      assert.are.equal(c[3], (h.bunpack("<f", unhex(c[1]))))
      assert.are.equal(c[3], h.f32(c[2]))
      assert.are.equal(unhex(c[1]):reverse(), h.bpack(">f", c[2]))
    end
    for _, c in ipairs(F64) do
      assert.are.equal(unhex(c[1]), h.bpack("<d", c[2]), string.format("%.17g as f64", c[2]))
      assert.are.equal(c[2], (h.bunpack("<d", unhex(c[1]))))
      assert.are.equal(c[2], (h.bunpack(">d", unhex(c[1]):reverse())))
    end
    for _, c in ipairs(I64) do
      assert.are.equal(unhex(c[1]), h.bpack("<i8", c[2]), string.format("%.17g as i8", c[2]))
      assert.are.equal(c[2], (h.bunpack("<i8", unhex(c[1]))))
    end
    for _, c in ipairs(I32) do
      assert.are.equal(unhex(c[1]), h.bpack("<i4", c[2]))
      assert.are.equal(c[2], (h.bunpack("<i4", unhex(c[1]))))
    end
    local neg_zero = -1 / math.huge
    assert.are.equal(unhex("00000080"), h.bpack("<f", neg_zero))
    assert.are.equal(unhex("0000000000000080"), h.bpack("<d", neg_zero))
    assert.is_true(is_neg_zero(h.f32(neg_zero)))
    assert.is_true(is_neg_zero((h.bunpack("<d", unhex("0000000000000080")))))
    local n = h.bunpack("<f", unhex("0000c07f"))
    assert.is_true(n ~= n)
    n = h.bunpack("<d", unhex("000000000000f8ff"))
    assert.is_true(n ~= n)
    -- several items, both byte orders, and the position after them
    local s = unhex("0102ffffffffffff785634123ff8000000000000fffffffebf400000d4fe80ff")
    assert.are.equal(s, h.bpack("<I2I2I4I4>d>i4>f<i2<i1<I1", 513, 65535, 4294967295, 305419896,
      1.5, -2, -0.75, -300, -128, 255))
    assert.are.same({ 513, 65535, 4294967295, 305419896, 1.5, -2, -0.75, -300, -128, 255, #s + 1 },
      { h.bunpack("<I2I2I4I4>d>i4>f<i2<i1<I1", s) })
    assert.are.same({ -300, #s + 3 }, { h.bunpack("<i2", s .. unhex("d4fe"), #s + 1) })
  end)

  it("write the exact bits of i64 values beyond 2^53", function()
    assert.are.equal(unhex("0100000000002000"), h.i64_bytes(0x200000, 1))
    assert.are.equal(unhex("ffffffffffffff7f"), h.i64_bytes(0x7FFFFFFF, 0xFFFFFFFF))
    assert.are.equal(unhex("0000000000000080"), h.i64_bytes(0x80000000, 0))
    if h.has_int64 then
      assert.are.equal(h.i64_bytes(0x200000, 1), h.bpack("<i8", 9007199254740993))
      assert.are.equal(h.i64_bytes(0x7FFFFFFF, 0xFFFFFFFF), h.bpack("<i8", math.maxinteger))
      assert.are.equal(h.i64_bytes(0x80000000, 0), h.bpack("<i8", math.mininteger))
      assert.are.equal(math.maxinteger, (h.bunpack("<i8", h.i64_bytes(0x7FFFFFFF, 0xFFFFFFFF))))
      assert.are.equal("integer", math.type((h.bunpack("<i8", h.i64_bytes(0x200000, 1)))))
      assert.are.equal(9007199254740993, (h.bunpack("<i8", h.i64_bytes(0x200000, 1))))
    else
      -- the nearest double
      assert.are.equal(2 ^ 53, (h.bunpack("<i8", h.i64_bytes(0x200000, 1))))
      assert.are.equal(2 ^ 63, (h.bunpack("<i8", h.i64_bytes(0x7FFFFFFF, 0xFFFFFFFF))))
    end
  end)

  it("reject values their format cannot hold", function()
    assert.has_error(function() h.bpack("<i4", 2 ^ 31) end)
    assert.has_error(function() h.bpack("<i8", 2 ^ 63) end)
    assert.has_error(function() h.bpack("<I2", -1) end)
    assert.has_error(function() h.bpack("<i4", 1.5) end)
    assert.has_error(function() h.bpack("<x", 1) end)
    assert.has_error(function() h.bunpack("<d", "short") end)
  end)

  it("agree with string.pack and string.unpack on many values", function()
    if not string.pack then
      pending("string.pack needs 5.3 (" .. _VERSION .. "); the fixed bytes above are checked here")
    end
    local floats, ints = {}, {}
    for e = -1080, 1030, 3 do
      floats[#floats + 1] = (math.random() - 0.5) * 2.0 ^ e
      floats[#floats + 1] = 2.0 ^ e
    end
    for e = -155, 130 do
      local base = 2.0 ^ e
      floats[#floats + 1] = (1 + (math.random() - 0.5) * 2 ^ -20) * base
      floats[#floats + 1] = base * (1 + 2 ^ -24)          -- f32 ties
      floats[#floats + 1] = -base * (1 + 3 * 2 ^ -24)
      floats[#floats + 1] = base * (1 + 2 ^ -24 + 2 ^ -40)
    end
    for _, v in ipairs(floats) do
      for _, fmt in ipairs { "<f", "<d", ">f", ">d" } do
        local want = string.pack(fmt, v)
        assert.are.equal(want, h.bpack(fmt, v), string.format("%s of %.17g", fmt, v))
        local a, pa = h.bunpack(fmt, want)
        local b, pb = string.unpack(fmt, want)
        assert.is_true(a == b and 1 / a == 1 / b and pa == pb, string.format("%s of %.17g", fmt, v))
      end
    end
    for _ = 1, 500 do
      ints[#ints + 1] = math.random(math.mininteger, -1)
      ints[#ints + 1] = math.random(0, math.maxinteger)
      ints[#ints + 1] = math.random(-70000, 70000)
    end
    for _, v in ipairs { 0, -1, 255, -128, 32767, -32768, 65535, 2147483647, -2147483648,
      4294967295, math.maxinteger, math.mininteger, 9007199254740993 } do
      ints[#ints + 1] = v
    end
    for _, v in ipairs(ints) do
      for _, fmt in ipairs { "<i1", "<i2", "<i4", "<i8", "<I1", "<I2", "<I4", ">i8", ">i4", ">I2" } do
        local ok, want = pcall(string.pack, fmt, v)
        if ok then
          assert.are.equal(want, h.bpack(fmt, v), string.format("%s of %d", fmt, v))
          local a, pa = h.bunpack(fmt, want)
          local b, pb = string.unpack(fmt, want)
          assert.are.same({ b, pb, math.type(b) }, { a, pa, math.type(a) })
        else
          assert.has_error(function() h.bpack(fmt, v) end)
        end
      end
    end
  end)
end)
