-- scripts/generate.lua as a library: sampling (greedy, temperature, top-k,
-- top-p), a model saved by train_tiny.lua --save and loaded back, and the
-- generation with the KV cache writing what the generation without it
-- writes; the command line's errors.
local h = require "helper"
local ft = h.ft

local gen = assert(loadfile("scripts/generate.lua"))({})
local train = gen.trainer()

describe("scripts/generate.lua", function()
  it("picks greedily, and samples only within top-k and top-p", function()
    local logits = { 0.1, 3.0, 2.9, -1, 2.0 }
    assert.are.equal(2, gen.pick(logits, {}))
    assert.are.equal(2, gen.pick(logits, { temperature = 0 }))
    local seen = {}
    local x = 0
    local rand = function() x = (x + 0.137) % 1; return x end
    for _ = 1, 200 do seen[gen.pick(logits, { temperature = 1, top_k = 2 }, rand)] = true end
    assert.are.same({ [2] = true, [3] = true }, seen)
    seen = {}
    for _ = 1, 200 do seen[gen.pick(logits, { temperature = 1, top_p = 0.3 }, rand)] = true end
    assert.are.same({ [2] = true }, seen) -- the first token alone holds over 0.3
    seen = {}
    for _ = 1, 400 do seen[gen.pick(logits, { temperature = 5 }, rand)] = true end
    assert.are.same({ true, true, true, true, true }, seen)
  end)

  it("a model saved by train_tiny --save loads back and writes the same tokens with the KV cache as without", function()
    local path = os.tmpname()
    local r = train.run { steps = 60, control = false, device = "cpu", save = path, quiet = true }
    local model, o = gen.load(path, "cpu")
    assert.are.equal(o.k, train.defaults.k)
    -- the loaded model computes what the trained one does
    local ids = train.batch(o, 99)
    r.model:evaluate()
    assert.is_true(ft.max_abs_diff(model:forward(ids), r.model:forward(ids)) < 1e-6)
    for _, so in ipairs { {}, { temperature = 0.7, top_k = 5, top_p = 0.95, seed = 3 } } do
      local prompt = { 3, 1, 4, 1, 5, 9 - 1, o.vocab + 1 }
      local a = gen.generate(model, prompt, o.k, so, true)
      local b = gen.generate(model, prompt, o.k, so, false)
      assert.are.same(b, a)
      assert.are.equal(o.k, #a)
    end
    os.remove(path)
  end)

  it("rejects bad command-line values", function()
    assert.is_nil((gen.parse_args { "--top-p", "1.5" }))
    assert.is_nil((gen.parse_args { "--samples", "0" }))
    assert.is_nil((gen.parse_args { "--what", "1" }))
    assert.are.same({ temperature = 0.5, top_k = 3 }, gen.parse_args { "--temperature", "0.5", "--top-k", "3" })
  end)
end)
