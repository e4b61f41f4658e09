-- Every tensor method and module function, called with a spread of wrong
-- arguments (nil, odd numbers, strings, tables, tensors of other dtypes and
-- shapes, a freed tensor): each call returns or raises a Lua error, never
-- crashes, and the tensors it was given keep their values. Run under the
-- sanitizer build (scripts/test --sanitize) this also proves that no error
-- path leaks or touches freed memory.
local h = require "helper"
local ft = h.ft
local core = require "flashtile.core"

local function arguments()
  local freed = ft.ones(2)
  freed:free()
  return { nil, 0, -1, 1, 2, 3, 1.5, 2^40, -2^63, 0 / 0, math.huge, "x", "f64", "cuda", "cpu",
    {}, { 2, 3 }, { -1 }, { 0 }, { 1, 2, 3, 4, 5, 6, 7, 8, 9 }, true,
    ft.ones(2, 3), ft.zeros(3, { dtype = "i64" }), ft.tensor({ 1, 2 }, { dtype = "i32" }),
    ft.randn({ 2, 3, 4 }, { seed = 1 }), ft.ones(0), ft.tensor(5), freed, ft.ones(4, 3):transpose(),
    ft.randn({ 1, 3, 2, 8 }, { dtype = "f64", seed = 2 }), function() end }
end

describe("misuse", function()
  it("of every tensor method is an error or a result, never a crash", function()
    local args = arguments()
    local names = {}
    for name in pairs(core.Tensor_methods) do names[#names + 1] = name end
    table.sort(names)
    local keep = h.randn({ 3, 4 })
    local keep_values = keep:totable()
    local calls = 0
    for _, name in ipairs(names) do
      -- free ends the tensor on purpose; save would write files named after
      -- the arguments (its errors are io_spec's)
      if name ~= "free" and name ~= "save" then
        for _, make in ipairs {
          function() return ft.ones(2, 3) end, function() return ft.tensor(1.5) end,
          function() return ft.zeros(0, 2) end, function() return ft.ones(4, 3):transpose() end,
          function() return ft.randn({ 1, 3, 2, 8 }, { seed = 3 }) end,
        } do
          for i = 1, #args + 1, 2 do
            for j = 1, #args + 1, 4 do
              pcall(core.Tensor_methods[name], make(), args[i], args[j])
              calls = calls + 1
            end
          end
        end
      end
    end
    collectgarbage()
    assert.is_true(calls > 1000)
    assert.are.same(keep_values, keep:totable())
  end)

  it("of every module function is an error or a result, never a crash", function()
    local args = arguments()
    local names = {}
    for name, f in pairs(ft) do
      -- save_safetensors would write files named after the arguments (its
      -- errors are safetensors_spec's)
      if type(f) == "function" and name ~= "manual_seed" and name ~= "save_safetensors" then
        names[#names + 1] = name
      end
    end
    table.sort(names)
    for _, name in ipairs(names) do
      for i = 1, #args + 1, 2 do
        for j = 1, #args + 1, 3 do
          pcall(ft[name], args[i], args[j], args[(i + j) % #args + 1])
        end
      end
    end
    collectgarbage()
    -- the session goes on
    assert.are.equal(6, ft.ones(2, 3):sum())
  end)
end)
