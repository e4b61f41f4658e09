-- The CUDA seam. Tests tagged #gpu need a CUDA backend and a device: where
-- either is missing they are reported as pending (visibly), never passed.
-- Run only these with `busted --tags=gpu`, or skip them with
-- `busted --exclude-tags=gpu`.
local h = require "helper"
local ft = h.ft


--- it() whose body runs only with a usable device; pending otherwise.
local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

describe("cuda #gpu", function()
  gpu_it("t:to('cuda') and back round trips every dtype", function()
    for _, dtype in ipairs(h.DTYPES) do
      local src = ft.tensor({ { 1, -2, 3 }, { 100, 0, -7 } }, { dtype = dtype })
      local g = src:to("cuda")
      assert.are.equal("cuda:0", g.device)
      assert.are.equal(dtype, g.dtype)
      assert.are.same({ 2, 3 }, g.shape)
      local back = g:to("cpu")
      assert.are.equal("cpu", back.device)
      assert.are.same(src:totable(), back:totable())
    end
  end)

  gpu_it("random values survive the round trip bit for bit", function()
    local src = h.randn({ 17, 33 })
    assert.are.same(src:totable(), src:to("cuda"):cpu():totable())
    local v = src:transpose():narrow(1, 3, 20) -- a strided view
    assert.are.same(v:totable(), v:to("cuda"):to("cpu"):totable())
  end)

  gpu_it("to{dtype=, device=} converts and moves at once", function()
    local src = h.randn({ 4, 5 })
    local g = src:to { dtype = "f32", device = "cuda:0" }
    assert.are.equal("cuda:0", g.device)
    assert.are.equal("f32", g.dtype)
    assert.are.same(src:float():totable(), g:cpu():totable())
  end)

  gpu_it("factories take device = 'cuda'", function()
    local z = ft.zeros(3, 4, { device = "cuda" })
    assert.are.equal("cuda:0", z.device)
    assert.are.same(ft.zeros(3, 4):totable(), z:cpu():totable())
    local r = ft.rand(8, { device = "cuda", seed = 3, dtype = "f64" })
    assert.are.same(ft.rand(8, { seed = 3, dtype = "f64" }):totable(), r:cpu():totable())
  end)

  gpu_it("memory_stats('cuda') counts device memory", function()
    collectgarbage()
    local before = ft.memory_stats("cuda")
    assert.is_number(before.reserved)
    local g = ft.zeros(1000, 1000, { dtype = "f64", device = "cuda" })
    assert.are.equal(before.in_use + 8000000, ft.memory_stats("cuda").in_use)
    g:free()
    assert.are.equal(before.in_use, ft.memory_stats("cuda").in_use)
  end)
end)

describe("cuda names without a CUDA backend", function()
  it("asking for a cuda device is a clear error", function()
    if h.no_gpu_reason() == nil then
      pending("a CUDA device is available: see the #gpu tests")
      return
    end
    for _, call in ipairs {
      function() return ft.zeros(2, { device = "cuda" }) end,
      function() return ft.ones(2):to("cuda") end,
      function() return ft.ones(2):to("cuda:1") end,
      function() return ft.memory_stats("cuda") end,
    } do
      local msg = h.error_of(call)
      assert.is_truthy(msg:find("cuda", 1, true), msg)
      -- a build without CUDA, or a CUDA build on a machine without a GPU
      assert.is_truthy(msg:find("without CUDA", 1, true) or msg:find("no CUDA device", 1, true), msg)
    end
  end)
end)
