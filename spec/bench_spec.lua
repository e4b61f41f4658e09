-- flashtile.bench: timing (median, min, max in milliseconds) and the
-- attention FLOP counts of FlashAttention's benchmarks.
local h = require "helper"
local ft = h.ft
local bench = require "flashtile.bench"

--- A function that counts its calls.
local function counter()
  local n = 0
  return function() n = n + 1 end, function() return n end
end

--- Busy-waits ms milliseconds on the wall clock.
local function spin(ms)
  local t0 = ft.clock()
  while (ft.clock() - t0) * 1e3 < ms do end
end

describe("flashtile.bench", function()
  describe("run", function()
    it("returns median, min and max with min <= median <= max, and reps times", function()
      for _, reps in ipairs { 1, 2, 5, 8 } do
        local i = 0
        -- uneven work so that the times differ
        local r = bench.run(function()
          i = i + 1
          spin(0.2 * (i % 3))
        end, { warmup = 0, reps = reps })
        assert.are.equal(reps, r.reps)
        assert.are.equal(reps, #r.times)
        assert.is_true(r.min <= r.median and r.median <= r.max,
          ("min %g, median %g, max %g"):format(r.min, r.median, r.max))
        local sorted = {}
        for k, t in ipairs(r.times) do
          assert.is_number(t)
          assert.is_true(t >= 0)
          sorted[k] = t
        end
        table.sort(sorted)
        assert.are.equal(sorted[1], r.min)
        assert.are.equal(sorted[reps], r.max)
        local half = math.floor(reps / 2)
        local median = reps % 2 == 1 and sorted[half + 1] or (sorted[half] + sorted[half + 1]) / 2
        assert.are.equal(median, r.median)
      end
    end)

    it("calls fn warmup + reps times (defaults: warmup 1, reps 5)", function()
      local fn, calls = counter()
      local r = bench.run(fn)
      assert.are.equal(6, calls())
      assert.are.equal(5, r.reps)
      assert.are.equal(5, #r.times)

      fn, calls = counter()
      bench.run(fn, { warmup = 3, reps = 4 })
      assert.are.equal(7, calls())

      fn, calls = counter()
      bench.run(fn, { warmup = 0, reps = 1 })
      assert.are.equal(1, calls())
    end)

    it("measures wall-clock milliseconds", function()
      local r = bench.run(function() spin(3) end, { warmup = 0, reps = 3 })
      assert.is_true(r.min >= 3, ("min %g ms for a 3 ms wait"):format(r.min))
      assert.is_true(r.max < 3000, ("max %g ms for a 3 ms wait"):format(r.max))
    end)

    it("times attention calls", function()
      local q = h.randn({ 1, 64, 2, 32 }, { dtype = "f32" })
      local r = bench.run(function() ft.attention(q, q, q, { causal = true }) end, { reps = 3 })
      assert.is_true(r.min > 0 and r.min <= r.median and r.median <= r.max)
      local tf = bench.tflops(bench.attention_flops(1, 2, 64, 64, 32, true), r.median)
      assert.is_true(tf > 0 and tf < math.huge)
    end)

    it("lets an error of fn through", function()
      h.assert_error(function()
        bench.run(function() error("boom in fn") end, { warmup = 0, reps = 2 })
      end, "boom in fn")
    end)

    describe("validates its arguments", function()
      local bad = {
        { { warmup = -1 }, "bench.run: warmup must be an integer >= 0" },
        { { warmup = 1.5 }, "bench.run: warmup must be an integer >= 0" },
        { { warmup = "2" }, "bench.run: warmup must be an integer >= 0" },
        { { reps = 0 }, "bench.run: reps must be an integer >= 1" },
        { { reps = -3 }, "bench.run: reps must be an integer >= 1" },
        { { reps = 2.5 }, "bench.run: reps must be an integer >= 1" },
        { { reps = "3" }, "bench.run: reps must be an integer >= 1" },
      }
      for _, case in ipairs(bad) do
        local opts, needle = case[1], case[2]
        local k, v = next(opts)
        it(("%s = %s (%s)"):format(k, tostring(v), math.type and math.type(v) or type(v)), function()
          local fn, calls = counter()
          local msg = h.assert_error(function() bench.run(fn, opts) end, needle)
          assert.are.equal(0, calls())
          -- raised at the caller's line
          assert.is_truthy(msg:find("^[^:]*bench_spec%.lua:%d+:"), msg)
        end)
      end

      it("fn that is not a function", function()
        for _, fn in ipairs { 1, "f", {} } do
          h.assert_error(function() bench.run(fn) end, "bench.run: fn must be a function")
        end
        h.assert_error(function() bench.run() end, "bench.run: fn must be a function")
      end)

      -- Like ft.attention's options and gradcheck's, a misspelt key should
      -- not pass silently ({rep = 100} would run the default 5 reps).
      it("an unknown option", function()
        local fn, calls = counter()
        h.assert_error(function() bench.run(fn, { rep = 100 }) end, "bench.run", "unknown option 'rep'")
        assert.are.equal(0, calls())
      end)

      it("options that are not a table", function()
        local fn = counter()
        h.assert_error(function() bench.run(fn, 5) end, "bench.run", "opts must be a table")
      end)

      it("a device that is not a string", function()
        local fn, calls = counter()
        h.assert_error(function() bench.run(fn, { device = 0 }) end, "bench.run: device must be a string")
        assert.are.equal(0, calls())
      end)

      it("device = 'cpu' is the wall clock, as without it", function()
        local fn, calls = counter()
        local r = bench.run(function() fn(); spin(1) end, { device = "cpu", warmup = 0, reps = 2 })
        assert.are.equal(2, calls())
        assert.is_true(r.min >= 1)
      end)
    end)
  end)

  describe("attention_flops", function()
    it("is 4 * B * H * Nq * Nk * d for the forward pass (the default)", function()
      assert.are.equal(4 * 2 * 3 * 5 * 7 * 11, bench.attention_flops(2, 3, 5, 7, 11))
      assert.are.equal(4 * 2 * 3 * 5 * 7 * 11, bench.attention_flops(2, 3, 5, 7, 11, false, "fwd"))
      assert.are.equal(4 * 1 * 1 * 1 * 1 * 1, bench.attention_flops(1, 1, 1, 1, 1))
      -- Nq and Nk are not interchangeable with the other sizes, but are with each other
      assert.are.equal(bench.attention_flops(2, 3, 5, 7, 11), bench.attention_flops(2, 3, 7, 5, 11))
      -- a large case, beyond 2^32 and exact in a double
      assert.are.equal(4 * 16 * 32 * 16384 * 16384 * 128, bench.attention_flops(16, 32, 16384, 16384, 128))
    end)

    it("halves when causal", function()
      local full = bench.attention_flops(2, 8, 1024, 2048, 64, false)
      assert.are.equal(full / 2, bench.attention_flops(2, 8, 1024, 2048, 64, true))
      assert.are.equal(4 * 3 * 5 * 7 * 11 / 2, bench.attention_flops(1, 3, 5, 7, 11, true))
    end)

    it("is 2.5x the forward for 'bwd' and 3.5x for 'fwd+bwd', causal or not", function()
      for _, causal in ipairs { false, true } do
        local f = bench.attention_flops(4, 16, 512, 384, 128, causal, "fwd")
        assert.are.equal(4.0 * 4 * 16 * 512 * 384 * 128 / (causal and 2 or 1), f)
        assert.are.equal(2.5 * f, bench.attention_flops(4, 16, 512, 384, 128, causal, "bwd"))
        assert.are.equal(3.5 * f, bench.attention_flops(4, 16, 512, 384, 128, causal, "fwd+bwd"))
      end
    end)

    it("errors on an unknown pass, naming it", function()
      for _, pass in ipairs { "backward", "FWD", "fwd+bwd+fwd", "" } do
        local msg = h.assert_error(function() bench.attention_flops(1, 1, 8, 8, 8, false, pass) end,
          "bench.attention_flops: pass must be 'fwd', 'bwd' or 'fwd+bwd', got '" .. pass .. "'")
        assert.is_truthy(msg:find("^[^:]*bench_spec%.lua:%d+:"), msg)
      end
      h.assert_error(function() bench.attention_flops(1, 1, 8, 8, 8, false, 3) end,
        "pass must be 'fwd', 'bwd' or 'fwd+bwd', got '3'")
    end)
  end)

  describe("tflops", function()
    it("is flops / (ms * 1e-3) / 1e12", function()
      assert.are.equal(1, bench.tflops(1e12, 1000))
      assert.are.equal(2, bench.tflops(2e12, 1000))
      assert.are.equal(1, bench.tflops(1e9, 1))
      assert.is_true(math.abs(bench.tflops(3e9, 2) - 1.5) < 1e-15)
      local flops = bench.attention_flops(2, 8, 1024, 1024, 64, true, "fwd+bwd")
      assert.is_true(math.abs(bench.tflops(flops, 12.5) - flops / 0.0125 / 1e12) < 1e-12)
    end)
  end)
end)
