--- Samples from the tiny copy-task model of scripts/train_tiny.lua, one
-- token at a time with a KV cache (nn.KVCache), and prints what it wrote
-- and the tokens per second, beside the same generation without the cache
-- (each step the whole sequence again).
--
--   scripts/ftlua scripts/generate.lua [--weights FILE] [--device cpu|cuda]
--       [--samples N] [--temperature T] [--top-k K] [--top-p P] [--seed N]
--       [--steps N] [--help]
--
-- --weights: a file written by train_tiny.lua --save (default
-- tiny.safetensors); when it does not exist, a model is trained first
-- (--steps, default 200) and saved there. Each sample is a prompt of K
-- random tokens and the separator; the model writes K tokens, which should
-- copy the prompt. Temperature 0 (the default) is greedy; otherwise the
-- logits are divided by T, cut to the top K and to the smallest set of
-- probability at least P, and sampled (seeded, so a run repeats).
--
-- As a library (the specs): loadfile("scripts/generate.lua")({}) returns
-- the table of functions below without running anything.
--
-- Runs under Lua 5.1 to 5.4 and LuaJIT; from a clone it finds flashtile in
-- lua/ and build/ (or $FT_BUILD_DIR) by itself (scripts/lib/paths.lua).
local gen = {}

local usage = [==[
usage: generate.lua [--weights FILE] [--device cpu|cuda] [--samples N]
                    [--temperature T] [--top-k K] [--top-p P] [--seed N]
                    [--steps N] [--help]]==]

local kinds = { weights = "string", device = "string", samples = "int", temperature = "number",
                ["top-k"] = "int", ["top-p"] = "number", seed = "int", steps = "int" }

local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
local paths = dofile(here .. "lib/paths.lua")

function gen.parse_args(args)
  return paths.parse_args(args, kinds, usage, function(name, n, text)
    if kinds[name] == "string" then return nil end
    if not n or n ~= n or n < 0 or n == math.huge or (kinds[name] == "int" and n < 1)
       or (name == "top-p" and (n <= 0 or n > 1)) then
      return ("--%s: bad value '%s'"):format(name, text)
    end
  end)
end

local as_library = select("#", ...) > 0 and type((...)) == "table"
local cli = not as_library and paths.options(gen.parse_args, usage)

local ok, ft = pcall(require, "flashtile")
if not ok then ft = paths.require("generate.lua", here) end
local nn = require "flashtile.nn"

--- train_tiny.lua as a library.
function gen.trainer()
  local chunk = assert(loadfile(here .. "train_tiny.lua"))
  return chunk({})
end

--- The model of a file saved by train_tiny.lua --save, and its options.
function gen.load(path, device)
  local train = gen.trainer()
  local state, meta = ft.load_safetensors(path)
  local o = {}
  for k, v in pairs(train.defaults) do o[k] = v end
  for _, key in ipairs(train.shape_keys) do
    if meta[key] == nil then error(("generate: %s has no '%s' in its metadata (not train_tiny's)"):format(path, key), 0) end
    o[key] = tonumber(meta[key])
  end
  local model = train.model(o)
  model:load_state_dict(state)
  model:to(device)
  model:evaluate()
  return model, o
end

--- A seeded generator of uniform numbers in [0, 1) (the same sequence on
-- every Lua).
local function uniform(seed)
  local x = seed % 2147483647
  if x <= 0 then x = x + 2147483646 end
  return function()
    x = (x * 48271) % 2147483647
    return (x - 1) / 2147483646
  end
end

--- The next token from one row of logits (a Lua list): greedy, or sampled
-- with temperature, top-k and top-p.
function gen.pick(logits, o, rand)
  local n = #logits
  local best = 1
  for i = 2, n do if logits[i] > logits[best] then best = i end end
  if not o.temperature or o.temperature == 0 then return best end
  local order = {}
  for i = 1, n do order[i] = i end
  table.sort(order, function(a, b) return logits[a] > logits[b] or (logits[a] == logits[b] and a < b) end)
  local k = math.min(o.top_k or n, n)
  local p, total = {}, 0
  for r = 1, k do
    p[r] = math.exp((logits[order[r]] - logits[best]) / o.temperature)
    total = total + p[r]
  end
  local keep, mass = k, 0
  for r = 1, k do
    mass = mass + p[r] / total
    if mass >= (o.top_p or 1) then keep = r; break end
  end
  local kept = 0
  for r = 1, keep do kept = kept + p[r] end
  local u, acc = rand() * kept, 0
  for r = 1, keep do
    acc = acc + p[r]
    if u < acc then return order[r] end
  end
  return order[keep]
end

--- The last row of logits [1, N, V] as a Lua list.
local function last_row(logits)
  return logits:select(2, logits:size(2)):reshape(-1):double():cpu():totable()
end

--- Writes n tokens after prompt (a Lua list of ids); with cache = true
-- through nn.KVCache, else the whole sequence each step. Returns the list
-- of tokens written and the seconds.
function gen.generate(model, prompt, n, o, cache)
  local device = o.device or "cpu"
  local rand = uniform(o.seed or 1)
  local seq = {}
  for i, t in ipairs(prompt) do seq[i] = t end
  local function ids(from, to)
    local t = {}
    for i = from, to do t[#t + 1] = seq[i] end
    return ft.tensor({ t }, { dtype = "i64", device = device })
  end
  local kv = cache and nn.KVCache(model, { batch = 1, capacity = #prompt + n }) or nil
  local t0 = ft.clock()
  local out = {}
  local logits = model:forward(ids(1, #seq))
  for step = 1, n do
    local tok = gen.pick(last_row(logits), o, rand)
    out[step] = tok
    seq[#seq + 1] = tok
    if step < n then
      logits = kv and model:forward(ids(#seq, #seq)) or model:forward(ids(1, #seq))
    end
  end
  if device:sub(1, 4) == "cuda" then ft.cuda.synchronize() end
  local seconds = ft.clock() - t0
  if kv then kv:detach() end
  return out, seconds
end

--- A prompt of the copy task: K tokens drawn from 1..V, then the separator.
function gen.prompt(o, rand)
  local p = {}
  for i = 1, o.k do p[i] = math.floor(rand() * o.vocab) + 1 end
  p[o.k + 1] = o.vocab + 1
  return p
end

function gen.run(opts)
  local o = {}
  for k, v in pairs(opts or {}) do o[k] = v end
  o.weights = o.weights or "tiny.safetensors"
  o.device = o.device or (ft.cuda.is_available() and "cuda" or "cpu")
  o.samples = o.samples or 4
  local okd, derr = pcall(ft.zeros, { 1 }, { device = o.device })
  if not okd then error(("generate: --device %s: %s"):format(o.device, tostring(derr)), 0) end
  local f = io.open(o.weights, "rb")
  if f then
    f:close()
  else
    print(("no %s: training the model first"):format(o.weights))
    gen.trainer().run({ steps = o.steps or 200, control = false, device = o.device, save = o.weights,
                        log_every = 0 })
  end
  local okl, model, mo = pcall(gen.load, o.weights, o.device)
  if not okl then
    local msg = tostring(model)
    error(msg:find("^generate:") and msg or ("generate: --weights %s: %s"):format(o.weights, msg), 0)
  end
  print(("model: %s (%d parameters) on %s; temperature %s, top-k %s, top-p %s"):format(
    o.weights, model:n_parameters(), o.device, tostring(o.temperature or 0),
    tostring(o.top_k or "all"), tostring(o.top_p or 1)))
  local rand = uniform((o.seed or 1) + 7)
  -- one untimed generation each way first: the first use of each kernel
  -- (CUDA loads them lazily) and of each buffer size is not the rate
  do
    local warm = gen.prompt(mo, uniform((o.seed or 1) + 3))
    gen.generate(model, warm, mo.k, { device = o.device }, true)
    gen.generate(model, warm, mo.k, { device = o.device }, false)
  end
  local right, total, t_cache, t_plain, tokens = 0, 0, 0, 0, 0
  for s = 1, o.samples do
    local prompt = gen.prompt(mo, rand)
    local so = { temperature = o.temperature, top_k = o.top_k, top_p = o.top_p,
                 seed = (o.seed or 1) + s, device = o.device }
    local out, sec = gen.generate(model, prompt, mo.k, so, true)
    local plain, sec_plain = gen.generate(model, prompt, mo.k, so, false)
    local same = table.concat(out, " ") == table.concat(plain, " ")
    local copied = 0
    for i = 1, mo.k do if out[i] == prompt[i] then copied = copied + 1 end end
    right, total = right + copied, total + mo.k
    t_cache, t_plain, tokens = t_cache + sec, t_plain + sec_plain, tokens + mo.k
    print(("prompt %s | wrote %s | copied %d of %d%s"):format(
      table.concat(prompt, " ", 1, mo.k), table.concat(out, " "), copied, mo.k,
      same and "" or " (without the cache: " .. table.concat(plain, " ") .. ")"))
  end
  print(("%d of %d tokens copied; %.0f tokens/s with the KV cache, %.0f without"):format(
    right, total, tokens / t_cache, tokens / t_plain))
  return { right = right, total = total, cache_rate = tokens / t_cache, plain_rate = tokens / t_plain }
end

if as_library then return gen end
local ran, err = pcall(gen.run, cli)
if not ran then
  io.stderr:write(tostring(err), "\n")
  os.exit(1)
end
