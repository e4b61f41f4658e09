-- Operations: elementwise arithmetic and functions, reductions, softmax,
-- matmul and comparisons, checked against plain-Lua computations.
local h = require "helper"
local ft = h.ft

local f32 = h.f32

--- Elementwise reference: applies f to the flat values of the tables
-- (with one argument when b is absent: LuaJIT's math.log(x, nil) is an error).
local function map(f, a, b)
  local fa, fb = h.flatten(a), b and h.flatten(b)
  local out = {}
  for i = 1, #fa do
    if fb then out[i] = f(fa[i], fb[i]) else out[i] = f(fa[i]) end
  end
  return out
end

local function tanh(x)
  local e = math.exp(2 * x)
  return (e - 1) / (e + 1)
end

describe("ops", function()
  describe("arithmetic", function()
    local A, B, a, b
    before_each(function()
      A, B = h.random_table({ 3, 4 }), h.random_table({ 3, 4 })
      a, b = ft.tensor(A, { dtype = "f64" }), ft.tensor(B, { dtype = "f64" })
    end)

    it("adds, subtracts, multiplies and divides tensors", function()
      h.assert_values(a + b, map(function(x, y) return x + y end, A, B))
      h.assert_values(a - b, map(function(x, y) return x - y end, A, B))
      h.assert_values(a * b, map(function(x, y) return x * y end, A, B))
      h.assert_values(a / b, map(function(x, y) return x / y end, A, B))
      h.assert_values(a:add(b), map(function(x, y) return x + y end, A, B))
      h.assert_values(a:sub(b), map(function(x, y) return x - y end, A, B))
      h.assert_values(a:mul(b), map(function(x, y) return x * y end, A, B))
      h.assert_values(a:div(b), map(function(x, y) return x / y end, A, B))
    end)

    it("takes a number on either side", function()
      h.assert_values(a + 2, map(function(x) return x + 2 end, A))
      h.assert_values(2 + a, map(function(x) return 2 + x end, A))
      h.assert_values(a - 2, map(function(x) return x - 2 end, A))
      h.assert_values(2 - a, map(function(x) return 2 - x end, A))
      h.assert_values(a * 3, map(function(x) return x * 3 end, A))
      h.assert_values(3 * a, map(function(x) return 3 * x end, A))
      h.assert_values(a / 4, map(function(x) return x / 4 end, A))
      h.assert_values(2 / a, map(function(x) return 2 / x end, A))
    end)

    it("negates with unary minus", function()
      h.assert_values(-a, map(function(x) return -x end, A))
      h.assert_values(a:neg(), map(function(x) return -x end, A))
    end)

    it("keeps the shape and dtype, and leaves the operands alone", function()
      local r = a * b
      assert.are.same({ 3, 4 }, r.shape)
      assert.are.equal("f64", r.dtype)
      assert.is_false(r:is_same_storage(a))
      assert.are.same(A, a:totable())
      assert.are.same(B, b:totable())
    end)

    it("rounds f32 results to f32", function()
      local x, y = a:float(), b:float()
      local X, Y = x:totable(), y:totable()
      local r = x / y
      assert.are.equal("f32", r.dtype)
      h.assert_values(r, map(function(p, q) return f32(p / q) end, X, Y))
      h.assert_values(1 - x, map(function(p) return f32(1 - p) end, X))
    end)

    it("works on integer tensors", function()
      local i = ft.tensor({ 5, -3, 7 }, { dtype = "i32" })
      local j = ft.tensor({ 2, 4, -6 }, { dtype = "i32" })
      assert.are.same({ 7, 1, 1 }, (i + j):totable())
      assert.are.same({ 3, -7, 13 }, (i - j):totable())
      assert.are.same({ 10, -12, -42 }, (i * j):totable())
      assert.are.same({ -5, 3, -7 }, (-i):totable())
      assert.are.same({ 15, -9, 21 }, (i * 3):totable())
      assert.are.equal("i32", (i + j).dtype)
    end)

    it("pow, maximum and minimum", function()
      local P = map(function(x) return math.abs(x) + 0.5 end, A)
      local p = ft.tensor(P, { dtype = "f64" }):view(3, 4)
      h.assert_values(p:pow(b), map(function(x, y) return x ^ y end, P, B), 1e-15)
      h.assert_values(p:pow(2), map(function(x) return x ^ 2 end, P), 1e-15)
      h.assert_values(p ^ 0.5, map(function(x) return x ^ 0.5 end, P), 1e-15)
      h.assert_values(2 ^ p, map(function(x) return 2 ^ x end, P), 1e-15)
      h.assert_values(a:maximum(b), map(math.max, A, B))
      h.assert_values(a:minimum(b), map(math.min, A, B))
      h.assert_values(a:maximum(0), map(function(x) return math.max(x, 0) end, A))
      h.assert_values(a:minimum(0.5), map(function(x) return math.min(x, 0.5) end, A))
    end)
  end)

  describe("functions", function()
    local A, a
    before_each(function()
      A = h.random_table({ 2, 5 })
      a = ft.tensor(A, { dtype = "f64" })
    end)

    it("exp, abs, tanh, sigmoid, relu", function()
      h.assert_values(a:exp(), map(math.exp, A), 1e-15)
      h.assert_values(a:abs(), map(math.abs, A))
      h.assert_values(a:tanh(), map(tanh, A), 1e-14)
      h.assert_values(a:sigmoid(), map(function(x) return 1 / (1 + math.exp(-x)) end, A), 1e-15)
      h.assert_values(a:relu(), map(function(x) return x > 0 and x or 0 end, A))
    end)

    it("log and sqrt of positive values", function()
      local pos = a:abs() + 0.1
      local P = pos:totable()
      h.assert_values(pos:log(), map(math.log, P), 1e-15)
      h.assert_values(pos:sqrt(), map(math.sqrt, P), 1e-15)
      h.assert_values(pos:log():exp(), P, 1e-14)
    end)

    it("in f32 round once to f32", function()
      local x = a:float()
      local X = x:totable()
      h.assert_values(x:exp(), map(function(v) return f32(math.exp(v)) end, X))
      h.assert_values(x:abs(), map(math.abs, X))
    end)

    it("sigmoid does not overflow", function()
      local s = ft.tensor({ -1000, 1000 }, { dtype = "f64" }):sigmoid()
      assert.are.same({ 0, 1 }, s:totable())
    end)

    it("abs and neg of integers stay integers", function()
      local i = ft.tensor({ -4, 0, 9 }, { dtype = "i64" })
      assert.are.same({ 4, 0, 9 }, i:abs():totable())
      assert.are.equal("i64", i:abs().dtype)
    end)
  end)

  describe("reductions", function()
    local A, a
    before_each(function()
      A = h.random_table({ 3, 4 })
      a = ft.tensor(A, { dtype = "f64" })
    end)

    local function all(f, init)
      local acc = init
      for _, row in ipairs(A) do
        for _, v in ipairs(row) do acc = f(acc, v) end
      end
      return acc
    end

    it("over the whole tensor give numbers", function()
      local sum = all(function(s, v) return s + v end, 0)
      local sq = all(function(s, v) return s + v * v end, 0)
      assert.is_number(a:sum())
      assert.is_true(math.abs(a:sum() - sum) < 1e-13)
      assert.is_true(math.abs(a:mean() - sum / 12) < 1e-14)
      assert.are.equal(all(math.max, -math.huge), a:max())
      assert.are.equal(all(math.min, math.huge), a:min())
      assert.is_true(math.abs(a:norm() - math.sqrt(sq)) < 1e-13)
    end)

    it("of integer tensors give integers for sum, max and min", function()
      local i = ft.tensor({ { 3, -8 }, { 5, 1 } }, { dtype = "i32" })
      assert.are.equal(1, i:sum())
      assert.are.equal(5, i:max())
      assert.are.equal(-8, i:min())
      assert.are.equal(0.25, i:mean())
      if not h.has_int64 then
        pending("math.type needs 5.3 (" .. _VERSION .. " has no integer subtype); the values are checked above")
      end
      assert.are.equal("integer", math.type(i:sum()))
      assert.are.equal("integer", math.type(i:max()))
      assert.are.equal("integer", math.type(i:min()))
    end)

    it("along a dim give a tensor without that dim", function()
      local rows, cols = {}, {}
      for i = 1, 3 do
        rows[i] = 0
        for j = 1, 4 do rows[i] = rows[i] + A[i][j] end
      end
      for j = 1, 4 do
        cols[j] = 0
        for i = 1, 3 do cols[j] = cols[j] + A[i][j] end
      end
      local s2 = a:sum(2)
      assert.are.same({ 3 }, s2.shape)
      assert.are.equal("f64", s2.dtype)
      h.assert_values(s2, rows, 1e-14)
      h.assert_values(a:sum(1), cols, 1e-14)
      h.assert_values(a:sum(-1), rows, 1e-14)
      h.assert_values(a:mean(2), map(function(s) return s / 4 end, rows), 1e-14)
      local norms = {}
      for i = 1, 3 do
        local s = 0
        for j = 1, 4 do s = s + A[i][j] ^ 2 end
        norms[i] = math.sqrt(s)
      end
      h.assert_values(a:norm(2), norms, 1e-14)
    end)

    it("along the middle dim of a 3-d tensor", function()
      local T = h.random_table({ 2, 3, 4 })
      local t = ft.tensor(T, { dtype = "f64" })
      local s = t:sum(2, true)
      local m, idx = t:max(2)
      assert.are.same({ 2, 1, 4 }, s.shape)
      assert.are.same({ 2, 4 }, m.shape)
      for a = 1, 2 do
        for c = 1, 4 do
          local sum, best, at = 0, -math.huge, 0
          for b = 1, 3 do
            sum = sum + T[a][b][c]
            if T[a][b][c] > best then best, at = T[a][b][c], b end
          end
          assert.is_true(math.abs(s:get(a, 1, c) - sum) < 1e-14)
          assert.are.equal(best, m:get(a, c))
          assert.are.equal(at, idx:get(a, c))
        end
      end
    end)

    it("keepdim keeps the dim with size 1", function()
      assert.are.same({ 3, 1 }, a:sum(2, true).shape)
      assert.are.same({ 1, 4 }, a:mean(1, true).shape)
      local m, i = a:max(2, true)
      assert.are.same({ 3, 1 }, m.shape)
      assert.are.same({ 3, 1 }, i.shape)
    end)

    it("max and min along a dim give values and 1-based i64 indices", function()
      local m, i = a:max(2)
      local n, k = a:min(1)
      assert.are.equal("i64", i.dtype)
      assert.are.equal("i64", k.dtype)
      for r = 1, 3 do
        local best, at = -math.huge, 0
        for c = 1, 4 do if A[r][c] > best then best, at = A[r][c], c end end
        assert.are.equal(best, m:get(r))
        assert.are.equal(at, i:get(r))
      end
      for c = 1, 4 do
        local best, at = math.huge, 0
        for r = 1, 3 do if A[r][c] < best then best, at = A[r][c], r end end
        assert.are.equal(best, n:get(c))
        assert.are.equal(at, k:get(c))
      end
    end)

    it("of empty tensors: sum is 0, mean is NaN, max is an error", function()
      local e = ft.zeros(0, { dtype = "f64" })
      assert.are.equal(0, e:sum())
      local m = e:mean()
      assert.is_true(m ~= m)
      assert.has_error(function() return e:max() end)
    end)

    it("max and min of integer tensors along a dim keep the dtype", function()
      local i = ft.tensor({ { 3, 9, 9 }, { -1, -5, 2 } }, { dtype = "i32" })
      local m, k = i:max(2)
      assert.are.equal("i32", m.dtype)
      assert.are.same({ 9, 2 }, m:totable())
      assert.are.same({ 2, 3 }, k:totable())
      local n, j = i:min(1)
      assert.are.same({ -1, -5, 2 }, n:totable())
      assert.are.same({ 2, 2, 2 }, j:totable())
    end)

    it("max and min report the first of equal extremes", function()
      local t = ft.tensor({ { 1, 5, 5 }, { 7, 0, 7 } })
      local m, i = t:max(2)
      assert.are.same({ 5, 7 }, m:totable())
      assert.are.same({ 2, 1 }, i:totable())
      local n, k = t:min(2)
      assert.are.same({ 1, 0 }, n:totable())
      assert.are.same({ 1, 2 }, k:totable())
    end)
  end)

  describe("softmax", function()
    it("rows sum to 1 and match a plain-Lua softmax", function()
      local A = h.random_table({ 4, 6 }, function() return math.random() * 20 - 10 end)
      local s = ft.tensor(A, { dtype = "f64" }):softmax(2)
      assert.are.same({ 4, 6 }, s.shape)
      local want = {}
      for i, row in ipairs(A) do
        local m = math.max(h.unpack(row))
        local total = 0
        for _, v in ipairs(row) do total = total + math.exp(v - m) end
        want[i] = {}
        for j, v in ipairs(row) do want[i][j] = math.exp(v - m) / total end
      end
      h.assert_values(s, want, 1e-15)
      h.assert_values(s:sum(2), { 1, 1, 1, 1 }, 1e-14)
    end)

    it("defaults to the last dim and works along any dim", function()
      local a = h.randn({ 3, 5 })
      assert.is_true(ft.allclose(a:softmax(), a:softmax(2), 0, 0))
      assert.is_true(ft.allclose(a:softmax(-1), a:softmax(2), 0, 0))
      local cols = a:softmax(1)
      h.assert_values(cols:sum(1), { 1, 1, 1, 1, 1 }, 1e-14)
      assert.is_true(ft.allclose(cols, a:transpose():softmax(2):transpose(), 0, 0))
    end)

    it("does not overflow on large inputs", function()
      local s = ft.tensor({ 1000, 1000, 999 }, { dtype = "f64" }):softmax(1)
      local e = math.exp(-1)
      h.assert_values(s, { 1 / (2 + e), 1 / (2 + e), e / (2 + e) }, 1e-15)
    end)

    it("in f32 is close to the f64 result", function()
      local a = h.randn({ 5, 7 })
      local d = ft.max_abs_diff(a:float():softmax(2), a:softmax(2))
      assert.is_true(d < 1e-6, "max diff " .. d)
    end)
  end)

  describe("ft.matmul", function()
    local function rel_err(c, want)
      local got, ref = h.flatten(c:totable()), h.flatten(want)
      local scale = 0
      for _, v in ipairs(ref) do scale = math.max(scale, math.abs(v)) end
      return h.max_diff(got, ref) / scale
    end

    it("multiplies 2-d f64 matrices like the triple loop", function()
      local A, B = h.random_table({ 5, 7 }), h.random_table({ 7, 3 })
      local c = ft.matmul(ft.tensor(A, { dtype = "f64" }), ft.tensor(B, { dtype = "f64" }))
      assert.are.same({ 5, 3 }, c.shape)
      assert.are.equal("f64", c.dtype)
      h.assert_values(c, h.matmul_ref(A, B), 1e-13)
    end)

    it("multiplies 2-d f32 matrices within f32 precision", function()
      local A, B = h.random_table({ 6, 9 }), h.random_table({ 9, 4 })
      local a, b = ft.tensor(A):float(), ft.tensor(B):float()
      local c = ft.matmul(a, b)
      assert.are.equal("f32", c.dtype)
      local err = rel_err(c, h.matmul_ref(a:totable(), b:totable()))
      assert.is_true(err < 1e-5, "relative error " .. err)
    end)

    it("multiplies batched 3-d tensors", function()
      for _, dtype in ipairs { "f64", "f32" } do
        local A, B = h.random_table({ 3, 4, 5 }), h.random_table({ 3, 5, 2 })
        local a, b = ft.tensor(A, { dtype = dtype }), ft.tensor(B, { dtype = dtype })
        local c = ft.matmul(a, b)
        assert.are.same({ 3, 4, 2 }, c.shape)
        local want = {}
        for k = 1, 3 do want[k] = h.matmul_ref(a:totable()[k], b:totable()[k]) end
        local err = rel_err(c, want)
        assert.is_true(err < (dtype == "f64" and 1e-14 or 1e-5), dtype .. " relative error " .. err)
      end
    end)

    it("takes transposed (non-contiguous) operands", function()
      for _, dtype in ipairs { "f64", "f32" } do
        local A, B = h.random_table({ 4, 6 }), h.random_table({ 5, 4 })
        local a = ft.tensor(A, { dtype = dtype }):transpose() -- 6 x 4
        local b = ft.tensor(B, { dtype = dtype }):transpose() -- 4 x 5
        assert.is_false(a:is_contiguous())
        local c = ft.matmul(a, b)
        assert.are.same({ 6, 5 }, c.shape)
        local err = rel_err(c, h.matmul_ref(a:totable(), b:totable()))
        assert.is_true(err < (dtype == "f64" and 1e-14 or 1e-5), dtype .. " relative error " .. err)
        -- the same as the product of contiguous copies
        local d = ft.max_abs_diff(c, ft.matmul(a:contiguous(), b:contiguous()))
        assert.is_true(d <= (dtype == "f64" and 1e-14 or 1e-5), dtype .. " diff " .. d)
      end
    end)

    it("takes narrowed and batched strided operands", function()
      local big = h.randn({ 3, 6, 8 })
      local a = big:narrow(2, 2, 4):narrow(3, 3, 5) -- 3 x 4 x 5, padded rows
      local b = h.randn({ 3, 2, 5 }):transpose(2, 3) -- 3 x 5 x 2
      local c = ft.matmul(a, b)
      local want = ft.matmul(a:contiguous(), b:contiguous())
      assert.is_true(ft.max_abs_diff(c, want) < 1e-14)
      local ref = {}
      for k = 1, 3 do ref[k] = h.matmul_ref(a:totable()[k], b:totable()[k]) end
      h.assert_values(c, ref, 1e-13)
    end)

    it("takes operands without a unit stride and permuted batch dims", function()
      local a = h.randn({ 4, 5, 6 }):select(3, 2)          -- 4 x 5, strides {30, 6}
      local b = h.randn({ 5, 3, 2 }):select(3, 1)          -- 5 x 3, strides {6, 2}
      local ref = h.matmul_ref(a:totable(), b:totable())
      h.assert_values(ft.matmul(a, b), ref, 1e-13)
      h.assert_values(ft.matmul(a:float(), b:float()), ref, 1e-4)
      local x = h.randn({ 4, 3, 5 }):permute(2, 1, 3)       -- 3 x 4 x 5
      local y = h.randn({ 2, 5, 3 }):permute(3, 2, 1)       -- 3 x 5 x 2
      local c = ft.matmul(x, y)
      assert.are.same({ 3, 4, 2 }, c.shape)
      local want = {}
      for k = 1, 3 do want[k] = h.matmul_ref(x:totable()[k], y:totable()[k]) end
      h.assert_values(c, want, 1e-13)
    end)

    it("handles edge shapes: 1 x k, k x 1, k = 0 and m = 0", function()
      local a = h.randn({ 5, 4 })
      local row = a:narrow(1, 2, 1)                -- 1 x 4, a view
      local col = a:transpose():narrow(2, 3, 1)    -- 4 x 1, strided
      local dot = 0
      for k = 1, 4 do dot = dot + a:get(2, k) * a:get(3, k) end
      assert.is_true(math.abs(ft.matmul(row, col):item() - dot) < 1e-14)
      local outer = ft.matmul(col, row)            -- 4 x 4
      assert.are.same({ 4, 4 }, outer.shape)
      assert.is_true(math.abs(outer:get(2, 3) - a:get(3, 2) * a:get(2, 3)) < 1e-15)
      local z = ft.matmul(ft.ones(3, 0, { dtype = "f64" }), ft.ones(0, 2, { dtype = "f64" }))
      assert.are.same({ { 0, 0 }, { 0, 0 }, { 0, 0 } }, z:totable())
      assert.are.same({ 0, 2 }, ft.matmul(ft.ones(0, 3), ft.ones(3, 2)).shape)
    end)

    it("multiplies f16 and bf16 within their precision", function()
      local A, B = h.random_table({ 8, 16 }), h.random_table({ 16, 8 })
      for dtype, tol in pairs { f16 = 2e-3, bf16 = 1.6e-2 } do
        local a, b = ft.tensor(A, { dtype = dtype }), ft.tensor(B, { dtype = dtype })
        local c = ft.matmul(a, b)
        assert.are.equal(dtype, c.dtype)
        -- against the exact product of the rounded inputs
        local err = rel_err(c, h.matmul_ref(a:totable(), b:totable()))
        assert.is_true(err < tol, dtype .. " relative error " .. err)
      end
    end)
  end)

  describe("comparisons", function()
    it("ft.max_abs_diff is the largest elementwise difference", function()
      local a = ft.tensor({ 1, 2, 3, 4 }, { dtype = "f64" })
      local b = ft.tensor({ 1.5, 2, 1, 4.25 }, { dtype = "f64" })
      assert.are.equal(2, ft.max_abs_diff(a, b))
      assert.are.equal(0, ft.max_abs_diff(a, a))
      assert.are.equal(2, ft.max_abs_diff(a:float(), b))
      local n = ft.max_abs_diff(a, ft.tensor({ 1, 0 / 0, 3, 4 }, { dtype = "f64" }))
      assert.is_true(n ~= n)
    end)

    it("ft.allclose uses |a - b| <= atol + rtol * |b|", function()
      local b = ft.tensor({ 100, 1, 0 }, { dtype = "f64" })
      local a = ft.tensor({ 100.5, 1, 0.001 }, { dtype = "f64" })
      assert.is_false(ft.allclose(a, b))
      assert.is_true(ft.allclose(a, b, 0.01, 0.001))
      assert.is_false(ft.allclose(a, b, 0.01, 0.0009))
      assert.is_false(ft.allclose(a, b, 0.004, 0.001))
      assert.is_true(ft.allclose(a, b, 0, 0.5))
      assert.is_true(ft.allclose(b, b, 0, 0))
      local nan = ft.tensor({ 0 / 0 }, { dtype = "f64" })
      assert.is_false(ft.allclose(nan, nan, 1, 1))
    end)
  end)

  describe("on strided views", function()
    local base, view, copy
    before_each(function()
      base = h.randn({ 5, 6 })
      view = base:transpose():narrow(1, 2, 4) -- 4 x 5, non-contiguous
      copy = view:contiguous()
      assert.is_false(view:is_contiguous())
    end)

    local function same(x, y)
      assert.are.same(x.shape, y.shape)
      assert.are.equal(0, ft.max_abs_diff(x, y))
    end

    it("elementwise ops equal those on a contiguous copy", function()
      local other = h.randn({ 4, 5 })
      same(view + other, copy + other)
      same(other - view, other - copy)
      same(view * view, copy * copy)
      same(view / 3, copy / 3)
      same(2 - view, 2 - copy)
      same(-view, -copy)
      same(view:exp(), copy:exp())
      same(view:tanh(), copy:tanh())
      same(view:relu(), copy:relu())
      same(view:maximum(other), copy:maximum(other))
    end)

    it("f32 + - * / on strided, broadcast and scalar operands: the f64 result rounded once to f32", function()
      local a = ft.randn({ 6, 7, 9 }, { seed = h.next_seed() })
      local b = ft.randn({ 6, 9, 7 }, { seed = h.next_seed() }):transpose(2, 3) -- [6, 7, 9], strided
      local row = ft.randn({ 1, 1, 9 }, { seed = h.next_seed() }):expand(6, 7, 9) -- stride 0 twice
      local col = ft.randn({ 6, 7, 1 }, { seed = h.next_seed() }):expand(6, 7, 9) -- stride 0 last
      local nar = ft.randn({ 6, 7, 12 }, { seed = h.next_seed() }):narrow(3, 2, 9)
      local function f64(t) return t:to("f64") end
      for _, x in ipairs { a, b, nar } do
        for _, y in ipairs { a, b, row, col, nar } do
          same(x + y, (f64(x) + f64(y)):to("f32"))
          same(x - y, (f64(x) - f64(y)):to("f32"))
          same(y * x, (f64(y) * f64(x)):to("f32"))
          same(x / y, (f64(x) / f64(y)):to("f32"))
        end
        same(x * 0.1, (f64(x) * 0.1):to("f32"))
        same(3 - x, (3 - f64(x)):to("f32"))
        same(1 / x, (1 / f64(x)):to("f32"))
      end
    end)

    it("reductions equal those on a contiguous copy", function()
      assert.is_true(math.abs(view:sum() - copy:sum()) < 1e-13)
      assert.are.equal(copy:max(), view:max())
      assert.are.equal(copy:min(), view:min())
      assert.is_true(math.abs(view:norm() - copy:norm()) < 1e-13)
      for d = 1, 2 do
        assert.is_true(ft.max_abs_diff(view:sum(d), copy:sum(d)) < 1e-14)
        assert.is_true(ft.max_abs_diff(view:mean(d, true), copy:mean(d, true)) < 1e-14)
        local m1, i1 = view:max(d)
        local m2, i2 = copy:max(d)
        same(m1, m2)
        assert.are.same(i2:totable(), i1:totable())
      end
    end)

    it("softmax and matmul equal those on a contiguous copy", function()
      same(view:softmax(1), copy:softmax(1))
      same(view:softmax(2), copy:softmax(2))
      local w = h.randn({ 5, 3 })
      assert.is_true(ft.max_abs_diff(ft.matmul(view, w), ft.matmul(copy, w)) < 1e-14)
    end)
  end)
end)
