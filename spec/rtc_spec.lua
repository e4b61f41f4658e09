-- Mods written in Lua as CUDA source (lib/mods_cuda.c), compiled with
-- NVRTC for the flash kernels (kernels/attention/rtc.cu) without a GPU:
-- ft.cuda.compile_mods for both kernel families, a mod that uses every
-- operation and reads tensors of every dtype; the disk cache; bad options.
-- Needs a build with CUDA (NVRTC), not a GPU; pending without CUDA.
local h = require "helper"
local ft = h.ft

local function cuda_it(name, body)
  it(name, function()
    if not ft.cuda.is_built() then
      pending("this build has no CUDA backend (NVRTC)")
      return
    end
    body()
  end)
end

describe("mods as CUDA source, compiled with NVRTC (no GPU needed)", function()
  local rel = ft.randn({ 4, 64 }, { dtype = "f32", seed = 1 })
  local gain = ft.randn({ 2, 3, 4 }, { dtype = "bf16", seed = 2 })
  local scale = ft.tensor({ 0.5, 2.0 }, { dtype = "f64" })
  local group = ft.tensor({ 1, 2, 1, 2 }, { dtype = "i64" })
  local doc = ft.tensor({ 1, 1, 2, 2, 3, 3, 3, 4 }, { dtype = "i32" })
  local half = ft.tensor({ 1.5, -0.5 }, { dtype = "f16" })

  -- every operation the tracer records, in three mods (a mod is inlined
  -- at every score of the kernels' unrolled loops, so one mod with all of
  -- them takes minutes to compile): reads of f32, bf16, f64, i64, i32 and
  -- f16 tensors, reads indexed by reads and by float expressions;
  -- arithmetic on indices (ints) and scores (floats); the functions; the
  -- mask's logic
  local function three_mods()
    return {
      { "reads and arithmetic", ft.attention_mods {
          score = function(s, b, hh, i, j)
            return s + rel[hh][(i - j) % 64 + 1] * gain[group[hh]][(j % 3) + 1][hh] * scale[b % 2 + 1]
                - ((i + j) / 7):floor() * half[(i % 2) + 1] + (i * j - b) % 5 - s % 0.75
          end } },
      { "functions", ft.attention_mods {
          score = function(s, b, hh, i, j)
            local x = ft.where(j:gt(i), ft.min(s, 1), ft.max(s * s:sigmoid(), s ^ 2 / 4))
            return (x / 3):tanh() * 3 + (s:abs() + 1):log() - (-s):exp() * 0.01 + (s * s + 1):sqrt()
          end } },
      { "mask logic", ft.attention_mods {
          mask = function(b, hh, i, j)
            return ft.any(ft.all(doc[(i - 1) % 8 + 1]:eq(doc[(j - 1) % 8 + 1]), j:le(i)),
              ft.negate(ft.any(j:ne(i), i:lt(3))), j:ge(i + 100))
          end } },
    }
  end

  -- On sm_90a the forward has two kernels at d = 64 (the warp-specialised
  -- one, and the wgmma one that shorter calls take) and four at d = 128
  -- (the persistent form of the first, and the first with turns, which
  -- calls of 8192 keys or more take).
  cuda_it("every operation compiles into the forward kernels: Hopper's (sm_90a) and mma.sync (sm_80), bf16 and f16", function()
    local targets = { { "bf16", 64, "sm_90a", 2 }, { "f16", 64, "sm_80", 1 }, { "f16", 128, "sm_90a", 4 } }
    for n, case in ipairs(three_mods()) do
      local t = targets[n]
      assert.are.equal(t[4], ft.cuda.compile_mods(case[2], { dtype = t[1], head_dim = t[2], arch = t[3],
                                                            pass = "fwd", cache = false }), case[1])
    end
  end)

  -- The Hopper backward: the warp-specialised dK/dV and dQ kernels, and the
  -- wgmma ones (varlen calls take those).
  cuda_it("a mask alone and a score alone compile, forward and backward (the mask's backward in the plain kernels), then come from the disk cache", function()
    local mask = ft.attention_mods { mask = function(b, hh, i, j) return ft.all(j:le(i), j:ge(i - 37)) end }
    local score = ft.attention_mods { score = function(s) return (s / 30):tanh() * 30 end }
    assert.are.equal(6, ft.cuda.compile_mods(mask, { dtype = "bf16", head_dim = 64, arch = "sm_90a", cache = false }))
    assert.are.equal(3, ft.cuda.compile_mods(score, { dtype = "f16", head_dim = 64, arch = "sm_80", cache = false }))
    assert.are.equal(0, ft.cuda.compile_mods(score, { dtype = "f16", head_dim = 64, arch = "sm_80" }))
  end)

  cuda_it("the backward that gives the gradients of the float tensors a mod reads (grads, the default) is its own pair of kernels; a mod that reads no float tensor has none", function()
    -- a constant of this run keeps the kernels out of any earlier cache
    local c = 1 + math.random(1, 1000000) / 1e7
    local bias = ft.attention_mods { score = function(s, b, hh, i, j) return s * c + rel[hh][(i - j) % 64 + 1] end }
    -- (the gradients' pair is the mma.sync one; without them, on sm_90a two
    -- pairs: the warp-specialised kernels and the wgmma ones)
    assert.are.equal(2, ft.cuda.compile_mods(bias, { dtype = "bf16", head_dim = 64, arch = "sm_90a", pass = "bwd" }))
    assert.are.equal(4, ft.cuda.compile_mods(bias, { dtype = "bf16", head_dim = 64, arch = "sm_90a", pass = "bwd",
                                                     grads = false }))
    assert.are.equal(0, ft.cuda.compile_mods(bias, { dtype = "bf16", head_dim = 64, arch = "sm_90a", pass = "bwd",
                                                     grads = true }))
    local by_doc = ft.attention_mods { score = function(s, b, hh, i, j) return s * c + doc[(j - 1) % 8 + 1] end }
    assert.are.equal(2, ft.cuda.compile_mods(by_doc, { dtype = "f16", head_dim = 64, arch = "sm_80", pass = "bwd",
                                                       grads = false }))
    assert.are.equal(0, ft.cuda.compile_mods(by_doc, { dtype = "f16", head_dim = 64, arch = "sm_80", pass = "bwd" }))
    -- reads of f32, bf16, f64 and f16 tensors, each with its gradient
    assert.are.equal(2, ft.cuda.compile_mods(three_mods()[1][2], { dtype = "f16", head_dim = 64, arch = "sm_80",
                                                                   pass = "bwd", cache = false }))
    h.assert_error(function() ft.cuda.compile_mods(bias, { grads = 1 }) end, "grads must be a boolean")
  end)

  cuda_it("bad options are clear errors", function()
    local mods = ft.attention_mods { score = function(s) return s * 2 end }
    h.assert_error(function() ft.cuda.compile_mods(mods, { arch = "sm_70" }) end, "sm_80")
    h.assert_error(function() ft.cuda.compile_mods(mods, { arch = "hopper" }) end, "arch must be")
    h.assert_error(function() ft.cuda.compile_mods(mods, { dtype = "f32" }) end, "f16 or bf16")
    h.assert_error(function() ft.cuda.compile_mods(mods, { head_dim = 12 }) end, "multiples of 8")
    h.assert_error(function() ft.cuda.compile_mods(mods, { head_dim = 64.5 }) end, "integer")
    h.assert_error(function() ft.cuda.compile_mods(mods, { device = "cuda" }) end, "unknown option 'device'")
    h.assert_error(function() ft.cuda.compile_mods(mods, { pass = "both ways" }) end, "fwd, bwd or both")
    h.assert_error(function() ft.cuda.compile_mods({}) end, "made by ft.attention_mods")
  end)
end)
