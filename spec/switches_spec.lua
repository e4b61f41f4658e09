-- The kernel switches (lib/switches.c): ft.switch, ft.set_switch and
-- ft.switch_names; set from Lua they take over from the environment
-- variables of the same names until given back (nil). On the GPU (tag gpu)
-- turning one between calls takes the other kernels in the same process,
-- whose results agree.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local NAMES = { "FT_NO_WGMMA", "FT_NO_WS", "FT_WS", "FT_PERSIST", "FT_NO_PERSIST", "FT_NO_DECODE",
                "FT_LAZY_RESCALE", "FT_NO_LAZY_RESCALE", "FT_TURNS", "FT_NO_TURNS",
                "FT_NO_CAP_MAX", "FT_NO_DECODE_WS", "FT_NO_FP8_MMA" }

describe("kernel switches", function()
  after_each(function()
    for _, name in ipairs(NAMES) do ft.set_switch(name, nil) end
  end)

  it("are named by ft.switch_names, and each reads as the environment says until set", function()
    assert.are.same(NAMES, ft.switch_names())
    for _, name in ipairs(NAMES) do
      local env = os.getenv(name)
      assert.are.equal(env ~= nil and env ~= "" and env ~= "0", ft.switch(name), name)
    end
  end)

  it("are turned on and off by ft.set_switch, and given back to the environment by nil", function()
    for _, name in ipairs(NAMES) do
      local start = ft.switch(name)
      ft.set_switch(name, true)
      assert.is_true(ft.switch(name))
      ft.set_switch(name, false)
      assert.is_false(ft.switch(name))
      ft.set_switch(name)
      assert.are.equal(start, ft.switch(name))
      ft.set_switch(name, not start)
      ft.set_switch(name, nil)
      assert.are.equal(start, ft.switch(name))
    end
  end)

  it("refuse a name that is not a switch and an on that is not a boolean, naming the argument", function()
    h.assert_error(function() ft.switch("FT_BOGUS") end, "bad argument #1", "not a switch")
    h.assert_error(function() ft.set_switch("FT_BOGUS", true) end, "bad argument #1", "not a switch")
    h.assert_error(function() ft.set_switch("fT_ws", true) end, "bad argument #1", "not a switch")
    h.assert_error(function() ft.set_switch("FT_WS", 1) end, "bad argument #2", "boolean expected")
    h.assert_error(function() ft.set_switch("FT_WS", "on") end, "bad argument #2", "boolean expected")
    h.assert_error(function() ft.set_switch() end, "bad argument #1", "string expected")
    h.assert_error(function() ft.switch({}) end, "bad argument #1", "string expected")
    assert.is_false(ft.switch("FT_WS") and os.getenv("FT_WS") == nil) -- untouched by the failures
  end)

  it("FT_NO_DECODE: decoding from a cache on the CPU gives the same result either way", function()
    local q = ft.randn({ 2, 1, 4, 16 }, { dtype = "f64", seed = h.next_seed() })
    local kc = ft.randn({ 2, 40, 2, 16 }, { dtype = "f64", seed = h.next_seed() })
    local vc = ft.randn({ 2, 40, 2, 16 }, { dtype = "f64", seed = h.next_seed() })
    local lens = ft.tensor({ 17, 33 }, { dtype = "i32" })
    local o = { causal = true, cache_seqlens = lens }
    ft.set_switch("FT_NO_DECODE", false)
    local a, la = ft.attention(q, kc, vc, o)
    ft.set_switch("FT_NO_DECODE", true)
    local b, lb = ft.attention(q, kc, vc, o)
    assert.is_true(ft.max_abs_diff(a, b) < 1e-12)
    assert.is_true(ft.max_abs_diff(la, lb) < 1e-12)
  end)

  gpu_it("turned between calls, each switch takes its kernels in the same process, and they agree #gpu", function()
    local function input(shape, seed)
      return ft.randn(shape, { dtype = "bf16", device = "cuda", seed = seed })
    end
    local q, k, v = input({ 2, 384, 4, 128 }, 1), input({ 2, 384, 2, 128 }, 2), input({ 2, 384, 2, 128 }, 3)
    local dout = input({ 2, 384, 4, 128 }, 4)
    local function run(opts)
      local out, lse = ft.attention(q, k, v, opts)
      local dq, dk, dv = ft.attention_backward(dout, q, k, v, out, lse, opts)
      return { out, lse, dq, dk, dv }
    end
    for _, opts in ipairs { { causal = false }, { causal = true, window_left = 100 }, { softcap = 20, causal = true } } do
      local want = run(opts)
      for _, name in ipairs(NAMES) do
        if name ~= "FT_NO_DECODE" and name ~= "FT_NO_DECODE_WS" then -- no decoding kernel in these calls
          ft.set_switch(name, true)
          local got = run(opts)
          ft.set_switch(name, nil)
          for i = 1, 5 do -- out, lse, dq, dk, dv: bf16 rounding of the largest element, or the lse's f32
            local w = want[i]:cpu():double()
            local e = ft.max_abs_diff(got[i]:cpu():double(), w)
            local tol = i == 2 and 1e-4 or 2^-6 * math.max(1, w:abs():max())
            assert.is_true(e <= tol, ("%s, result %d: %g > %g"):format(name, i, e, tol))
          end
        end
      end
    end
  end)
end)
