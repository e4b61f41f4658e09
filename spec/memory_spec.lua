-- Memory statistics: bytes of tensor storage in use, and the peak.
local h = require "helper"
local ft = h.ft

local MB8 = 1000 * 1000 * 8 -- a 1000x1000 f64 tensor

describe("memory statistics", function()
  before_each(function()
    collectgarbage()
    collectgarbage()
  end)

  describe("ft.memory_stats", function()
    it("gives in_use and peak in bytes, as integers", function()
      for _, s in ipairs { ft.memory_stats(), ft.memory_stats("cpu") } do
        assert.are.equal(math.floor(s.in_use), s.in_use)
        assert.are.equal(math.floor(s.peak), s.peak)
        assert.is_true(s.in_use >= 0)
        assert.is_true(s.peak >= s.in_use)
      end
      assert.are.same(ft.memory_stats(), ft.memory_stats("cpu"))
      if not h.has_int64 then
        pending("math.type needs 5.3 (" .. _VERSION .. " has no integer subtype); whole numbers are checked above")
      end
      for _, s in ipairs { ft.memory_stats(), ft.memory_stats("cpu") } do
        assert.are.equal("integer", math.type(s.in_use))
        assert.are.equal("integer", math.type(s.peak))
      end
    end)

    it("rises by 8e6 bytes for a 1000x1000 f64 tensor", function()
      local before = ft.memory_stats().in_use
      local t = ft.zeros(1000, 1000, { dtype = "f64" })
      assert.are.equal(before + MB8, ft.memory_stats().in_use)
      t:free()
      assert.are.equal(before, ft.memory_stats().in_use)
    end)

    it("counts numel times the element size of each dtype", function()
      local sizes = { f64 = 8, f32 = 4, f16 = 2, bf16 = 2, i32 = 4, i64 = 8 }
      for dtype, size in pairs(sizes) do
        local before = ft.memory_stats().in_use
        local t = ft.empty(3, 7, { dtype = dtype })
        assert.are.equal(before + 21 * size, ft.memory_stats().in_use, dtype)
        t:free()
      end
    end)

    it("does not count views, and counts clones", function()
      local base = ft.rand(100, 100, { dtype = "f64" })
      local before = ft.memory_stats().in_use
      local views = { base:view(-1), base:transpose(), base:narrow(1, 3, 10), base:select(2, 5),
        base:permute(2, 1), base:reshape(50, 200), base:contiguous(), base:to("f64") }
      assert.are.equal(before, ft.memory_stats().in_use)
      local c = base:clone()
      assert.are.equal(before + 80000, ft.memory_stats().in_use)
      local r = base:transpose():reshape(-1) -- must copy
      assert.are.equal(before + 160000, ft.memory_stats().in_use)
      c:free()
      r:free()
      for _, v in ipairs(views) do v:free() end
      assert.are.equal(before, ft.memory_stats().in_use)
    end)

    it("counts nothing for empty tensors", function()
      local before = ft.memory_stats().in_use
      local e = { ft.zeros(0), ft.empty(5, 0, 3), ft.tensor({}) }
      assert.are.equal(before, ft.memory_stats().in_use)
      for _, t in ipairs(e) do t:free() end
    end)

    it("releases the results of operations when they are freed", function()
      local a = ft.rand(50, 40, { dtype = "f64" })
      local b = ft.rand(40, 30, { dtype = "f64" })
      local before = ft.memory_stats().in_use
      local results = { a + 1, a:exp(), a:sum(2), ft.matmul(a, b), a:softmax(1), a:clone() }
      assert.is_true(ft.memory_stats().in_use > before)
      for _, r in ipairs(results) do r:free() end
      assert.are.equal(before, ft.memory_stats().in_use)
    end)

    it("max and min along a dim keep no hidden temporary alive", function()
      local a = ft.rand(50, 40, { dtype = "f64" })
      for _, op in ipairs { "max", "min" } do
        local before = ft.memory_stats().in_use
        local values, indices = a[op](a, 1)
        -- exactly the two results: 40 f64 values and 40 i64 indices
        assert.are.equal(before + 40 * 8 + 40 * 8, ft.memory_stats().in_use, op)
        values:free()
        indices:free()
        assert.are.equal(before, ft.memory_stats().in_use, op)
      end
    end)
  end)

  describe("peak", function()
    it("keeps the high-water mark until ft.reset_peak_memory()", function()
      ft.reset_peak_memory()
      local base = ft.memory_stats()
      assert.are.equal(base.in_use, base.peak)
      local t = ft.zeros(1000, 1000, { dtype = "f64" })
      local u = ft.zeros(1000, 1000, { dtype = "f64" })
      u:free()
      t:free()
      local s = ft.memory_stats()
      assert.are.equal(base.in_use, s.in_use)
      assert.are.equal(base.in_use + 2 * MB8, s.peak)
      -- a smaller allocation does not move it
      local small = ft.zeros(10)
      small:free()
      assert.are.equal(base.in_use + 2 * MB8, ft.memory_stats().peak)
      ft.reset_peak_memory("cpu")
      s = ft.memory_stats()
      assert.are.equal(s.in_use, s.peak)
    end)

    it("after a reset rises with the next allocation", function()
      ft.reset_peak_memory()
      local before = ft.memory_stats().in_use
      local t = ft.zeros(1000, 1000, { dtype = "f64" })
      assert.are.equal(before + MB8, ft.memory_stats().peak)
      t:free()
    end)
  end)

  describe("garbage collection", function()
    it("collectgarbage() releases unreferenced tensors", function()
      local before = h.in_use()
      do
        local t = ft.zeros(1000, 1000, { dtype = "f64" })
        assert.are.equal(before + MB8, ft.memory_stats().in_use)
      end
      assert.are.equal(before, h.in_use())
    end)

    it("releases the storage once the last view is collected", function()
      local before = h.in_use()
      local view
      do
        local t = ft.zeros(1000, 1000, { dtype = "f64" })
        view = t:narrow(1, 1, 1)
      end
      assert.are.equal(before + MB8, h.in_use())
      view = nil
      assert.are.equal(before, h.in_use())
    end)

    it("releases temporaries of expressions", function()
      local before = h.in_use()
      local a = ft.rand(100, 100, { dtype = "f64" })
      for _ = 1, 20 do
        local _ = ((a * 2 + 1):exp() - a):sum()
      end
      a = nil
      assert.are.equal(before, h.in_use())
    end)
  end)
end)
