-- flashtile.gradcheck: finite-difference gradient checks in f64. These
-- specs show the checker itself works: it passes correct analytic
-- gradients, fails wrong ones with a message naming the input, the index
-- and both values, and rejects what it cannot check.
local h = require "helper"
local ft = h.ft
local gradcheck = require "flashtile.gradcheck"

-- ---- functions with known gradients --------------------------------------------

--- y = x * x; the gradient of sum(y * dy) is 2 x dy (times factor, to make
-- a wrong one).
local function square(factor)
  factor = factor or 1
  return function(x) return x * x end,
         function(dy, x) return x * dy * (2 * factor) end
end

--- y = softmax(x) along the last dim of a 2-d x; dx = y * (dy - rowsum(dy * y)).
local function softmax_fns()
  local function forward(x) return x:softmax(2) end
  local function backward(dy, x)
    local y = x:softmax(2)
    local s = (dy * y):sum(2, true)                               -- [m, 1]
    local ones = ft.ones(1, x:size(2), { dtype = "f64" })
    return y * (dy - ft.matmul(s, ones))                          -- broadcast over n
  end
  return forward, backward
end

--- y = a * tanh(b), two inputs: da = dy tanh(b), db = dy a (1 - tanh(b)^2).
-- factors scale each gradient (1 when correct).
local function product(fa, fb)
  fa, fb = fa or 1, fb or 1
  return function(a, b) return a * b:tanh() end,
         function(dy, a, b)
           local t = b:tanh()
           return dy * t * fa, dy * a * (1 - t * t) * fb
         end
end

--- y = a b (matrix product): da = dy b^T, db = a^T dy.
local function matmul_fns()
  return function(a, b) return ft.matmul(a, b) end,
         function(dy, a, b)
           return ft.matmul(dy, b:transpose(1, 2):contiguous()),
                  ft.matmul(a:transpose(1, 2):contiguous(), dy)
         end
end

--- The 1-based multi-index of the largest |x| of a 2-d tensor, and x there.
local function argmax_abs(x)
  local best, bi, bj = -1, nil, nil
  for i = 1, x:size(1) do
    for j = 1, x:size(2) do
      local a = math.abs(x:get(i, j))
      if a > best then best, bi, bj = a, i, j end
    end
  end
  return { bi, bj }, x:get(bi, bj)
end

--- The analytic and numeric values quoted in a failure message.
local function quoted_values(msg)
  local a = msg:match("analytic ([^,]+),")
  local n = msg:match("numeric ([^ ]+) %(")
  return tonumber(a), tonumber(n), a, n
end

describe("flashtile.gradcheck", function()
  describe("passes correct gradients", function()
    it("of a forward that returns its input or a view of it", function()
      local x = h.randn({ 3 })
      for _, opts in ipairs { {}, { fast = true } } do
        local ok, report = gradcheck.check(function(a) return a:view(3, 1) end,
          function(dy) return dy:view(3) end, { x }, opts)
        assert.is_true(ok, report.message)
        ok, report = gradcheck.check(function(a) return a end, function(dy) return dy end, { x }, opts)
        assert.is_true(ok, report.message)
      end
    end)

    it("of y = x * x, in full and fast mode", function()
      local forward, backward = square()
      local x = h.randn({ 3, 4 })
      local ok, report = gradcheck.check(forward, backward, { x })
      assert.is_true(ok, report.message)
      assert.is_true(report.ok)
      assert.are.equal(0, report.failures)
      assert.is_nil(report.message)
      assert.is_number(report.worst.err)
      assert.is_true(report.worst.err < 1e-6)

      local ok2, report2 = gradcheck.check(forward, backward, { h.randn({ 5, 6 }) }, { fast = true })
      assert.is_true(ok2, report2.message)
    end)

    it("of softmax along the last dim", function()
      local forward, backward = softmax_fns()
      local ok, report = gradcheck.check(forward, backward, { h.randn({ 3, 5 }) })
      assert.is_true(ok, report.message)
      local ok2, report2 = gradcheck.check(forward, backward, { h.randn({ 4, 7 }) }, { fast = true, seed = 3 })
      assert.is_true(ok2, report2.message)
    end)

    it("of a function of two inputs, and of a matrix product", function()
      local forward, backward = product()
      local ok, report = gradcheck.check(forward, backward, { h.randn({ 2, 3 }), h.randn({ 2, 3 }) })
      assert.is_true(ok, report.message)
      local mf, mb = matmul_fns()
      local ok2, report2 = gradcheck.check(mf, mb, { h.randn({ 3, 4 }), h.randn({ 4, 2 }) })
      assert.is_true(ok2, report2.message)
      local ok3, report3 = gradcheck.check(mf, mb, { h.randn({ 5, 4 }), h.randn({ 4, 6 }) }, { fast = true })
      assert.is_true(ok3, report3.message)
    end)

    it("skips an input whose gradient is nil", function()
      -- the gradient of a is wrong but not returned; b's is right
      local forward = product()
      local _, backward = product()
      local ok, report = gradcheck.check(forward, function(dy, a, b)
        local _, db = backward(dy, a, b)
        return nil, db
      end, { h.randn({ 2, 3 }), h.randn({ 2, 3 }) })
      assert.is_true(ok, report.message)
      assert.are.equal(2, report.worst.input)
    end)

    it("restores the inputs it perturbs", function()
      local forward, backward = product()
      local a, b = h.randn({ 3, 3 }), h.randn({ 3, 3 })
      local a0, b0 = a:clone(), b:clone()
      gradcheck.check(forward, backward, { a, b })
      gradcheck.check(forward, backward, { a, b }, { fast = true })
      assert.are.equal(0, ft.max_abs_diff(a, a0))
      assert.are.equal(0, ft.max_abs_diff(b, b0))
    end)

    it("gradcheck.assert returns the report on success", function()
      local forward, backward = square()
      local report = gradcheck.assert(forward, backward, { h.randn({ 2, 2 }) })
      assert.is_true(report.ok)
    end)
  end)

  describe("fails wrong gradients", function()
    it("scaled by 1.01, naming the input, the index and both values (full mode)", function()
      local forward, backward = square(1.01)
      local x = h.randn({ 3, 4 })
      local ok, report = gradcheck.check(forward, backward, { x })
      assert.is_false(ok)
      assert.is_false(report.ok)
      assert.is_true(report.failures > 0)
      -- the worst entry is at the largest |x| (the error 0.02 |x| grows
      -- faster than the tolerance), on the diagonal of the Jacobian
      local idx, xv = argmax_abs(x)
      local where = "[" .. table.concat(idx, ", ") .. "]"
      local msg = report.message
      assert.is_string(msg)
      for _, needle in ipairs { "gradcheck:", "out of tolerance", "input 1 at " .. where,
                                "output " .. where, "analytic", "numeric" } do
        assert.is_truthy(msg:find(needle, 1, true), ("%q not in %q"):format(needle, msg))
      end
      local a, n = quoted_values(msg)
      assert.is_number(a, msg)
      assert.is_number(n, msg)
      assert.is_true(math.abs(a - 2.02 * xv) <= 1e-9 * math.abs(xv), msg)
      assert.is_true(math.abs(n - 2 * xv) <= 1e-6, msg)
      -- the report holds the same
      assert.are.equal(1, report.worst.input)
      assert.are.same(idx, report.worst.index)
      assert.are.same(idx, report.worst.output)
      assert.are.equal(2.02 * xv, report.worst.analytic)
      assert.is_true(math.abs(report.worst.numeric - 2 * xv) <= 1e-6)
    end)

    it("scaled by 1.01 in fast mode", function()
      local forward, backward = square(1.01)
      local ok, report = gradcheck.check(forward, backward, { h.randn({ 4, 5 }) }, { fast = true })
      assert.is_false(ok)
      local msg = report.message
      assert.is_truthy(msg:find("input 1 at [" .. table.concat(report.worst.index, ", ") .. "]", 1, true), msg)
      local a, n = quoted_values(msg)
      assert.is_number(a, msg)
      assert.is_number(n, msg)
      assert.is_true(math.abs(a - n) > 1e-5, msg)
    end)

    it("of softmax (scaled by 1.01)", function()
      local forward, backward = softmax_fns()
      local ok, report = gradcheck.check(forward, function(dy, x) return backward(dy, x) * 1.01 end,
                                         { h.randn({ 3, 5 }) })
      assert.is_false(ok)
      assert.is_truthy(report.message:find("input 1", 1, true), report.message)
    end)

    it("naming the second input when only its gradient is wrong", function()
      local forward, backward = product(1, 1.01)
      for _, fast in ipairs { false, true } do
        local ok, report = gradcheck.check(forward, backward, { h.randn({ 2, 3 }), h.randn({ 2, 3 }) },
                                           { fast = fast })
        assert.is_false(ok)
        assert.are.equal(2, report.worst.input)
        assert.is_truthy(report.message:find("input 2 at [", 1, true), report.message)
      end
    end)

    it("with a transposed gradient of a matrix product", function()
      local mf, mb = matmul_fns()
      local ok, report = gradcheck.check(mf, function(dy, a, b)
        local da, db = mb(dy, a, b)
        return da, db:transpose(1, 2):contiguous()
      end, { h.randn({ 3, 3 }), h.randn({ 3, 3 }) })
      assert.is_false(ok)
      assert.are.equal(2, report.worst.input)
    end)

    it("with NaN in the gradient", function()
      local forward, backward = square()
      local ok, report = gradcheck.check(forward, function(dy, x)
        local g = backward(dy, x)
        g:set(2, 1, 0 / 0)
        return g
      end, { h.randn({ 2, 2 }) })
      assert.is_false(ok)
      assert.are.same({ 2, 1 }, report.worst.index)
      assert.is_truthy(report.message:find("input 1 at [2, 1]", 1, true), report.message)
    end)

    it("uses atol and rtol: a 1.01 error passes with rtol = 0.05", function()
      local forward, backward = square(1.01)
      local ok, report = gradcheck.check(forward, backward, { h.randn({ 3, 4 }) }, { rtol = 0.05 })
      assert.is_true(ok, report.message)
      local ok2 = gradcheck.check(forward, backward, { h.randn({ 3, 4 }) }, { rtol = 0, atol = 1e-7 })
      assert.is_false(ok2)
    end)

    it("gradcheck.assert raises the message", function()
      local forward, backward = square(1.01)
      local msg = h.assert_error(function()
        gradcheck.assert(forward, backward, { h.randn({ 2, 2 }) })
      end, "gradcheck:", "input 1 at [", "analytic", "numeric")
      -- raised at the caller's line, not inside gradcheck.lua
      assert.is_truthy(msg:find("gradcheck_spec.lua:", 1, true), msg)
    end)
  end)

  describe("rejects what it cannot check", function()
    local forward, backward = square()

    it("f32, f16, bf16 and integer inputs, with a clear message", function()
      for _, dtype in ipairs { "f32", "f16", "bf16" } do
        local x = ft.randn({ 2, 2 }, { dtype = dtype, seed = h.next_seed() })
        h.assert_error(function() gradcheck.check(forward, backward, { x }) end,
          "gradcheck: input 1 is " .. dtype .. "; finite differences need f64 (x:double())")
      end
      h.assert_error(function()
        gradcheck.check(product(), select(2, product()), { h.randn({ 2 }), ft.ones(2, { dtype = "i32" }) })
      end, "gradcheck: input 2 is i32; finite differences need f64")
    end)

    it("blames the caller's line for an f32 input or an unknown option, from check and assert", function()
      local x32 = ft.randn({ 2, 2 }, { dtype = "f32", seed = 1 })
      local x = h.randn({ 2, 2 })
      local calls = {
        function() gradcheck.check(forward, backward, { x32 }) end,
        function() gradcheck.check(forward, backward, { x }, { bogus = 1 }) end,
        function() gradcheck.assert(forward, backward, { x32 }) end,
        function() gradcheck.assert(forward, backward, { x }, { bogus = 1 }) end,
      }
      for i, call in ipairs(calls) do
        local msg = h.error_of(call)
        assert.is_truthy(msg:find("^[^:]*gradcheck_spec%.lua:%d+:"),
          ("call %d: the error should point at this spec, got %q"):format(i, msg))
      end
    end)

    it("unknown options, and options that are not a table", function()
      local x = h.randn({ 2, 2 })
      h.assert_error(function() gradcheck.check(forward, backward, { x }, 5) end,
        "gradcheck: opts must be a table")
      h.assert_error(function() gradcheck.check(forward, backward, { x }, { tol = 1e-3 }) end,
        "gradcheck: unknown option 'tol'")
      h.assert_error(function() gradcheck.assert(forward, backward, { x }, { Fast = true }) end,
        "gradcheck: unknown option 'Fast'")
    end)

    it("inputs that are not tensors, or no inputs", function()
      h.assert_error(function() gradcheck.check(forward, backward, { 3 }) end,
        "gradcheck: input 1 is a number, not a tensor")
      h.assert_error(function() gradcheck.check(forward, backward, {}) end,
        "gradcheck: inputs must be a list of tensors")
      h.assert_error(function() gradcheck.check(forward, backward, h.randn({ 2 })) end,
        "gradcheck: inputs must be a list of tensors")
    end)

    it("a forward or backward that is not a function, or a forward without a tensor", function()
      local x = h.randn({ 2, 2 })
      h.assert_error(function() gradcheck.check(nil, backward, { x }) end,
        "gradcheck: forward must be a function")
      h.assert_error(function() gradcheck.check(forward, "grad", { x }) end,
        "gradcheck: backward must be a function")
      h.assert_error(function()
        gradcheck.check(function(t) return t:sum() end, backward, { x })
      end, "gradcheck: forward must return a tensor")
    end)
  end)
end)
