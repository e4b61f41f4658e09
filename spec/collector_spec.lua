-- The garbage collector sees tensor memory: a loop that drops big tensors
-- keeps the peak of tensor storage near its working set, on the CPU and
-- (tag #gpu) on CUDA, in every Lua flashtile supports.
local h = require "helper"
local ft = h.ft

local MB = 1024 * 1024
local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

describe("memory the collector can see", function()
  before_each(function()
    collectgarbage()
    collectgarbage()
  end)

  it("500 dropped 4 MB tensors peak far under 64 MB on the CPU", function()
    ft.reset_peak_memory()
    local base = ft.memory_stats().in_use
    for _ = 1, 500 do
      local t = ft.ones({ 1024, 1024 }) -- 4 MB of f32, garbage at the next turn
      assert.are.equal(1, t:get(1024, 1024))
    end
    local peak = ft.memory_stats().peak - base
    assert.is_true(peak < 64 * MB, ("peak %.1f MB"):format(peak / MB))
    -- without the collector's help the loop would hold up to 2 GB
    assert.is_true(peak >= 4 * MB)
  end)

  it("randn in the same loop (the tensors a sweep makes) stays as low", function()
    ft.reset_peak_memory()
    local base = ft.memory_stats().in_use
    for i = 1, 60 do
      local t = ft.randn({ 1024, 1024 }, { seed = i })
      assert.are.equal(1024, #t)
    end
    local peak = ft.memory_stats().peak - base
    assert.is_true(peak < 64 * MB, ("peak %.1f MB"):format(peak / MB))
  end)

  it("results of arithmetic are counted as well, live tensors are never collected", function()
    ft.reset_peak_memory()
    local base = ft.memory_stats().in_use
    local keep = {}
    local x = ft.ones({ 512, 1024 }) -- 2 MB
    for i = 1, 200 do
      local y = x * 2 + 1 -- two 2 MB results, both garbage soon
      if i % 50 == 0 then keep[#keep + 1] = y end
      assert.are.equal(3, y:get(1, 1))
    end
    local peak = ft.memory_stats().peak - base
    assert.is_true(peak < 64 * MB, ("peak %.1f MB"):format(peak / MB))
    for _, y in ipairs(keep) do assert.are.equal(3, y:get(512, 1024)) end
  end)

  it("live tensors raise the threshold: keeping 100 MB does not collect at every step", function()
    local keep = {}
    for i = 1, 25 do keep[i] = ft.zeros({ 1024, 1024 }) end -- 100 MB alive
    local before = collectgarbage("count")
    ft.reset_peak_memory()
    local base = ft.memory_stats().in_use
    for _ = 1, 100 do local _t = ft.zeros({ 256, 1024 }) end -- 1 MB each
    local peak = ft.memory_stats().peak - base
    -- garbage may reach about the live bytes (100 MB) before a collection
    assert.is_true(peak <= 110 * MB, ("peak %.1f MB"):format(peak / MB))
    assert.is_true(collectgarbage("count") < before + 1024)
    for i = 1, 25 do keep[i]:free() end
  end)

  gpu_it("500 dropped 256 MB tensors on CUDA never run out of memory", function()
    ft.reset_peak_memory("cuda")
    local base = ft.memory_stats("cuda").in_use
    for i = 1, 500 do
      local t = ft.randn({ 64, 1024, 1024 }, { device = "cuda", seed = i }) -- 256 MB
      if i % 100 == 0 then assert.are.equal(64, #t) end
    end
    ft.cuda.synchronize()
    local peak = ft.memory_stats("cuda").peak - base
    assert.is_true(peak <= 1024 * MB, ("peak %.1f MB"):format(peak / MB))
  end)
end)
