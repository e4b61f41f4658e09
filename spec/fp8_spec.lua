-- fp8_e4m3, the storage dtype: its 256 bit patterns, rounding to nearest
-- even with saturation at 448, conversions from and to every dtype, views
-- and copies, printing, .npy and .safetensors files, and the refusal of
-- arithmetic. The CUDA cases (tag #gpu) compare with the CPU.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local inf, nan = math.huge, 0 / 0
-- -0.0 computed, not written (Lua 5.1 folds a literal -0.0 into 0)
local neg_zero = -1 / inf

local function is_nan(x) return x ~= x end
local function is_neg_zero(x) return x == 0 and 1 / x == -inf end
local function is_pos_zero(x) return x == 0 and 1 / x == inf end

local FP8 = "fp8_e4m3"
local MAX = 448

--- The value of an e4m3 bit pattern (0..255), decoded in plain Lua: bias
-- 7, no infinities, S.1111.111 NaN.
local function decode(bits)
  local sign = bits >= 128 and -1 or 1
  local mag = bits % 128
  if mag == 127 then return nan end
  local e, m = math.floor(mag / 8), mag % 8
  local v = e == 0 and m * 2 ^ -9 or (8 + m) * 2 ^ (e - 10)
  return sign * v
end

--- A .npy file's bytes holding the given fp8 bytes as flashtile writes
-- them (a one-field structured descr, see lib/npy.c).
local function fp8_npy(bytes, descr)
  descr = descr or "[('fp8_e4m3', '|u1')]"
  return h.npy_bytes(("{'descr': %s, 'fortran_order': False, 'shape': (%d,), }"):format(descr, #bytes),
    bytes)
end

--- An fp8 tensor holding the given bytes, loaded from a .npy file.
local function from_bits(bytes)
  local path = os.tmpname()
  h.write_file(path, fp8_npy(bytes))
  local t = ft.load(path)
  os.remove(path)
  return t
end

--- x stored into an fp8 tensor by set (ft.tensor) and by a copy from f64
-- (t:to); both must agree. Returns the value read back.
local function convert(x)
  local a = ft.tensor({ x }, { dtype = FP8 }):get(1)
  local b = ft.tensor({ x }, { dtype = "f64" }):to(FP8):get(1)
  assert.is_true(a == b or (a ~= a and b ~= b),
    ("set gives %.17g, copy gives %.17g for %.17g"):format(a, b, x))
  return a
end

local ALL_BYTES
do
  local c = {}
  for b = 0, 255 do c[#c + 1] = string.char(b) end
  ALL_BYTES = table.concat(c)
end

describe("fp8_e4m3", function()
  describe("the dtype", function()
    it("is listed, named, and has aliases", function()
      local listed = false
      for _, d in ipairs(ft.dtypes) do listed = listed or d == FP8 end
      assert.is_true(listed, "ft.dtypes lacks fp8_e4m3")
      for _, alias in ipairs { FP8, "float8_e4m3fn", "e4m3" } do
        assert.are.equal(FP8, ft.zeros(2, { dtype = alias }).dtype, alias)
        assert.are.equal(FP8, ft.ones(2):to(alias).dtype, alias)
        assert.are.equal(FP8, ft.ones(2):to { dtype = alias }.dtype, alias)
      end
      h.assert_error(function() return ft.ones(1):to("fp8") end, "fp8_e4m3")
    end)

    it("holds one byte an element", function()
      local t = ft.ones(3, 5, { dtype = FP8 })
      assert.are.equal(15, #h.saved_bytes(t))
      assert.are.equal(string.rep("\56", 15), h.saved_bytes(t)) -- 1.0 is 0.0111.000
    end)
  end)

  describe("bit patterns", function()
    it("decodes all 256 as the format says", function()
      local got = from_bits(ALL_BYTES):totable()
      for b = 0, 255 do
        local want = decode(b)
        if is_nan(want) then
          assert.is_true(is_nan(got[b + 1]), ("pattern %d is NaN"):format(b))
        else
          assert.are.equal(want, got[b + 1], ("pattern %d"):format(b))
          if b == 128 then assert.is_true(is_neg_zero(got[b + 1])) end
        end
      end
      assert.are.equal(MAX, got[0x7e + 1])
      assert.are.equal(-MAX, got[0xfe + 1])
      assert.are.equal(2 ^ -9, got[2])
      assert.are.equal(2 ^ -6, got[9])
    end)

    it("round trips all 256 through f32 (and f64, f16, bf16) bit for bit, NaN staying NaN", function()
      local t = from_bits(ALL_BYTES)
      for _, via in ipairs { "f32", "f64", "f16", "bf16" } do
        local back = h.saved_bytes(t:to(via):to(FP8))
        for b = 0, 255 do
          local got = back:byte(b + 1)
          if b % 128 == 127 then
            assert.are.equal(127, got % 128, ("NaN pattern %d through %s gives %d"):format(b, via, got))
          else
            assert.are.equal(b, got, ("pattern %d through %s"):format(b, via))
          end
        end
      end
      assert.are.equal(ALL_BYTES, h.saved_bytes(t:clone()))
    end)
  end)

  describe("rounding", function()
    it("is exact for representable values", function()
      for _, x in ipairs { 1, -1, 0.5, 1.125, 1.25, 1.875, 3.5, 240, 256, 288, 416, 448, -448,
                           2 ^ -6, 2 ^ -9, 7 * 2 ^ -9, 0.013671875 } do
        assert.are.equal(x, convert(x))
      end
    end)

    it("rounds to nearest, ties to even", function()
      assert.are.equal(1, convert(1.0625))        -- tie between 1 (even) and 1.125
      assert.are.equal(1.25, convert(1.1875))     -- tie between 1.125 and 1.25 (even)
      assert.are.equal(1.125, convert(1.0625 + 2 ^ -30)) -- just above the tie
      assert.are.equal(-1, convert(-1.0625))
      assert.are.equal(16, convert(17))           -- spacing 2 in [16, 32)
      assert.are.equal(20, convert(19))           -- 18 odd, 20 even
      assert.are.equal(0.1015625, convert(0.1))
      assert.are.equal(448, convert(432))         -- between 416 (odd) and 448 (even)
    end)

    it("rounds every midpoint between neighbours to the even one", function()
      local mids, want = {}, {}
      for b = 0, 125 do -- up to 448's predecessor
        local lo, hi = decode(b), decode(b + 1)
        local even = b % 2 == 0 and lo or hi
        mids[#mids + 1], want[#want + 1] = (lo + hi) / 2, even
        mids[#mids + 1], want[#want + 1] = -(lo + hi) / 2, -even
      end
      local got = ft.tensor(mids, { dtype = "f64" }):to(FP8):totable()
      for i, x in ipairs(mids) do
        assert.are.equal(want[i], got[i], ("the tie %.17g"):format(x))
      end
      assert.are.same(got, ft.tensor(mids, { dtype = FP8 }):totable())
    end)

    it("rounds at the subnormal boundary", function()
      assert.is_true(is_pos_zero(convert(2 ^ -10)))   -- half the smallest subnormal: to 0 (even)
      assert.are.equal(2 ^ -9, convert(2 ^ -10 + 2 ^ -40))
      assert.are.equal(2 ^ -8, convert(3 * 2 ^ -10))  -- between 1 and 2 subnormal steps: 2 (even)
      assert.are.equal(2 ^ -6, convert(7.5 * 2 ^ -9)) -- largest subnormal to smallest normal
      assert.is_true(is_neg_zero(convert(-(2 ^ -10))))
      assert.is_true(is_pos_zero(convert(1e-300)))
      assert.is_true(is_pos_zero(convert(4.9e-324)))  -- a subnormal double
    end)

    it("saturates finite values past 448 and makes inf and NaN NaN", function()
      assert.are.equal(MAX, convert(448))
      assert.are.equal(MAX, convert(464))   -- the tie with the NaN pattern's place
      assert.are.equal(MAX, convert(465))
      assert.are.equal(MAX, convert(480))
      assert.are.equal(MAX, convert(1e6))
      assert.are.equal(MAX, convert(1.7e308))
      assert.are.equal(-MAX, convert(-464))
      assert.are.equal(-MAX, convert(-1e30))
      assert.is_true(is_nan(convert(inf)))
      assert.is_true(is_nan(convert(-inf)))
      assert.is_true(is_nan(convert(nan)))
      -- the bits: 0x7e / 0xfe for the saturated values, S.1111.111 for NaN
      local bytes = h.saved_bytes(ft.tensor({ 1e6, -1e6, inf, -inf }, { dtype = "f64" }):to(FP8))
      assert.are.equal("\126\254\127\255", bytes)
    end)

    it("keeps the sign of zero", function()
      assert.is_true(is_neg_zero(convert(neg_zero)))
      assert.is_true(is_pos_zero(convert(0)))
      assert.are.equal("\0\128", h.saved_bytes(ft.tensor({ 0, neg_zero }, { dtype = FP8 })))
    end)
  end)

  describe("conversions", function()
    local vals = { 0, 1, -2, 0.1, 3.3, -17.5, 100, 300, -1000, 2 ^ -8, 5e-4, 470 }

    it("from f64, f32, f16 and bf16, rounded once from the source's value", function()
      for _, from in ipairs { "f64", "f32", "f16", "bf16" } do
        local src = ft.tensor(vals, { dtype = from })
        local want = {}
        for i, v in ipairs(src:totable()) do want[i] = convert(v) end
        assert.are.same(want, src:to(FP8):totable(), from)
        assert.are.same(want, ft.zeros(#vals, { dtype = FP8 }):copy(src):totable(), from .. " (copy)")
      end
    end)

    it("from i32 and i64, through double", function()
      local ints = { 0, 1, -3, 17, 19, -300, 1000, 2147483647 }
      local want = { 0, 1, -3, 16, 20, -288, 448, 448 }
      assert.are.same(want, ft.tensor(ints, { dtype = "i32" }):to(FP8):totable())
      assert.are.same(want, ft.tensor(ints, { dtype = "i64" }):to(FP8):totable())
      assert.are.equal(-448, ft.tensor({ -2 ^ 62 }, { dtype = "i64" }):to(FP8):item())
    end)

    it("to every dtype: exactly to the floats, truncated and NaN as 0 to the integers", function()
      local t = from_bits(ALL_BYTES)
      local values = t:totable()
      for _, to in ipairs { "f64", "f32", "f16", "bf16" } do
        local got = t:to(to):totable()
        for i, v in ipairs(values) do
          assert.is_true(got[i] == v or (is_nan(v) and is_nan(got[i])), to .. " " .. i)
        end
      end
      for _, to in ipairs { "i32", "i64" } do
        local got = t:to(to):totable()
        for i, v in ipairs(values) do
          local want = is_nan(v) and 0 or (v < 0 and math.ceil(v) or math.floor(v))
          assert.are.equal(want, got[i], to .. " " .. i)
        end
      end
      assert.are.same({ 1.5, -448 }, ft.tensor({ 1.5, -1e9 }, { dtype = FP8 }):float():totable())
    end)

    it("fill and set convert as copies do", function()
      local t = ft.zeros(2, 3, { dtype = FP8 })
      t:fill(1.0625)
      assert.are.same({ { 1, 1, 1 }, { 1, 1, 1 } }, t:totable())
      t:set(2, 3, 1000)
      assert.are.equal(MAX, t:get(2, 3))
      t:set(1, 1, -1 / 0)
      assert.is_true(is_nan(t:get(1, 1)))
      assert.are.same({ 3.25, 3.25 }, ft.full({ 2 }, 3.3, { dtype = FP8 }):totable())
      assert.are.same({ 0, 1, 2, 3 }, ft.arange(4, { dtype = FP8 }):totable())
    end)
  end)

  describe("data movement", function()
    local function sample()
      return ft.tensor({ { 1, 2, 3, 4 }, { -0.5, 0.25, 448, -6 }, { 0.125, 10, 12, 14 } }, { dtype = FP8 })
    end

    it("views: reshape, view, transpose, permute, select, narrow, expand, indexing", function()
      local t = sample()
      assert.are.same({ 4, 3 }, t:reshape(4, 3).shape)
      assert.are.equal(-0.5, t:view(12):get(5))
      local tt = t:transpose()
      assert.is_true(tt:is_same_storage(t))
      assert.are.equal(448, tt:get(3, 2))
      assert.are.same({ 3, 448, 12 }, t:select(2, 3):totable())
      assert.are.same({ { 2, 3 }, { 0.25, 448 }, { 10, 12 } }, t:narrow(2, 2, 2):totable())
      assert.are.same({ 4, 3 }, t:permute(2, 1).shape)
      assert.are.same({ { 1, 2, 3, 4 }, { 1, 2, 3, 4 } }, t[1]:expand(2, 4):totable())
      assert.are.equal(-6, t[2][4])
      assert.are.equal(FP8, t[2].dtype)
    end)

    it("contiguous, clone and copy into strided views keep the bits", function()
      local t = sample()
      local tt = t:transpose()
      local c = tt:contiguous()
      assert.is_true(c:is_contiguous())
      assert.are.equal(FP8, c.dtype)
      assert.are.same(tt:totable(), c:totable())
      assert.are.equal(h.saved_bytes(tt), h.saved_bytes(c))
      assert.are.equal(h.saved_bytes(t), h.saved_bytes(t:clone()))
      local dst = ft.zeros(4, 3, { dtype = FP8 })
      dst:transpose():copy(t)
      assert.are.same(tt:totable(), dst:totable())
      local back = ft.zeros(3, 4, { dtype = "f32" }):copy(t)
      assert.are.same(t:totable(), back:totable())
    end)

    it("index_select gathers", function()
      local t = sample()
      local r = t:index_select(1, ft.tensor({ 3, 1, 3 }, { dtype = "i64" }))
      assert.are.equal(FP8, r.dtype)
      assert.are.same({ t:totable()[3], t:totable()[1], t:totable()[3] }, r:totable())
      local cols = t:index_select(2, ft.tensor({ 4 }, { dtype = "i32" }))
      assert.are.same({ { 4 }, { -6 }, { 14 } }, cols:totable())
    end)

    it("reads elements as Lua floats: get, item, totable, indexing", function()
      local t = sample()
      assert.are.equal(0.25, t:get(2, 2))
      assert.are.equal(448, t:narrow(1, 2, 1):narrow(2, 3, 1):item())
      if math.type then
        assert.are.equal("float", math.type(t:get(1, 1)))
        assert.are.equal("float", math.type(t:totable()[1][2]))
      end
    end)

    it("compares with max_abs_diff and allclose against any dtype", function()
      local t = sample()
      local f = t:to("f32")
      assert.are.equal(0, ft.max_abs_diff(t, f))
      assert.is_true(ft.allclose(t, f))
      local g = f:clone()
      g:set(1, 1, 1.5)
      assert.are.equal(0.5, ft.max_abs_diff(t, g))
      assert.are.equal(0, ft.max_abs_diff(t, t:transpose():transpose()))
      assert.is_true(is_nan(ft.max_abs_diff(ft.tensor({ nan }, { dtype = FP8 }), ft.zeros(1))))
    end)
  end)

  describe("printing", function()
    it("shows the values as floats", function()
      assert.are.equal("[  0.5000,  -1.5000, 448.0000]\n[flashtile.Tensor fp8_e4m3 cpu {3}]",
        tostring(ft.tensor({ 0.5, -1.5, 1000 }, { dtype = FP8 })))
      assert.are.equal("[[1., 2.],\n [3., 4.]]\n[flashtile.Tensor fp8_e4m3 cpu {2, 2}]",
        tostring(ft.tensor({ { 1, 2 }, { 3, 4 } }, { dtype = FP8 })))
      -- every finite fp8 magnitude lies in [2^-9, 448]: always fixed point
      assert.are.equal("[0.0020,    nan, 1.0000]\n[flashtile.Tensor fp8_e4m3 cpu {3}]",
        tostring(ft.tensor({ 2 ^ -9, inf, 1 }, { dtype = FP8 })))
      assert.are.equal("1.2500\n[flashtile.Tensor fp8_e4m3 cpu {}]", tostring(ft.tensor(1.2, { dtype = FP8 })))
    end)
  end)

  describe("files", function()
    local path
    before_each(function() path = os.tmpname() end)
    after_each(function() os.remove(path) end)

    it(".npy: saved as the one-field record [('fp8_e4m3', '|u1')] and loaded back as fp8_e4m3", function()
      local t = from_bits(ALL_BYTES):view(16, 16):transpose()
      t:save(path)
      local bytes = h.read_file(path)
      assert.is_truthy(bytes:find("{'descr': [('fp8_e4m3', '|u1')], 'fortran_order': False, 'shape': (16, 16), }",
        1, true), bytes:sub(1, 128))
      assert.are.equal(0, (#bytes - 256) % 64) -- the data starts on 64 bytes
      local back = ft.load(path)
      assert.are.equal(FP8, back.dtype)
      assert.are.same({ 16, 16 }, back.shape)
      assert.are.equal(h.saved_bytes(t), h.saved_bytes(back))
    end)

    it(".npy: reads the record as NumPy may spell it; other records and plain u1 stay unsupported", function()
      for _, descr in ipairs { '[("fp8_e4m3", "<u1")]', "[ ( 'fp8_e4m3' , 'u1' , ) , ]", "[('fp8_e4m3', '=u1')]" } do
        h.write_file(path, fp8_npy("\56\184", descr))
        local t = ft.load(path)
        assert.are.equal(FP8, t.dtype, descr)
        assert.are.same({ 1, -1 }, t:totable(), descr)
      end
      for _, case in ipairs {
        { "[('x', '|u1')]", "structured" }, { "[('fp8_e4m3', '<f2')]", "structured" },
        { "[('fp8_e4m3', '|u1'), ('y', '|u1')]", "structured" }, { "'|u1'", "unsupported dtype" },
        { "'|V1'", "unsupported dtype" },
      } do
        h.write_file(path, fp8_npy("\56\184", case[1]))
        h.assert_error(function() return ft.load(path) end, case[2])
      end
    end)

    it(".safetensors: F8_E4M3 written and read back, bit for bit", function()
      local file = path .. ".safetensors"
      local t = from_bits(ALL_BYTES)
      ft.save_safetensors(file, { w = t:view(8, 32), b = t:narrow(1, 1, 3) })
      local text = h.read_file(file)
      assert.is_truthy(text:find('"w":{"dtype":"F8_E4M3","shape":[8,32]', 1, true), text:sub(1, 200))
      local back = ft.load_safetensors(file)
      os.remove(file)
      assert.are.equal(FP8, back.w.dtype)
      assert.are.same({ 8, 32 }, back.w.shape)
      assert.are.equal(ALL_BYTES, h.saved_bytes(back.w))
      assert.are.equal(ALL_BYTES:sub(1, 3), h.saved_bytes(back.b))
    end)

    it(".safetensors: reads an F8_E4M3 tensor written by another writer", function()
      local header = '{"x":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]}}'
      h.write_file(path, h.bpack("<I4", #header) .. "\0\0\0\0" .. header .. "\56\64\126\255")
      local x = ft.load_safetensors(path).x
      assert.are.equal(FP8, x.dtype)
      local v = x:totable()
      assert.are.same({ 1, 2 }, v[1])
      assert.are.equal(448, v[2][1])
      assert.is_true(is_nan(v[2][2]))
    end)
  end)

  describe("arithmetic is refused, by name", function()
    local function refused(fn, ...)
      return h.assert_error(fn, "fp8_e4m3 tensors hold data only", "convert with :to('f16')", ...)
    end
    local a = ft.ones(2, 3, { dtype = FP8 })

    it("elementwise ops, tensor and scalar", function()
      refused(function() return a + a end, "'add'")
      refused(function() return a + 1 end, "'add'")
      refused(function() return 2 * a end, "'mul'")
      refused(function() return a:to("f32") - a end, "'sub'")
      refused(function() return a / a end, "'div'")
      refused(function() return -a end, "neg")
      refused(function() return a:exp() end, "exp")
      refused(function() return a:abs() end, "abs")
      refused(function() return a:maximum(a) end, "maximum")
    end)

    it("reductions, softmax and matmul", function()
      refused(function() return a:sum() end, "sum")
      refused(function() return a:mean(1) end, "mean")
      refused(function() return a:max(2) end, "max")
      refused(function() return a:norm() end, "norm")
      refused(function() return a:softmax() end, "softmax")
      refused(function() return ft.matmul(a, a:transpose()) end, "matmul")
      refused(function() return ft.matmul(a:to("f32"), a:transpose()) end, "matmul")
    end)

    it("random numbers drawn in fp8, and index_add", function()
      h.assert_error(function() return ft.randn({ 2 }, { dtype = FP8 }) end, "randn", "fp8_e4m3 holds data only")
      h.assert_error(function() return ft.rand({ 2 }, { dtype = FP8 }) end, "rand", "fp8_e4m3 holds data only")
      refused(function() return a:index_add(1, ft.tensor({ 1 }, { dtype = "i64" }), ft.ones(1, 3, { dtype = FP8 })) end,
        "index_add")
    end)

    it("attention with fp8 beside other dtypes, KV caches, and mods that read an fp8 tensor", function()
      local q = ft.ones(1, 4, 2, 8, { dtype = FP8 })
      local f = ft.ones(1, 4, 2, 8)
      h.assert_error(function() return ft.attention(f, q, q) end, "'attention'", "fp8_e4m3")
      h.assert_error(function() return ft.attention(q, f, q) end, "'attention'",
        "k is f32 but q is fp8_e4m3")
      -- a KV-cache call writes nothing into its fp8 caches before refusing
      local kc, vc = ft.zeros(1, 4, 2, 8, { dtype = FP8 }), ft.zeros(1, 4, 2, 8, { dtype = FP8 })
      local new = ft.ones(1, 1, 2, 8, { dtype = FP8 })
      h.assert_error(function()
        return ft.attention(q:narrow(2, 1, 1), kc, vc,
          { cache_seqlens = ft.tensor({ 1 }, { dtype = "i32" }), k_new = new, v_new = new })
      end, "'attention'", "KV cache call does not take fp8_e4m3")
      assert.are.equal(0, kc:to("f32"):abs():sum() + vc:to("f32"):abs():sum())
      local tbl = ft.zeros(2, { dtype = FP8 })
      local mods = ft.attention_mods { score = function(s, b, hh, i, j) return s + tbl[hh] end }
      refused(function() return ft.attention(f, f, f, { mods = mods }) end, "mods' tensors")
    end)

    it("leaves the fp8 tensor as it was", function()
      pcall(function() return a + a end)
      assert.are.same({ { 1, 1, 1 }, { 1, 1, 1 } }, a:totable())
    end)
  end)

  describe("attention (forward, FlashAttention-3's fp8 interface)", function()
    -- q, k, v quantised from f32 draws; the reference is f64 attention of
    -- the values they stand for (each times its descale factor)
    local function inputs(B, Nq, Nk, H, Hk, d, seed, device)
      local o = { device = device }
      local function draw(shape, s, mul)
        return ft.randn(shape, { seed = seed + s }):mul(mul):to(FP8):to(device or "cpu")
      end
      return draw({ B, Nq, H, d }, 1, 3), draw({ B, Nk, Hk, d }, 2, 2), draw({ B, Nk, Hk, d }, 3, 4), o
    end
    local function reference(q8, k8, v8, dq, dk, dv, opts)
      local ro = h.merge(opts, { impl = "naive", descale_q = nil, descale_k = nil, descale_v = nil })
      return ft.attention(q8:to("f64", "cpu"):mul(dq), k8:to("f64", "cpu"):mul(dk),
                          v8:to("f64", "cpu"):mul(dv), ro)
    end
    -- the output is bf16: at most twice the error of the reference
    -- rounded to bf16, plus what V's rounding to bf16 (CUDA) adds
    local function check(o, l, ref_o, ref_l, vmax)
      assert.are.equal("bf16", o.dtype)
      assert.are.equal("f32", l.dtype)
      local rounding = ft.max_abs_diff(ref_o:to("bf16"):to("f64"), ref_o)
      local err = ft.max_abs_diff(o:to("f64", "cpu"), ref_o)
      assert.is_true(err <= 2 * rounding + vmax * 2 ^ -9 + 1e-6,
        ("out: error %g, bf16 rounding of the reference %g"):format(err, rounding))
      local lerr = ft.max_abs_diff(l:to("f64", "cpu"), ref_l)
      assert.is_true(lerr <= 1e-4, ("lse: error %g"):format(lerr))
    end

    it("matches f64 attention of the descaled values on the CPU (tiled and naive, causal, GQA, Nq ~= Nk, variants)", function()
      for _, c in ipairs {
        { B = 2, Nq = 70, Nk = 70, H = 4, Hk = 2, d = 32, opts = { causal = true } },
        { B = 1, Nq = 33, Nk = 129, H = 2, Hk = 1, d = 64, opts = {} },
        { B = 1, Nq = 40, Nk = 90, H = 2, Hk = 2, d = 16, opts = { causal = true, window_left = 20, softcap = 15 } },
      } do
        local q8, k8, v8 = inputs(c.B, c.Nq, c.Nk, c.H, c.Hk, c.d, 10 * c.d)
        for _, impl in ipairs { "tiled", "naive" } do
          for _, ds in ipairs { { 1, 1, 1 }, { 0.5, 0.125, 3 } } do
            local opts = h.merge(c.opts, { impl = impl, descale_q = ds[1], descale_k = ds[2], descale_v = ds[3] })
            local o, l = ft.attention(q8, k8, v8, opts)
            local ro, rl = reference(q8, k8, v8, ds[1], ds[2], ds[3], c.opts)
            check(o, l, ro, rl, 0)
          end
        end
      end
    end)

    it("names what is wrong: descale factors, dtypes, impl cudnn, and the backward", function()
      local q8, k8, v8 = inputs(1, 8, 8, 2, 2, 8, 1)
      local f = ft.randn({ 1, 8, 2, 8 })
      for _, bad in ipairs { 0, -1, math.huge, 0 / 0 } do
        h.assert_error(function() return ft.attention(q8, k8, v8, { descale_v = bad }) end,
          "'attention'", "option 'descale_v' must be a finite positive number")
      end
      h.assert_error(function() return ft.attention(q8, k8, v8, { descale_q = "2" }) end, "descale_q")
      h.assert_error(function() return ft.attention(f, f, f, { descale_k = 2 }) end,
        "'attention'", "descale_q, descale_k and descale_v are for fp8_e4m3 inputs (q is f32)")
      h.assert_error(function() return ft.attention(q8, k8, v8:to("bf16")) end,
        "'attention'", "v is bf16 but q is fp8_e4m3")
      h.assert_error(function() return ft.attention(q8, k8, v8, { impl = "cudnn" }) end,
        "'attention'", "impl cudnn does not take fp8_e4m3")
      local o, l = ft.attention(q8, k8, v8)
      h.assert_error(function() return ft.attention_backward(o, q8, k8, v8, o, l) end,
        "'attention_backward'", "fp8_e4m3 attention", "forward only")
    end)

    gpu_it("on CUDA matches the same f64 reference (the flash and naive paths) #gpu", function()
      for _, c in ipairs {
        { B = 2, Nq = 300, Nk = 300, H = 4, Hk = 2, d = 128, opts = { causal = true } },
        { B = 1, Nq = 65, Nk = 200, H = 2, Hk = 1, d = 64, opts = {} },
      } do
        local q8, k8, v8 = inputs(c.B, c.Nq, c.Nk, c.H, c.Hk, c.d, c.d, "cuda")
        local ds = { 0.5, 0.25, 2 }
        local ro, rl = reference(q8, k8, v8, ds[1], ds[2], ds[3], c.opts)
        local vmax = v8:to("f32"):abs():max() * ds[3]
        ft.set_switch("FT_NO_FP8_MMA", true) -- the bf16 route (the fp8 kernel: below)
        for _, impl in ipairs { "flash", "naive" } do
          local o, l = ft.attention(q8, k8, v8, h.merge(c.opts,
            { impl = impl, descale_q = ds[1], descale_k = ds[2], descale_v = ds[3] }))
          assert.are.equal("cuda", o.device:sub(1, 4))
          check(o, l, ro, rl, vmax)
        end
        ft.set_switch("FT_NO_FP8_MMA", nil)
      end
    end)

    -- The fp8 tensor-core kernel (head dim 128, Hopper): P is rounded to e4m3
    -- (3 significant bits) before P V, so the output is further from the f64
    -- reference than the bf16 route's; the bound below is P's relative
    -- rounding (2^-4) of the largest value, and the mean error must be far
    -- smaller. LSE comes from f32 sums of S, whose fp8 products the tensor
    -- cores add up with fewer bits than f32 (an error of about 2e-4 here,
    -- against 1e-5 for the bf16 route's).
    gpu_it("on CUDA with head dim 128 takes the fp8 tensor cores on Hopper: the f64 reference within e4m3's rounding of P, rows that see no key, GQA, Nq ~= Nk, strided q, more tiles than SMs (the persistent walk's rounds, in head order and in order of length, the same bits as a CTA a tile) #gpu", function()
      local hopper = ft.cuda.device_name(0):match("H[12]00") ~= nil
      for _, c in ipairs {
        { B = 2, Nq = 300, Nk = 300, H = 4, Hk = 2, opts = { causal = true } },
        { B = 1, Nq = 65, Nk = 700, H = 4, Hk = 1, opts = {} },
        { B = 2, Nq = 200, Nk = 129, H = 2, Hk = 2, opts = { causal = true } },
        { B = 1, Nq = 128, Nk = 1000, H = 2, Hk = 2, opts = { causal = true }, strided = true },
        -- 192 and 288 tiles of 128 rows: several rounds of a persistent
        -- grid; in the second, the first block of rows of each head sees
        -- no key (tiles without keys amid the walk)
        { B = 12, Nq = 200, Nk = 200, H = 8, Hk = 2, opts = { causal = true } },
        { B = 12, Nq = 300, Nk = 100, H = 8, Hk = 8, opts = { causal = true } },
      } do
        local q8, k8, v8 = inputs(c.B, c.Nq, c.Nk, c.H, c.Hk, 128, 7 * c.Nk, "cuda")
        if c.strided then -- q as a view of a wider tensor: row stride 3 heads
          local wide = ft.zeros({ c.B, c.Nq, 3 * c.H, 128 }, { dtype = FP8, device = "cuda" })
          wide:narrow(3, 2, c.H):copy(q8)
          q8 = wide:narrow(3, 2, c.H)
        end
        local ds = { 0.5, 0.25, 2 }
        local ro, rl = reference(q8, k8, v8, ds[1], ds[2], ds[3], c.opts)
        local vmax = v8:to("f32"):abs():max() * ds[3]
        local opts = h.merge(c.opts, { descale_q = ds[1], descale_k = ds[2], descale_v = ds[3] })
        local o, l = ft.attention(q8, k8, v8, opts)
        ft.set_switch("FT_NO_FP8_MMA", true)
        local ob, lb = ft.attention(q8, k8, v8, opts)
        ft.set_switch("FT_NO_FP8_MMA", nil)
        local label = ("B %d Nq %d Nk %d H %d Hk %d"):format(c.B, c.Nq, c.Nk, c.H, c.Hk)
        local diff = o:to("f64", "cpu") - ro
        local err, mean = diff:abs():max(), diff:abs():mean()
        local err_b = ft.max_abs_diff(ob:to("f64", "cpu"), ro)
        print(("fp8 kernel %s: out error max %.3g mean %.3g (bf16 route %.3g), lse %.3g, vmax %.3g"):format(
          label, err, mean, err_b, ft.max_abs_diff(l:to("f64", "cpu"), rl), vmax))
        assert.is_true(err <= vmax * 2 ^ -4, ("%s: out error %g > %g"):format(label, err, vmax * 2 ^ -4))
        assert.is_true(mean <= vmax * 2 ^ -9, ("%s: mean error %g"):format(label, mean))
        local lerr = ft.max_abs_diff(l:to("f64", "cpu"), rl)
        assert.is_true(lerr <= 2 ^ -10, ("%s: lse error %g"):format(label, lerr))
        if hopper then -- the kernel ran: P's rounding shows against the bf16 route
          assert.is_true(ft.max_abs_diff(o, ob) > 0, label .. ": the fp8 kernel did not run")
        end
        -- every run the same bits
        local o2, l2 = ft.attention(q8, k8, v8, opts)
        assert.are.equal(0, ft.max_abs_diff(o2, o), label .. ": deterministic")
        assert.are.equal(0, ft.max_abs_diff(l2, l), label .. ": deterministic lse")
        -- the persistent grid and a CTA a tile: the same arithmetic a tile
        ft.set_switch("FT_NO_PERSIST", true)
        local o3, l3 = ft.attention(q8, k8, v8, opts)
        ft.set_switch("FT_NO_PERSIST", nil)
        assert.are.equal(0, ft.max_abs_diff(o3, o), label .. ": persistent or not")
        assert.are.equal(0, ft.max_abs_diff(l3, l), label .. ": persistent or not, lse")
        -- forced persistent (a causal walk then in order of the tiles' lengths)
        ft.set_switch("FT_PERSIST", true)
        local o4, l4 = ft.attention(q8, k8, v8, opts)
        ft.set_switch("FT_PERSIST", nil)
        assert.are.equal(0, ft.max_abs_diff(o4, o), label .. ": FT_PERSIST")
        assert.are.equal(0, ft.max_abs_diff(l4, l), label .. ": FT_PERSIST, lse")
      end
    end)
  end)

  describe("on CUDA #gpu", function()
    local DTYPES = { "f64", "f32", "f16", "bf16", "i32", "i64", FP8 }

    --- The same values, zeros' signs included; a NaN matches any NaN (a
    -- GPU's conversion of a NaN to f32 need not keep its sign).
    local function same_bits(cpu, gpu, what)
      assert.are.equal("cuda:0", gpu.device)
      assert.are.equal(cpu.dtype, gpu.dtype, what)
      local a, b = h.flatten(cpu:totable()), h.flatten(gpu:cpu():totable())
      assert.are.equal(#a, #b, what)
      for i = 1, #a do
        local x, y = a[i], b[i]
        assert.is_true((is_nan(x) and is_nan(y)) or (x == y and 1 / x == 1 / y),
          ("%s: element %d is %.17g on the cpu, %.17g on the GPU"):format(what, i, x, y))
      end
    end

    gpu_it("converts to and from every dtype as the cpu does, bit for bit, strided views included", function()
      local src = ft.randn({ 6, 7 }, { dtype = "f64", seed = h.next_seed() }) * 200
      src:set(1, 1, 1e6)
      src:set(1, 2, -1 / 0)
      src:set(1, 3, 0 / 0)
      src:set(1, 4, 1.0625)
      src:set(1, 5, 2 ^ -10)
      for _, from in ipairs(DTYPES) do
        local a = src:to(from)
        local g = a:cuda()
        for _, to in ipairs(DTYPES) do
          if from == FP8 or to == FP8 then
            same_bits(a:to(to), g:to(to), from .. " -> " .. to)
            same_bits(a:transpose():to(to), g:transpose():to(to), from .. " -> " .. to .. " (transposed)")
          end
        end
      end
      local bits = from_bits(ALL_BYTES)
      same_bits(bits:to("f32"), bits:cuda():to("f32"), "all 256 patterns")
      same_bits(bits, bits:cuda():to("f32"):to(FP8), "256 patterns round trip")
    end)

    gpu_it("copies, fills, gathers and compares fp8 on the GPU", function()
      local a = ft.randn({ 5, 6 }, { dtype = "f32", seed = h.next_seed() }):to(FP8)
      local g = a:cuda()
      same_bits(a:transpose():contiguous(), g:transpose():contiguous(), "contiguous of a transpose")
      same_bits(a:clone(), g:clone(), "clone")
      local dst, gdst = ft.zeros(6, 5, { dtype = FP8 }), ft.zeros(6, 5, { dtype = FP8, device = "cuda" })
      dst:transpose():copy(a)
      gdst:transpose():copy(g)
      same_bits(dst, gdst, "copy into a transposed view")
      a:narrow(2, 2, 3):fill(1.0625)
      g:narrow(2, 2, 3):fill(1.0625)
      same_bits(a, g, "fill a view")
      local ids = ft.tensor({ 5, 1, 5 }, { dtype = "i64" })
      same_bits(a:index_select(1, ids), g:index_select(1, ids:cuda()), "index_select")
      assert.are.equal(0, ft.max_abs_diff(g, a:to("f32"):cuda()))
      assert.is_true(ft.allclose(g, g:to("f16")))
      g:set(5, 6, 1000)
      assert.are.equal(448, g:get(5, 6))
      assert.are.equal(FP8, g[2].dtype)
    end)

    gpu_it("refuses arithmetic and the attention backward on the GPU as on the cpu", function()
      local g = ft.ones(2, 3, { dtype = FP8, device = "cuda" })
      h.assert_error(function() return g + g end, "'add'", "fp8_e4m3 tensors hold data only")
      h.assert_error(function() return g:sum() end, "sum", "fp8_e4m3 tensors hold data only")
      h.assert_error(function() return ft.matmul(g, g:transpose()) end, "matmul", "fp8_e4m3")
      local q = ft.ones(1, 4, 2, 8, { dtype = FP8, device = "cuda" })
      local o, l = ft.attention(q, q, q) -- the forward takes fp8 (above); the backward does not
      h.assert_error(function() return ft.attention_backward(o, q, q, q, o, l) end,
        "'attention_backward'", "fp8_e4m3 attention", "forward only")
    end)
  end)
end)
