-- safetensors checkpoints from Lua: ft.save_safetensors / ft.load_safetensors
-- round trip every dtype with the metadata, read a file made byte by byte
-- from the format's definition (as another writer makes it), refuse
-- malformed files with a clear error, and carry nn modules' state_dict.
local h = require "helper"
local ft = h.ft
local nn = require "flashtile.nn"

local function tmp()
  return os.tmpname() .. ".safetensors"
end

local write, read = h.write_file, h.read_file

--- 8 little-endian bytes of a non-negative integer below 2^53.
local function u64(n)
  local b = {}
  for i = 1, 8 do
    b[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(b)
end

--- A file: the header's length, the header, the data.
local function file(header, data)
  return u64(#header) .. header .. (data or "")
end

describe("safetensors", function()
  it("round trips every dtype, with shapes, strided sources and the metadata", function()
    local src = ft.randn({ 3, 5 }, { dtype = "f64", seed = h.next_seed() }) * 100
    local tensors = {
      a64 = src,
      b32 = src:float(),
      c16 = src:half():transpose(),         -- non-contiguous source
      d_bf = src:bf16():narrow(2, 2, 3),
      e32 = src:int(),
      f64i = src:long(),
      scalar = ft.tensor(2.5, { dtype = "f64" }),
      empty = ft.zeros({ 0, 4 }, { dtype = "f32" }),
    }
    local path = tmp()
    ft.save_safetensors(path, tensors, { format = "pt", note = "flashtile spec" })
    local back, meta = ft.load_safetensors(path)
    assert.are.same({ format = "pt", note = "flashtile spec" }, meta)
    local n = 0
    for name, t in pairs(tensors) do
      n = n + 1
      local b = back[name]
      assert.is_truthy(b, name)
      assert.are.equal(t.dtype, b.dtype, name)
      assert.are.same(t.shape, b.shape, name)
      assert.is_true(b:is_contiguous())
      assert.are.equal(0, ft.max_abs_diff(t, b), name)
    end
    local m = 0
    for _ in pairs(back) do m = m + 1 end
    assert.are.equal(n, m)
    os.remove(path)
  end)

  it("writes what the format says: 8-byte aligned header, sorted names, contiguous data", function()
    local path = tmp()
    ft.save_safetensors(path, { zb = ft.tensor({ 1, 2 }, { dtype = "i32" }),
                               aa = ft.tensor({ { 1.5 } }, { dtype = "f64" }) })
    local bytes = read(path)
    local n = 0
    for i = 8, 1, -1 do n = n * 256 + bytes:byte(i) end
    assert.are.equal(0, (8 + n) % 8)
    local header = bytes:sub(9, 8 + n)
    assert.is_truthy(header:find('"aa"', 1, true) < header:find('"zb"', 1, true))
    assert.is_truthy(header:find('"dtype":"F64"', 1, true) or header:find('"dtype": "F64"', 1, true))
    -- 1.5 as f64 little-endian, then 1 and 2 as i32
    assert.are.equal("\0\0\0\0\0\0\248\63" .. "\1\0\0\0\2\0\0\0", bytes:sub(9 + n))
    os.remove(path)
  end)

  it("loads a file another writer made, byte by byte from the format's definition", function()
    -- keys in another order, spaces, unpadded header, metadata first, F16
    local header = '{ "__metadata__" : {"source":"hand \\u00e9crit", "k":"v"},'
      .. '"w" : {"shape":[2,2],"dtype":"F16","data_offsets":[8,16]},'
      .. '"ids":{"data_offsets":[0,8],"shape":[2],"dtype":"I32"} }'
    local data = "\7\0\0\0" .. "\249\255\255\255"       -- i32 7, -7
      .. "\0\60" .. "\0\192" .. "\0\56" .. "\0\0"         -- f16 1, -2, 0.5, 0
    local path = tmp()
    write(path, file(header, data))
    local t, meta = ft.load_safetensors(path)
    assert.are.same({ source = "hand \195\169crit", k = "v" }, meta)
    assert.are.equal("i32", t.ids.dtype)
    assert.are.same({ 7, -7 }, t.ids:totable())
    assert.are.equal("f16", t.w.dtype)
    assert.are.same({ { 1, -2 }, { 0.5, 0 } }, t.w:totable())
    os.remove(path)
  end)

  it("refuses every malformed file with an error naming the problem, reading nothing outside it", function()
    local good_entry = '{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
    local cases = {
      { "truncated length", "\16\0\0", "truncated" },
      { "header longer than the file", u64(1000) .. "{}", "truncated" },
      { "header over the limit", u64(2 ^ 40) .. "{}", "header" },
      { "data cut short", file(good_entry, "\0\0\0\0"), "" },
      { "offsets past the end", file('{"x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', ("\0"):rep(8)), "" },
      { "overlapping ranges", file('{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
          .. '"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', ("\0"):rep(12)), "overlap" },
      { "end before begin", file('{"x":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}', ("\0"):rep(8)), "" },
      { "size not matching the shape", file('{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', ("\0"):rep(8)), "" },
      { "unknown dtype", file('{"x":{"dtype":"XYZ","shape":[2],"data_offsets":[0,8]}}', ("\0"):rep(8)), "XYZ" },
      { "a dtype flashtile lacks", file('{"x":{"dtype":"F8_E5M2","shape":[8],"data_offsets":[0,8]}}', ("\0"):rep(8)), "F8_E5M2" },
      { "duplicate names", file('{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
          .. '"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', ("\0"):rep(8)), "" },
      { "not an object", file('[1,2]'), "" },
      { "bad JSON", file('{"x":{"dtype":"F32",'), "" },
      { "negative shape", file('{"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}', ("\0"):rep(8)), "" },
      { "fractional shape", file('{"x":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}}', ("\0"):rep(8)), "" },
      { "shape product overflow", file('{"x":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}', ("\0"):rep(8)), "" },
      { "empty file", "", "" },
    }
    local path = tmp()
    for _, case in ipairs(cases) do
      write(path, case[2])
      local msg = h.assert_error(function() return ft.load_safetensors(path) end,
        "load_safetensors", path, case[3])
      assert.is_truthy(#msg < 400, case[1] .. ": " .. msg)
    end
    os.remove(path)
    -- the session goes on
    assert.are.equal(6, ft.ones(2, 3):sum())
  end)

  it("checks its arguments", function()
    local path = tmp()
    h.assert_error(function() ft.save_safetensors(path, { w = 1 }) end, "save_safetensors", "'w'", "not a tensor")
    h.assert_error(function() ft.save_safetensors(path, { ft.ones(1) }) end, "save_safetensors", "keys must be strings")
    h.assert_error(function() ft.save_safetensors(path, { w = ft.ones(1) }, { a = 1 }) end, "save_safetensors", "metadata 'a'")
    h.assert_error(function() ft.save_safetensors(path, "w") end, "save_safetensors", "table expected")
    local f = ft.ones(1)
    f:free()
    h.assert_error(function() ft.save_safetensors(path, { f = f }) end, "save_safetensors", "freed")
    h.assert_error(function() ft.save_safetensors("/nonexistent-dir/x.safetensors", { w = ft.ones(1) }) end,
      "save_safetensors", "/nonexistent-dir")
    h.assert_error(function() return ft.load_safetensors("/nonexistent-dir/x.safetensors") end,
      "load_safetensors", "/nonexistent-dir")
    assert.is_nil(io.open(path, "rb"))
  end)

  it("replaces a file whole: a failed save leaves the old file as it was", function()
    local path = tmp()
    ft.save_safetensors(path, { w = ft.ones(3) })
    local before = read(path)
    local f = ft.ones(1)
    f:free()
    pcall(ft.save_safetensors, path, { w = ft.zeros(3), f = f })
    assert.are.equal(before, read(path))
    os.remove(path)
  end)
end)

describe("nn state_dict", function()
  local function model(seed)
    return nn.Sequential(nn.Embedding(10, 8, { seed = seed }),
      nn.TransformerBlock { dim = 8, heads = 2, causal = true, seed = seed + 1 },
      nn.RMSNorm(8), nn.Linear(8, 10, { seed = seed + 2 }))
  end

  it("names every parameter as PyTorch does, the tensors themselves", function()
    local m = model(1)
    local sd = m:state_dict()
    local names = {}
    for k in pairs(sd) do names[#names + 1] = k end
    table.sort(names)
    assert.are.equal(#m:parameters(), #names)
    assert.are.equal(m.modules[4].weight, sd["4.weight"])
    assert.is_truthy(sd["2.1.1.2.qkv.weight"])
    assert.is_truthy(sd["2.1.1.2.out_proj.weight"])
  end)

  it("survives a restart: save, load into a differently seeded model, same outputs", function()
    local a, b = model(1), model(100)
    local x = ft.tensor({ { 1, 2, 3, 4 } }, { dtype = "i64" })
    assert.is_true(ft.max_abs_diff(a:forward(x), b:forward(x)) > 0)
    local path = tmp()
    ft.save_safetensors(path, a:state_dict(), { step = "200" })
    local st, meta = ft.load_safetensors(path)
    assert.are.equal("200", meta.step)
    assert.are.equal(b, b:load_state_dict(st))
    assert.are.equal(0, ft.max_abs_diff(a:forward(x), b:forward(x)))
    os.remove(path)
  end)

  it("checks everything before copying anything", function()
    local b = model(5)
    local before = b:state_dict()["4.weight"]:clone()
    local st = model(7):state_dict()
    st["4.weight"] = ft.zeros(3)
    st["3.weight"] = nil
    st.extra = ft.zeros(1)
    h.assert_error(function() b:load_state_dict(st) end, "load_state_dict",
      "4.weight has shape {3}", "missing: 3.weight", "unexpected: extra")
    assert.are.equal(0, ft.max_abs_diff(before, b:state_dict()["4.weight"]))
    h.assert_error(function() b:load_state_dict(5) end, "load_state_dict", "table")
    local gone = ft.zeros(10)
    gone:free()
    h.assert_error(function() b:load_state_dict({ ["4.bias"] = gone }, { strict = false }) end,
      "load_state_dict: 4.bias has been freed")
    -- strict = false: only what matches is copied
    b:load_state_dict({ ["4.bias"] = ft.ones(10) }, { strict = false })
    assert.are.same(ft.ones(10):totable(), b:state_dict()["4.bias"]:totable())
    -- converting dtypes
    b:load_state_dict({ ["4.bias"] = ft.zeros(10, { dtype = "f64" }) }, { strict = false })
    assert.are.equal("f32", b:state_dict()["4.bias"].dtype)
    assert.are.equal(0, b:state_dict()["4.bias"]:sum())
  end)
end)
