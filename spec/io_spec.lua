-- Files: NumPy .npy save and load.
local h = require "helper"
local ft = h.ft

local function read_file(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("a")
  f:close()
  return s
end

local function write_file(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

--- A .npy file in the given version with the given dict and data bytes,
-- padded as NumPy pads it.
local function npy_bytes(dict, data, major)
  major = major or 1
  local pre = major == 1 and 10 or 12
  local len = #dict + 1
  local total = math.ceil((pre + len) / 64) * 64
  local header = dict .. string.rep(" ", total - pre - len) .. "\n"
  local lenfield = major == 1 and string.pack("<I2", #header) or string.pack("<I4", #header)
  return "\x93NUMPY" .. string.char(major, 0) .. lenfield .. header .. data
end

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
      local big = { 9007199254740993, math.mininteger, math.maxinteger }
      ft.tensor(big, { dtype = "i64" }):save(path)
      assert.are.same(big, ft.load(path):totable())
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
      assert.are.equal("\x93NUMPY", bytes:sub(1, 6))
      assert.are.equal("\1\0", bytes:sub(7, 8)) -- version 1.0
      local hlen = string.unpack("<I2", bytes, 9)
      assert.are.equal(0, (10 + hlen) % 64)
      local header = bytes:sub(11, 10 + hlen)
      local dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"
      assert.are.equal(dict, header:sub(1, #dict))
      assert.are.equal(string.rep(" ", hlen - #dict - 1) .. "\n", header:sub(#dict + 1))
      assert.are.equal(10 + hlen + 6 * 4, #bytes)
      assert.are.equal(string.pack("<ffffff", 1, 2, 3, 4, 5, 6.5), bytes:sub(11 + hlen))
    end)

    it("writes 1-d shapes as (n,) and 0-d as ()", function()
      ft.tensor({ 1, 2, 3, 4, 5 }, { dtype = "i64" }):save(path)
      local bytes = read_file(path)
      assert.is_truthy(bytes:find("{'descr': '<i8', 'fortran_order': False, 'shape': (5,), }", 1, true))
      ft.tensor(2.5, { dtype = "f64" }):save(path)
      bytes = read_file(path)
      assert.is_truthy(bytes:find("{'descr': '<f8', 'fortran_order': False, 'shape': (), }", 1, true))
      local hlen = string.unpack("<I2", bytes, 9)
      assert.are.equal(string.pack("<d", 2.5), bytes:sub(11 + hlen))
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
        string.pack("<i8i8i8i8", 1, -2, 3, 1 << 60)))
      local t = ft.load(path)
      assert.are.equal("i64", t.dtype)
      assert.are.same({ { 1, -2 }, { 3, 1 << 60 } }, t:totable())
    end)

    it("reads big-endian data", function()
      write_file(path, npy_bytes("{'descr': '>f8', 'fortran_order': False, 'shape': (3,), }",
        string.pack(">ddd", 1.5, -0.25, 1e100)))
      assert.are.same({ 1.5, -0.25, 1e100 }, ft.load(path):totable())
    end)

    it("reads fortran_order data into row-major order", function()
      -- the 2x3 matrix {{1, 2, 3}, {4, 5, 6}} stored column by column
      write_file(path, npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
        string.pack("<ffffff", 1, 4, 2, 5, 3, 6)))
      assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, ft.load(path):totable())
    end)

    it("reads format version 2.0", function()
      write_file(path, npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2,), }",
        string.pack("<i4i4", 7, -9), 2))
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
        string.pack("<dd", 1, 2)))
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
