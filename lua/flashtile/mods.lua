--- flashtile.mods: attention modifications written as Lua functions.
--
--   local mods = ft.attention_mods{
--     score = function(s, b, h, i, j) return s + bias[h][i - j + N] end,
--     mask  = function(b, h, i, j) return ft.all(doc[i]:eq(doc[j]), j:le(i)) end,
--   }
--   local out, lse = ft.attention(q, k, v, {mods = mods})
--
-- ft.attention_mods calls each function once with symbolic arguments and
-- records what it computes as a graph (lib/mods.c runs it). s is the
-- scaled score; b, h, i, j are 1-based. On symbolic values:
--   + - * / % ^ // and unary minus (metamethods);
--   x:eq(y) x:ne(y) x:lt(y) x:le(y) x:gt(y) x:ge(y) (Lua's == < <= cannot
--   give a symbolic value, so they are errors here);
--   ft.all(a, b, ...), ft.any(a, b, ...), ft.negate(c), ft.where(c, a, b);
--   x:abs() x:exp() x:log() x:sqrt() x:tanh() x:sigmoid() x:floor(),
--   ft.min(a, b), ft.max(a, b) (also as methods);
--   t[x][y] reads a captured tensor at 1-based indices (t[1] with a plain
--   number is still a view of row 1).
-- A Lua `if`, `and`, `or` or `not` on a symbolic value cannot be traced
-- (a table is always true in Lua): the trace is checked against the
-- function run with plain values at sample points, and a disagreement is
-- an error that says so.
local core = require "flashtile.core"

local OPS = core.mod_ops
local unpack = table.unpack or unpack

local M = {}

local Sym = {}     -- the metatable of a traced value: {id = node}
local Read = {}    -- a tensor read being indexed: {t =, idx = {...}}
local methods = {}

local trace -- the trace being recorded: nodes, indices, tensors, slots

local function fail(msg, level)
  error("ft.attention_mods: " .. msg, (level or 1) + 1)
end

local function node(op, a, b, c, value)
  local n = #trace.nodes + 1
  trace.nodes[n] = { OPS[op], a or 0, b or 0, c or 0, value or 0 }
  return n
end

local function is_sym(x)
  local mt = getmetatable(x)
  return mt == Sym or mt == Read
end

--- The node of a value: a traced value, a finished read, a number or a
-- boolean (constants).
local function node_of(x)
  local mt = getmetatable(x)
  if mt == Sym then
    if x.trace ~= trace then fail("a symbolic value from another trace was used", 3) end
    return x.id
  end
  if mt == Read then
    local t = x.t
    if #x.idx ~= t:dim() then
      fail(("a tensor of %d dims read with %d indices"):format(t:dim(), #x.idx), 3)
    end
    local slot = trace.slots[t]
    if not slot then
      trace.tensors[#trace.tensors + 1] = t
      slot = #trace.tensors
      trace.slots[t] = slot
    end
    -- the index nodes first (an index may be a read itself), then the list
    local ids = {}
    for k, e in ipairs(x.idx) do ids[k] = node_of(e) end
    local first = #trace.indices + 1
    for k, id in ipairs(ids) do trace.indices[first + k - 1] = id end
    return node("read", slot, first, #ids)
  end
  if type(x) == "number" then
    if x ~= x or x == math.huge or x == -math.huge then fail("constants must be finite", 3) end
    local n = trace.consts[x]
    if not n then
      n = node("const", 0, 0, 0, x)
      trace.consts[x] = n
    end
    return n
  end
  if type(x) == "boolean" then return node_of(x and 1 or 0) end
  fail(("cannot trace a %s (only numbers, symbolic values and tensor reads)"):format(type(x)), 3)
end

local function sym(n) return setmetatable({ id = n, trace = trace }, Sym) end

local function op1(op) return function(a) return sym(node(op, node_of(a))) end end
local function op2(op) return function(a, b) return sym(node(op, node_of(a), node_of(b))) end end

for _, mt in ipairs { Sym, Read } do
  mt.__add, mt.__sub, mt.__mul, mt.__div = op2("+"), op2("-"), op2("*"), op2("/")
  mt.__mod, mt.__pow, mt.__unm = op2("%"), op2("^"), op1("unary -")
  mt.__idiv = function(a, b) return sym(node("floor", node("/", node_of(a), node_of(b)))) end
  mt.__eq = function() fail("== cannot give a symbolic value: use x:eq(y)", 2) end
  mt.__lt = function() fail("< and > cannot give a symbolic value: use x:lt(y), x:gt(y)", 2) end
  mt.__le = function() fail("<= and >= cannot give a symbolic value: use x:le(y), x:ge(y)", 2) end
  mt.__concat = function() fail("cannot concatenate a symbolic value", 2) end
  mt.__call = function() fail("a symbolic value is not a function", 2) end
  mt.__len = function() fail("a symbolic value has no length", 2) end
  mt.__tostring = function() return "<a symbolic value of ft.attention_mods>" end
  mt.__newindex = function() fail("a symbolic value cannot be assigned into", 2) end
  -- t[x] with x symbolic: the binding's __index asks the key's metatable
  mt.__ft_index = function(t, key) return setmetatable({ t = t, idx = { key } }, Read) end
end

Sym.__index = methods
Read.__index = function(r, k)
  if type(k) == "string" then
    local m = methods[k]
    if m then return m end
    fail(("no method '%s' on a symbolic value"):format(k), 2)
  end
  local idx = { unpack(r.idx) }
  idx[#idx + 1] = k
  return setmetatable({ t = r.t, idx = idx }, Read)
end

for _, name in ipairs { "eq", "ne", "lt", "le", "gt", "ge", "min", "max" } do
  methods[name] = op2(name)
end
for _, name in ipairs { "abs", "exp", "log", "sqrt", "tanh", "sigmoid", "floor" } do
  methods[name] = op1(name)
end
methods.negate = op1("negate")

-- ---- functions that work on symbolic values and on plain ones ----------------

--- Each of these computes at once on plain values (numbers, booleans) and
-- records a node on symbolic ones.
local function any_sym(...)
  for k = 1, select("#", ...) do
    if is_sym((select(k, ...))) then return true end
  end
  return false
end

local function truthy(x)
  if type(x) == "number" then return x ~= 0 end
  return x and true or false
end

function M.all(...)
  local n = select("#", ...)
  if n == 0 then return true end
  if not any_sym(...) then
    for k = 1, n do if not truthy((select(k, ...))) then return false end end
    return true
  end
  local r = node_of((select(1, ...)))
  for k = 2, n do r = node("all", r, node_of((select(k, ...)))) end
  return sym(r)
end

function M.any(...)
  local n = select("#", ...)
  if n == 0 then return false end
  if not any_sym(...) then
    for k = 1, n do if truthy((select(k, ...))) then return true end end
    return false
  end
  local r = node_of((select(1, ...)))
  for k = 2, n do r = node("any", r, node_of((select(k, ...)))) end
  return sym(r)
end

function M.negate(c)
  if not is_sym(c) then return not truthy(c) end
  return sym(node("negate", node_of(c)))
end

function M.where(c, a, b)
  if not is_sym(c) then return truthy(c) and a or b end
  return sym(node("where", node_of(c), node_of(a), node_of(b)))
end

function M.min(a, b)
  if not any_sym(a, b) then return math.min(a, b) end
  return sym(node("min", node_of(a), node_of(b)))
end

function M.max(a, b)
  if not any_sym(a, b) then return math.max(a, b) end
  return sym(node("max", node_of(a), node_of(b)))
end

-- ---- plain values at sample points (the check of a trace) -----------------------

-- A plain number in the same clothes as a symbolic one: the same methods,
-- but comparisons give Lua booleans, so a branch goes the way it would.
local Conc = {}
local ConcRead = {}
local cmethods = {}
local function cv(x)
  local mt = getmetatable(x)
  if mt == Conc then return x.v end
  if mt == ConcRead then
    local t = x.t
    if #x.idx ~= t:dim() then error("a tensor read with the wrong number of indices", 0) end
    local at = {}
    for k, e in ipairs(x.idx) do
      local n = math.floor(cv(e))
      if n < 1 or n > t:size(k) then error("out of range", 0) end
      at[k] = n
    end
    return t:get(unpack(at))
  end
  if type(x) == "boolean" then return x and 1 or 0 end
  return x
end
local function conc(v) return setmetatable({ v = v }, Conc) end
for _, mt in ipairs { Conc, ConcRead } do
  mt.__add = function(a, b) return conc(cv(a) + cv(b)) end
  mt.__sub = function(a, b) return conc(cv(a) - cv(b)) end
  mt.__mul = function(a, b) return conc(cv(a) * cv(b)) end
  mt.__div = function(a, b) return conc(cv(a) / cv(b)) end
  mt.__mod = function(a, b) local x, y = cv(a), cv(b) return conc(x - math.floor(x / y) * y) end
  mt.__pow = function(a, b) return conc(cv(a) ^ cv(b)) end
  mt.__unm = function(a) return conc(-cv(a)) end
  mt.__idiv = function(a, b) return conc(math.floor(cv(a) / cv(b))) end
  mt.__ft_index = function(t, key) return setmetatable({ t = t, idx = { key } }, ConcRead) end
end
Conc.__index = cmethods
ConcRead.__index = function(r, k)
  if type(k) == "string" then return cmethods[k] end
  local idx = { unpack(r.idx) }
  idx[#idx + 1] = k
  return setmetatable({ t = r.t, idx = idx }, ConcRead)
end
local cmp = {
  eq = function(x, y) return x == y end, ne = function(x, y) return x ~= y end,
  lt = function(x, y) return x < y end, le = function(x, y) return x <= y end,
  gt = function(x, y) return x > y end, ge = function(x, y) return x >= y end,
}
for name, f in pairs(cmp) do cmethods[name] = function(a, b) return f(cv(a), cv(b)) end end
local math_fns = {
  abs = math.abs, exp = math.exp, log = math.log, sqrt = math.sqrt, floor = math.floor,
  tanh = function(x) local e = math.exp(-2 * math.abs(x)); local t = (1 - e) / (1 + e); return x < 0 and -t or t end,
  sigmoid = function(x) return 1 / (1 + math.exp(-x)) end,
}
for name, f in pairs(math_fns) do cmethods[name] = function(a) return conc(f(cv(a))) end end
cmethods.min = function(a, b) return conc(math.min(cv(a), cv(b))) end
cmethods.max = function(a, b) return conc(math.max(cv(a), cv(b))) end
cmethods.negate = function(a) return not truthy(cv(a)) end

-- While checking, ft.all and friends see Conc values: they must compute.
local checking = false
local base = { all = M.all, any = M.any, negate = M.negate, where = M.where, min = M.min, max = M.max }
local function plain(x)
  local mt = getmetatable(x)
  if mt == Conc or mt == ConcRead then return cv(x) end
  return x
end
local function wrap(name)
  return function(...)
    if checking then
      local args = { ... }
      for k = 1, select("#", ...) do args[k] = plain(args[k]) end
      local r = base[name](unpack(args, 1, select("#", ...)))
      if type(r) == "number" then return conc(r) end
      return r
    end
    return base[name](...)
  end
end
for name in pairs(base) do M[name] = wrap(name) end

-- ---- tracing ----------------------------------------------------------------------

local function record(fn, nargs, what)
  local ok, r = pcall(function()
    local args = {}
    local names = nargs == 5 and { "s", "b", "h", "i", "j" } or { "b", "h", "i", "j" }
    for k, name in ipairs(names) do args[k] = sym(node(name)) end
    return node_of(fn(unpack(args, 1, nargs)))
  end)
  if not ok then
    local msg = tostring(r)
    if not msg:find("ft.attention_mods:", 1, true) then
      msg = "ft.attention_mods: tracing " .. what .. ": " .. msg
    end
    error(msg, 0)
  end
  return r
end

--- Runs fn with plain values at sample points and compares with the
-- graph: a Lua branch on a traced value shows as a disagreement.
local function check_trace(graph, tensors, score_fn, mask_fn)
  local seed = 12345
  local function rnd(n) -- a small LCG: independent of math.random
    seed = (seed * 1103515245 + 12345) % 2147483648
    return seed % n + 1
  end
  checking = true
  local ok, err = pcall(function()
    for _ = 1, 256 do
      local b, h, i, j = rnd(3), rnd(8), rnd(96), rnd(96)
      local s = (rnd(2001) - 1001) / 137
      local score, _, keep, fault = core.attention_mods_eval(graph, tensors, s, b, h, i, j)
      if not fault then
        if score_fn then
          local good, r = pcall(score_fn, conc(s), conc(b), conc(h), conc(i), conc(j))
          if good then
            local want = cv(r)
            if type(want) == "number" and math.abs(want - score) > 1e-9 * (1 + math.abs(want)) then
              error(("the score function gives %.17g at (s, b, h, i, j) = (%g, %d, %d, %d, %d), " ..
                "its trace %.17g: a Lua if, and, or, not or comparison on a traced value? " ..
                "(use ft.where, ft.all, ft.any, ft.negate, x:lt(y) ...)"):format(
                want, s, b, h, i, j, score), 0)
            end
          end
        end
        if mask_fn then
          local good, r = pcall(mask_fn, conc(b), conc(h), conc(i), conc(j))
          if good then
            local want = truthy(cv(r))
            if want ~= keep then
              error(("the mask gives %s at (b, h, i, j) = (%d, %d, %d, %d), its trace %s: a Lua " ..
                "if, and, or, not or comparison on a traced value? (use ft.all, ft.any, " ..
                "ft.negate, ft.where, x:lt(y) ...)"):format(tostring(want), b, h, i, j,
                tostring(keep)), 0)
            end
          end
        end
      end
    end
  end)
  checking = false
  if not ok then error("ft.attention_mods: " .. tostring(err), 0) end
end

local AttentionMods = { __name = "flashtile.AttentionMods" }
AttentionMods.__index = AttentionMods
AttentionMods.__tostring = function(m)
  return ("flashtile.AttentionMods(%s%s%s, %d nodes, %d tensors)"):format(
    m.has_score and "score" or "", m.has_score and m.has_mask and " and " or "",
    m.has_mask and "mask" or "", m.nodes, #m.tensors)
end

--- The top of the score's range where interval arithmetic over the graph
-- finds it at most 69 wide whatever s, the indices and the tensors read
-- (a softcap (s / c):tanh() * c of c <= 34: c), else nil: what a bf16
-- forward can take as every row's maximum from the start, as the Hopper
-- kernels do for the built-in softcap.
function AttentionMods:score_bound() return core.attention_mods_bound(self.graph) end

--- ft.attention_mods{score = function(s, b, h, i, j) ... end,
-- mask = function(b, h, i, j) ... end}: either or both.
function M.attention_mods(spec)
  if type(spec) ~= "table" then
    error("ft.attention_mods: expected a table {score = function, mask = function}", 2)
  end
  for k in pairs(spec) do
    if k ~= "score" and k ~= "mask" then
      error(("ft.attention_mods: unknown field '%s' (expected score or mask)"):format(tostring(k)), 2)
    end
  end
  local score_fn, mask_fn = spec.score, spec.mask
  if score_fn == nil and mask_fn == nil then
    error("ft.attention_mods: give a score function, a mask function or both", 2)
  end
  for name, f in pairs { score = score_fn, mask = mask_fn } do
    if type(f) ~= "function" then
      error(("ft.attention_mods: %s must be a function, got %s"):format(name, type(f)), 2)
    end
  end
  -- A trace left by a coroutine that yielded inside a traced function is
  -- abandoned (its values, if it resumes, belong to no trace and are an
  -- error); the same coroutine tracing again is a mod making mods.
  local co = coroutine.running()
  if trace and trace.co == co then
    error("ft.attention_mods: already tracing (a mod may not make mods)", 2)
  end
  trace = { nodes = {}, indices = {}, tensors = {}, slots = {}, consts = {}, co = co }
  local ok, err = pcall(function()
    trace.score = score_fn and record(score_fn, 5, "the score function") or 0
    trace.mask = mask_fn and record(mask_fn, 4, "the mask function") or 0
  end)
  local t = trace
  trace = nil
  if not ok then error(err, 2) end
  if #t.nodes > core.mod_max_nodes or #t.indices > core.mod_max_nodes then
    error(("ft.attention_mods: the functions trace to %d operations and %d tensor indices; "
      .. "at most %d of each"):format(#t.nodes, #t.indices, core.mod_max_nodes), 2)
  end
  local graph = core.attention_mods_graph(t.nodes, t.indices, #t.tensors, t.score, t.mask)
  local cpu = true
  for _, x in ipairs(t.tensors) do if x.device ~= "cpu" then cpu = false end end
  if cpu then check_trace(graph, t.tensors, score_fn, mask_fn) end
  return setmetatable({ graph = graph, tensors = t.tensors, has_score = score_fn ~= nil,
                        has_mask = mask_fn ~= nil, nodes = #t.nodes }, AttentionMods)
end

local BlockMask = { __name = "flashtile.BlockMask" }
BlockMask.__index = BlockMask
BlockMask.__tostring = function(bm)
  local e, p, f = core.attention_block_mask_counts(bm.data)
  return ("flashtile.BlockMask(%s, %d tiles: %d hidden, %d partly, %d visible)"):format(
    table.concat(bm.shape, "x"), e + p + f, e, p, f)
end
--- empty, partial, full: how many tiles the mask hides wholly, partly,
-- not at all.
function BlockMask:counts() return core.attention_block_mask_counts(self.data) end

--- ft.block_mask(mods, B, H, Nq, Nk [, {block_q = 128, block_k = 128,
-- device =}]): the mods' mask evaluated once per tile (FlexAttention's
-- BlockMask), for ft.attention(q, k, v, {mods = mods, block_mask = bm}):
-- the tiled path skips the tiles the mask hides wholly, and the mask
-- where it hides nothing (the tiles must be the call's block_q, block_k).
-- On CUDA (device "cuda", or the mods' tensors there) the mask is
-- evaluated on the GPU, and the flash kernels skip the tiles outside the
-- band that holds every pair it keeps and leave the mask out of the tiles
-- inside the band where it keeps every pair.
--- The checks a function taking (mods, ..., opts) makes: mods made by
-- ft.attention_mods, opts a table (or nil) of the listed keys. Returns
-- opts (a new table for nil). Errors are raised at the caller's caller.
local function check_mods_call(fname, mods, opts, keys)
  if getmetatable(mods) ~= AttentionMods then
    error(("%s: argument 1 must be made by ft.attention_mods"):format(fname), 3)
  end
  opts = opts or {}
  if type(opts) ~= "table" then error(("%s: options must be a table"):format(fname), 3) end
  for key in pairs(opts) do
    local known = false
    for _, k in ipairs(keys) do known = known or key == k end
    if not known then
      error(("%s: unknown option '%s' (expected %s or %s)"):format(fname, tostring(key),
        table.concat(keys, ", ", 1, #keys - 1), keys[#keys]), 3)
    end
  end
  return opts
end

function M.block_mask(mods, B, H, Nq, Nk, opts)
  opts = check_mods_call("ft.block_mask", mods, opts, { "block_q", "block_k", "device" })
  local sizes = { B, H, Nq, Nk, opts.block_q or 128, opts.block_k or 128 }
  local names = { "B", "H", "Nq", "Nk", "block_q", "block_k" }
  for i = 1, 6 do
    local v = sizes[i]
    if type(v) ~= "number" or v ~= math.floor(v) then
      error(("ft.block_mask: %s must be a whole number, got %s"):format(names[i],
        type(v) == "number" and tostring(v) or type(v)), 2)
    end
  end
  -- the C side's errors under this function's name
  local ok, data = pcall(core.attention_block_mask, mods.graph, mods.tensors, B, H, Nq, Nk,
    sizes[5], sizes[6], opts.device)
  if not ok then
    error((tostring(data):gsub("^attention_block_mask:", "ft.block_mask:")), 2)
  end
  return setmetatable({ data = data, mods = mods, shape = { B, H, Nq, Nk } }, BlockMask)
end

--- ft.cuda.compile_mods(mods, {dtype = "bf16", head_dim = 128, arch = "sm_90a",
-- pass = "both", grads = true, cache = true}): compiles the flash kernels
-- a call with these mods runs (pass "fwd": the forward; "bwd": dK/dV and
-- dQ; "both"; grads = false: the backward of mod_grads = false, which
-- skips the gradients of the float tensors the mods read) for that dtype,
-- head dim and architecture, for calls without the built-in softcap,
-- ALiBi or dropout and without a block mask whose band is the mask (a
-- call with them compiles its kernels at first use)
-- ("sm_90a": Hopper's kernels; "sm_80", "sm_89"...: the mma.sync ones),
-- without a GPU if need be, into the disk cache (cache = false: compile
-- even if there); returns how many it compiled. Fills the cache ahead of
-- a run, or checks that a mod compiles.
function M.compile_mods(mods, opts)
  opts = check_mods_call("ft.cuda.compile_mods", mods, opts,
    { "dtype", "head_dim", "arch", "pass", "grads", "cache" })
  local d = opts.head_dim or 128
  if type(d) ~= "number" or d ~= math.floor(d) then
    error("ft.cuda.compile_mods: head_dim must be an integer", 2)
  end
  local passes = ({ fwd = 1, bwd = 2, both = 3 })[opts.pass or "both"]
  if not passes then
    error(("ft.cuda.compile_mods: pass must be fwd, bwd or both, got %s"):format(tostring(opts.pass)), 2)
  end
  if opts.grads ~= nil and type(opts.grads) ~= "boolean" then
    error(("ft.cuda.compile_mods: grads must be a boolean, got %s"):format(type(opts.grads)), 2)
  end
  if passes >= 2 and opts.grads ~= false then passes = passes + 4 end
  return core.attention_mods_compile(mods.graph, mods.tensors, opts.dtype or "bf16", d,
    opts.arch or "sm_90a", passes, opts.cache ~= false)
end

return M
