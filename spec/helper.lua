-- spec/helper.lua - shared helpers of the flashtile specs.
--
--   local h = require "helper"
--   local ft = h.ft
--
-- busted's lpath (see .busted) includes spec/, so `require "helper"` finds
-- this file. Nothing here knows about the library's internals: it only
-- builds inputs, plain-Lua reference results and error-message checks.
local ft = require "flashtile"
-- required modules see the plain _G, not the spec environment of busted
local assert = require "luassert"

local h = { ft = ft }

-- ---- errors -----------------------------------------------------------------

--- Runs fn, asserts that it raised an error, and returns the message.
function h.error_of(fn, ...)
  local args = table.pack(...)
  local call = function() return fn(table.unpack(args, 1, args.n)) end
  assert.has_error(call, nil, "expected an error, but the call returned normally")
  local ok, msg = pcall(call)
  assert.is_false(ok)
  return tostring(msg)
end

--- Asserts that fn raises an error whose message contains every one of
-- the given strings (plain text, not patterns). Returns the message.
function h.assert_error(fn, ...)
  local msg = h.error_of(fn)
  for i = 1, select("#", ...) do
    local needle = select(i, ...)
    assert.is_truthy(string.find(msg, needle, 1, true),
      string.format("expected the error message to contain %q, got %q", needle, msg))
  end
  return msg
end

-- ---- inputs -----------------------------------------------------------------

local seed_counter = 1000

--- A fresh seed: each call differs, and a run is reproducible.
function h.next_seed()
  seed_counter = seed_counter + 1
  return seed_counter
end

--- A plain-Lua nested table of the given shape with values drawn by gen()
-- (default: uniform in [-2, 2), never exactly zero).
function h.random_table(shape, gen)
  gen = gen or function()
    local v
    repeat v = math.random() * 4 - 2 until v ~= 0
    return v
  end
  local function rec(d)
    local t = {}
    for i = 1, shape[d] do
      t[i] = d == #shape and gen() or rec(d + 1)
    end
    return t
  end
  if #shape == 0 then return gen() end
  return rec(1)
end

--- A tensor of the given shape with standard normal values from a fresh
-- seed (f64 unless opts says otherwise).
function h.randn(shape, opts)
  opts = opts or {}
  return ft.randn(shape, { dtype = opts.dtype or "f64", seed = h.next_seed() })
end

-- ---- comparisons --------------------------------------------------------------

--- The elements of a nested table (or a number) in row-major order.
function h.flatten(t, out)
  out = out or {}
  if type(t) ~= "table" then
    out[#out + 1] = t
    return out
  end
  for _, v in ipairs(t) do h.flatten(v, out) end
  return out
end

--- Max |a - b| over two equally long flat lists.
function h.max_diff(a, b)
  assert.are.equal(#a, #b)
  local m = 0
  for i = 1, #a do
    local d = math.abs(a[i] - b[i])
    if d ~= d then return d end
    if d > m then m = d end
  end
  return m
end

--- Asserts every element of tensor t is within tol of the flat list (or
-- nested table) expected.
function h.assert_values(t, expected, tol, what)
  local got = h.flatten(t:totable())
  local want = h.flatten(expected)
  assert.are.equal(#want, #got, (what or "values") .. ": element count")
  for i = 1, #want do
    local ok
    if tol == nil or tol == 0 then
      ok = got[i] == want[i]
    else
      ok = math.abs(got[i] - want[i]) <= tol
    end
    if not ok then
      assert.are.equal(want[i], got[i], string.format("%s: element %d is %.17g, expected %.17g (tolerance %s)",
        what or "values", i, got[i], want[i], tostring(tol or 0)))
    end
  end
end

--- Plain-Lua matrix product of two nested tables [m][k] x [k][n].
function h.matmul_ref(a, b)
  local m, k, n = #a, #b, #b[1]
  assert.are.equal(k, #a[1])
  local c = {}
  for i = 1, m do
    c[i] = {}
    for j = 1, n do
      local s = 0
      for p = 1, k do s = s + a[i][p] * b[p][j] end
      c[i][j] = s
    end
  end
  return c
end

--- Runs a full collection twice (finalisers of finalisers) and returns the
-- CPU bytes in use after it.
function h.in_use()
  collectgarbage()
  collectgarbage()
  return ft.memory_stats().in_use
end

h.DTYPES = { "f64", "f32", "f16", "bf16", "i32", "i64" }
h.FLOAT_DTYPES = { "f64", "f32", "f16", "bf16" }

-- ---- GPU specs --------------------------------------------------------------

--- Why specs tagged #gpu cannot run here, or nil when they can.
function h.no_gpu_reason()
  if type(ft.cuda) ~= "table" then
    return "no CUDA device: this flashtile build has no CUDA backend (ft.cuda is absent)"
  end
  if not ft.cuda.is_built() then
    return "no CUDA device: this flashtile build has no CUDA backend"
  end
  if not ft.cuda.is_available() then
    return "no CUDA device: ft.cuda.is_available() is false"
  end
  return nil
end

--- An it() for GPU specs: the body runs with a usable device, and is
-- reported pending, with the reason, without one. Pass busted's it, and
-- pending wrapped in a function of the spec file: a required module does
-- not see the spec environment, and busted's pending means "this test is
-- pending" only when looked up inside the running test (taken at load
-- time it would declare another, empty test and let this one pass):
--   local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)
function h.gpu_it(it, pending)
  return function(name, body)
    it(name, function()
      local reason = h.no_gpu_reason()
      if reason then
        pending(reason)
        return
      end
      body()
    end)
  end
end

return h
