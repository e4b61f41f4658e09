--- flashtile.nn: neural-network modules in the manner of torch7's nn.
--
--   local ft = require "flashtile"
--   local nn = require "flashtile.nn"
--   local model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
--   local y = model:forward(x)                 -- keeps what backward needs
--   local dx = model:backward(x, dy)           -- accumulates parameter grads
--   local params, grads = model:parameters()   -- two lists, same order
--   model:zero_grad()
--   print(model)                               -- the nested structure
--
-- Every module:
--   forward(input) -> output; backward(input, grad_output) -> grad_input
--     (backward follows the forward of the same input, as in torch7; it adds
--     into the parameter grads, so call zero_grad() between steps);
--   parameters() -> params, grads (documented order, children in order);
--   zero_grad(), train(), evaluate(), to(dtype or device) (in place,
--   returns the module), clone(), replace(fn), apply(fn), find(typename),
--   n_parameters(), and m(x) as a shorthand for m:forward(x).
--   state_dict() -> {name = parameter} ("qkv.weight", "2.attn.out_proj.bias");
--   load_state_dict(state [, {strict = true}]) copies them in (checked first).
--
-- Modules (shapes: x [..., dim] unless said):
--   Linear(in, out, {bias = true})   [..., in] -> [..., out]; weight [out, in], bias [out]
--   MultiheadAttention{dim =, heads =, kv_heads = heads, causal = false, bias = false,
--                      rotary = false}
--                                    [B, N, dim]; its Linears: qkv, out (or q, kv, out);
--                                    rotary = true (or a base): nn.Rotary on q and k
--   Rotary{head_dim =, base = 10000} rotary position embeddings (no parameters)
--   KVCache(model, {batch =, capacity =}) (not a module) keys and values of every
--                                    attention of model, for decoding step by step
--   RMSNorm(dim, {eps = 1e-6})       weight
--   LayerNorm(dim, {eps = 1e-5})     weight, bias
--   GELU() (tanh form), SiLU(), Identity()
--   Embedding(vocab, dim)            1-based ids (i64/i32) of any shape -> [..., dim]; weight
--   PositionalEmbedding(max_len, dim) x [..., N, dim] + learned rows 1..N; weight
--   Residual(f)                      x + f(x)
--   Sequential(m1, m2, ...)          children in order
--   TransformerBlock{dim =, heads =, kv_heads =, causal =, hidden = 4 dim, norm = "rms",
--                    rotary = false}
--                                    pre-norm attention and Linear-GELU-Linear MLP
--   CrossEntropy()                   forward(logits [N, C], targets [N]) -> number;
--                                    backward(logits, targets) -> grad logits
-- (after each module: the order of its parameters() and of their grads)
--
-- Parameters start from a seed: every constructor of a module with
-- parameters takes {seed = n}
-- (without one it draws from a counter, nn.manual_seed(n) resets it), and
-- {dtype = "f32", device = "cpu"}. The values are drawn in f64 on the CPU
-- and converted, so one seed gives one model on every dtype and device.
-- Initial scales follow PyTorch: Linear weights and biases uniform in
-- (-1/sqrt(in), 1/sqrt(in)), embeddings standard normal, norms ones/zeros.
local ft = require "flashtile"

--- An integral number (every Lua has numbers; only 5.3 on has integers).
local function is_integer(v)
  return type(v) == "number" and v == math.floor(v) and v > -2 ^ 63 and v < 2 ^ 63
end

local nn = {}

-- ---- small helpers ------------------------------------------------------------

local function shape_string(shape)
  return "{" .. table.concat(shape, ", ") .. "}"
end

local function is_float(t)
  local d = t.dtype
  return d == "f64" or d == "f32" or d == "f16" or d == "bf16"
end

--- A positive integer, or an error naming the argument.
local function check_count(ctx, name, v)
  if not is_integer(v) or v < 1 then
    error(("%s: %s must be a positive integer, got %s"):format(ctx, name, tostring(v)), 4)
  end
  return v
end

--- Checks an options table against the allowed keys (a map key -> default;
-- false stands for "no default") and returns a copy with the defaults.
local function check_opts(ctx, opts, allowed)
  if opts ~= nil and type(opts) ~= "table" then
    error(("%s: options must be a table, got %s"):format(ctx, type(opts)), 4)
  end
  local names, o = {}, {}
  for k, v in pairs(allowed) do
    names[#names + 1] = k
    if v ~= false then o[k] = v end
  end
  table.sort(names)
  for k, v in pairs(opts or {}) do
    if allowed[k] == nil then
      error(("%s: unknown option '%s' (expected %s)"):format(ctx, tostring(k), table.concat(names, ", ")), 4)
    end
    o[k] = v
  end
  return o
end

local function check_boolean(ctx, name, v)
  if type(v) ~= "boolean" then
    error(("%s: option '%s' must be a boolean, got %s"):format(ctx, name, tostring(v)), 4)
  end
end

local function check_positive_number(ctx, name, v)
  if type(v) ~= "number" or not (v > 0) or v == math.huge then
    error(("%s: option '%s' must be a positive number, got %s"):format(ctx, name, tostring(v)), 4)
  end
end

-- ---- seeds --------------------------------------------------------------------

local seed_counter = 0

--- Resets the counter that modules built without {seed=} draw from.
function nn.manual_seed(n)
  if not is_integer(n) then error("nn.manual_seed: seed must be an integer", 2) end
  seed_counter = n
end

local function next_seed()
  seed_counter = seed_counter + 1
  return seed_counter
end

--- A seed for part k of a module seeded with `seed` (a splitmix64 step in
-- flashtile.core, so that seeds 1 and 2 do not share streams between their
-- parts).
local derive = ft.derive_seed
nn.derive_seed = derive

--- Reads {seed, dtype, device} into what tensor factories take.
local function tensor_opts(o)
  return { dtype = o.dtype or "f32", device = o.device or "cpu" }
end

--- uniform(-bound, bound) of a shape, drawn in f64 on the CPU.
local function uniform(shape, bound, seed, o)
  return (ft.rand(shape, { dtype = "f64", seed = seed }) * (2 * bound) - bound):to(tensor_opts(o))
end

local function normal(shape, seed, o)
  return ft.randn(shape, { dtype = "f64", seed = seed }):to(tensor_opts(o))
end

local function zeros_like(t)
  return ft.zeros(t.shape, { dtype = t.dtype, device = t.device })
end

--- Whether tensor t has been freed (its fields read as nil then).
local function is_freed(t)
  return t.dtype == nil
end

--- grad += delta, in place (grad may be a view).
local function accumulate(grad, delta)
  grad:copy(grad + delta)
end

--- `small` (a tensor whose shape is `full`'s with some dims of size 1 or
-- missing in front) stretched to `full`'s shape as a view.
local function bcast(small, full)
  return small:expand(full.shape)
end

-- ---- classes ------------------------------------------------------------------

local metamethods = { "__tostring", "__call" }

--- A class table: nn.X(...) makes an instance and runs X.__init(self, ...).
local function class(name, parent)
  local cls = {}
  cls.__index = cls
  cls.__typename = "nn." .. name
  if parent then
    for _, mm in ipairs(metamethods) do cls[mm] = parent[mm] end
  end
  setmetatable(cls, {
    __index = parent,
    __call = function(c, ...)
      local self = setmetatable({}, c)
      self:__init(...)
      return self
    end,
  })
  nn[name] = cls
  return cls
end
nn.class = class

-- ---- Module: what every module has ---------------------------------------------

local Module = class("Module")

function Module:__init()
  self.training = true
  self._params = {}  -- list of {param field, grad field}, in parameters() order
end

Module.__tostring = function(self) return self:describe() end
Module.__call = function(self, ...) return self:forward(...) end

--- Declares self[param] (with its grad in self[grad]) as a parameter.
function Module:register(param, grad)
  self._params[#self._params + 1] = { param, grad }
end

function Module:forward(input)
  error(self.__typename .. ": forward is not implemented", 2)
end

function Module:backward(input, grad_output)
  error(self.__typename .. ": backward is not implemented", 2)
end

--- Two lists: the parameters and their grads, own ones first, then the
-- children's in order.
function Module:parameters()
  local params, grads = {}, {}
  self:apply(function(m)
    for _, pg in ipairs(m._params) do
      params[#params + 1] = m[pg[1]]
      grads[#grads + 1] = m[pg[2]]
    end
  end)
  return params, grads
end

--- How many numbers the parameters hold.
function Module:n_parameters()
  local n = 0
  for _, p in ipairs((self:parameters())) do n = n + p:numel() end
  return n
end

function Module:zero_grad()
  local _, grads = self:parameters()
  for _, g in ipairs(grads) do g:fill(0) end
  return self
end

--- Calls fn(m) on this module and every descendant, parents first.
function Module:apply(fn)
  fn(self)
  for _, m in ipairs(self.modules or {}) do m:apply(fn) end
  return self
end

--- Every module (this one included) whose type is typename ("nn.Linear" or
-- "Linear"), in order.
function Module:find(typename)
  if not typename:find("^nn%.") then typename = "nn." .. typename end
  local found = {}
  self:apply(function(m)
    if m.__typename == typename then found[#found + 1] = m end
  end)
  return found
end

--- torch7's replace: fn(m) returns the module to use instead of m (or m);
-- applied to every descendant. Returns fn(self).
function Module:replace(fn)
  local out = fn(self)
  for i, m in ipairs(self.modules or {}) do
    local new = m:replace(fn)
    if new ~= m then
      self.modules[i] = new
      -- named references to the child follow it
      for k, v in pairs(self) do
        if v == m then self[k] = new end
      end
    end
  end
  return out
end

function Module:train()
  return self:apply(function(m) m.training = true end)
end

function Module:evaluate()
  return self:apply(function(m) m.training = false end)
end

--- Drops what forward kept for backward (every tensor field that is not a
-- parameter or a grad).
function Module:clear_state()
  return self:apply(function(m)
    local keep = {}
    for _, pg in ipairs(m._params) do keep[pg[1]], keep[pg[2]] = true, true end
    for k, v in pairs(m) do
      if ft.is_tensor(v) and not keep[k] then m[k] = nil end
    end
  end)
end

--- Converts every parameter and grad (replacing the tensors inside the
-- modules) to a dtype or a device, as t:to takes. Optimisers built before
-- hold the old tensors: build them after to().
function Module:to(target)
  self:clear_state()
  return self:apply(function(m)
    for _, pg in ipairs(m._params) do
      m[pg[1]] = m[pg[1]]:to(target)
      m[pg[2]] = m[pg[2]]:to(target)
    end
  end)
end

--- The dtype and device of the first parameter (nil for none).
function Module:type()
  local params = self:parameters()
  if params[1] then return params[1].dtype, params[1].device end
end

-- ---- state: named parameters, for checkpoints -------------------------------

--- The name a parent gives child i: the field that refers to it (the
-- smallest name when several do), else its 1-based position.
local function child_name(parent, i, child)
  local best
  for k, v in pairs(parent) do
    if v == child and type(k) == "string" and k ~= "modules" and (not best or k < best) then
      best = k
    end
  end
  return best or tostring(i)
end

--- Calls fn(prefix .. name, module, param field) for every parameter, in
-- parameters() order.
local function each_named_param(m, prefix, fn)
  for _, pg in ipairs(m._params) do fn(prefix .. pg[1], m, pg[1]) end
  for i, c in ipairs(m.modules or {}) do
    each_named_param(c, prefix .. child_name(m, i, c) .. ".", fn)
  end
end

--- {name = parameter} with dotted names as PyTorch writes them
-- ("qkv.weight", "1.attn.out_proj.bias", positions for unnamed children).
-- The tensors are the parameters themselves (no copies):
-- ft.save_safetensors(path, model:state_dict()) writes a checkpoint.
function Module:state_dict()
  local state = {}
  each_named_param(self, "", function(name, m, field) state[name] = m[field] end)
  return state
end

--- Copies state[name] into each parameter (converting dtype and device),
-- after checking every name and shape first: a missing or unexpected name
-- or a shape that differs is an error naming them all, and nothing is
-- changed. {strict = false} allows missing and unexpected names. Returns
-- the module.
function Module:load_state_dict(state, opts)
  if type(state) ~= "table" then
    error(("load_state_dict: state must be a table of tensors, got %s"):format(type(state)), 2)
  end
  local o = check_opts("load_state_dict", opts, { strict = true })
  local missing, wrong, seen, todo = {}, {}, {}, {}
  each_named_param(self, "", function(name, m, field)
    local t = state[name]
    seen[name] = true
    if t == nil then
      missing[#missing + 1] = name
    elseif not ft.is_tensor(t) then
      wrong[#wrong + 1] = ("%s is a %s, not a tensor"):format(name, type(t))
    elseif is_freed(t) then
      wrong[#wrong + 1] = ("%s has been freed"):format(name)
    elseif is_freed(m[field]) then
      wrong[#wrong + 1] = ("the module's %s has been freed"):format(name)
    elseif shape_string(t.shape) ~= shape_string(m[field].shape) then
      wrong[#wrong + 1] = ("%s has shape %s, the module's is %s"):format(
        name, shape_string(t.shape), shape_string(m[field].shape))
    else
      todo[#todo + 1] = { m[field], t }
    end
  end)
  local unexpected = {}
  for k in pairs(state) do
    if not seen[k] then unexpected[#unexpected + 1] = tostring(k) end
  end
  table.sort(missing)
  table.sort(unexpected)
  local problems = wrong
  if o.strict and #missing > 0 then
    problems[#problems + 1] = "missing: " .. table.concat(missing, ", ")
  end
  if o.strict and #unexpected > 0 then
    problems[#problems + 1] = "unexpected: " .. table.concat(unexpected, ", ")
  end
  if #problems > 0 then
    error("load_state_dict: " .. table.concat(problems, "; "), 2)
  end
  for _, pair in ipairs(todo) do pair[1]:copy(pair[2]) end
  return self
end

local function deep_copy(v, memo)
  if ft.is_tensor(v) then
    if not memo[v] then memo[v] = v:clone() end
    return memo[v]
  end
  if type(v) ~= "table" then return v end
  if memo[v] then return memo[v] end
  local c = {}
  memo[v] = c
  for k, x in pairs(v) do c[deep_copy(k, memo)] = deep_copy(x, memo) end
  return setmetatable(c, getmetatable(v))
end

--- An independent copy: parameters and grads cloned, no forward state.
function Module:clone()
  return deep_copy(self, {}):clear_state()
end

--- The one-line description of a leaf (containers list their children).
function Module:describe()
  return self.__typename .. self:header()
end

--- What follows the type name: "(4 -> 8)" and the like.
function Module:header()
  return ""
end

--- The torch7 printing of a module with children:
--   nn.Sequential {
--     [input -> (1) -> (2) -> output]
--     (1): nn.Linear(4 -> 8)
--     (2): nn.GELU
--   }
local function describe_children(self, flow)
  local lines = { self.__typename .. self:header() .. " {" }
  if flow then lines[2] = "  " .. flow end
  for i, m in ipairs(self.modules) do
    local s = tostring(m):gsub("\n", "\n  ")
    lines[#lines + 1] = ("  (%d): %s"):format(i, s)
  end
  lines[#lines + 1] = "}"
  return table.concat(lines, "\n")
end

--- Checks that x is a float tensor of this module's dtype and device.
function Module:check_input(x, what, level)
  what, level = what or "input", level or 3
  if not ft.is_tensor(x) then
    error(("%s: %s must be a tensor, got %s"):format(self.__typename, what, type(x)), level)
  end
  if is_freed(x) then
    error(("%s: %s has been freed"):format(self.__typename, what), level)
  end
  if not is_float(x) then
    error(("%s: %s must be a float tensor, got %s"):format(self.__typename, what, x.dtype), level)
  end
  local dtype, device = self:type()
  if dtype and x.dtype ~= dtype then
    error(("%s: %s is %s but the parameters are %s (convert one: module:to(%q) or x:to(%q))")
      :format(self.__typename, what, x.dtype, dtype, x.dtype, dtype), level)
  end
  if device and x.device ~= device then
    error(("%s: %s is on %s but the parameters are on %s"):format(self.__typename, what, x.device,
      device), level)
  end
end

--- Before a backward(input, grad_output): forward has run, and grad_output
-- is a float tensor of the output's shape (and the parameters' dtype and
-- device), so that a mistake at the REPL is an error naming the module,
-- not one from deep inside it.
function Module:check_backward(grad_output)
  if not ft.is_tensor(self.output) then
    error(("%s: backward before forward: run forward(input) first, then "
      .. "backward(input, grad_output)"):format(self.__typename), 3)
  end
  self:check_input(grad_output, "grad_output", 4)
  if grad_output.dtype ~= self.output.dtype or grad_output.device ~= self.output.device then
    error(("%s: grad_output is %s on %s but the output is %s on %s"):format(self.__typename,
      grad_output.dtype, grad_output.device, self.output.dtype, self.output.device), 3)
  end
  if shape_string(grad_output.shape) ~= shape_string(self.output.shape) then
    error(("%s: grad_output %s must have the output's shape %s"):format(self.__typename,
      shape_string(grad_output.shape), shape_string(self.output.shape)), 3)
  end
end

--- Checks that the last dim of x is n.
function Module:check_last_dim(x, n, what)
  if x:dim() < 1 or x:size(x:dim()) ~= n then
    error(("%s: %s %s must end in a dim of size %d"):format(self.__typename, what or "input",
      shape_string(x.shape), n), 3)
  end
end

-- ---- Identity -------------------------------------------------------------------

--- nn.Identity(): returns its input (and grad_output) unchanged.
local Identity = class("Identity", Module)

function Identity:forward(input)
  self.output = input
  return input
end

function Identity:backward(input, grad_output)
  self:check_backward(grad_output)
  self.grad_input = grad_output
  return grad_output
end

-- ---- Linear ---------------------------------------------------------------------

--- nn.Linear(in, out, {bias = true, seed =, dtype =, device =}) on inputs
-- [..., in] -> [..., out]: y = x W^T + b. Parameters: weight [out, in],
-- then bias [out].
local Linear = class("Linear", Module)

function Linear:__init(in_features, out_features, opts)
  Module.__init(self)
  check_count("nn.Linear", "in_features", in_features)
  check_count("nn.Linear", "out_features", out_features)
  local o = check_opts("nn.Linear", opts, { bias = true, seed = false, dtype = false, device = false })
  check_boolean("nn.Linear", "bias", o.bias)
  local seed = o.seed or next_seed()
  self.in_features, self.out_features = in_features, out_features
  local bound = 1 / math.sqrt(in_features)
  self.weight = uniform({ out_features, in_features }, bound, derive(seed, 1), o)
  self.grad_weight = zeros_like(self.weight)
  self:register("weight", "grad_weight")
  if o.bias then
    self.bias = uniform({ out_features }, bound, derive(seed, 2), o)
    self.grad_bias = zeros_like(self.bias)
    self:register("bias", "grad_bias")
  end
end

function Linear:header()
  return ("(%d -> %d)%s"):format(self.in_features, self.out_features,
    self.bias and "" or " without bias")
end

function Linear:forward(input)
  self:check_input(input)
  self:check_last_dim(input, self.in_features)
  local x = input:reshape(-1, self.in_features)           -- [M, in]
  local y = ft.matmul(x, self.weight:transpose())          -- [M, out]
  if self.bias then y = y + bcast(self.bias, y) end
  local shape = input.shape
  shape[#shape] = self.out_features
  self.output = y:view(shape)                              -- [..., out]
  return self.output
end

function Linear:backward(input, grad_output)
  self:check_backward(grad_output)
  local x = input:reshape(-1, self.in_features)             -- [M, in]
  local g = grad_output:reshape(-1, self.out_features)      -- [M, out]
  accumulate(self.grad_weight, ft.matmul(g:transpose(), x)) -- [out, in]
  if self.bias then accumulate(self.grad_bias, g:sum(1)) end
  self.grad_input = ft.matmul(g, self.weight):view(input.shape)
  return self.grad_input
end

-- ---- activations ------------------------------------------------------------------

--- nn.GELU(): x * Phi(x) in the tanh approximation (GPT-2's):
-- 0.5 x (1 + tanh(c (x + 0.044715 x^3))), c = sqrt(2 / pi).
local GELU = class("GELU", Module)
local GELU_C, GELU_A = math.sqrt(2 / math.pi), 0.044715

function GELU:forward(x)
  self:check_input(x)
  local t = ((x + x * x * x * GELU_A) * GELU_C):tanh()
  self.output = x * (t + 1) * 0.5
  return self.output
end

function GELU:backward(x, grad_output)
  self:check_backward(grad_output)
  local x2 = x * x
  local t = ((x + x2 * x * GELU_A) * GELU_C):tanh()
  -- d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3a x^2)
  local dt = (1 - t * t) * (x2 * (3 * GELU_A) + 1) * (GELU_C * 0.5)
  self.grad_input = grad_output * ((t + 1) * 0.5 + x * dt)
  return self.grad_input
end

--- nn.SiLU(): x * sigmoid(x).
local SiLU = class("SiLU", Module)

function SiLU:forward(x)
  self:check_input(x)
  self.output = x * x:sigmoid()
  return self.output
end

function SiLU:backward(x, grad_output)
  self:check_backward(grad_output)
  local s = x:sigmoid()
  -- d/dx = s (1 + x (1 - s))
  self.grad_input = grad_output * s * (x * (1 - s) + 1)
  return self.grad_input
end

-- ---- norms ------------------------------------------------------------------------

--- nn.RMSNorm(dim, {eps = 1e-6}) over the last dim: x / rms(x) * weight.
-- Parameters: weight [dim] (ones).
local RMSNorm = class("RMSNorm", Module)

function RMSNorm:__init(dim, opts)
  Module.__init(self)
  check_count("nn.RMSNorm", "dim", dim)
  local o = check_opts("nn.RMSNorm", opts, { eps = 1e-6, seed = false, dtype = false, device = false })
  check_positive_number("nn.RMSNorm", "eps", o.eps)
  self.dim, self.eps = dim, o.eps
  self.weight = ft.ones({ dim }, tensor_opts(o))
  self.grad_weight = zeros_like(self.weight)
  self:register("weight", "grad_weight")
end

function RMSNorm:header()
  return ("(%d, eps %g)"):format(self.dim, self.eps)
end

function RMSNorm:forward(x)
  self:check_input(x)
  self:check_last_dim(x, self.dim)
  local rstd = ((x * x):mean(-1, true) + self.eps) ^ -0.5    -- [..., 1]
  self.xhat = x * bcast(rstd, x)                              -- [..., dim]
  self.rstd = rstd
  self.output = self.xhat * bcast(self.weight, x)
  return self.output
end

function RMSNorm:backward(x, grad_output)
  self:check_backward(grad_output)
  local xhat, g = self.xhat, grad_output
  accumulate(self.grad_weight, (g * xhat):reshape(-1, self.dim):sum(1))
  -- dx = rstd (dxhat - xhat mean(dxhat xhat))
  local dxhat = g * bcast(self.weight, g)
  local dot = (dxhat * xhat):mean(-1, true)
  self.grad_input = (dxhat - xhat * bcast(dot, xhat)) * bcast(self.rstd, xhat)
  return self.grad_input
end

--- nn.LayerNorm(dim, {eps = 1e-5}) over the last dim: (x - mean) / std *
-- weight + bias. Parameters: weight [dim] (ones), then bias [dim] (zeros).
local LayerNorm = class("LayerNorm", Module)

function LayerNorm:__init(dim, opts)
  Module.__init(self)
  check_count("nn.LayerNorm", "dim", dim)
  local o = check_opts("nn.LayerNorm", opts, { eps = 1e-5, seed = false, dtype = false, device = false })
  check_positive_number("nn.LayerNorm", "eps", o.eps)
  self.dim, self.eps = dim, o.eps
  self.weight = ft.ones({ dim }, tensor_opts(o))
  self.bias = ft.zeros({ dim }, tensor_opts(o))
  self.grad_weight, self.grad_bias = zeros_like(self.weight), zeros_like(self.bias)
  self:register("weight", "grad_weight")
  self:register("bias", "grad_bias")
end

LayerNorm.header = RMSNorm.header

function LayerNorm:forward(x)
  self:check_input(x)
  self:check_last_dim(x, self.dim)
  local xc = x - bcast(x:mean(-1, true), x)
  local rstd = ((xc * xc):mean(-1, true) + self.eps) ^ -0.5  -- [..., 1]
  self.xhat = xc * bcast(rstd, x)
  self.rstd = rstd
  self.output = self.xhat * bcast(self.weight, x) + bcast(self.bias, x)
  return self.output
end

function LayerNorm:backward(x, grad_output)
  self:check_backward(grad_output)
  local xhat, g = self.xhat, grad_output
  local g2 = g:reshape(-1, self.dim)
  accumulate(self.grad_weight, (g * xhat):reshape(-1, self.dim):sum(1))
  accumulate(self.grad_bias, g2:sum(1))
  -- dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))
  local dxhat = g * bcast(self.weight, g)
  local mean = dxhat:mean(-1, true)
  local dot = (dxhat * xhat):mean(-1, true)
  self.grad_input = (dxhat - bcast(mean, xhat) - xhat * bcast(dot, xhat)) * bcast(self.rstd, xhat)
  return self.grad_input
end

-- ---- embeddings -----------------------------------------------------------------

local function check_ids(self, ids)
  if not ft.is_tensor(ids) or (ids.dtype ~= "i64" and ids.dtype ~= "i32") then
    error(("%s: input must be an i64 (or i32) tensor of 1-based ids, got %s"):format(
      self.__typename, ft.is_tensor(ids) and ids.dtype .. " tensor" or type(ids)), 3)
  end
  if ids:numel() == 0 then return end
  local lo, hi = ids:min(), ids:max()
  if lo < 1 or hi > self.vocab then
    error(("%s: ids must be 1 to %d, got %d to %d"):format(self.__typename, self.vocab, lo, hi), 3)
  end
end

--- nn.Embedding(vocab, dim): 1-based ids of any shape (i64 or i32) ->
-- [..., dim]. Parameters: weight [vocab, dim] (standard normal). backward
-- adds into the weight grad and returns nil (ids have no gradient).
local Embedding = class("Embedding", Module)

function Embedding:__init(vocab, dim, opts)
  Module.__init(self)
  check_count("nn.Embedding", "vocab", vocab)
  check_count("nn.Embedding", "dim", dim)
  local o = check_opts("nn.Embedding", opts, { seed = false, dtype = false, device = false })
  self.vocab, self.dim = vocab, dim
  self.weight = normal({ vocab, dim }, derive(o.seed or next_seed(), 1), o)
  self.grad_weight = zeros_like(self.weight)
  self:register("weight", "grad_weight")
end

function Embedding:header()
  return ("(%d, %d)"):format(self.vocab, self.dim)
end

--- The ids flattened to 1-d i64 on the weight's device.
function Embedding:flat_ids(ids)
  local flat = ids:reshape(-1)
  if flat.dtype ~= "i64" then flat = flat:to("i64") end
  if flat.device ~= self.weight.device then flat = flat:to(self.weight.device) end
  return flat
end

function Embedding:forward(ids)
  check_ids(self, ids)
  local rows = self.weight:index_select(1, self:flat_ids(ids))  -- [n, dim]
  local shape = ids.shape
  shape[#shape + 1] = self.dim
  self.output = rows:view(shape)
  return self.output
end

function Embedding:backward(ids, grad_output)
  self:check_backward(grad_output)
  self.grad_weight:index_add(1, self:flat_ids(ids), grad_output:reshape(-1, self.dim))
  self.grad_input = nil
  return nil
end

--- nn.PositionalEmbedding(max_len, dim): learned positions added to
-- x [..., seqlen, dim] (seqlen <= max_len): y = x + weight[1..seqlen].
-- Parameters: weight [max_len, dim] (standard normal).
local PositionalEmbedding = class("PositionalEmbedding", Module)

function PositionalEmbedding:__init(max_len, dim, opts)
  Module.__init(self)
  check_count("nn.PositionalEmbedding", "max_len", max_len)
  check_count("nn.PositionalEmbedding", "dim", dim)
  local o = check_opts("nn.PositionalEmbedding", opts, { seed = false, dtype = false, device = false })
  self.max_len, self.dim = max_len, dim
  self.weight = normal({ max_len, dim }, derive(o.seed or next_seed(), 1), o)
  self.grad_weight = zeros_like(self.weight)
  self:register("weight", "grad_weight")
end

function PositionalEmbedding:header()
  return ("(%d, %d)"):format(self.max_len, self.dim)
end

function PositionalEmbedding:forward(x)
  self:check_input(x)
  self:check_last_dim(x, self.dim)
  local n = x:dim() >= 2 and x:size(x:dim() - 1) or 0
  local pos0 = self.cache and self.cache.len or 0 -- decoding: positions go on from the cache's
  if x:dim() < 2 or pos0 + n > self.max_len then
    error(("nn.PositionalEmbedding: input %s must be [..., seqlen <= %d, %d]%s"):format(
      shape_string(x.shape), self.max_len - pos0, self.dim,
      pos0 > 0 and (" after %d cached positions"):format(pos0) or ""), 2)
  end
  self.output = x + bcast(self.weight:narrow(1, pos0 + 1, n), x)
  return self.output
end

function PositionalEmbedding:backward(x, grad_output)
  self:check_backward(grad_output)
  local n = x:size(x:dim() - 1)
  local rows = self.grad_weight:narrow(1, 1, n)                      -- [n, dim]
  accumulate(rows, grad_output:reshape(-1, n, self.dim):sum(1))
  self.grad_input = grad_output
  return grad_output
end

-- ---- containers -------------------------------------------------------------------

--- nn.Sequential(m1, m2, ...): m_n(...m_2(m_1(x))). Parameters: the
-- children's, in order.
local Sequential = class("Sequential", Module)

function Sequential:__init(...)
  Module.__init(self)
  self.modules = {}
  for i = 1, select("#", ...) do self:add((select(i, ...))) end
end

local function check_module(ctx, m, what)
  if type(m) ~= "table" or getmetatable(m) == nil or type(m.forward) ~= "function" then
    error(("%s: %s must be a module, got %s"):format(ctx, what, type(m)), 4)
  end
end

--- Appends a module; returns the container.
function Sequential:add(m)
  check_module("nn.Sequential", m, "child " .. (#self.modules + 1))
  self.modules[#self.modules + 1] = m
  return self
end

function Sequential:forward(input)
  local x = input
  for _, m in ipairs(self.modules) do x = m:forward(x) end
  self.output = x
  return x
end

function Sequential:backward(input, grad_output)
  self:check_backward(grad_output)
  local g = grad_output
  for i = #self.modules, 1, -1 do
    local x = i == 1 and input or self.modules[i - 1].output
    g = self.modules[i]:backward(x, g)
  end
  self.grad_input = g
  return g
end

function Sequential:describe()
  local flow = { "[input" }
  for i = 1, #self.modules do flow[#flow + 1] = "(" .. i .. ")" end
  flow[#flow + 1] = "output]"
  return describe_children(self, table.concat(flow, " -> "))
end

--- nn.Residual(f): x + f(x). Parameters: f's.
local Residual = class("Residual", Module)

function Residual:__init(f)
  Module.__init(self)
  check_module("nn.Residual", f, "the wrapped module")
  self.modules = { f }
end

function Residual:forward(x)
  self.output = x + self.modules[1]:forward(x)
  return self.output
end

function Residual:backward(x, grad_output)
  self:check_backward(grad_output)
  self.grad_input = grad_output + self.modules[1]:backward(x, grad_output)
  return self.grad_input
end

function Residual:describe()
  return describe_children(self, "[input -> (1) -> + input -> output]")
end

-- ---- attention ----------------------------------------------------------------------

--- ALiBi's slopes for n heads (Press, Smith, Lewis: "Train short, test
-- long", 2022): for a power of two, 2^(-8 i / n), i = 1..n; otherwise those
-- of the power of two below, then every other slope of twice that.
function nn.alibi_slopes(n)
  if not is_integer(n) or n < 1 then
    error("nn.alibi_slopes: n must be a positive integer, got " .. tostring(n), 2)
  end
  local function pow2(m)
    local r = {}
    for i = 1, m do r[i] = 2 ^ (-8 * i / m) end
    return r
  end
  local p = 1
  while p * 2 <= n do p = p * 2 end
  local r = pow2(p)
  local extra = pow2(2 * p)
  for i = 1, n - p do r[p + i] = extra[2 * i - 1] end
  return r
end

--- nn.MultiheadAttention{dim =, heads =, kv_heads = heads, causal = false,
-- bias = false, seed =, dtype =, device =, and the variants: window_left =,
-- window_right = (-1: unbounded), softcap = (0: off), alibi = false (true:
-- the ALiBi paper's slopes for the heads), sink = false (true: a learned
-- sink logit per head, a parameter starting at 0), dropout = 0 (attention
-- dropout while training: every forward draws a fresh mask, its backward
-- the same one)} on x [batch, seqlen, dim]: projections to q [B, N, heads,
-- d] and k, v [B, N, kv_heads, d] (d = dim / heads), ft.attention, and an
-- output projection.
--
-- With kv_heads == heads one Linear(dim, 3 dim) makes q, k and v together,
-- viewed [B, N, 3, H, d] and selected along dim 3 (no copies); with fewer
-- kv heads (GQA) a Linear(dim, dim) makes q and a Linear(dim, 2 kv_heads d)
-- makes k and v the same way. Parameters: those Linears' in order (qkv, out
-- or q, kv, out), each weight then bias. f64 on CUDA runs the naive
-- attention kernels (the flash ones take f32, f16 and bf16).
--- nn.Rotary{head_dim =, base = 10000}: rotary position embeddings
-- (RoFormer; the GPT-NeoX layout: the first and second halves of a head
-- are the pairs). rotate(x [B, N, heads, head_dim], pos0) turns pair i of
-- the row at position p = pos0 + n - 1 (n = 1..N) by the angle
-- p * base^(-2 (i - 1) / head_dim): x1 cos - x2 sin, x2 cos + x1 sin;
-- with inverse, the other way (the rotation's gradient). A fresh tensor.
-- MultiheadAttention{rotary = true} applies it to q and k, from the KV
-- cache's length when decoding. No parameters.
local Rotary = class("Rotary", Module)

function Rotary:__init(opts)
  Module.__init(self)
  local ctx = "nn.Rotary"
  local o = check_opts(ctx, opts or {}, { head_dim = false, base = 10000 })
  check_count(ctx, "head_dim", o.head_dim)
  if o.head_dim % 2 ~= 0 then
    error(("%s: head_dim must be even, got %d"):format(ctx, o.head_dim), 3)
  end
  if type(o.base) ~= "number" or not (o.base > 1) or o.base == math.huge then
    error(("%s: base must be a number above 1, got %s"):format(ctx, tostring(o.base)), 3)
  end
  self.head_dim, self.base = o.head_dim, o.base
  self.tables = {} -- "N pos0 dtype device" -> {cos, sin}
end

function Rotary:header()
  return ("(head_dim %d, base %s)"):format(self.head_dim, tostring(self.base))
end

--- cos and sin [1, N, 1, head_dim / 2] for positions pos0 .. pos0 + N - 1,
-- computed in f64 and kept per shape (at most 64 of them).
function Rotary:table_for(N, pos0, like)
  local key = ("%d %d %s %s"):format(N, pos0, like.dtype, like.device)
  local t = self.tables[key]
  if t then return t[1], t[2] end
  local half = self.head_dim / 2
  local c, s = {}, {}
  for n = 1, N do
    local cn, sn = {}, {}
    for i = 1, half do
      local angle = (pos0 + n - 1) * self.base ^ (-2 * (i - 1) / self.head_dim)
      cn[i], sn[i] = math.cos(angle), math.sin(angle)
    end
    c[n], s[n] = cn, sn
  end
  local o = { dtype = like.dtype, device = like.device }
  local cos = ft.tensor(c, { dtype = "f64" }):to(o):view(1, N, 1, half)
  local sin = ft.tensor(s, { dtype = "f64" }):to(o):view(1, N, 1, half)
  self.n_tables = (self.n_tables or 0) + 1
  if self.n_tables > 64 then self.tables, self.n_tables = {}, 1 end
  self.tables[key] = { cos, sin }
  return cos, sin
end

function Rotary:rotate(x, pos0, inverse)
  if not ft.is_tensor(x) or x:dim() ~= 4 or x:size(4) ~= self.head_dim then
    error(("nn.Rotary: x must be [batch, seqlen, heads, %d], got %s"):format(
      self.head_dim, ft.is_tensor(x) and shape_string(x.shape) or type(x)), 2)
  end
  pos0 = pos0 or 0
  if not is_integer(pos0) or pos0 < 0 then
    error(("nn.Rotary:rotate: pos0 (the first row's position) must be a whole number >= 0, got %s")
      :format(tostring(pos0)), 2)
  end
  local half = self.head_dim / 2
  local cos, sin = self:table_for(x:size(2), pos0, x)
  local shape = { x:size(1), x:size(2), x:size(3), half }
  cos, sin = cos:expand(shape), sin:expand(shape)
  if inverse then sin = -sin end
  local x1, x2 = x:narrow(4, 1, half), x:narrow(4, half + 1, half)
  local out = ft.empty(x.shape, { dtype = x.dtype, device = x.device })
  out:narrow(4, 1, half):copy(x1 * cos - x2 * sin)
  out:narrow(4, half + 1, half):copy(x2 * cos + x1 * sin)
  return out
end

function Rotary:forward(x)
  self.output = self:rotate(x, 0)
  return self.output
end

function Rotary:backward(x, grad_output)
  self:check_backward(grad_output)
  self.grad_input = self:rotate(grad_output, 0, true)
  return self.grad_input
end

--- nn.KVCache(model, {batch =, capacity =}): a key and value cache for
-- every MultiheadAttention in model, for decoding one step at a time:
--   local cache = nn.KVCache(model, {batch = 1, capacity = 256})
--   model:evaluate()
--   model:forward(prompt)          -- fills the caches (prefill)
--   model:forward(next_token)      -- attends over everything so far
-- While attached, each attention writes its new keys and values after the
-- cache's len rows and attends over all of them (causal), and rotary
-- embeddings and PositionalEmbedding rows start at len. cache.len counts the positions so far (the same
-- for every sequence of the batch); cache:reset() empties it, cache:detach()
-- gives the modules back their plain forward.
local KVCache = {}
KVCache.__index = KVCache

function KVCache:check(x, m)
  if x:size(1) ~= self.batch then
    error(("nn.KVCache: input batch %d, the cache holds %d sequences"):format(x:size(1), self.batch), 3)
  end
  if self.len + x:size(2) > self.capacity then
    error(("nn.KVCache: %d positions so far and %d new exceed the capacity %d"):format(
      self.len, x:size(2), self.capacity), 3)
  end
  if not self.k[m] then error("nn.KVCache: this attention is not in the cache's model", 3) end
end

--- After module m has appended n positions: the last attention of the model
-- moves len on.
function KVCache:advance(m, n)
  self.seen[m] = true
  local all = true
  for _, a in ipairs(self.modules) do all = all and self.seen[a] end
  if all then
    self.len, self.seen = self.len + n, {}
    self.lens:fill(self.len)
  end
end

function KVCache:reset()
  self.len, self.seen = 0, {}
  self.lens:fill(0)
  return self
end

function KVCache:detach()
  for _, list in ipairs { self.modules, self.positional } do
    for _, m in ipairs(list) do
      if m.cache == self then m.cache = nil end
    end
  end
  return self
end

function nn.KVCache(model, opts)
  local ctx = "nn.KVCache"
  local o = check_opts(ctx, opts or {}, { batch = false, capacity = false })
  check_count(ctx, "batch", o.batch)
  check_count(ctx, "capacity", o.capacity)
  if type(model) ~= "table" or type(model.find) ~= "function" then
    error(("%s: model must be an nn module, got %s"):format(ctx, type(model)), 2)
  end
  local modules = model:find("MultiheadAttention")
  if #modules == 0 then error(ctx .. ": the model has no MultiheadAttention", 2) end
  local self = setmetatable({ batch = o.batch, capacity = o.capacity, modules = modules,
                              k = {}, v = {}, len = 0, seen = {} }, KVCache)
  -- learned positions count on from len too
  self.positional = model:find("PositionalEmbedding")
  for _, m in ipairs(self.positional) do m.cache = self end
  for _, m in ipairs(modules) do
    local w = (m.qkv or m.q_proj).weight
    local shape = { o.batch, o.capacity, m.kv_heads, m.head_dim }
    self.k[m] = ft.zeros(shape, { dtype = w.dtype, device = w.device })
    self.v[m] = ft.zeros(shape, { dtype = w.dtype, device = w.device })
    m.cache = self
  end
  -- the lengths stay on the host: a CUDA call checks them there with no wait on the device
  self.lens = ft.zeros({ o.batch }, { dtype = "i32" })
  return self
end

local MultiheadAttention = class("MultiheadAttention", Module)

function MultiheadAttention:__init(opts)
  Module.__init(self)
  local ctx = "nn.MultiheadAttention"
  if type(opts) ~= "table" then
    error(ctx .. ": expected a table {dim =, heads =, ...}, got " .. type(opts), 3)
  end
  local o = check_opts(ctx, opts, { dim = false, heads = false, kv_heads = false, causal = false,
                                    bias = false, seed = false, dtype = false, device = false,
                                    window_left = -1, window_right = -1, softcap = 0,
                                    alibi = false, sink = false, dropout = 0, rotary = false,
                                    context_parallel = false })
  check_count(ctx, "dim", o.dim)
  check_count(ctx, "heads", o.heads)
  o.rotary = o.rotary or false
  if o.rotary ~= false and o.rotary ~= true and
     not (type(o.rotary) == "number" and o.rotary > 1 and o.rotary < math.huge) then
    error(("%s: option 'rotary' must be true, false or a base above 1 (true: 10000), got %s"):format(
      ctx, tostring(o.rotary)), 3)
  end
  for _, name in ipairs { "window_left", "window_right" } do
    if not is_integer(o[name]) or o[name] < -1 then
      error(("%s: option '%s' must be an integer, -1 (unbounded) or more, got %s"):format(
        ctx, name, tostring(o[name])), 3)
    end
  end
  if type(o.softcap) ~= "number" or not (o.softcap >= 0) or o.softcap == math.huge then
    error(("%s: option 'softcap' must be 0 (off) or a positive number, got %s"):format(
      ctx, tostring(o.softcap)), 3)
  end
  if type(o.dropout) ~= "number" or not (o.dropout >= 0 and o.dropout < 1) then
    error(("%s: option 'dropout' must be a number in [0, 1), got %s"):format(
      ctx, tostring(o.dropout)), 3)
  end
  o.alibi, o.sink = o.alibi or false, o.sink or false
  check_boolean(ctx, "alibi", o.alibi)
  check_boolean(ctx, "sink", o.sink)
  o.kv_heads = o.kv_heads or o.heads
  check_count(ctx, "kv_heads", o.kv_heads)
  if o.context_parallel then
    -- the input is this rank's zigzag shard of the sequence (ft.dist.shard)
    local comm = o.context_parallel
    if type(comm) ~= "userdata" or not pcall(function() return comm:ranks() end) then
      error(ctx .. ": option 'context_parallel' must be a communicator (ft.dist.init)", 3)
    end
    if #comm:ranks() ~= 1 then
      error(ctx .. ": context_parallel takes a communicator of one process per GPU "
        .. "(scripts/ftrun), not one driving several devices", 3)
    end
    if o.window_left ~= -1 or o.window_right ~= -1 or o.softcap ~= 0 or o.alibi or o.sink
       or o.dropout ~= 0 then
      error(ctx .. ": context_parallel (ring attention) takes causal or not, and rotary; not "
        .. "windows, softcap, alibi, sink or dropout", 3)
    end
    self.context_parallel = comm
  end
  o.causal = o.causal or false
  o.bias = o.bias or false
  check_boolean(ctx, "causal", o.causal)
  check_boolean(ctx, "bias", o.bias)
  if o.dim % o.heads ~= 0 then
    error(("%s: heads (%d) must divide dim (%d)"):format(ctx, o.heads, o.dim), 3)
  end
  if o.heads % o.kv_heads ~= 0 then
    error(("%s: kv_heads (%d) must divide heads (%d)"):format(ctx, o.kv_heads, o.heads), 3)
  end
  self.dim, self.heads, self.kv_heads = o.dim, o.heads, o.kv_heads
  self.head_dim, self.causal = math.floor(o.dim / o.heads), o.causal
  if o.rotary then
    if self.head_dim % 2 ~= 0 then
      error(("%s: rotary embeddings need an even head_dim, got %d"):format(ctx, self.head_dim), 3)
    end
    self.rotary = nn.Rotary { head_dim = self.head_dim, base = o.rotary == true and 10000 or o.rotary }
  end
  self.window_left, self.window_right, self.softcap = o.window_left, o.window_right, o.softcap
  self.dropout = o.dropout
  if o.alibi then self.alibi_slopes = nn.alibi_slopes(o.heads) end
  local seed = o.seed or next_seed()
  self.dropout_seed, self.dropout_offset = derive(seed, 4), 0
  if o.sink then
    self.sink = ft.zeros({ o.heads }, tensor_opts(o))
    self.grad_sink = ft.zeros({ o.heads }, tensor_opts(o))
    self:register("sink", "grad_sink")
  end
  local function lin(k, n_in, n_out)
    return Linear(n_in, n_out, { bias = o.bias, seed = derive(seed, k), dtype = o.dtype, device = o.device })
  end
  if self.kv_heads == self.heads then
    self.qkv = lin(1, o.dim, 3 * o.dim)
    self.out_proj = lin(2, o.dim, o.dim)
    self.modules = { self.qkv, self.out_proj }
  else
    self.q_proj = lin(1, o.dim, o.dim)
    self.kv_proj = lin(3, o.dim, 2 * self.kv_heads * self.head_dim)
    self.out_proj = lin(2, o.dim, o.dim)
    self.modules = { self.q_proj, self.kv_proj, self.out_proj }
  end
end

function MultiheadAttention:header()
  local parts = { "dim " .. self.dim, "heads " .. self.heads }
  if self.kv_heads ~= self.heads then parts[#parts + 1] = "kv_heads " .. self.kv_heads end
  if self.causal then parts[#parts + 1] = "causal" end
  if self.window_left >= 0 or self.window_right >= 0 then
    parts[#parts + 1] = ("window %d, %d"):format(self.window_left, self.window_right)
  end
  if self.softcap > 0 then parts[#parts + 1] = "softcap " .. self.softcap end
  if self.alibi_slopes then parts[#parts + 1] = "alibi" end
  if self.sink then parts[#parts + 1] = "sink" end
  if self.dropout > 0 then parts[#parts + 1] = "dropout " .. self.dropout end
  if self.rotary then parts[#parts + 1] = "rotary " .. self.rotary.base end
  return "(" .. table.concat(parts, ", ") .. ")"
end

function MultiheadAttention:describe()
  return describe_children(self)
end

--- q [B, N, H, d], k and v [B, N, Hk, d]: strided views of the projections.
function MultiheadAttention:project(x)
  local B, N, H, Hk, d = x:size(1), x:size(2), self.heads, self.kv_heads, self.head_dim
  if self.qkv then
    local qkv = self.qkv:forward(x):view(B, N, 3, H, d)
    return qkv:select(3, 1), qkv:select(3, 2), qkv:select(3, 3)
  end
  local q = self.q_proj:forward(x):view(B, N, H, d)
  local kv = self.kv_proj:forward(x):view(B, N, 2, Hk, d)
  return q, kv:select(3, 1), kv:select(3, 2)
end

--- ft.attention's options ("auto" picks the kernels for the device and
-- dtype: tiled on the CPU, flash on CUDA, naive for f64 and the variants
-- on CUDA so far). The forward draws dropout's next offset; the backward
-- reuses the forward's options.
function MultiheadAttention:attention_options(x)
  local stats = x.dtype == "f64" and "f64" or "f32" -- slopes and sinks: f32 or f64
  local o = { causal = self.causal, window_left = self.window_left,
              window_right = self.window_right, softcap = self.softcap }
  if self.alibi_slopes then
    o.alibi_slopes = ft.tensor(self.alibi_slopes, { dtype = stats, device = x.device })
  end
  if self.sink then o.sink = self.sink.dtype == stats and self.sink or self.sink:to(stats) end
  if self.dropout > 0 and self.training then
    o.dropout_p, o.seed, o.offset = self.dropout, self.dropout_seed, self.dropout_offset
    self.dropout_offset = (self.dropout_offset + 1) % 2 ^ 31
  end
  return o
end

--- q or k rotated at their positions: pos0 on; under context_parallel the
-- two chunks of this rank's zigzag shard at theirs.
function MultiheadAttention:rotate(t, pos0, inverse)
  local comm = self.context_parallel
  if not comm then return self.rotary:rotate(t, pos0, inverse) end
  local r, W, n = comm:rank(), comm:world_size(), t:size(2)
  local c = math.floor(n / 2)
  local out = ft.empty(t.shape, { dtype = t.dtype, device = t.device })
  out:narrow(2, 1, c):copy(self.rotary:rotate(t:narrow(2, 1, c), r * c, inverse))
  out:narrow(2, c + 1, c):copy(self.rotary:rotate(t:narrow(2, c + 1, c), (2 * W - 1 - r) * c, inverse))
  return out
end

function MultiheadAttention:forward(x)
  self:check_input(x)
  if x:dim() ~= 3 or x:size(3) ~= self.dim then
    error(("nn.MultiheadAttention: input %s must be [batch, seqlen, %d]"):format(
      shape_string(x.shape), self.dim), 2)
  end
  local q, k, v = self:project(x)
  local cache = self.cache
  if cache and self.training then
    error("nn.MultiheadAttention: a KV cache is for decoding: call evaluate() first (a cached "
          .. "forward has no backward)", 2)
  end
  if cache and self.context_parallel then
    error("nn.MultiheadAttention: context_parallel does not take a KV cache", 2)
  end
  local pos0 = cache and cache.len or 0
  if self.rotary then
    q, k = self:rotate(q, pos0), self:rotate(k, pos0)
  end
  local opts = self:attention_options(x)
  local out, lse
  if self.context_parallel then
    out, lse = self.context_parallel:ring_attention(q, k, v, { causal = self.causal })
  elseif cache then
    cache:check(x, self)
    opts.cache_seqlens, opts.k_new, opts.v_new = cache.lens, k, v
    out, lse = ft.attention(q, cache.k[self], cache.v[self], opts)
    cache:advance(self, x:size(2))
  else
    out, lse = ft.attention(q, k, v, opts)  -- [B, N, H, d], [B, H, N]
  end
  self.q, self.k, self.v, self.attn, self.lse, self.opts = q, k, v, out, lse, opts
  self.output = self.out_proj:forward(out:reshape(x:size(1), x:size(2), self.dim))
  return self.output
end

--- Copies tensors into selects of a zeros [B, N, #parts, heads, d] along
-- dim 3 and returns it as [B, N, #parts * heads * d].
local function pack(parts, B, N, heads, d, like)
  local packed = ft.zeros({ B, N, #parts, heads, d }, { dtype = like.dtype, device = like.device })
  for i, t in ipairs(parts) do packed:select(3, i):copy(t) end
  return packed:view(B, N, #parts * heads * d)
end

function MultiheadAttention:backward(x, grad_output)
  self:check_backward(grad_output)
  local B, N, H, Hk, d = x:size(1), x:size(2), self.heads, self.kv_heads, self.head_dim
  local dattn = self.out_proj:backward(self.attn:reshape(B, N, self.dim), grad_output)
  local dq, dk, dv, dsink
  if self.context_parallel then
    dq, dk, dv = self.context_parallel:ring_attention_backward(dattn:reshape(B, N, H, d), self.q,
      self.k, self.v, self.attn, self.lse, { causal = self.causal })
  else
    dq, dk, dv, dsink = ft.attention_backward(dattn:reshape(B, N, H, d), self.q, self.k,
                                              self.v, self.attn, self.lse, self.opts)
  end
  if dsink then self.grad_sink:copy(self.grad_sink + dsink:to(self.grad_sink.dtype)) end
  if self.rotary then -- the rotation's gradient: the inverse rotation
    dq, dk = self:rotate(dq, 0, true), self:rotate(dk, 0, true)
  end
  if self.qkv then
    self.grad_input = self.qkv:backward(x, pack({ dq, dk, dv }, B, N, H, d, x))
  else
    local gq = self.q_proj:backward(x, dq:reshape(B, N, self.dim))
    self.grad_input = gq + self.kv_proj:backward(x, pack({ dk, dv }, B, N, Hk, d, x))
  end
  return self.grad_input
end

-- ---- the transformer block ----------------------------------------------------------

--- nn.TransformerBlock{dim =, heads =, kv_heads = heads, causal = false,
-- hidden = 4 dim, norm = "rms" | "layer", eps =, bias = false (attention
-- projections), seed =, dtype =, device =, and MultiheadAttention's
-- variants: window_left, window_right, softcap, alibi, sink, dropout}: pre-norm,
--   x = x + attn(norm1(x));  x = x + mlp(norm2(x)),  mlp = Linear-GELU-Linear.
-- A Sequential of two Residuals: parameters in that order (norm1, attn,
-- norm2, the two MLP Linears).
local TransformerBlock = class("TransformerBlock", Sequential)

function TransformerBlock:__init(opts)
  local ctx = "nn.TransformerBlock"
  if type(opts) ~= "table" then
    error(ctx .. ": expected a table {dim =, heads =, ...}, got " .. type(opts), 3)
  end
  local o = check_opts(ctx, opts, { dim = false, heads = false, kv_heads = false, causal = false,
                                    hidden = false, norm = "rms", eps = false, bias = false,
                                    seed = false, dtype = false, device = false,
                                    window_left = false, window_right = false, softcap = false,
                                    alibi = false, sink = false, dropout = false, rotary = false,
                                    context_parallel = false })
  check_count(ctx, "dim", o.dim)
  o.hidden = o.hidden or 4 * o.dim
  check_count(ctx, "hidden", o.hidden)
  if o.norm ~= "rms" and o.norm ~= "layer" then
    error(("%s: option 'norm' must be \"rms\" or \"layer\", got %s"):format(ctx, tostring(o.norm)), 3)
  end
  local seed = o.seed or next_seed()
  local t = { dtype = o.dtype, device = o.device }
  local function norm()
    local Norm = o.norm == "rms" and RMSNorm or LayerNorm
    return Norm(o.dim, { eps = o.eps, dtype = o.dtype, device = o.device })
  end
  local attn = MultiheadAttention { dim = o.dim, heads = o.heads, kv_heads = o.kv_heads,
                                    causal = o.causal, bias = o.bias, seed = derive(seed, 1),
                                    dtype = t.dtype, device = t.device,
                                    window_left = o.window_left, window_right = o.window_right,
                                    softcap = o.softcap, alibi = o.alibi, sink = o.sink,
                                    dropout = o.dropout, rotary = o.rotary,
                                    context_parallel = o.context_parallel }
  local mlp = Sequential(
    norm(),
    Linear(o.dim, o.hidden, { seed = derive(seed, 2), dtype = t.dtype, device = t.device }),
    GELU(),
    Linear(o.hidden, o.dim, { seed = derive(seed, 3), dtype = t.dtype, device = t.device }))
  Sequential.__init(self, Residual(Sequential(norm(), attn)), Residual(mlp))
  self.dim, self.hidden = o.dim, o.hidden
end

function TransformerBlock:header()
  return ("(dim %d, hidden %d)"):format(self.dim, self.hidden)
end

-- ---- losses -------------------------------------------------------------------------

--- nn.CrossEntropy(): forward(logits [N, C], targets [N] i64 1-based) ->
-- the mean of -log softmax(logits)[target] as a number; backward(logits,
-- targets) -> grad logits [N, C] = (softmax - onehot) / N. Like torch7's
-- criteria, backward takes the targets, not a grad_output.
local CrossEntropy = class("CrossEntropy", Module)

function CrossEntropy:check(logits, targets)
  self:check_input(logits, "logits")
  if logits:dim() ~= 2 then
    error(("nn.CrossEntropy: logits %s must be [N, classes]"):format(shape_string(logits.shape)), 3)
  end
  if not ft.is_tensor(targets) or (targets.dtype ~= "i64" and targets.dtype ~= "i32") then
    error("nn.CrossEntropy: targets must be an i64 (or i32) tensor of 1-based classes", 3)
  end
  local N, C = logits:size(1), logits:size(2)
  if targets:dim() ~= 1 or targets:size(1) ~= N then
    error(("nn.CrossEntropy: targets %s must be [%d], one per row of the logits"):format(
      shape_string(targets.shape), N), 3)
  end
  local lo, hi = targets:min(), targets:max()
  if lo < 1 or hi > C then
    error(("nn.CrossEntropy: targets must be 1 to %d, got %d to %d"):format(C, lo, hi), 3)
  end
end

--- Positions of logits[i, targets[i]] in the flattened logits (1-based).
local function target_positions(targets, C, device)
  local N = targets:size(1)
  local t = targets:to({ dtype = "i64", device = device })
  return ft.arange(0, N * C, C, { dtype = "i64", device = device }) + t
end

function CrossEntropy:forward(logits, targets)
  self:check(logits, targets)
  local C = logits:size(2)
  -- log softmax, shifted by the row max so that exp cannot overflow
  local shifted = logits - bcast(logits:max(2, true), logits)
  local logp = shifted - bcast(shifted:exp():sum(2, true):log(), logits)
  self.logp = logp
  self.positions = target_positions(targets, C, logits.device)
  self.output = -logp:reshape(-1):index_select(1, self.positions):mean()
  return self.output
end

function CrossEntropy:backward(logits, targets)
  local N = logits:size(1)
  local p = self.logp:exp()                     -- softmax, a fresh contiguous tensor
  local minus_one = ft.full({ N }, -1, { dtype = p.dtype, device = p.device })
  p:view(-1):index_add(1, self.positions, minus_one)
  self.grad_input = p / N
  return self.grad_input
end

return nn
