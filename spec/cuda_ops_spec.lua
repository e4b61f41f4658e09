-- Tensor operations on CUDA (tag #gpu) against the same operations on the
-- CPU, on fresh random inputs and on strided views. Pending, with the
-- reason, where there is no GPU.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local function same(cpu, gpu, tol, what)
  assert.are.equal("cpu", cpu.device)
  assert.are.equal("cuda:0", gpu.device)
  assert.are.same(cpu.shape, gpu.shape)
  assert.are.equal(cpu.dtype, gpu.dtype)
  local d = ft.max_abs_diff(cpu, gpu:cpu())
  assert.is_true(d <= (tol or 0), ("%s: |cpu - gpu| = %g"):format(what or "", d))
end

local FLOATS = { "f64", "f32", "f16", "bf16" }

describe("tensor operations on CUDA #gpu", function()
  gpu_it("casts between every pair of dtypes match the cpu's, strided views included", function()
    local src = ft.randn({ 6, 7 }, { dtype = "f64", seed = h.next_seed() }) * 100
    for _, from in ipairs { "f64", "f32", "f16", "bf16", "i32", "i64" } do
      local a = src:to(from)
      local g = a:cuda()
      for _, to in ipairs { "f64", "f32", "f16", "bf16", "i32", "i64" } do
        same(a:to(to), g:to(to), 0, from .. " -> " .. to)
        same(a:transpose():to(to), g:transpose():to(to), 0, from .. " -> " .. to .. " (transposed)")
      end
    end
  end)

  gpu_it("copy into a strided view on the GPU, fill, get and set", function()
    local a = ft.randn({ 5, 6 }, { dtype = "f32", seed = h.next_seed() })
    local g = a:cuda()
    local view = g:narrow(2, 2, 3)
    view:copy(ft.ones(5, 3))
    a:narrow(2, 2, 3):copy(ft.ones(5, 3))
    same(a, g, 0, "copy into a view")
    g:select(1, 2):fill(7)
    a:select(1, 2):fill(7)
    same(a, g, 0, "fill a row")
    g:set(5, 6, -3.5)
    assert.are.equal(-3.5, g:get(5, 6))
  end)

  gpu_it("elementwise ops and scalars", function()
    for _, dtype in ipairs(FLOATS) do
      local a = ft.rand({ 4, 9 }, { dtype = dtype, seed = h.next_seed() }) + 0.5
      local b = ft.randn({ 9, 4 }, { dtype = dtype, seed = h.next_seed() }):transpose()
      local ga, gb = a:cuda(), b:cuda()
      local tol = (dtype == "f64" or dtype == "f32") and 1e-6 or 1e-2
      same(a + b, ga + gb, tol, dtype .. " +")
      same(a - b, ga - gb, tol, dtype .. " -")
      same(a * b, ga * gb, tol, dtype .. " *")
      same(a / b:abs(), ga / gb:abs(), tol * 10, dtype .. " /")
      same(2 - a, 2 - ga, tol, dtype .. " 2 - a")
      same(-a, -ga, 0, dtype .. " neg")
      for _, f in ipairs { "exp", "log", "abs", "sqrt", "tanh", "sigmoid", "relu" } do
        same(a[f](a), ga[f](ga), tol, dtype .. " " .. f)
      end
    end
  end)

  gpu_it("reductions over everything and along a dim, softmax", function()
    local a = ft.randn({ 7, 300 }, { dtype = "f32", seed = h.next_seed() })
    local g = a:cuda()
    for _, f in ipairs { "sum", "mean", "max", "min", "norm" } do
      assert.is_true(math.abs(a[f](a) - g[f](g)) <= 1e-4 * (1 + math.abs(a[f](a))), f)
      same(a[f](a, 2), g[f](g, 2), 1e-4, f .. " along dim 2")
      same(a[f](a, 1, true), g[f](g, 1, true), 1e-4, f .. " along dim 1, keepdim")
    end
    local _, ia = a:max(2)
    local _, ig = g:max(2)
    same(ia, ig, 0, "max positions")
    same(a:softmax(2), g:softmax(2), 1e-6, "softmax")
  end)

  gpu_it("matmul through cuBLAS, 2-d and batched, transposed operands", function()
    for _, dtype in ipairs(FLOATS) do
      local a = ft.randn({ 3, 40, 50 }, { dtype = dtype, seed = h.next_seed() })
      local b = ft.randn({ 3, 60, 50 }, { dtype = dtype, seed = h.next_seed() }):transpose(2, 3)
      local tol = ({ f64 = 1e-10, f32 = 1e-3, f16 = 0.1, bf16 = 0.5 })[dtype]
      same(ft.matmul(a, b), ft.matmul(a:cuda(), b:cuda()), tol, dtype .. " batched")
      same(ft.matmul(a:select(1, 1), b:select(1, 2)),
        ft.matmul(a:select(1, 1):cuda(), b:select(1, 2):cuda()), tol, dtype .. " 2-d")
      -- an empty inner dim sums nothing: zeros
      local e = ft.matmul(ft.ones({ 2, 5, 0 }, { dtype = dtype, device = "cuda" }),
        ft.ones({ 2, 0, 7 }, { dtype = dtype, device = "cuda" }))
      same(ft.zeros({ 2, 5, 7 }, { dtype = dtype }), e, 0, dtype .. " inner dim 0")
    end
  end)

  gpu_it("comparisons, printing and files of device tensors", function()
    local a = ft.randn({ 3, 4 }, { seed = h.next_seed() })
    local g = a:cuda()
    assert.are.equal(0, ft.max_abs_diff(g, a:cuda()))
    assert.is_true(ft.allclose(g, (a + 1e-9):cuda()))
    local s = tostring(g)
    assert.is_truthy(s:find("[flashtile.Tensor f32 cuda:0 {3, 4}]", 1, true), s)
    assert.are.equal(tostring(a):gsub("cpu", "cuda:0"), s)
    local path = os.tmpname()
    g:save(path)
    same(a, ft.load(path):cuda(), 0, "npy")
    os.remove(path)
  end)

  gpu_it("running out of device memory is an error, and the session goes on", function()
    collectgarbage() -- the failed allocation collects garbage before its retry
    local before = ft.memory_stats("cuda").in_use
    local msg = h.error_of(function() return ft.empty(2^20, 2^20, { device = "cuda" }) end)
    assert.is_truthy(msg:find("out of memory", 1, true), msg)
    assert.are.equal(before, ft.memory_stats("cuda").in_use)
    local z = ft.ones(4, { device = "cuda" })
    assert.are.equal(4, z:sum())
  end)

  gpu_it("a CUDA event pair times GPU work", function()
    local a = ft.randn({ 512, 512 }, { device = "cuda", seed = 1 })
    local start, stop = ft.cuda.Event(), ft.cuda.Event()
    start:record()
    for _ = 1, 10 do ft.matmul(a, a) end
    stop:record()
    local ms = start:elapsed(stop)
    assert.is_true(ms > 0 and ms < 1e4, tostring(ms))
    local bench = require "flashtile.bench"
    local r = bench.run(function() ft.matmul(a, a) end, { warmup = 2, reps = 5, device = "cuda" })
    assert.is_true(r.min > 0 and r.min <= r.median and r.median <= r.max)
  end)
end)
