--- Finite-difference gradient checks in f64, in the manner of torch's
-- gradcheck and nn.Jacobian.
--
--   local gradcheck = require "flashtile.gradcheck"
--   local ok, report = gradcheck.check(forward, backward, {q, k, v})
--
-- forward(x1, x2, ...) returns one tensor y. backward(dy, x1, x2, ...)
-- returns the gradients of sum(y * dy) with respect to each input (nil for
-- an input not to check). Inputs must be f64 tensors; they are perturbed in
-- place, one element at a time, and restored.
--
-- The full check builds both Jacobians column by column: the numeric one
-- from central differences (two forward calls per input element), the
-- analytic one from one backward call per output element with a one-hot
-- dy. `fast = true` instead compares one random projection (a random dy),
-- which needs a single backward call and suits larger shapes.
--
-- Returns true, report when every entry satisfies
--   |analytic - numeric| <= atol + rtol * |numeric|,
-- else false and a message naming the worst entry: which input, which
-- index, which output element, both values. report.worst holds the same.
local ft = require "flashtile"
local unpack = table.unpack or unpack -- 5.1 and LuaJIT: the global

local gradcheck = {}

local defaults = { eps = 1e-6, atol = 1e-5, rtol = 1e-3, fast = false, seed = 1 }

--- The 1-based multi-index of linear (0-based, row-major) position n.
local function unravel(shape, n)
  local idx = {}
  for d = #shape, 1, -1 do
    idx[d] = n % shape[d] + 1
    n = math.floor(n / shape[d])
  end
  return idx
end

--- t[idx] = v (idx a list of 1-based indices).
local function set_at(t, idx, v)
  local args = { unpack(idx) }
  args[#args + 1] = v
  t:set(unpack(args))
end

local function index_string(idx)
  return "[" .. table.concat(idx, ", ") .. "]"
end

-- Errors name the caller's line: `level` is the stack level of the user's
-- call (check and assert both pass their own).
local function check_inputs(inputs, level)
  if type(inputs) ~= "table" or #inputs == 0 then
    error("gradcheck: inputs must be a list of tensors", level + 1)
  end
  for i, x in ipairs(inputs) do
    if not ft.is_tensor(x) then
      error(("gradcheck: input %d is a %s, not a tensor"):format(i, type(x)), level + 1)
    end
    if x.dtype ~= "f64" then
      error(("gradcheck: input %d is %s; finite differences need f64 (x:double())"):format(i, x.dtype),
            level + 1)
    end
  end
end

--- sum(y * dy) in f64.
local function project(y, dy)
  return (y:double() * dy):sum()
end

--- Numeric d/dx_i of f at every element of input i, as a function of the
-- element (cached per call).
local function numeric_column(forward, inputs, i, n, eps, dy)
  local x = inputs[i]
  local idx = unravel(x.shape, n)
  local orig = x:get(unpack(idx))
  set_at(x, idx, orig + eps)
  -- a copy: forward may return its input or a view of it, which the next
  -- perturbation would change under our feet
  local yp = forward(unpack(inputs)):clone()
  set_at(x, idx, orig - eps)
  local ym = forward(unpack(inputs)):clone()
  set_at(x, idx, orig)
  if dy then return (project(yp, dy) - project(ym, dy)) / (2 * eps), idx end
  return (yp:double() - ym:double()) / (2 * eps), idx
end

local function run_check(forward, backward, inputs, opts, level)
  if type(forward) ~= "function" then error("gradcheck: forward must be a function", level + 1) end
  if type(backward) ~= "function" then error("gradcheck: backward must be a function", level + 1) end
  check_inputs(inputs, level + 1)
  if opts ~= nil and type(opts) ~= "table" then error("gradcheck: opts must be a table", level + 1) end
  local o = {}
  for k, v in pairs(defaults) do o[k] = v end
  for k, v in pairs(opts or {}) do
    if defaults[k] == nil then error(("gradcheck: unknown option '%s'"):format(k), level + 1) end
    o[k] = v
  end

  local y = forward(unpack(inputs))
  if not ft.is_tensor(y) then error("gradcheck: forward must return a tensor", level + 1) end
  local worst = { err = -1 }
  local failures = 0
  local function compare(a, num, i, idx, out_idx)
    local err = math.abs(a - num)
    local bad = not (err <= o.atol + o.rtol * math.abs(num))
    if bad then failures = failures + 1 end
    local score = err / (o.atol + o.rtol * math.abs(num))
    if score ~= score then score = math.huge end
    if score > (worst.score or -1) then
      worst = { score = score, err = err, input = i, index = idx, output = out_idx,
                analytic = a, numeric = num }
    end
  end

  if o.fast then
    local dy = ft.randn(y.shape, { dtype = "f64", seed = o.seed })
    local grads = { backward(dy, unpack(inputs)) }
    for i, x in ipairs(inputs) do
      local g = grads[i]
      if g then
        for n = 0, x:numel() - 1 do
          local num, idx = numeric_column(forward, inputs, i, n, o.eps, dy)
          compare(g:get(unpack(idx)), num, i, idx, nil)
        end
      end
    end
  else
    -- analytic Jacobian rows: one backward per output element
    local analytic = {} -- analytic[out_n][i] = gradient tensor
    for m = 0, y:numel() - 1 do
      local dy = ft.zeros(y.shape, { dtype = "f64" })
      if y:dim() > 0 then set_at(dy, unravel(y.shape, m), 1) else dy:fill(1) end
      analytic[m] = { backward(dy, unpack(inputs)) }
    end
    for i, x in ipairs(inputs) do
      if analytic[0] == nil or analytic[0][i] then
        for n = 0, x:numel() - 1 do
          local col, idx = numeric_column(forward, inputs, i, n, o.eps)
          for m = 0, y:numel() - 1 do
            local out_idx = unravel(y.shape, m)
            local num = y:dim() > 0 and col:get(unpack(out_idx)) or col:item()
            compare(analytic[m][i]:get(unpack(idx)), num, i, idx, out_idx)
          end
        end
      end
    end
  end

  local report = { ok = failures == 0, failures = failures, worst = worst }
  if failures == 0 then return true, report end
  local msg = ("gradcheck: %d entr%s out of tolerance; worst: input %d at %s"):format(
    failures, failures == 1 and "y" or "ies", worst.input, index_string(worst.index))
  if worst.output then msg = msg .. (", output %s"):format(index_string(worst.output)) end
  msg = msg .. (": analytic %.10g, numeric %.10g (|diff| %.3g, atol %g, rtol %g)"):format(
    worst.analytic, worst.numeric, worst.err, o.atol, o.rtol)
  report.message = msg
  return false, report
end

function gradcheck.check(forward, backward, inputs, opts)
  -- not a tail call: the error levels count this frame
  local ok, report = run_check(forward, backward, inputs, opts, 2)
  return ok, report
end

--- Like check, but raises the message on failure; returns the report.
function gradcheck.assert(forward, backward, inputs, opts)
  local ok, report = run_check(forward, backward, inputs, opts, 2)
  if not ok then error(report.message, 2) end
  return report
end

return gradcheck
