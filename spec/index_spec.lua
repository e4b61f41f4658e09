-- Broadcast views and gathers along a dim: t:expand, t:index_select and
-- t:index_add (an embedding's lookup and gradient), against plain Lua.
local h = require "helper"
local ft = h.ft

describe("expand, index_select, index_add", function()
  it("expand repeats size-1 and new leading dims with stride 0, sharing storage", function()
    local b = ft.tensor({ 1, 2, 3 }, { dtype = "f64" })
    local e = b:expand(2, 3)
    assert.are.same({ 2, 3 }, e.shape)
    assert.are.same({ 0, 1 }, e:stride())
    assert.is_true(e:is_same_storage(b))
    assert.are.same({ { 1, 2, 3 }, { 1, 2, 3 } }, e:totable())
    local c = ft.tensor({ { 5 }, { 7 } }, { dtype = "f64" }):expand({ 2, -1, 4 })
    assert.are.same({ 2, 2, 4 }, c.shape)
    assert.are.same({ { 5, 5, 5, 5 }, { 7, 7, 7, 7 } }, c:select(1, 2):totable())
    local x = h.randn({ 4, 3 })
    local sum = x + b:expand(x.shape)
    for i = 1, 4 do
      for j = 1, 3 do assert.are.equal(x:get(i, j) + b:get(j), sum:get(i, j)) end
    end
  end)

  it("expand rejects a size that is neither 1 nor the target", function()
    local b = ft.ones(3)
    h.assert_error(function() return b:expand(2, 4) end, "cannot expand {3} to {2, 4}")
    h.assert_error(function() return ft.ones(2, 3):expand(3) end, "cannot expand a 2-d tensor to 1 dims")
  end)

  it("index_select gathers rows by 1-based positions, repeats included", function()
    local w = h.randn({ 5, 3 })
    local ids = ft.tensor({ 2, 5, 2, 1 }, { dtype = "i64" })
    local r = w:index_select(1, ids)
    assert.are.same({ 4, 3 }, r.shape)
    for i, id in ipairs { 2, 5, 2, 1 } do
      for j = 1, 3 do assert.are.equal(w:get(id, j), r:get(i, j)) end
    end
    local cols = w:index_select(2, ft.tensor({ 3, 1 }, { dtype = "i32" }))
    assert.are.same({ 5, 2 }, cols.shape)
    assert.are.equal(w:get(4, 3), cols:get(4, 1))
    -- strided source
    local wt = w:transpose()
    assert.are.equal(w:get(5, 2), wt:index_select(2, ft.tensor({ 5 }, { dtype = "i64" })):get(2, 1))
  end)

  it("index_add scatters and adds, repeated positions add up", function()
    local g = ft.zeros(4, 2, { dtype = "f64" })
    local src = h.randn({ 3, 2 })
    local ids = ft.tensor({ 4, 1, 4 }, { dtype = "i64" })
    assert.are.equal(g, g:index_add(1, ids, src))
    for j = 1, 2 do
      assert.is_true(math.abs(g:get(4, j) - (src:get(1, j) + src:get(3, j))) < 1e-15)
      assert.are.equal(src:get(2, j), g:get(1, j))
      assert.are.equal(0, g:get(2, j))
    end
  end)

  it("bad indices are clear errors and change nothing", function()
    local w = ft.ones(3, 2, { dtype = "f64" })
    h.assert_error(function() return w:index_select(1, ft.tensor({ 4 }, { dtype = "i64" })) end,
      "index[1] = 4 is out of range 1..3")
    h.assert_error(function() return w:index_select(1, ft.tensor({ 0 }, { dtype = "i64" })) end,
      "out of range")
    h.assert_error(function() return w:index_select(1, ft.tensor({ 1 })) end, "i64 or i32")
    h.assert_error(function() return w:index_add(1, ft.tensor({ 1 }, { dtype = "i64" }), ft.ones(2, 2, { dtype = "f64" })) end,
      "src must have shape {1, 2}")
    h.assert_error(function() return w:index_add(1, ft.tensor({ 1 }, { dtype = "i64" }), ft.ones(1, 2)) end,
      "src is f32")
    assert.are.same({ { 1, 1 }, { 1, 1 }, { 1, 1 } }, w:totable())
  end)
end)

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

describe("expand, index_select, index_add on CUDA #gpu", function()
  gpu_it("match the cpu", function()
    local w = ft.randn({ 50, 8 }, { seed = 3 })
    local ids = ft.tensor({ 3, 50, 3, 1, 7 }, { dtype = "i64" })
    local wg, ig = w:cuda(), ids:cuda()
    assert.are.equal(0, ft.max_abs_diff(w:index_select(1, ids), wg:index_select(1, ig):cpu()))
    local src = ft.randn({ 5, 8 }, { seed = 4 })
    local a = ft.zeros(50, 8):index_add(1, ids, src)
    local b = ft.zeros(50, 8, { device = "cuda" }):index_add(1, ig, src:cuda())
    assert.is_true(ft.max_abs_diff(a, b:cpu()) < 1e-6)
    local bias = ft.randn({ 8 }, { seed = 5 })
    assert.are.equal(0, ft.max_abs_diff(w + bias:expand(50, 8), (wg + bias:cuda():expand(50, 8)):cpu()))
    local msg = h.error_of(function() return wg:index_select(1, ft.tensor({ 51 }, { dtype = "i64" }):cuda()) end)
    assert.is_truthy(msg:find("out of range", 1, true), msg)
  end)
end)

describe("sizes that do not fit", function()
  it("a view whose element count overflows is an error, not a huge view", function()
    h.assert_error(function() return ft.zeros(0):view(4294967296, 4294967296) end, "too large")
  end)

  it("attention with seqlens past 32 bits (broadcast inputs) is an error", function()
    local q = ft.ones(1, 1, 1, 1, { dtype = "f16" }):expand(1, 2^32 + 2^17, 1, 1)
    local k = ft.ones(1, 1, 1, 1, { dtype = "f16" }):expand(1, 2^32 - 2^17, 1, 1)
    h.assert_error(function() return ft.attention(q, k, k, { impl = "naive" }) end,
      "seqlens above 2147483647 are not supported")
  end)
end)
