-- t[i] is t:select(1, i), as in torch7 and PyTorch: row i as a view, or the
-- number at i for a 1-d tensor; t[i] = v writes through.
local h = require "helper"
local ft = h.ft

describe("t[i]", function()
  local function grid()
    return ft.arange(1, 13, { dtype = "f64" }):view(3, 4) -- rows 1..4, 5..8, 9..12
  end

  it("gives row i as a view of the same storage", function()
    local t = grid()
    local row = t[2]
    assert.are.same({ 4 }, row.shape)
    assert.are.same({ 5, 6, 7, 8 }, row:totable())
    assert.is_true(row:is_same_storage(t))
    assert.are.equal(0, ft.max_abs_diff(row, t:select(1, 2)))
    row:set(1, -5)
    assert.are.equal(-5, t:get(2, 1))
  end)

  it("gives a number for a 1-d tensor, and chains: t[i][j]", function()
    local t = grid()
    assert.are.equal(7, t[2][3])
    assert.are.equal("number", type(t[3][4]))
    local v = ft.tensor({ 10, 20, 30 }, { dtype = "i64" })
    assert.are.equal(20, v[2])
    local cube = ft.arange(24, { dtype = "f32" }):view(2, 3, 4)
    assert.are.equal(23, cube[2][3][4])
    assert.are.same({ 3, 4 }, cube[1].shape)
  end)

  it("works on strided views: a transposed tensor's rows are its columns", function()
    local t = grid():transpose()
    assert.are.same({ 2, 6, 10 }, t[2]:totable())
    assert.are.equal(10, t[2][3])
  end)

  it("t[i] = number sets the element or fills the row", function()
    local t = grid()
    t[1] = 0
    assert.are.same({ 0, 0, 0, 0 }, t[1]:totable())
    t[3][2] = 42
    assert.are.equal(42, t:get(3, 2))
    local v = ft.zeros(3, { dtype = "i32" })
    v[3] = 7
    assert.are.same({ 0, 0, 7 }, v:totable())
  end)

  it("t[i] = tensor copies into the row, converting the dtype", function()
    local t = grid()
    t[2] = ft.tensor({ 1, 2, 3, 4 }, { dtype = "f32" })
    assert.are.same({ { 1, 2, 3, 4 }, { 1, 2, 3, 4 }, { 9, 10, 11, 12 } }, t:totable())
  end)

  it("is an error naming t[i] for a bad index, and the tensor goes on", function()
    local t = grid()
    h.assert_error(function() return t[0] end, "t[i]", "out of range 1..3")
    h.assert_error(function() return t[4] end, "t[i]", "out of range 1..3")
    h.assert_error(function() return t[1.5] end, "t[i]", "integer")
    h.assert_error(function() return ft.tensor(3)[1] end, "0-d")
    h.assert_error(function() t[1] = "x" end, "t[i] = v", "number or a tensor")
    h.assert_error(function() t[1] = ft.ones(3) end, "t[i] = v", "{4}", "{3}")
    local f = ft.ones(2)
    f:free()
    h.assert_error(function() return f[1] end, "freed")
    h.assert_error(function() t[1] = f end, "freed")
    assert.are.same({ 1, 2, 3, 4 }, t[1]:totable())
  end)

  it("leaves names alone: fields and methods are as before", function()
    local t = grid()
    assert.are.same({ 3, 4 }, t.shape)
    assert.are.equal("f64", t.dtype)
    assert.is_nil(t.no_such_method)
    assert.are.equal(3, #t)
    h.assert_error(function() t.shape = 1 end, "read-only")
  end)
end)

describe("conversion methods name themselves in errors", function()
  it("t:cuda() without a GPU, t:cuda(-1)", function()
    local t = ft.zeros(2)
    if ft.cuda.is_available() then
      h.assert_error(function() return t:cuda(-1) end, "cuda", "out of range")
    else
      local msg = h.assert_error(function() return t:cuda() end, "cuda")
      assert.is_nil(msg:find("init.lua", 1, true))
      assert.is_nil(msg:find("'to'", 1, true))
    end
    h.assert_error(function() return t:cuda("x") end, "cuda")
  end)

  it("t:double(), t:half(), t:long(), t:cpu() convert (and return t when nothing changes)", function()
    local t = ft.tensor({ 1.5, -2 }, { dtype = "f32" })
    assert.are.equal("f64", t:double().dtype)
    assert.are.equal("f16", t:half().dtype)
    assert.are.equal("bf16", t:bf16().dtype)
    assert.are.same({ 1, -2 }, t:long():totable())
    assert.are.same({ 1, -2 }, t:int():totable())
    assert.are.equal(t, t:float())
    assert.are.equal(t, t:cpu())
    h.assert_error(function() return t.double(3) end, "double")
  end)
end)
