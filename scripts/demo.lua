-- flashtile's main job script. For now: a short tour of the tensors that
-- the attention kernels will take, run on the CPU.
local ft = require "flashtile"

local function section(title) print(("\n== %s =="):format(title)) end

section("creation")
local q = ft.randn({2, 4, 3}, {dtype = "f64", seed = 42})
print("q = ft.randn({2, 4, 3}, {dtype = 'f64', seed = 42})")
print(q)

section("views share storage")
local qt = q:transpose(2, 3)
print("q:transpose(2, 3) is a view:", qt:is_same_storage(q), "contiguous:", qt:is_contiguous())
qt:set(1, 1, 1, 100)
print("after qt:set(1, 1, 1, 100), q:get(1, 1, 1) =", q:get(1, 1, 1))

section("dtypes")
local x = ft.tensor({1/3, 65519, 1e-8, -2.5}, {dtype = "f64"})
print("f64 ", x)
print("f16 ", x:half())
print("bf16", x:bf16())

section("arithmetic and reductions")
local a = ft.arange(6, {dtype = "f64"}):view(2, 3)
print("a = ", a)
print("a * 2 + 1 =", a * 2 + 1)
print("a:sum() =", a:sum(), " a:sum(2) =", a:sum(2))
print("softmax(a, 2) =", a:softmax(2))
print("a @ a^T =", ft.matmul(a, a:transpose()))

section("attention scores by hand (the naive path the kernels will beat)")
local B, N, d = 2, 128, 64
local Q = ft.randn({B, N, d}, {seed = 1})
local K = ft.randn({B, N, d}, {seed = 2})
local V = ft.randn({B, N, d}, {seed = 3})
ft.reset_peak_memory()
local before = ft.memory_stats().in_use
local t0 = os.clock()
local S = ft.matmul(Q, K:transpose(2, 3)) * (1 / math.sqrt(d))
local P = S:softmax(3)
local O = ft.matmul(P, V)
local ms = (os.clock() - t0) * 1e3
local stats = ft.memory_stats()
print(("O = softmax(Q K^T / sqrt(d)) V for B=%d N=%d d=%d: %.2f ms, peak extra memory %.1f KiB")
      :format(B, N, d, ms, (stats.peak - before) / 1024))
print(("the N x N scores alone take %.1f KiB per batch: what the tiled kernels avoid")
      :format(N * N * 4 / 1024))
print("O:", O:size(1), O:size(2), O:size(3), " max |O| =", O:abs():max())

section("files")
local path = os.tmpname()
O:save(path)
local back = ft.load(path)
print("saved and loaded", path, "max |diff| =", ft.max_abs_diff(O, back))
os.remove(path)
print("\nran on: cpu")
