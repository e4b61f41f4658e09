--- Trains a tiny decoder-only transformer on a copy task, and the same
-- model without attention as a control.
--
--   scripts/ftlua scripts/train_tiny.lua [--steps N] [--device cpu|cuda]
--       [--seed N] [--control true|false] [--csv FILE] [--save FILE]
--       [--gpus N] [--help]
--
-- --gpus N trains data-parallel on N GPUs: the script starts itself again
-- through scripts/ftrun, one process per GPU; each rank draws its own
-- batches, and the gradients are averaged over the ranks (an NCCL
-- all_reduce, ft.dist.all_reduce_grads) before every step, so that the
-- replicas stay equal. Rank 0 prints and saves.
--
-- --save FILE writes the trained model's parameters and its shape (as
-- metadata) to a .safetensors file, which scripts/generate.lua reads.
--
-- The task: K random tokens (of V), a separator, then the same K tokens.
-- The loss counts only the copied half, where the next token is one of the
-- first K: a model can predict it only by looking back K positions, that is
-- through attention. Chance is log(V). The control model is identical
-- (same seed, same batches, same optimiser) except that every
-- MultiheadAttention is replaced by an Identity, so it cannot look back
-- and its loss must stay near chance.
--
-- The model: token embedding + learned positions, 2 causal
-- TransformerBlocks, RMSNorm, a Linear head. f32, on the GPU when
-- ft.cuda.is_available(), else on the CPU.
--
-- Prints progress lines (step, loss, tokens/s) and ends with
--   final loss X (control Y, chance Z)
-- where X and Y are losses on held-out batches after training.
--
-- As a library (the specs): loadfile("scripts/train_tiny.lua")({}) returns
-- the table of functions below without running anything; train.run(opts)
-- returns {loss =, control =, chance =, curve =, control_curve =, seconds =}.
--
-- Runs under Lua 5.1 to 5.4 and LuaJIT; from a clone (lua
-- scripts/train_tiny.lua) it finds flashtile in lua/ and build/ (or
-- $FT_BUILD_DIR) by itself (scripts/lib/paths.lua).
local train = {}

-- ---- command line ---------------------------------------------------------------

local usage = [==[
usage: train_tiny.lua [--steps N] [--device cpu|cuda] [--seed N]
                      [--control true|false] [--csv FILE] [--save FILE] [--gpus N] [--help]]==]

local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
local paths = dofile(here .. "lib/paths.lua")

--- Options from the command line: --name value pairs.
function train.parse_args(args)
  local kinds = { steps = "int", seed = "int", device = "string", csv = "string", control = "bool",
                  save = "string", gpus = "int" }
  return paths.parse_args(args, kinds, usage, function(name, v)
    if kinds[name] == "int" and (v == nil or ((name == "steps" or name == "gpus") and v < 1)) then
      return ("--%s must be %s"):format(name, (name == "steps" or name == "gpus") and "a positive integer"
        or "an integer")
    elseif kinds[name] == "bool" and v == nil then
      return ("--%s must be true or false"):format(name)
    end
  end)
end

-- loadfile("scripts/train_tiny.lua")({}) is the library: nothing runs.
local as_library = select("#", ...) > 0 and type((...)) == "table"
local cli = not as_library and paths.options(train.parse_args, usage)

local ok, ft = pcall(require, "flashtile")
if not ok then ft = paths.require("train_tiny.lua", here) end
local nn = require "flashtile.nn"
local optim = require "flashtile.optim"

train.defaults = {
  steps = 200,      -- optimiser steps, for each model
  device = nil,     -- "cuda" when available, else "cpu"
  seed = 1,         -- model parameters and batches
  control = true,   -- also train the control model
  csv = nil,        -- write step,loss,control_loss here
  vocab = 8,        -- V: content tokens 1..V; V + 1 is the separator
  k = 6,            -- K: tokens to copy
  batch = 32,
  dim = 32,
  heads = 4,
  hidden = 64,
  lr = 3e-3,
  log_every = 50,   -- steps between progress lines (0: none)
  eval_batches = 4, -- held-out batches for the final losses
  quiet = false,    -- no output at all
}

--- The options that fix the model's shape and task (saved with it).
train.shape_keys = { "vocab", "k", "dim", "heads", "hidden", "seed" }

-- ---- data ---------------------------------------------------------------------

--- One batch: ids [B, 2K] (the sequence but its last token) and targets
-- [B * K] (the copied half), i64 on the CPU; the same seed gives the same
-- batch.
function train.batch(o, seed)
  local B, K, V = o.batch, o.k, o.vocab
  -- uniform in [0, V), truncated to 0..V-1, then 1-based
  local tokens = (ft.rand({ B, K }, { dtype = "f64", seed = seed }) * V):to("i64") + 1
  local seq = ft.empty({ B, 2 * K + 1 }, { dtype = "i64" })
  seq:narrow(2, 1, K):copy(tokens)
  seq:select(2, K + 1):fill(V + 1)
  seq:narrow(2, K + 2, K):copy(tokens)
  local ids = seq:narrow(2, 1, 2 * K):contiguous()
  local targets = seq:narrow(2, K + 2, K):reshape(-1)
  return ids, targets
end

-- ---- model --------------------------------------------------------------------

function train.model(o)
  local V, D = o.vocab + 1, o.dim
  local block = function(k)
    return nn.TransformerBlock { dim = D, heads = o.heads, hidden = o.hidden, causal = true,
                                 seed = nn.derive_seed(o.seed, 10 + k) }
  end
  return nn.Sequential(
    nn.Embedding(V, D, { seed = nn.derive_seed(o.seed, 1) }),
    nn.PositionalEmbedding(2 * o.k, D, { seed = nn.derive_seed(o.seed, 2) }),
    block(1), block(2),
    nn.RMSNorm(D),
    nn.Linear(D, V, { seed = nn.derive_seed(o.seed, 3) }))
end

--- The model with every attention replaced by an identity.
function train.control_model(o)
  return train.model(o):replace(function(m)
    if m.__typename == "nn.MultiheadAttention" then return nn.Identity() end
    return m
  end)
end

-- ---- training -----------------------------------------------------------------

--- Loss on the copied half of ids; with backward = true also the grads.
local function loss_of(model, crit, ids, targets, o, backward)
  local B, K, V = o.batch, o.k, o.vocab + 1
  local logits = model:forward(ids)                              -- [B, 2K, V]
  local copied = logits:narrow(2, K + 1, K):reshape(-1, V)       -- [B K, V]
  local loss = crit:forward(copied, targets)
  if backward then
    local dlogits = ft.zeros(logits.shape, { dtype = logits.dtype, device = logits.device })
    dlogits:narrow(2, K + 1, K):copy(crit:backward(copied, targets):view(B, K, V))
    model:backward(ids, dlogits)
  end
  return loss
end

--- Mean loss on held-out batches (seeds no training batch uses).
local function evaluate(model, o)
  model:evaluate()
  local crit, sum = nn.CrossEntropy(), 0
  for i = 1, o.eval_batches do
    local ids, targets = train.batch(o, nn.derive_seed(o.seed, 1000000 + i))
    sum = sum + loss_of(model, crit, ids:to(o.device), targets:to(o.device), o, false)
  end
  model:train()
  return sum / o.eval_batches
end

local function say(o, ...)
  if not o.quiet then print(string.format(...)) end
end

--- Trains a model for o.steps; returns the per-step losses and the seconds.
function train.fit(model, o, name)
  model:to(o.device)
  local crit = nn.CrossEntropy()
  local opt = optim.AdamW(model, { lr = o.lr, weight_decay = 0.01 })
  local curve, tokens = {}, o.batch * 2 * o.k
  local t0 = ft.clock()
  local t_last, s_last = t0, 0
  local comm = o.comm -- data-parallel: this rank's batches, gradients averaged
  local rank, world = comm and comm:rank() or 0, comm and comm:world_size() or 1
  for step = 1, o.steps do
    local bseed = world == 1 and step or (step - 1) * world + rank + 1
    local ids, targets = train.batch(o, nn.derive_seed(o.seed, bseed))
    opt:zero_grad()
    curve[step] = loss_of(model, crit, ids:to(o.device), targets:to(o.device), o, true)
    if comm then ft.dist.all_reduce_grads(model, comm) end
    opt:step()
    if o.log_every > 0 and (step % o.log_every == 0 or step == o.steps) then
      local now = ft.clock()
      say(o, "%-7s step %5d  loss %.4f  tokens/s %.0f", name, step, curve[step],
          (step - s_last) * tokens * world / (now - t_last))
      t_last, s_last = now, step
    end
  end
  return curve, ft.clock() - t0
end

local function write_csv(path, curve, control_curve)
  local f = assert(io.open(path, "w"))
  f:write("step,loss,control_loss\n")
  for i, l in ipairs(curve) do
    f:write(("%d,%.6f,%s\n"):format(i, l, control_curve and ("%.6f"):format(control_curve[i]) or ""))
  end
  f:close()
end

--- Runs the whole experiment; opts override train.defaults.
function train.run(opts)
  local o = {}
  for k, v in pairs(train.defaults) do o[k] = v end
  for k, v in pairs(opts or {}) do
    if train.defaults[k] == nil and k ~= "device" and k ~= "csv" and k ~= "save" and k ~= "gpus" then
      error(("train_tiny: unknown option '%s'"):format(k), 2)
    end
    o[k] = v
  end
  if o.gpus then
    if not os.getenv("FT_RANK") then -- start one process per GPU, this script in each
      local function q(x) return "'" .. tostring(x):gsub("'", "'\\''") .. "'" end
      local cmd = q(here .. "ftrun") .. " -n " .. o.gpus .. " " .. q(here .. "train_tiny.lua")
      for i = 1, #(arg or {}) do cmd = cmd .. " " .. q(arg[i]) end
      local okx, how, code = os.execute(cmd)
      local status = type(okx) == "number" and okx or (okx and 0 or (code or 1))
      os.exit(status == 0 and 0 or 1)
    end
    o.comm = ft.dist.init()
    if o.comm:world_size() ~= o.gpus then
      error(("train_tiny: --gpus %d, but ftrun started %d ranks"):format(o.gpus, o.comm:world_size()), 2)
    end
    o.device = "cuda:" .. o.comm:devices()[1]
    o.quiet = o.quiet or o.comm:rank() ~= 0
  end
  o.device = o.device or (ft.cuda.is_available() and "cuda" or "cpu")
  if o.device:sub(1, 4) == "cuda" and not ft.cuda.is_available() then
    error(("train_tiny: device '%s', but ft.cuda.is_available() is false"):format(o.device), 2)
  end
  local chance = math.log(o.vocab)
  say(o, "copy task: %d tokens of %d, batch %d, dim %d, %d heads, %d steps on %s%s (chance %.4f)",
      o.k, o.vocab, o.batch, o.dim, o.heads, o.steps, o.device,
      o.comm and (" and %d more GPUs, data-parallel"):format(o.comm:world_size() - 1) or "", chance)

  local model = train.model(o)
  say(o, "%d parameters", model:n_parameters())
  local r = { chance = chance }
  r.curve, r.seconds = train.fit(model, o, "model")
  r.loss = evaluate(model, o)
  if o.control then
    local control = train.control_model(o)
    r.control_curve, r.control_seconds = train.fit(control, o, "control")
    r.control = evaluate(control, o)
  end
  if o.csv then write_csv(o.csv, r.curve, r.control_curve) end
  r.model = model
  if o.save and not (o.comm and o.comm:rank() ~= 0) then
    local meta = {}
    for _, key in ipairs(train.shape_keys) do meta[key] = tostring(o[key]) end
    ft.save_safetensors(o.save, model:clone():to({ dtype = "f32", device = "cpu" }):state_dict(), meta)
    say(o, "saved the model to %s", o.save)
  end
  r.summary = ("final loss %.4f (control %s, chance %.4f)"):format(r.loss,
    r.control and ("%.4f"):format(r.control) or "not trained", chance)
  say(o, "%s", r.summary)
  if o.comm then o.comm:free() end
  return r
end

-- ---- run ------------------------------------------------------------------------

if as_library then return train end
train.run(cli)
