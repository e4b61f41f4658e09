-- Tensors: creation, fields, element access, views, copies and lifetime.
local h = require "helper"
local ft = h.ft

local function shape_of(t) return table.concat(t.shape, ",") end

describe("flashtile tensors", function()
  describe("ft.tensor", function()
    it("builds a 2-d f32 tensor from a nested table", function()
      local t = ft.tensor { { 1, 2, 3 }, { 4, 5, 6 } }
      assert.are.same({ 2, 3 }, t.shape)
      assert.are.equal("f32", t.dtype)
      assert.are.equal("cpu", t.device)
      assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, t:totable())
    end)

    it("builds a 3-d tensor with the given dtype", function()
      local src = h.random_table({ 2, 3, 4 })
      local t = ft.tensor(src, { dtype = "f64" })
      assert.are.same({ 2, 3, 4 }, t.shape)
      assert.are.equal("f64", t.dtype)
      assert.are.same(src, t:totable())
    end)

    it("makes a 0-d tensor from a number", function()
      local t = ft.tensor(3.5)
      assert.are.equal(0, t:dim())
      assert.are.same({}, t.shape)
      assert.are.equal(1, t:numel())
      assert.are.equal(3.5, t:item())
      assert.are.equal(3.5, t:get())
      assert.are.equal(3.5, t:totable())
    end)

    it("makes empty tensors from empty tables", function()
      assert.are.same({ 0 }, ft.tensor({}).shape)
      assert.are.same({ 1, 0 }, ft.tensor({ {} }).shape)
      assert.are.equal(0, ft.tensor({}):numel())
    end)

    it("keeps integers exactly in integer dtypes", function()
      local t = ft.tensor({ -7, 0, 2147483647 }, { dtype = "i32" })
      assert.are.same({ -7, 0, 2147483647 }, t:totable())
      if not h.has_int64 then
        pending("math.type needs 5.3 (" .. _VERSION .. " has no integer subtype); the values are checked above")
      end
      assert.are.equal("integer", math.type(t:get(1)))
    end)
  end)

  describe("factories", function()
    it("ft.empty takes the shape as a table or as integers", function()
      local a, b = ft.empty({ 2, 3 }), ft.empty(2, 3)
      assert.are.same({ 2, 3 }, a.shape)
      assert.are.same({ 2, 3 }, b.shape)
      assert.are.equal("f32", a.dtype)
      assert.are.same({ 4 }, ft.empty(4, { dtype = "i64" }).shape)
      assert.are.equal("i64", ft.empty(4, { dtype = "i64" }).dtype)
      assert.are.equal(0, ft.empty({}):dim())
    end)

    it("ft.zeros and ft.ones fill with 0 and 1", function()
      for _, dtype in ipairs(h.DTYPES) do
        local z = ft.zeros({ 2, 3 }, { dtype = dtype, device = "cpu" })
        local o = ft.ones(3, 2, { dtype = dtype })
        assert.are.equal(dtype, z.dtype)
        assert.are.same({ 2, 3 }, z.shape)
        assert.are.same({ 3, 2 }, o.shape)
        h.assert_values(z, { 0, 0, 0, 0, 0, 0 }, 0, "zeros " .. dtype)
        h.assert_values(o, { 1, 1, 1, 1, 1, 1 }, 0, "ones " .. dtype)
      end
    end)

    it("ft.full fills with the value", function()
      local t = ft.full({ 2, 2 }, -2.5, { dtype = "f64" })
      assert.are.equal("f64", t.dtype)
      h.assert_values(t, { -2.5, -2.5, -2.5, -2.5 })
      local i = ft.full({ 3 }, 42, { dtype = "i32" })
      assert.are.same({ 42, 42, 42 }, i:totable())
    end)

    it("ft.full takes the shape as integers too, the value last", function()
      local ok, t = pcall(ft.full, 2, 3, 2.5, { dtype = "f64" })
      assert.is_true(ok, tostring(t))
      assert.are.same({ 2, 3 }, t.shape)
      assert.are.equal("f64", t.dtype)
      h.assert_values(t, { 2.5, 2.5, 2.5, 2.5, 2.5, 2.5 })
      assert.are.same({ 7, 7 }, ft.full(2, 7):totable())
    end)

    it("ft.rand and ft.randn take the shape as a table or integers, and a seed", function()
      for _, f in ipairs { ft.rand, ft.randn } do
        local a = f({ 3, 4 }, { seed = 7, dtype = "f64" })
        local b = f(3, 4, { seed = 7, dtype = "f64" })
        assert.are.same({ 3, 4 }, a.shape)
        assert.are.same({ 3, 4 }, b.shape)
        assert.are.equal("f64", a.dtype)
        assert.are.same(a:totable(), b:totable())
        assert.are.equal("f32", f(2).dtype)
      end
    end)

    it("ft.arange counts from start to before stop by step", function()
      assert.are.same({ 0, 1, 2, 3, 4 }, ft.arange(5):totable())
      assert.are.same({ 2, 4, 6 }, ft.arange(2, 8, 2):totable())
      assert.are.same({ 1, 1.25, 1.5, 1.75 }, ft.arange(1, 2, 0.25, { dtype = "f64" }):totable())
      assert.are.same({ 5, 3, 1 }, ft.arange(5, 0, -2):totable())
      assert.are.equal(0, ft.arange(3, 3):numel())
      local l = ft.arange(4, { dtype = "i64" })
      assert.are.equal("i64", l.dtype)
      assert.are.same({ 0, 1, 2, 3 }, l:totable())
    end)
  end)

  describe("fields", function()
    it("t.shape is a fresh table each time", function()
      local t = ft.zeros(2, 3)
      local s = t.shape
      assert.are_not.equal(s, t.shape)
      s[1] = 99
      s[3] = 5
      assert.are.same({ 2, 3 }, t.shape)
      assert.are.equal(2, t:size(1))
      assert.are.equal(6, t:numel())
    end)

    it("t.dtype and t.device name the dtype and device", function()
      local t = ft.zeros(2, { dtype = "bf16" })
      assert.are.equal("bf16", t.dtype)
      assert.are.equal("cpu", t.device)
    end)

    it("fields are read-only", function()
      local t = ft.zeros(2)
      h.assert_error(function() t.dtype = "f64" end, "read-only")
      assert.are.equal("f32", t.dtype)
    end)
  end)

  describe("geometry", function()
    local t
    before_each(function() t = ft.arange(24):view(2, 3, 4) end)

    it("dim, numel and size", function()
      assert.are.equal(3, t:dim())
      assert.are.equal(24, t:numel())
      assert.are.equal(2, t:size(1))
      assert.are.equal(3, t:size(2))
      assert.are.equal(4, t:size(3))
      assert.are.equal(4, t:size(-1))
      assert.are.equal(2, t:size(-3))
      assert.are.same({ 2, 3, 4 }, t:size())
    end)

    it("stride, in elements", function()
      assert.are.same({ 12, 4, 1 }, t:stride())
      assert.are.equal(12, t:stride(1))
      assert.are.equal(1, t:stride(-1))
    end)

    it("is_contiguous", function()
      assert.is_true(t:is_contiguous())
      assert.is_false(t:transpose(1, 3):is_contiguous())
      assert.is_false(t:narrow(3, 2, 2):is_contiguous())
      assert.is_true(t:narrow(1, 2, 1):is_contiguous())
    end)

    it("#t is the size of the first dim", function()
      assert.are.equal(2, #t)
      assert.are.equal(4, #ft.zeros(4, 2))
      assert.are.equal(0, #ft.zeros(0))
    end)
  end)

  describe("elements", function()
    it("get and set are 1-based, set returns the tensor", function()
      local t = ft.zeros(2, 3, { dtype = "f64" })
      assert.are.equal(t, t:set(1, 1, 1.5))
      t:set(2, 3, -4.25):set(1, 2, 7)
      assert.are.equal(1.5, t:get(1, 1))
      assert.are.equal(7, t:get(1, 2))
      assert.are.equal(-4.25, t:get(2, 3))
      assert.are.same({ { 1.5, 7, 0 }, { 0, 0, -4.25 } }, t:totable())
    end)

    it("get reads every position of a known tensor", function()
      local src = h.random_table({ 3, 4 })
      local t = ft.tensor(src, { dtype = "f64" })
      for i = 1, 3 do
        for j = 1, 4 do assert.are.equal(src[i][j], t:get(i, j)) end
      end
    end)

    it("item reads the single element of any shape", function()
      assert.are.equal(2.5, ft.full({ 1, 1, 1 }, 2.5):item())
      assert.are.equal(9, ft.tensor({ 9 }, { dtype = "i64" }):item())
    end)

    it("totable gives nested tables", function()
      local src = h.random_table({ 2, 2, 3 })
      assert.are.same(src, ft.tensor(src, { dtype = "f64" }):totable())
    end)
  end)

  describe("views", function()
    local base
    before_each(function()
      base = ft.tensor(h.random_table({ 3, 4 }), { dtype = "f64" })
    end)

    it("view reshapes without copying, with one -1 inferred", function()
      local v = base:view(2, 6)
      assert.are.same({ 2, 6 }, v.shape)
      assert.are.same({ 6, 2 }, base:view({ -1, 2 }).shape)
      assert.are.same({ 12 }, base:view(-1).shape)
      assert.is_true(v:is_same_storage(base))
      assert.are.equal(base:get(2, 1), v:get(1, 5))
    end)

    it("reshape is a view when possible and a copy otherwise", function()
      local r = base:reshape(4, -1)
      assert.are.same({ 4, 3 }, r.shape)
      assert.is_true(r:is_same_storage(base))
      local tr = base:transpose(1, 2)
      local flat = tr:reshape(-1)
      assert.is_false(flat:is_same_storage(base))
      -- row-major order of the transposed view
      assert.are.equal(base:get(1, 1), flat:get(1))
      assert.are.equal(base:get(2, 1), flat:get(2))
      assert.are.equal(base:get(1, 2), flat:get(4))
    end)

    it("transpose swaps two dims (the first two by default)", function()
      local tr = base:transpose(1, 2)
      assert.are.same({ 4, 3 }, tr.shape)
      assert.are.same({ 1, 4 }, tr:stride())
      assert.are.same(tr.shape, base:transpose().shape)
      assert.are.same(tr.shape, base:transpose(-1, -2).shape)
      for i = 1, 3 do
        for j = 1, 4 do assert.are.equal(base:get(i, j), tr:get(j, i)) end
      end
    end)

    it("permute reorders dims, given as integers or a table", function()
      local t = ft.arange(24, { dtype = "f64" }):view(2, 3, 4)
      local p = t:permute(3, 1, 2)
      assert.are.same({ 4, 2, 3 }, p.shape)
      assert.are.same({ 4, 2, 3 }, t:permute({ 3, 1, 2 }).shape)
      assert.are.same({ 4, 2, 3 }, t:permute(-1, 1, 2).shape)
      assert.are.equal(t:get(2, 3, 4), p:get(4, 2, 3))
      assert.are.equal(t:get(1, 2, 3), p:get(3, 1, 2))
    end)

    it("narrow takes length elements from start along a dim", function()
      local n = base:narrow(2, 2, 3)
      assert.are.same({ 3, 3 }, n.shape)
      assert.are.equal(base:get(1, 2), n:get(1, 1))
      assert.are.equal(base:get(3, 4), n:get(3, 3))
      assert.are.same({ 3, 0 }, base:narrow(2, 5, 0).shape)
    end)

    it("select drops a dim at an index", function()
      local s = base:select(1, 2)
      assert.are.same({ 4 }, s.shape)
      for j = 1, 4 do assert.are.equal(base:get(2, j), s:get(j)) end
      local c = base:select(-1, 4)
      assert.are.same({ 3 }, c.shape)
      for i = 1, 3 do assert.are.equal(base:get(i, 4), c:get(i)) end
    end)

    it("write through a view with set shows in the base", function()
      local v = base:transpose(1, 2):narrow(1, 2, 2)
      v:set(1, 3, 123.5)
      assert.are.equal(123.5, base:get(3, 2))
      base:view(-1):set(12, -8)
      assert.are.equal(-8, base:get(3, 4))
    end)

    it("fill through a view writes only the view's elements", function()
      local before = base:totable()
      base:select(2, 3):fill(9.25)
      for i = 1, 3 do
        for j = 1, 4 do
          assert.are.equal(j == 3 and 9.25 or before[i][j], base:get(i, j))
        end
      end
    end)

    it("copy into a view writes into the base", function()
      local src = ft.tensor({ { 1, 2 }, { 3, 4 } }, { dtype = "f64" })
      local before = base:totable()
      base:narrow(1, 2, 2):narrow(2, 3, 2):copy(src)
      assert.are.same({ before[1], { before[2][1], before[2][2], 1, 2 },
        { before[3][1], before[3][2], 3, 4 } }, base:totable())
    end)

    it("copy between overlapping views of one storage reads before writing", function()
      local t = ft.arange(6, { dtype = "f64" })
      t:narrow(1, 2, 5):copy(t:narrow(1, 1, 5))
      assert.are.same({ 0, 0, 1, 2, 3, 4 }, t:totable())
    end)

    it("clone copies into fresh storage", function()
      local c = base:clone()
      assert.is_false(c:is_same_storage(base))
      assert.are.same(base:totable(), c:totable())
      local before = base:get(1, 1)
      c:set(1, 1, before + 1)
      assert.are.equal(before, base:get(1, 1))
    end)

    it("contiguous of a contiguous tensor is the tensor itself", function()
      assert.are.equal(base, base:contiguous())
    end)

    it("contiguous of a non-contiguous view copies", function()
      local tr = base:transpose(1, 2)
      local c = tr:contiguous()
      assert.is_true(c:is_contiguous())
      assert.is_false(c:is_same_storage(base))
      assert.are.same(tr:totable(), c:totable())
      local before = base:get(2, 1)
      c:set(1, 2, before + 1)
      assert.are.equal(before, base:get(2, 1))
    end)

    it("view splits and merges dims of strided views where strides allow", function()
      local grid = ft.arange(24, { dtype = "f64" }):view(4, 6)
      local cases = {
        { grid:narrow(2, 1, 3), { 2, 2, 3 } }, -- split the outer dim
        { grid:narrow(2, 1, 3), { 4, 3, 1 } },
        { grid:transpose(), { 3, 2, 4 } },    -- split the (strided) outer dim
        { grid:transpose(), { 6, 2, 2 } },    -- split the inner dim
        { grid:transpose(), { 1, 6, 1, 4 } },
        { grid:select(2, 3), { 2, 2 } },
        { grid:view(2, 2, 6):transpose(1, 2), { 2, 2, 3, 2 } },
      }
      for k, case in ipairs(cases) do
        local src, shape = case[1], case[2]
        local v = src:view(shape)
        assert.are.same(shape, v.shape, "case " .. k)
        assert.is_true(v:is_same_storage(grid), "case " .. k)
        assert.are.same(src:contiguous():view(shape):totable(), v:totable(), "case " .. k)
      end
      -- merging dims whose strides do not line up needs a copy
      h.assert_error(function() return grid:narrow(2, 1, 3):view(12) end, "view", "reshape")
      h.assert_error(function() return grid:transpose():view(4, 6) end, "view", "reshape")
    end)

    it("copy from a transposed view of the same storage", function()
      local sq = ft.tensor({ { 1, 2, 3 }, { 4, 5, 6 }, { 7, 8, 9 } }, { dtype = "f64" })
      sq:copy(sq:transpose())
      assert.are.same({ { 1, 4, 7 }, { 2, 5, 8 }, { 3, 6, 9 } }, sq:totable())
    end)

    it("view refuses strides it cannot express, naming reshape", function()
      h.assert_error(function() return base:transpose(1, 2):view(12) end, "reshape")
    end)
  end)

  describe("copy and conversion", function()
    -- representable exactly in every dtype
    local ints = { -128, -3, 0, 1, 2, 7, 100, 255 }

    it("copy converts between every pair of dtypes", function()
      for _, from in ipairs(h.DTYPES) do
        local src = ft.tensor(ints, { dtype = from })
        for _, to in ipairs(h.DTYPES) do
          local dst = ft.zeros(#ints, { dtype = to })
          assert.are.equal(dst, dst:copy(src))
          assert.are.equal(to, dst.dtype)
          h.assert_values(dst, ints, 0, from .. " -> " .. to)
        end
      end
    end)

    it("copy keeps fractions between floating dtypes", function()
      local fr = { 0.5, -0.25, 1.5, 3.140625, -96, 0.0078125 }
      for _, from in ipairs(h.FLOAT_DTYPES) do
        local src = ft.tensor(fr, { dtype = from })
        for _, to in ipairs(h.FLOAT_DTYPES) do
          local dst = ft.empty(#fr, { dtype = to }):copy(src)
          h.assert_values(dst, fr, 0, from .. " -> " .. to)
        end
      end
    end)

    it("copy from a strided view", function()
      local src = ft.tensor(h.random_table({ 3, 4 }), { dtype = "f64" })
      local dst = ft.zeros(4, 3, { dtype = "f64" }):copy(src:transpose(1, 2))
      assert.are.same(src:transpose(1, 2):totable(), dst:totable())
    end)

    it("copy needs equal shapes", function()
      h.assert_error(function() return ft.zeros(2, 3):copy(ft.zeros(3, 2)) end,
        "{2, 3}", "{3, 2}")
    end)

    it("fill sets every element, converting the value", function()
      local t = ft.tensor(h.random_table({ 2, 3 }))
      assert.are.equal(t, t:fill(0.75))
      h.assert_values(t, { 0.75, 0.75, 0.75, 0.75, 0.75, 0.75 })
      local i = ft.zeros(3, { dtype = "i32" }):fill(-2.75)
      assert.are.same({ -2, -2, -2 }, i:totable())
    end)

    it("to(dtype) converts into a new tensor", function()
      local src = ft.tensor({ 1, -2, 3 }, { dtype = "f64" })
      for _, dtype in ipairs(h.DTYPES) do
        local c = src:to(dtype)
        assert.are.equal(dtype, c.dtype)
        assert.are.same({ 1, -2, 3 }, c:totable())
        if dtype ~= "f64" then assert.is_false(c:is_same_storage(src)) end
      end
      local c = src:to { dtype = "f16" }
      assert.are.equal("f16", c.dtype)
    end)

    it("to() with nothing to change returns the tensor itself", function()
      local t = ft.zeros(3)
      assert.are.equal(t, t:to("f32"))
      assert.are.equal(t, t:to("cpu"))
      assert.are.equal(t, t:float())
      assert.are.equal(t, t:cpu())
    end)

    it("float, double, half, bf16, int and long", function()
      local t = ft.tensor({ 2, -3 }, { dtype = "f64" })
      local expect = { float = "f32", double = "f64", half = "f16", bf16 = "bf16",
        int = "i32", long = "i64" }
      for method, dtype in pairs(expect) do
        local c = t[method](t)
        assert.are.equal(dtype, c.dtype, method)
        assert.are.same({ 2, -3 }, c:totable(), method)
      end
    end)
  end)

  describe("lifetime", function()
    it("a view keeps the storage alive after the base is freed", function()
      local base = ft.tensor(h.random_table({ 4, 5 }), { dtype = "f64" })
      local expected = base:totable()
      local v = base:transpose(1, 2):narrow(2, 2, 3)
      base:free()
      collectgarbage()
      collectgarbage()
      -- new allocations must not reuse the storage the view still reads
      local junk = {}
      for i = 1, 8 do junk[i] = ft.full({ 4, 5 }, -1, { dtype = "f64" }) end
      for i = 1, 5 do
        for j = 1, 3 do assert.are.equal(expected[j + 1][i], v:get(i, j)) end
      end
    end)

    it("the storage goes with the last view", function()
      local before = h.in_use()
      local base = ft.zeros(1000, { dtype = "f64" })
      local v = base:narrow(1, 1, 10)
      base:free()
      assert.are.equal(before + 8000, h.in_use())
      v:free()
      assert.are.equal(before, h.in_use())
    end)

    it("a <close> variable frees its tensor at the end of the scope", function()
      -- in every version: the metamethod a <close> variable calls frees
      local before0 = h.in_use()
      local c = ft.zeros(1000, { dtype = "f64" })
      assert.is_function(getmetatable(c).__close)
      getmetatable(c).__close(c, nil)
      assert.are.equal(before0, ft.memory_stats().in_use)
      h.assert_error(function() return c:numel() end, "freed")
      -- compiled from a string, so that this file parses where <close> is
      -- a syntax error (before 5.4)
      local compile = loadstring or load
      local scope = compile([=[
        local ft, h, assert = ...
        local before = h.in_use()
        local escaped
        do
          local t <close> = ft.zeros(1000, { dtype = "f64" })
          escaped = t
          assert.are.equal(before + 8000, ft.memory_stats().in_use)
        end
        return before, escaped
      ]=], "=(<close> scope)")
      if not scope then
        pending("<close> variables need Lua 5.4 (" .. _VERSION .. ")")
      end
      local before, escaped = scope(ft, h, assert)
      -- escaped still references the userdata: only the close freed it
      assert.are.equal(before, ft.memory_stats().in_use)
      h.assert_error(function() return escaped:numel() end, "freed")
    end)

    it("use after free is an error, not a crash", function()
      local t = ft.ones(3)
      t:free()
      h.assert_error(function() return t:numel() end, "freed")
      h.assert_error(function() return t:get(1) end, "freed")
      h.assert_error(function() return t + 1 end, "freed")
      h.assert_error(function() return t:view(3) end, "freed")
      h.assert_error(function() return ft.ones(3):copy(t) end, "freed")
      t:free() -- freeing twice is harmless
    end)
  end)
end)
