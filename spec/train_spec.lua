-- scripts/train_tiny.lua on the CPU: a short training of the tiny
-- transformer on the copy task ends far below chance, while the control
-- (the same model with every attention replaced by an identity, trained the
-- same way) stays near chance. Also the script's arguments and CSV output.
local h = require "helper"
local ft = h.ft
local nn = require "flashtile.nn"

local train = assert(loadfile("scripts/train_tiny.lua"))({})

describe("train_tiny", function()
  it("batches are the copy task: K tokens, the separator, the same K tokens", function()
    local o = { batch = 3, k = 4, vocab = 5 }
    local ids, targets = train.batch(o, 7)
    assert.are.same({ 3, 8 }, ids.shape)
    assert.are.same({ 12 }, targets.shape)
    local seq, tg = ids:totable(), targets:totable()
    for b = 1, 3 do
      assert.are.equal(6, seq[b][5])                      -- the separator, V + 1
      for i = 1, 4 do
        assert.is_true(seq[b][i] >= 1 and seq[b][i] <= 5)
        -- copied (the input drops the last token of the sequence)
        if i < 4 then assert.are.equal(seq[b][i], seq[b][5 + i]) end
        assert.are.equal(seq[b][i], tg[(b - 1) * 4 + i])  -- the targets are the copies
      end
    end
    local again = train.batch(o, 7)
    assert.are.equal(0, ft.max_abs_diff(ids, again))
    assert.is_true(ft.max_abs_diff(ids, (train.batch(o, 8))) > 0)
  end)

  it("the control model is the model without its attention", function()
    local o = {}
    for k, v in pairs(train.defaults) do o[k] = v end
    local model, control = train.model(o), train.control_model(o)
    assert.are.equal(2, #model:find("MultiheadAttention"))
    assert.are.equal(0, #control:find("MultiheadAttention"))
    assert.are.equal(2, #control:find("Identity"))
    -- the same parameters otherwise (same seed)
    local pm, pc = model:parameters(), control:parameters()
    assert.are.equal(0, ft.max_abs_diff(pm[1], pc[1]))
    assert.are.equal(0, ft.max_abs_diff(pm[#pm], pc[#pc]))
  end)

  it("the model learns the copy task; the control stays near chance", function()
    local t0 = ft.clock()
    local r = train.run { steps = 80, device = "cpu", quiet = true }
    local chance = math.log(8)
    assert.are.equal(chance, r.chance)
    assert.are.equal(80, #r.curve)
    assert.are.equal(80, #r.control_curve)
    -- both start near chance
    assert.is_true(math.abs(r.curve[1] - chance) < 0.6, tostring(r.curve[1]))
    assert.is_true(math.abs(r.control_curve[1] - chance) < 0.6, tostring(r.control_curve[1]))
    -- held-out losses after training
    assert.is_true(r.loss < 0.3, ("model loss %.4f"):format(r.loss))
    assert.is_true(r.control > chance - 0.15, ("control loss %.4f, chance %.4f"):format(r.control, chance))
    assert.is_true(r.loss < r.control - 1.5)
    assert.is_truthy(r.summary:find("^final loss %d%.%d+ %(control %d%.%d+, chance 2%.0794%)$"), r.summary)
    print(("\n  train_tiny, 80 steps each on the cpu: %s (%.1f s)"):format(r.summary, ft.clock() - t0))
  end)

  it("writes the loss curves to a CSV file", function()
    local path = os.tmpname()
    local r = train.run { steps = 3, device = "cpu", quiet = true, csv = path, batch = 4 }
    local f = assert(io.open(path))
    local lines = {}
    for line in f:lines() do lines[#lines + 1] = line end
    f:close()
    os.remove(path)
    assert.are.equal("step,loss,control_loss", lines[1])
    assert.are.equal(4, #lines)
    local step, loss, control = lines[4]:match("^(%d+),([%d.]+),([%d.]+)$")
    assert.are.equal("3", step)
    assert.is_true(math.abs(tonumber(loss) - r.curve[3]) < 1e-5)
    assert.is_true(math.abs(tonumber(control) - r.control_curve[3]) < 1e-5)
  end)

  it("reads its options from the command line and rejects bad ones", function()
    local o = train.parse_args { "--steps", "50", "--device", "cpu", "--seed", "3", "--control", "false", "--csv", "x.csv" }
    assert.are.same({ steps = 50, device = "cpu", seed = 3, control = false, csv = "x.csv" }, o)
    local bad = {
      { { "--steps", "0" }, "--steps must be a positive integer" },
      { { "--steps", "ten" }, "--steps must be a positive integer" },
      { { "--control", "yes" }, "--control must be true or false" },
      { { "--seed" }, "--seed needs a value" },
      { { "--lr", "1" }, "unknown argument '--lr'" },
    }
    for _, case in ipairs(bad) do
      local got, err = train.parse_args(case[1])
      assert.is_nil(got)
      assert.is_truthy(err:find(case[2], 1, true), err)
    end
    local _, usage = train.parse_args { "--help" }
    assert.is_truthy(usage:find("usage: train_tiny.lua", 1, true))
    h.assert_error(function() return train.run { stepz = 3 } end, "train_tiny: unknown option 'stepz'")
    if not ft.cuda.is_available() then
      h.assert_error(function() return train.run { device = "cuda", quiet = true } end,
        "train_tiny: device 'cuda', but ft.cuda.is_available() is false")
    end
  end)
end)
