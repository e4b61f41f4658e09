-- Printing: tostring of tensors.
local h = require "helper"
local ft = h.ft

describe("tostring", function()
  describe("small tensors", function()
    it("a 2x3 f32 of integers", function()
      assert.are.equal("[[1., 2., 3.],\n [4., 5., 6.]]\n[flashtile.Tensor f32 cpu {2, 3}]",
        tostring(ft.tensor { { 1, 2, 3 }, { 4, 5, 6 } }))
    end)

    it("aligns values of different widths", function()
      assert.are.equal("[[ -1.,  20.],\n [300.,   4.]]\n[flashtile.Tensor f64 cpu {2, 2}]",
        tostring(ft.tensor({ { -1, 20 }, { 300, 4 } }, { dtype = "f64" })))
    end)

    it("a 1-d f64 with fractions, four decimals", function()
      assert.are.equal("[ 0.5000,  0.2500, -1.1250]\n[flashtile.Tensor f64 cpu {3}]",
        tostring(ft.tensor({ 0.5, 0.25, -1.125 }, { dtype = "f64" })))
    end)

    it("very small or large values in scientific notation", function()
      assert.are.equal("[1.0000e-05, 1.0000e+00]\n[flashtile.Tensor f64 cpu {2}]",
        tostring(ft.tensor({ 1e-5, 1 }, { dtype = "f64" })))
      assert.are.equal("[1.2346e+05, 2.5000e+00]\n[flashtile.Tensor f64 cpu {2}]",
        tostring(ft.tensor({ 123456.5, 2.5 }, { dtype = "f64" })))
    end)

    it("a 0-d tensor", function()
      assert.are.equal("3.5000\n[flashtile.Tensor f32 cpu {}]", tostring(ft.tensor(3.5)))
      assert.are.equal("5\n[flashtile.Tensor i64 cpu {}]", tostring(ft.tensor(5, { dtype = "i64" })))
    end)

    it("an empty tensor", function()
      assert.are.equal("[]\n[flashtile.Tensor f32 cpu {0}]", tostring(ft.zeros(0)))
      assert.are.equal("[]\n[flashtile.Tensor i32 cpu {2, 0, 3}]",
        tostring(ft.zeros(2, 0, 3, { dtype = "i32" })))
    end)

    it("an i64 tensor, as integers", function()
      assert.are.equal("[ 1, -2, 30]\n[flashtile.Tensor i64 cpu {3}]",
        tostring(ft.tensor({ 1, -2, 30 }, { dtype = "i64" })))
      assert.are.equal("[9007199254740992]\n[flashtile.Tensor i64 cpu {1}]",
        tostring(ft.tensor({ 2 ^ 53 }, { dtype = "i64" })))
      if not h.has_int64 then
        pending("Lua integers above 2^53 need 5.3 (" .. _VERSION .. " numbers are doubles); 2^53 is checked above")
      end
      assert.are.equal("[9007199254740993]\n[flashtile.Tensor i64 cpu {1}]",
        tostring(ft.tensor({ 9007199254740993 }, { dtype = "i64" })))
    end)

    it("an i64 tensor at both ends of its range, each number as its element", function()
      local t = ft.tensor({ 1e30, -1e30 }, { dtype = "i64" }) -- saturated: 2^63 - 1 and -2^63
      if h.has_int64 then
        assert.are.equal("[ 9223372036854775807, -9223372036854775808]\n[flashtile.Tensor i64 cpu {2}]",
          tostring(t))
      else
        -- there 2^63 - 1 reads as the double 2^63, printed exactly
        assert.are.equal("[ 9223372036854775808, -9223372036854775808]\n[flashtile.Tensor i64 cpu {2}]",
          tostring(t))
      end
      local printed = {}
      for num in tostring(t):match("^%[(.-)%]"):gmatch("[^,%s]+") do printed[#printed + 1] = tonumber(num) end
      assert.are.same(t:totable(), printed)
    end)

    it("a 3-d tensor with a blank line between matrices", function()
      assert.are.equal("[[[0., 1.],\n  [2., 3.]],\n\n [[4., 5.],\n  [6., 7.]]]\n"
        .. "[flashtile.Tensor f32 cpu {2, 2, 2}]", tostring(ft.arange(8):view(2, 2, 2)))
    end)

    it("a transposed view in its logical order", function()
      assert.are.equal("[[1., 4.],\n [2., 5.],\n [3., 6.]]\n[flashtile.Tensor f32 cpu {3, 2}]",
        tostring(ft.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }):transpose()))
    end)
  end)

  describe("the footer", function()
    it("names dtype, device and shape", function()
      local s = tostring(ft.rand(2, 3))
      assert.are.equal("[flashtile.Tensor f32 cpu {2, 3}]", s:match("[^\n]*$"))
      for _, dtype in ipairs(h.DTYPES) do
        local f = tostring(ft.zeros(4, 1, { dtype = dtype })):match("[^\n]*$")
        assert.are.equal("[flashtile.Tensor " .. dtype .. " cpu {4, 1}]", f)
      end
    end)

    it("rawstring is the footer alone", function()
      assert.are.equal("flashtile.Tensor f64 cpu {2, 3}", ft.zeros(2, 3, { dtype = "f64" }):rawstring())
    end)
  end)

  describe("large tensors", function()
    it("elide the middle of each dim with ...", function()
      local s = tostring(ft.arange(10000, { dtype = "f64" }):view(100, 100))
      assert.is_true(#s < 3000, "length " .. #s)
      local lines = {}
      for line in s:gmatch("[^\n]+") do lines[#lines + 1] = line end
      -- 3 rows, "...", 3 rows, the footer
      assert.are.equal(8, #lines)
      assert.are.equal("[[   0.,    1.,    2., ...,   97.,   98.,   99.],", lines[1])
      assert.are.equal(" ...,", lines[4])
      assert.are.equal(" [9900., 9901., 9902., ..., 9997., 9998., 9999.]]", lines[7])
      assert.are.equal("[flashtile.Tensor f64 cpu {100, 100}]", lines[8])
    end)

    it("stay short whatever the size", function()
      local s = tostring(ft.rand(100, 100))
      assert.is_truthy(s:find("...", 1, true))
      assert.is_true(#s < 3000, "length " .. #s)
      assert.is_true(#tostring(ft.zeros(20, 20, 20, 20)) < 20000)
    end)

    it("small tensors are not elided", function()
      assert.is_nil(tostring(ft.rand(10, 10)):find("...", 1, true))
    end)
  end)

  describe("special values", function()
    it("prints nan and inf", function()
      assert.are.equal("[ nan,  inf, -inf,   1.]\n[flashtile.Tensor f32 cpu {4}]",
        tostring(ft.tensor { 0 / 0, 1 / 0, -1 / 0, 1 }))
      assert.are.equal("[   nan, 0.5000]\n[flashtile.Tensor f64 cpu {2}]",
        tostring(ft.tensor({ 0 / 0, 0.5 }, { dtype = "f64" })))
    end)

    it("prints a freed tensor without failing", function()
      local t = ft.ones(2)
      t:free()
      assert.are.equal("[flashtile.Tensor (freed)]", tostring(t))
      assert.are.equal("flashtile.Tensor (freed)", t:rawstring())
    end)
  end)
end)
