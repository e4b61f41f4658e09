-- Random numbers: Philox streams, seeding, and the distributions.
local h = require "helper"
local ft = h.ft

local f32 = h.f32

local N = 100000

describe("random numbers", function()
  describe("seeding", function()
    it("the same seed option gives the same values", function()
      for _, f in ipairs { ft.rand, ft.randn } do
        for _, dtype in ipairs(h.FLOAT_DTYPES) do
          local a = f({ 3, 5 }, { seed = 42, dtype = dtype })
          local b = f({ 3, 5 }, { seed = 42, dtype = dtype })
          assert.are.same(a:totable(), b:totable())
        end
      end
    end)

    it("different seeds give different values", function()
      for _, f in ipairs { ft.rand, ft.randn } do
        local a = f(64, { seed = 1, dtype = "f64" }):totable()
        local b = f(64, { seed = 2, dtype = "f64" }):totable()
        local equal = 0
        for i = 1, 64 do if a[i] == b[i] then equal = equal + 1 end end
        assert.are.equal(0, equal)
      end
      -- seeds that differ only in the high 32 bits
      local lo = ft.rand(8, { seed = 5, dtype = "f64" })
      local hi = ft.rand(8, { seed = 4294967301, dtype = "f64" }) -- 5 + 2^32, an integer literal
      assert.is_true(ft.max_abs_diff(lo, hi) > 0)
    end)

    it("successive calls after manual_seed differ, and repeat after re-seeding", function()
      ft.manual_seed(1234)
      local a, b = ft.rand(10, { dtype = "f64" }), ft.rand(10, { dtype = "f64" })
      local c = ft.randn(10, { dtype = "f64" })
      assert.is_true(ft.max_abs_diff(a, b) > 0)
      ft.manual_seed(1234)
      local a2, b2 = ft.rand(10, { dtype = "f64" }), ft.rand(10, { dtype = "f64" })
      local c2 = ft.randn(10, { dtype = "f64" })
      assert.are.same(a:totable(), a2:totable())
      assert.are.same(b:totable(), b2:totable())
      assert.are.same(c:totable(), c2:totable())
      ft.manual_seed(4321)
      assert.is_true(ft.max_abs_diff(a, ft.rand(10, { dtype = "f64" })) > 0)
    end)

    it("manual_seed(s) starts the stream that the seed option gives", function()
      ft.manual_seed(77)
      local a, b = ft.rand(4, { dtype = "f64" }), ft.rand(4, { dtype = "f64" })
      local whole = ft.rand(8, { seed = 77, dtype = "f64" }):totable()
      -- successive calls continue the stream
      assert.are.same({ whole[1], whole[2], whole[3], whole[4] }, a:totable())
      assert.are.same({ whole[5], whole[6], whole[7], whole[8] }, b:totable())
    end)

    it("a call with a seed option leaves the global stream alone", function()
      ft.manual_seed(99)
      local first = ft.rand(6, { dtype = "f64" }):totable()
      ft.manual_seed(99)
      ft.rand(6, { seed = 5, dtype = "f64" })
      assert.are.same(first, ft.rand(6, { dtype = "f64" }):totable())
    end)

    it("values depend on the element's position, not on the shape", function()
      local flat = ft.randn(24, { seed = 8, dtype = "f64" })
      local shaped = ft.randn({ 2, 3, 4 }, { seed = 8, dtype = "f64" })
      assert.are.same(flat:totable(), h.flatten(shaped:totable()))
    end)
  end)

  describe("ft.rand", function()
    it("is uniform in [0, 1)", function()
      local r = ft.rand(N, { seed = h.next_seed(), dtype = "f64" })
      assert.is_true(r:min() >= 0)
      assert.is_true(r:max() < 1)
      assert.is_true(math.abs(r:mean() - 0.5) < 0.01, "mean " .. r:mean())
      -- ten bins of about N/10 each (a standard deviation is ~95)
      local bins = {}
      for i = 1, 10 do bins[i] = 0 end
      for _, v in ipairs(r:totable()) do
        local b = math.floor(v * 10) + 1
        bins[b] = bins[b] + 1
      end
      for i = 1, 10 do
        assert.is_true(math.abs(bins[i] - N / 10) < 600, "bin " .. i .. ": " .. bins[i])
      end
    end)

    it("stays below 1 in every floating dtype", function()
      for _, dtype in ipairs(h.FLOAT_DTYPES) do
        local r = ft.rand(N, { seed = h.next_seed(), dtype = dtype })
        assert.is_true(r:max() < 1, dtype .. " max " .. r:max())
        assert.is_true(r:min() >= 0, dtype)
      end
    end)
  end)

  describe("ft.randn", function()
    it("has mean ~0 and standard deviation ~1", function()
      local n = ft.randn(N, { seed = h.next_seed(), dtype = "f64" })
      local mean = n:mean()
      local std = (n - mean):norm() / math.sqrt(N)
      -- the mean's standard error is 1/sqrt(N) ~ 0.0032, the std's ~ 0.0022
      assert.is_true(math.abs(mean) < 0.02, "mean " .. mean)
      assert.is_true(math.abs(std - 1) < 0.02, "std " .. std)
      -- about 68.3% within one standard deviation, 95.4% within two
      local one, two = 0, 0
      for _, v in ipairs(n:totable()) do
        if math.abs(v) < 1 then one = one + 1 end
        if math.abs(v) < 2 then two = two + 1 end
      end
      assert.is_true(math.abs(one / N - 0.6827) < 0.01, "within 1: " .. one / N)
      assert.is_true(math.abs(two / N - 0.9545) < 0.005, "within 2: " .. two / N)
    end)
  end)

  describe("dtypes", function()
    it("f32 values are the f64 values rounded to f32", function()
      for _, f in ipairs { ft.rand, ft.randn } do
        local seed = h.next_seed()
        local d = f(1000, { seed = seed, dtype = "f64" }):totable()
        local s = f(1000, { seed = seed, dtype = "f32" }):totable()
        for i = 1, 1000 do assert.are.equal(f32(d[i]), s[i]) end
      end
    end)

    it("f16 and bf16 values are the f64 values rounded", function()
      for _, dtype in ipairs { "f16", "bf16" } do
        local seed = h.next_seed()
        local d = ft.randn(1000, { seed = seed, dtype = "f64" })
        local s = ft.randn(1000, { seed = seed, dtype = dtype })
        assert.are.same(d:to(dtype):totable(), s:totable())
        local u = ft.rand(1000, { seed = seed, dtype = "f64" }):to(dtype):totable()
        local v = ft.rand(1000, { seed = seed, dtype = dtype }):totable()
        for i = 1, 1000 do
          -- values that would round up to 1 are kept just below it
          if u[i] < 1 then assert.are.equal(u[i], v[i]) else assert.is_true(v[i] < 1) end
        end
      end
    end)
  end)
end)
