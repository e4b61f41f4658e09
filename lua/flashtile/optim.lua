--- flashtile.optim: SGD and AdamW over lists of parameters and grads, as
-- model:parameters() returns them.
--
--   local optim = require "flashtile.optim"
--   local opt = optim.AdamW(model, {lr = 3e-3})
--   -- or, with the lists: local params, grads = model:parameters()
--   --                     optim.AdamW(params, grads, {lr = 3e-3})
--   for step = 1, n do
--     opt:zero_grad()
--     ... forward, backward ...
--     opt:step()
--   end
--
-- step() updates every parameter in place (p:copy(new value)), so modules
-- keep their tensors; the state (momentum buffers, Adam moments) lives on
-- each parameter's device in its dtype. Build the optimiser after
-- model:to(...), which replaces the tensors.
--
-- SGD (PyTorch's, without dampening or Nesterov):
--   d = g + weight_decay p;  b = momentum b + d (b = d at the first step);
--   p = p - lr (momentum > 0 and b or d)
-- AdamW (decoupled weight decay):
--   p = p (1 - lr weight_decay);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
--   p = p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
local ft = require "flashtile"

local optim = {}

-- ---- option checks ------------------------------------------------------------

local this_file = debug.getinfo(1, "S").source

--- Raises ctx: msg at the first caller outside this file (however deep the
-- checks are, and with or without tail calls, which Lua 5.1 keeps as frames).
local function fail(ctx, msg)
  local level = 2
  while true do
    local info = debug.getinfo(level, "S")
    if not info or info.source ~= this_file then break end
    level = level + 1
  end
  error(ctx .. ": " .. msg, level)
end

--- The options with their defaults; unknown keys are errors. `spec` maps a
-- key to {default, check(value) -> message or nil}.
local function read_options(ctx, opts, spec)
  if opts ~= nil and type(opts) ~= "table" then fail(ctx, "options must be a table, got " .. type(opts)) end
  local names = {}
  for k in pairs(spec) do names[#names + 1] = k end
  table.sort(names)
  local o = {}
  for k, v in pairs(opts or {}) do
    if spec[k] == nil then
      fail(ctx, ("unknown option '%s' (expected %s)"):format(tostring(k), table.concat(names, ", ")))
    end
    o[k] = v
  end
  for _, k in ipairs(names) do
    if o[k] == nil then o[k] = spec[k][1] end
    if o[k] == nil then fail(ctx, ("option '%s' is required"):format(k)) end
    local msg = spec[k][2](o[k])
    if msg then fail(ctx, ("option '%s' %s, got %s"):format(k, msg, tostring(o[k]))) end
  end
  return o
end

local function is_number(v) return type(v) == "number" and v == v and v ~= math.huge and v ~= -math.huge end

local function positive(v) if not (is_number(v) and v > 0) then return "must be a positive number" end end
local function non_negative(v) if not (is_number(v) and v >= 0) then return "must be a number >= 0" end end
local function fraction(v) if not (is_number(v) and v >= 0 and v < 1) then return "must be in [0, 1)" end end

local function betas(v)
  if type(v) ~= "table" or #v ~= 2 or fraction(v[1]) or fraction(v[2]) then
    return "must be two numbers in [0, 1), {beta1, beta2}"
  end
end

--- params and grads: lists of tensors of equal length, each grad like its
-- parameter (shape, dtype, device), floats.
local function check_lists(ctx, params, grads)
  if type(params) ~= "table" or type(grads) ~= "table" then
    fail(ctx, "expected a module, or two lists (params, grads) as model:parameters() returns")
  end
  if #grads == 0 and #params > 0 and next(grads) ~= nil then
    -- f(model:parameters(), opts) passes only the first list: Lua truncates
    -- a call that is not the last argument to one value
    fail(ctx, "grads is not a list; pass the module, or params, grads, opts "
      .. "(in f(model:parameters(), opts) Lua keeps only the params)")
  end
  if #params ~= #grads then
    fail(ctx, ("%d params but %d grads"):format(#params, #grads))
  end
  for i, p in ipairs(params) do
    local g = grads[i]
    if not ft.is_tensor(p) or not ft.is_tensor(g) then fail(ctx, ("param %d or its grad is not a tensor"):format(i)) end
    if p.dtype == "i32" or p.dtype == "i64" then fail(ctx, ("param %d is %s; parameters are floats"):format(i, p.dtype)) end
    local same = p.dtype == g.dtype and p.device == g.device and table.concat(p.shape, ",") == table.concat(g.shape, ",")
    if not same then
      fail(ctx, ("grad %d (%s %s {%s}) does not match its param (%s %s {%s})"):format(i,
        g.dtype, g.device, table.concat(g.shape, ", "), p.dtype, p.device, table.concat(p.shape, ", ")))
    end
  end
end

local function zeros_like(t)
  return ft.zeros(t.shape, { dtype = t.dtype, device = t.device })
end

local Optimizer = {}
Optimizer.__index = Optimizer

--- Sets every grad to zero.
function Optimizer:zero_grad()
  self:check_alive("zero_grad")
  for _, g in ipairs(self.grads) do g:fill(0) end
end

--- Before a step: no param or grad freed since the optimizer was made
-- (a freed one is an error naming it, not one from the arithmetic).
function Optimizer:check_alive(what)
  for i, p in ipairs(self.params) do
    if p.dtype == nil then fail(self.ctx, ("%s: param %d has been freed"):format(what, i)) end
    if self.grads[i].dtype == nil then fail(self.ctx, ("%s: grad %d has been freed"):format(what, i)) end
  end
end

--- (cls, ctx, module, opts, spec) or (cls, ctx, params, grads, opts, spec)
local function new(cls, ctx, params, grads, opts, spec)
  if type(params) == "table" and type(params.parameters) == "function" then
    if opts ~= nil then fail(ctx, "with a module, the options come second: f(model, opts)") end
    opts = grads
    params, grads = params:parameters()
  end
  check_lists(ctx, params, grads)
  local self = setmetatable({}, cls)
  self.ctx, self.params, self.grads = ctx, params, grads
  self.options = read_options(ctx, opts, spec)
  self.state = {}   -- per parameter, created at its first step
  self.t = 0        -- steps taken
  return self
end

-- ---- SGD ----------------------------------------------------------------------

local SGD = setmetatable({}, { __index = Optimizer })
SGD.__index = SGD

--- optim.SGD(params, grads, {lr =, momentum = 0, weight_decay = 0}), or
-- optim.SGD(module, {...}) for the module's parameters().
function optim.SGD(params, grads, opts)
  -- not a tail call: Lua 5.1 would leave a "(tail call)" frame where the
  -- error level of a bad option points
  local o = new(SGD, "optim.SGD", params, grads, opts, {
    lr = { nil, positive }, momentum = { 0, fraction }, weight_decay = { 0, non_negative },
  })
  return o
end

function SGD:step()
  self:check_alive("step")
  local o = self.options
  self.t = self.t + 1
  for i, p in ipairs(self.params) do
    local d = self.grads[i]
    if o.weight_decay ~= 0 then d = d + p * o.weight_decay end
    if o.momentum ~= 0 then
      local buf = self.state[i]
      if buf then buf:copy(buf * o.momentum + d) else buf = d:clone(); self.state[i] = buf end
      d = buf
    end
    p:copy(p - d * o.lr)
  end
end

-- ---- AdamW --------------------------------------------------------------------

local AdamW = setmetatable({}, { __index = Optimizer })
AdamW.__index = AdamW

--- optim.AdamW(params, grads, {lr = 1e-3, betas = {0.9, 0.999}, eps = 1e-8,
-- weight_decay = 0.01}), or optim.AdamW(module, {...}).
function optim.AdamW(params, grads, opts)
  local o = new(AdamW, "optim.AdamW", params, grads, opts, {
    lr = { 1e-3, positive }, betas = { { 0.9, 0.999 }, betas }, eps = { 1e-8, positive },
    weight_decay = { 0.01, non_negative },
  })
  return o
end

function AdamW:step()
  self:check_alive("step")
  local o = self.options
  local b1, b2 = o.betas[1], o.betas[2]
  self.t = self.t + 1
  local c1, c2 = 1 - b1 ^ self.t, 1 - b2 ^ self.t  -- bias corrections
  for i, p in ipairs(self.params) do
    local g = self.grads[i]
    local s = self.state[i]
    if not s then
      s = { m = zeros_like(p), v = zeros_like(p) }
      self.state[i] = s
    end
    s.m:copy(s.m * b1 + g * (1 - b1))
    s.v:copy(s.v * b2 + g * g * (1 - b2))
    local update = (s.m / c1) / ((s.v / c2):sqrt() + o.eps)
    p:copy(p * (1 - o.lr * o.weight_decay) - update * o.lr)
  end
end

return optim
