-- Errors: every misuse is a Lua error whose message names the function (or
-- the argument's position) and the problem; the session goes on after it.
local h = require "helper"
local ft = h.ft

local expect = h.assert_error

describe("errors", function()
  -- tensors that no error may disturb
  local witness, witness_values, t, t_values
  before_each(function()
    witness = ft.tensor(h.random_table({ 3, 3 }), { dtype = "f64" })
    witness_values = witness:totable()
    t = ft.tensor(h.random_table({ 2, 3 }))
    t_values = t:totable()
  end)
  after_each(function()
    assert.are.same(witness_values, witness:totable())
    assert.are.same(t_values, t:totable())
    assert.are.same({ 2, 3 }, t.shape)
  end)

  describe("wrong types", function()
    it("ft.zeros('a')", function()
      expect(function() return ft.zeros("a") end, "#1", "zeros", "shape", "got string")
    end)

    it("a non-integer size", function()
      expect(function() return ft.zeros(2.5) end, "#1", "zeros", "integer", "2.5")
      expect(function() return ft.zeros({ 2, "x" }) end, "#1", "zeros", "size 2 of the shape", "string")
    end)

    it("a fractional size in a shape table shows the value", function()
      expect(function() return ft.zeros({ 2, 2.5 }) end, "#1", "zeros", "size 2 of the shape", "2.5")
    end)

    it("a dtype or device that is not a string says so", function()
      expect(function() return ft.zeros(2, { dtype = true }) end, "zeros", "dtype", "boolean")
      expect(function() return ft.zeros(2, { device = 0 }) end, "zeros", "device", "number")
    end)

    it("t:view('x')", function()
      expect(function() return t:view("x") end, "view", "shape", "got string")
    end)

    it("t + 's'", function()
      expect(function() return t + "s" end, "#2", "add", "number expected, got string")
      expect(function() return {} * t end, "#1", "mul", "number expected, got table")
    end)

    it("ft.matmul(t, 3)", function()
      expect(function() return ft.matmul(t, 3) end, "#2", "matmul", "flashtile.Tensor expected, got number")
      expect(function() return ft.matmul(3, t) end, "#1", "matmul", "flashtile.Tensor expected, got number")
    end)

    it("a method called on something that is not a tensor", function()
      expect(function() return t.numel(5) end, "#1", "numel", "flashtile.Tensor expected")
    end)

    it("fill, set and copy with the wrong kind of value", function()
      expect(function() return t:fill("a") end, "fill", "number expected, got string")
      expect(function() return t:set(1, 1, "x") end, "set", "number expected, got string")
      expect(function() return t:copy(3) end, "copy", "flashtile.Tensor expected, got number")
    end)

    it("options that are not a table", function()
      expect(function() return ft.zeros(2, "f64") end, "#2", "zeros", "table expected, got string")
    end)
  end)

  describe("wrong shapes", function()
    it("view with the wrong element count", function()
      local a = ft.arange(16)
      expect(function() return a:view(3, 5) end, "view", "shape {3, 5} has 15 elements", "16")
      expect(function() return a:view({ 3, 5 }) end, "has 15 elements")
      expect(function() return t:reshape(7) end, "reshape", "has 7 elements")
      expect(function() return t:view(4, -1) end, "view", "{4, -1}", "6 elements")
      expect(function() return t:view(-1, -1) end, "view", "only one size may be -1")
    end)

    it("matmul with different inner dims", function()
      expect(function() return ft.matmul(ft.ones(2, 3), ft.ones(2, 3)) end,
        "#2", "matmul", "inner dimensions differ", "{2, 3} x {2, 3}")
      expect(function() return ft.matmul(ft.ones(2, 2, 2), ft.ones(3, 2, 2)) end,
        "matmul", "batch sizes differ (2 and 3)")
      expect(function() return ft.matmul(ft.ones(2), ft.ones(2)) end, "matmul", "2-d or 3-d", "1-d")
    end)

    it("binary op on tensors of different shapes", function()
      expect(function() return t + ft.ones(3, 2) end, "add", "shapes differ ({2, 3} and {3, 2})")
      expect(function() return t:mul(ft.ones(6)) end, "mul", "shapes differ")
      expect(function() return ft.max_abs_diff(t, ft.ones(3, 2)) end, "max_abs_diff", "shapes differ")
      expect(function() return ft.allclose(t, ft.ones(3)) end, "allclose", "shapes differ")
    end)

    it("copy between different shapes", function()
      expect(function() return t:copy(ft.ones(3, 2)) end, "copy", "shapes differ ({2, 3} and {3, 2})")
    end)

    it("a negative size names the dim, counted from 1", function()
      expect(function() return ft.zeros(2, -3) end, "zeros", "size -3 of dim 2 is negative")
      expect(function() return ft.zeros(-1) end, "zeros", "size -1 of dim 1 is negative")
    end)

    it("too many dims", function()
      expect(function() return ft.zeros(1, 1, 1, 1, 1, 1, 1, 1, 1) end, "zeros", "at most 8 dims")
    end)

    it("item of a tensor with more than one element", function()
      expect(function() return t:item() end, "item", "one element", "6")
    end)
  end)

  describe("out-of-range indices and dims", function()
    it("get", function()
      expect(function() return t:get(3, 1) end, "#1", "get", "index 3 out of range for dim 1 of size 2")
      expect(function() return t:get(1, 0) end, "#2", "get", "index 0 out of range for dim 2 of size 3")
      expect(function() return t:get(-1, 1) end, "get", "index -1 out of range")
      expect(function() return t:get(1) end, "get", "expected 2 indices for a 2-d tensor, got 1")
      expect(function() return t:get(1, 1, 1) end, "get", "expected 2 indices", "got 3")
      expect(function() return t:get(1.5, 1) end, "get", "index must be an integer, got 1.5")
    end)

    it("set", function()
      expect(function() return t:set(1, 4, 1) end, "#2", "set", "index 4 out of range for dim 2 of size 3")
      expect(function() return t:set(1, 1) end, "set", "expected 2 indices and a value")
    end)

    it("narrow", function()
      expect(function() return t:narrow(1, 2, 2) end, "#3", "narrow", "length 2 from start 2 exceeds dim 1 of size 2")
      expect(function() return t:narrow(1, 0, 1) end, "#2", "narrow", "start 0 out of range for dim 1")
      expect(function() return t:narrow(3, 1, 1) end, "#1", "narrow", "dim 3 out of range for a 2-d tensor")
    end)

    it("select", function()
      expect(function() return t:select(1, 3) end, "#2", "select", "index 3 out of range for dim 1 of size 2")
      expect(function() return t:select(3, 1) end, "#1", "select", "dim 3 out of range")
    end)

    it("transpose and permute", function()
      expect(function() return t:transpose(1, 3) end, "#2", "transpose", "dim 3 out of range for a 2-d tensor")
      expect(function() return t:transpose(0, 1) end, "#1", "transpose", "dim 0 out of range")
      expect(function() return ft.ones(3):transpose() end, "transpose", "2 or more dims")
      expect(function() return t:permute(1) end, "permute", "permutation has 1 dims, tensor has 2")
    end)

    it("transpose given a single dim is an error, not a silent identity", function()
      -- swapping needs two dims; the default is the first two
      expect(function() return t:transpose(2) end, "transpose")
      local msg = expect(function() return ft.ones(3):transpose(1) end, "transpose")
      -- dim 1 is a valid dim of a 1-d tensor: the message must not blame it
      assert.is_nil(msg:find("dim 1 out of range", 1, true), msg)
    end)

    it("permute with a repeated dim names it as given", function()
      expect(function() return t:permute(2, 2) end, "permute", "dim 2 appears twice")
      expect(function() return t:permute { 1, 1 } end, "permute", "dim 1 appears twice")
    end)

    it("size and stride", function()
      expect(function() return t:size(5) end, "#1", "size", "dim 5 out of range for a 2-d tensor (1..2 or -2..-1)")
      expect(function() return t:size(0) end, "size", "dim 0 out of range")
      expect(function() return t:size(-3) end, "size", "dim -3 out of range")
      expect(function() return t:stride(3) end, "stride", "dim 3 out of range")
      expect(function() return ft.tensor(1):size(1) end, "size", "0-d")
    end)

    it("reductions and softmax along a missing dim", function()
      expect(function() return t:sum(3) end, "sum", "dim 3 out of range")
      expect(function() return t:softmax(3) end, "softmax", "dim 3 out of range")
      expect(function() return ft.tensor(1):softmax() end, "softmax", "at least one dim")
    end)

    it("max along an empty dim names the dim, counted from 1", function()
      expect(function() return ft.zeros(2, 0):max(2) end, "max", "along dim 2", "size 0")
      expect(function() return ft.zeros(0):min() end, "min", "empty")
    end)
  end)

  describe("unknown names", function()
    it("an unknown dtype is named", function()
      expect(function() return ft.zeros(2, { dtype = "f17" }) end, "#2", "zeros", "unknown dtype 'f17'")
      expect(function() return ft.tensor({ 1 }, { dtype = "float128" }) end, "tensor", "'float128'")
      expect(function() return t:to("f17") end, "to", "'f17'")
    end)

    it("an unknown device is named", function()
      expect(function() return ft.zeros(2, { device = "tpu" }) end, "#2", "zeros", "unknown device 'tpu'")
      expect(function() return ft.memory_stats("tpu") end, "memory_stats", "'tpu'")
      expect(function() return t:to("gpu") end, "to", "'gpu'")
    end)

    it("a misspelt option key is named", function()
      expect(function() return ft.zeros(2, { dtpye = "f64" }) end, "#2", "zeros", "unknown option 'dtpye'")
      expect(function() return ft.rand(2, { sed = 1 }) end, "rand", "unknown option 'sed'")
    end)

    it("a seed that is not an integer", function()
      expect(function() return ft.rand(2, { seed = 1.5 }) end, "rand", "seed", "integer")
      expect(function() return ft.manual_seed("x") end, "manual_seed", "number expected")
    end)
  end)

  describe("dtype errors", function()
    it("f32 + f64", function()
      expect(function() return t + ft.ones(2, 3, { dtype = "f64" }) end, "add", "dtypes differ (f32 and f64)")
      expect(function() return ft.matmul(ft.ones(2, 2), ft.ones(2, 2, { dtype = "f64" })) end,
        "matmul", "dtypes differ (f32 and f64)")
    end)

    it("floating-point functions of integer tensors", function()
      local i = ft.ones(2, { dtype = "i32" })
      expect(function() return i:exp() end, "exp", "floating-point", "i32")
      expect(function() return i / 2 end, "div", "floating-point", "i32")
      expect(function() return i:softmax() end, "softmax", "floating-point", "i32")
      expect(function() return i:mean(1) end, "mean", "floating-point", "i32")
      expect(function() return ft.matmul(ft.ones(2, 2, { dtype = "i64" }), ft.ones(2, 2, { dtype = "i64" })) end,
        "matmul", "floating-point", "i64")
    end)

    it("random numbers of an integer dtype", function()
      expect(function() return ft.rand(2, { dtype = "i64" }) end, "rand", "floating-point", "i64")
      expect(function() return ft.randn(2, { dtype = "i32" }) end, "randn", "floating-point", "i32")
    end)
  end)

  describe("ft.tensor", function()
    it("rejects ragged tables", function()
      expect(function() return ft.tensor { { 1, 2 }, { 3 } } end, "#1", "tensor", "ragged")
      expect(function() return ft.tensor { { 1, 2 }, { 3, 4, 5 } } end, "tensor", "ragged")
    end)

    it("rejects strings, naming the element", function()
      expect(function() return ft.tensor { 1, "a" } end, "tensor", "element [2] is a string, not a number")
      expect(function() return ft.tensor { { 1, 2 }, { 3, "4" } } end, "element [2][2] is a string")
      expect(function() return ft.tensor("abc") end, "#1", "tensor", "got string")
      expect(function() return ft.tensor { 1, { 2 } } end, "element [2] is a table")
    end)
  end)

  describe("the session goes on", function()
    local misuses = {
      function() return ft.zeros("a") end,
      function(x) return x:view(4, 4) end,
      function(x) return x + "s" end,
      function(x) return x + ft.ones(3, 2) end,
      function(x) return x:copy(ft.ones(3, 2)) end,
      function(x) return x:set(3, 1, 9) end,
      function(x) return ft.matmul(x, x) end,
      function(x) return x:narrow(2, 2, 5) end,
      function(x) return x:to("f17") end,
      function() return ft.tensor { { 1 }, { 2, 3 } } end,
      function() return ft.tensor { 1, "a" } end,
      function() return ft.zeros(2, { dtpye = "f64" }) end,
      function() return ft.ones(2, { dtype = "i32" }):exp() end,
      function() return ft.load("/nonexistent/flashtile.npy") end,
      function() return ft.ones(2, { dtype = "bf16" }):save("/nonexistent/x.npy") end,
    }

    it("after each error, the tensors involved and others are intact", function()
      for k, misuse in ipairs(misuses) do
        assert.has_error(function() return misuse(t) end, nil, "misuse " .. k)
        assert.are.same(t_values, t:totable(), "misuse " .. k)
        assert.are.same(witness_values, witness:totable(), "misuse " .. k)
      end
      -- and the library still works
      local r = ft.matmul(t, t:transpose())
      assert.are.same({ 2, 2 }, r.shape)
      assert.is_true(math.abs(r:get(1, 2) - r:get(2, 1)) < 1e-6)
    end)

    it("errors leak no tensor memory", function()
      local before = h.in_use()
      for _ = 1, 3 do
        for _, misuse in ipairs(misuses) do pcall(misuse, t) end
      end
      assert.are.equal(before, h.in_use())
    end)

    it("a tensor freed elsewhere is an error in every function", function()
      local f = ft.ones(2, 3)
      f:free()
      expect(function() return f:numel() end, "numel", "freed")
      expect(function() return f + 1 end, "add", "freed")
      expect(function() return f:exp() end, "exp", "freed")
      expect(function() return ft.matmul(t, f) end, "matmul", "freed")
      expect(function() return t:copy(f) end, "copy", "freed")
      expect(function() return f:save("/tmp/never-written.npy") end, "save", "freed")
      expect(function() return #f end, "freed")
    end)

    it("a freed tensor as the second operand of a binary op says it was freed", function()
      local f = ft.ones(2, 3)
      f:free()
      expect(function() return 1 + f end, "#2", "add", "freed")
      expect(function() return t + f end, "#2", "add", "freed")
      expect(function() return t:maximum(f) end, "maximum", "freed")
    end)
  end)
end)
