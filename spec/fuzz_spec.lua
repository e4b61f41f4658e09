-- The Lua API under fire: every function of ft and every tensor method,
-- called with random and hostile arguments under pcall, must raise a Lua
-- error or return, never crash, leak or corrupt the tensors it was not
-- given. Hostile means: tables whose metamethods free the tensors of the
-- call, finalizers that free them while the call runs (the collector set to
-- run at every allocation), freed tensors, stride-0 views, 0-d and empty
-- tensors, huge and non-integral sizes, NaN, coroutines. Fixed seed and
-- count (FT_FUZZ_SEED, FT_FUZZ_CALLS: default 1 and 20000); CI runs it in
-- the sanitizer build too, where any memory error or leak fails it.
local h = require "helper"
local ft = h.ft
local core = require "flashtile.core"

local SEED = tonumber(os.getenv("FT_FUZZ_SEED") or "") or 1
local CALLS = tonumber(os.getenv("FT_FUZZ_CALLS") or "") or 20000

-- functions that write files named after their arguments, or reseed
local SKIP = { save = true, save_safetensors = true, manual_seed = true, free = true }

describe("the Lua API fuzzed with hostile arguments", function()
  it(("survives %d calls (seed %d) and leaves the bystanders intact"):format(CALLS, SEED), function()
    math.randomseed(SEED)
    local rand = math.random
    local bystander = ft.randn({ 3, 5 }, { dtype = "f64", seed = 99 })
    local bystander_values = bystander:totable()

    local victims = {}
    local function victim()
      local kinds = {
        function() return ft.randn({ 2, 3 }, { seed = rand(1000) }) end,
        function() return ft.ones(4):expand({ 3, 4 }) end,
        function() return ft.tensor(1.5, { dtype = "f64" }) end,
        function() return ft.zeros({ 0, 2 }) end,
        function() return ft.arange(6, { dtype = "i64" }) end,
        function() return ft.randn({ 1, 5, 2, 8 }, { dtype = "f16", seed = rand(1000) }) end,
        function() return ft.randn({ 4, 3 }):transpose() end,
        function() return ft.ones(1):expand({ 2 ^ 40 }) end,
      }
      local t = kinds[rand(#kinds)]()
      victims[#victims + 1] = t
      return t
    end

    -- a table whose length and entries free a victim while they are read
    local function hostile_table(t, values)
      return setmetatable({}, {
        __len = function() t:free() return #values end,
        __index = function(_, i) t:free() return values[i] end,
      })
    end

    -- finalizers that free t when the collector runs them, mid-call
    local function arm_finalizers(t)
      for _ = 1, rand(3) do
        setmetatable({}, { __gc = function() pcall(t.free, t) end })
      end
      if rand(4) == 1 then
        -- a coroutine that frees it, resumed from a finalizer
        setmetatable({}, { __gc = function()
          local co = coroutine.create(function() t:free() end)
          coroutine.resume(co)
        end })
      end
    end

    local function arg(t)
      local pool = {
        function() return nil end,
        function() return rand(-3, 5) end,
        function() return 2 ^ rand(20, 70) end,
        function() return -2 ^ 63 end,
        function() return 0 / 0 end,
        function() return math.huge end,
        function() return 1.5 end,
        function() return "f64" end,
        function() return ({ "x", "cpu", "cuda", "cuda:4294967296", "f16", "i64", "naive", "" })[rand(8)] end,
        function() return { 2, 3 } end,
        function() return { rand(-1, 4), rand(0, 4) } end,
        function() return { 2 ^ 62, 0, 16 } end,
        function() return { dtype = "f64", device = "cpu", seed = rand(10) } end,
        function() return { causal = true, scale = 0.5 } end,
        function() return { dtpye = "f64" } end,
        function() return hostile_table(t, { 1, 6 }) end,
        function() return setmetatable({ causal = true }, { __index = function() t:free() end }) end,
        function() return t end,
        function() return victim() end,
        function() local f = victim(); f:free(); return f end,
        function() return bystander end,
        function() return function() t:free() end end,
        function() return coroutine.create(function() end) end,
        function() return true end,
      }
      return pool[rand(#pool)]()
    end

    local module_fns, methods = {}, {}
    for name, f in pairs(ft) do
      if type(f) == "function" and not SKIP[name] then module_fns[#module_fns + 1] = name end
    end
    for name in pairs(core.Tensor_methods) do
      if not SKIP[name] then methods[#methods + 1] = name end
    end
    table.sort(module_fns)
    table.sort(methods)
    assert.is_true(#module_fns >= 19 and #methods >= 50, #module_fns .. " functions, " .. #methods .. " methods")

    local oldpause = collectgarbage("setpause", 50)
    local calls, errors = 0, 0
    while calls < CALLS do
      local t = victim()
      arm_finalizers(t)
      local ok
      local n = rand(0, 4)
      local a = {}
      for i = 1, n do a[i] = arg(t) end
      local choice = rand(10)
      if choice <= 5 then
        local name = methods[rand(#methods)]
        ok = pcall(core.Tensor_methods[name], t, a[1], a[2], a[3], a[4])
      elseif choice <= 9 then
        local name = module_fns[rand(#module_fns)]
        ok = pcall(ft[name], t, a[1], a[2], a[3])
      else
        -- indexing and operators on the victim
        local ops = {
          function() return t[a[1]] end,
          function() t[a[1]] = a[2] end,
          function() return t + a[1] end,
          function() return a[1] * t end,
          function() return -t end,
          function() return #t end,
          function() return tostring(t) end,
          function() return t.shape end,
        }
        ok = pcall(ops[rand(#ops)])
      end
      if not ok then errors = errors + 1 end
      calls = calls + 1
      if calls % 500 == 0 then
        victims = {}
        collectgarbage()
      end
    end
    collectgarbage("setpause", oldpause)
    collectgarbage()
    collectgarbage()
    -- every call was an error or a result; most of these calls are mistakes
    assert.is_true(errors > CALLS / 4, ("%d errors in %d calls"):format(errors, calls))
    assert.are.same(bystander_values, bystander:totable())
    assert.are.equal(6, ft.ones(2, 3):sum())
  end)
end)
