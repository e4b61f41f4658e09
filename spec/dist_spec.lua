-- flashtile.dist (lib/dist.c, lua/flashtile/dist.lua): communicators over
-- NCCL in both process models, the collectives, exchanges that overlap
-- the kernels, and ring attention against attention of the whole sequence
-- on one GPU. Specs that need one GPU carry the tag gpu; those that need
-- two carry gpu and multigpu; each is reported pending, with the reason,
-- where it cannot run.
local h = require "helper"
local ft = h.ft

local gpu_it = h.gpu_it(it, function(reason) pending(reason) end)

local multigpu_it = h.multigpu_it(it, function(reason) pending(reason) end)

local function randn(shape, dtype)
  return ft.randn(shape, { dtype = dtype or "f64", seed = h.next_seed() })
end

describe("ft.dist", function()
  it("says whether it was built, and names what is wrong in ft.dist.init's options", function()
    assert.are.equal("boolean", type(ft.dist.built()))
    local cases = {
      { nil, "give devices = {...}" },
      { { devices = {} }, "devices must be a list" },
      { { devices = { 0, -1 } }, "devices[2] must be a device number" },
      { { devices = { 0 }, rank = 0 }, "takes no rank" },
      { { rank = 2, world_size = 2, id_file = "x" }, "rank must be an integer from 0 to 1" },
      { { rank = 0, world_size = 0, id_file = "x" }, "world_size must be an integer >= 1" },
      { { rank = 0, world_size = 2, id_file = "" }, "id_file must be a path" },
      { { rank = 0, world_size = 2, id_file = "x", timeout = 0 }, "timeout must be a number" },
      { { rank = 0, world_size = 2, id_file = "x", device = 1.5 }, "device must be a device number" },
      { { ranks = 2 }, "unknown option 'ranks'" },
    }
    for _, c in ipairs(cases) do
      local ok, err = pcall(ft.dist.init, c[1])
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find(c[2], 1, true), tostring(err))
    end
    local ok, err = pcall(ft.dist.init, "x")
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("ft.dist.init: opts must be a table", 1, true))
  end)

  it("refuses a device this machine lacks, or any without NCCL, with a clear error", function()
    local ok, err = pcall(ft.dist.init, { devices = { 63 } })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("no CUDA device", 1, true) or tostring(err):find("NCCL", 1, true)
      or tostring(err):find("63", 1, true), tostring(err))
  end)

  it("shards a sequence (zigzag and contiguous) and puts the shards back together", function()
    local t = randn { 2, 24, 3, 4 }
    for _, layout in ipairs { "zigzag", "contiguous" } do
      for _, W in ipairs { 1, 2, 3 } do
        local shards = {}
        for r = 0, W - 1 do shards[r + 1] = ft.dist.shard(t, r, W, layout) end
        assert.are.equal(24 / W, shards[1]:size(2))
        assert.are.equal(0, ft.max_abs_diff(ft.dist.unshard(shards, layout), t))
      end
    end
    -- zigzag: rank 0 of 2 holds chunks 1 and 4 of 4
    local z = ft.dist.shard(t, 0, 2)
    assert.are.equal(0, ft.max_abs_diff(z:narrow(2, 1, 6), t:narrow(2, 1, 6)))
    assert.are.equal(0, ft.max_abs_diff(z:narrow(2, 7, 6), t:narrow(2, 19, 6)))
    local ok, err = pcall(ft.dist.shard, t, 0, 5)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("ft.dist.shard: seqlen 24 is not a multiple of 2 x world (10)", 1, true))
  end)

  it("ring attention's arithmetic (forward and backward, 2 and 3 ranks, causal or not, GQA, zigzag and contiguous) on the CPU, an in-process exchange standing in for NCCL, matches attention of the whole sequence", function()
    local Comm = debug.getregistry()["flashtile.Comm"].__index
    local function fake_comm(W)
      local c = {}
      function c.world_size() return W end
      function c.ranks()
        local r = {}
        for i = 1, W do r[i] = i - 1 end
        return r
      end
      function c.all_gather_list(_, list) -- 1-d tensors
        local total = 0
        for i = 1, W do total = total + list[i]:size(1) end
        local out = ft.empty({ total }, { dtype = list[1].dtype })
        local at = 1
        for i = 1, W do
          out:narrow(1, at, list[i]:size(1)):copy(list[i])
          at = at + list[i]:size(1)
        end
        local r = {}
        for i = 1, W do r[i] = out end
        return r
      end
      function c.sendrecv_list(_, send, to, recv, from)
        local got = {}
        for i = 1, W do
          if send[i] then
            local j = to[i] + 1
            assert.are.equal(i - 1, from[j])
            got[j] = send[i]:clone()
          end
        end
        for j = 1, W do if recv[j] then recv[j]:copy(got[j]) end end
        return { wait = function() end }
      end
      return setmetatable(c, { __index = Comm })
    end
    local B, H, Hk, d = 2, 4, 2, 8
    for _, W in ipairs { 2, 3 } do
      local N = 12 * W
      local q, k, v, dout = randn { B, N, H, d }, randn { B, N, Hk, d }, randn { B, N, Hk, d },
                            randn { B, N, H, d }
      local comm = fake_comm(W)
      for _, causal in ipairs { false, true } do
        for _, layout in ipairs { "zigzag", "contiguous" } do
          local ref = h.attention_both(q, k, v, dout, { causal = causal })
          local function shards(t)
            local r = {}
            for i = 1, W do r[i] = ft.dist.shard(t, i - 1, W, layout) end
            return r
          end
          local qs, ks, vs, ds = shards(q), shards(k), shards(v), shards(dout)
          local ro = { causal = causal, layout = layout }
          local out, lse = comm:ring_attention(qs, ks, vs, ro)
          local dq, dk, dv = comm:ring_attention_backward(ds, qs, ks, vs, out, lse, ro)
          local where = ("W %d causal %s %s"):format(W, tostring(causal), layout)
          for name, got in pairs { out = out, dq = dq, dk = dk, dv = dv } do
            local e = ft.max_abs_diff(ft.dist.unshard(got, layout), ref[name])
            assert.is_true(e < 1e-5, ("%s: %s error %g"):format(where, name, e))
          end
          local l = {}
          for i = 1, W do l[i] = lse[i]:permute(1, 3, 2):contiguous() end
          -- a rank whose shard differs is named, before any exchange
          if W == 3 and not causal and layout == "zigzag" then
            local odd = { qs[1], qs[2], qs[3]:narrow(2, 1, 2):contiguous() }
            local ok, err = pcall(comm.ring_attention, comm, odd, ks, vs, ro)
            assert.is_false(ok)
            assert.is_truthy(tostring(err):find("rank 2's q, k, v (shapes or dtype) differ from rank 0's", 1, true), tostring(err))
          end
          local e = ft.max_abs_diff(ft.dist.unshard(l, layout), ref.lse:permute(1, 3, 2):double())
          assert.is_true(e < 1e-5, ("%s: lse error %g"):format(where, e))
        end
      end
    end
  end)

  gpu_it("a rank alone does not hang: rank 0 of 2 and rank 1 of 2 each fail within their timeout, saying whom they waited for #gpu", function()
    if not ft.dist.built() then
      local ok, err = pcall(ft.dist.init, { devices = { 0 } })
      assert.is_false(ok)
      assert.is_truthy(tostring(err):find("without NCCL", 1, true), tostring(err))
      return
    end
    local dir = os.tmpname()
    os.remove(dir)
    local t0 = ft.clock()
    local ok, err = pcall(ft.dist.init, { rank = 1, world_size = 2, id_file = dir .. ".id", device = 0,
                                          timeout = 1 })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("no id from rank 0", 1, true), tostring(err))
    t0 = ft.clock()
    ok, err = pcall(ft.dist.init, { rank = 0, world_size = 2, id_file = dir .. ".id", device = 0,
                                    timeout = 2 })
    local took = ft.clock() - t0
    os.remove(dir .. ".id")
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("did not all join within 2 s", 1, true), tostring(err))
    assert.is_true(took < 30, "took " .. took .. " s")
  end)

  gpu_it("one device: the collectives of a world of one, and ring attention (forward and backward) equal to attention #gpu", function()
    if not ft.dist.built() then return end
    local comm = ft.dist.init { devices = { 0 } }
    assert.are.equal(1, comm:world_size())
    assert.are.same({ 0 }, comm:ranks())
    assert.are.same({ 0 }, comm:devices())
    assert.are.equal("flashtile.Comm: rank 0 of 1 on cuda:0", tostring(comm))
    local x = randn({ 5, 7 }, "f32")
    local g = x:cuda()
    comm:all_reduce(g, "max")
    assert.are.equal(0, ft.max_abs_diff(g:cpu(), x))
    assert.are.equal(0, ft.max_abs_diff(comm:all_gather(g):cpu(), x))
    assert.has_error(function() comm:all_reduce(x) end)           -- on the cpu
    assert.has_error(function() comm:all_reduce(g:transpose(1, 2)) end) -- not contiguous
    assert.has_error(function() comm:sendrecv { send = g, to = 0 } end) -- to itself
    local q, k, v = randn { 1, 64, 4, 64 }, randn { 1, 64, 2, 64 }, randn { 1, 64, 2, 64 }
    local function b(t) return t:to("bf16"):cuda() end
    local dout = randn { 1, 64, 4, 64 }
    for _, causal in ipairs { false, true } do
      local o = { causal = causal }
      local want, wl = ft.attention(b(q), b(k), b(v), o)
      local got, gl = comm:ring_attention(b(q), b(k), b(v), o)
      assert.is_true(ft.max_abs_diff(got:cpu():double(), want:cpu():double()) < 2^-7)
      assert.is_true(ft.max_abs_diff(gl:cpu():double(), wl:cpu():double()) < 1e-5)
      local w = { ft.attention_backward(b(dout), b(q), b(k), b(v), want, wl, o) }
      local g = { comm:ring_attention_backward(b(dout), b(q), b(k), b(v), got, gl, o) }
      for i = 1, 3 do
        assert.is_true(ft.max_abs_diff(g[i]:cpu():double(), w[i]:cpu():double()) < 2^-6, "gradient " .. i)
      end
    end
    comm:free()
    assert.has_error(function() comm:world_size() end)
    assert.are.equal("flashtile.Comm (freed)", tostring(comm))
  end)

  multigpu_it("two devices in one process: all_reduce, broadcast, all_gather, reduce_scatter and sendrecv against the CPU #gpu #multigpu", function()
    local comm = ft.dist.init { devices = { 0, 1 } }
    assert.are.equal(2, comm:world_size())
    local a, b = randn({ 6, 5 }, "f32"), randn({ 6, 5 }, "f32")
    local function on(t, d) return t:to("cuda:" .. d) end
    for _, op in ipairs { "sum", "mean", "max", "min" } do
      local ts = { on(a, 0), on(b, 1) }
      comm:all_reduce(ts, op)
      local want = op == "sum" and a + b or op == "mean" and (a + b) / 2 or op == "max" and a:maximum(b)
                   or a:minimum(b)
      for i = 1, 2 do assert.is_true(ft.max_abs_diff(ts[i]:cpu(), want) < 1e-6, op) end
    end
    local ts = { on(a, 0), on(b, 1) }
    comm:broadcast(ts, 1)
    assert.are.equal(0, ft.max_abs_diff(ts[1]:cpu(), b))
    local g = comm:all_gather { on(a, 0), on(b, 1) }
    assert.are.same({ 12, 5 }, g[2].shape)
    assert.are.equal(0, ft.max_abs_diff(g[2]:cpu():narrow(1, 1, 6), a))
    assert.are.equal(0, ft.max_abs_diff(g[2]:cpu():narrow(1, 7, 6), b))
    local s = comm:reduce_scatter({ on(a, 0), on(b, 1) }, "sum")
    assert.are.same({ 3, 5 }, s[1].shape)
    assert.is_true(ft.max_abs_diff(s[2]:cpu(), (a + b):narrow(1, 4, 3)) < 1e-6)
    local r0, r1 = ft.empty({ 6, 5 }, { dtype = "f32", device = "cuda:0" }),
                   ft.empty({ 6, 5 }, { dtype = "f32", device = "cuda:1" })
    local p = comm:sendrecv { send = { on(a, 0), on(b, 1) }, to = { 1, 0 }, recv = { r0, r1 },
                              from = { 1, 0 }, async = true }
    p:wait()
    assert.are.equal(0, ft.max_abs_diff(r0:cpu(), b))
    assert.are.equal(0, ft.max_abs_diff(r1:cpu(), a))
    comm:free()
  end)

  multigpu_it("one process per GPU (scripts/ftrun -n 2): every rank joins through the id file, all_reduces, and its ring attention shard (causal, GQA, forward and backward) matches attention of the whole sequence #gpu #multigpu", function()
    local out, status = h.sh(("cd %s && FT_BUILD_DIR=%s scripts/ftrun -n 2 --timeout 10 spec/dist_job.lua"):format(
      h.quote(h.ROOT), h.quote(assert(h.BUILD))))
    assert.are.equal(0, status, out)
    assert.is_truthy(out:find("[0] rank 0 ok", 1, true), out)
    assert.is_truthy(out:find("[1] rank 1 ok", 1, true), out)
  end)

  multigpu_it("ring attention over two devices matches attention of the whole sequence (forward and backward, causal or not, GQA, zigzag and contiguous) within FlashAttention's rule #gpu #multigpu", function()
    local comm = ft.dist.init { devices = { 0, 1 } }
    local B, N, H, Hk, d = 1, 512, 8, 2, 64
    local q, k, v, dout = randn { B, N, H, d }, randn { B, N, Hk, d }, randn { B, N, Hk, d },
                          randn { B, N, H, d }
    for _, causal in ipairs { false, true } do
      for _, layout in ipairs { "zigzag", "contiguous" } do
        local o = { causal = causal }
        local ref = h.attention_both(q, k, v, dout, o)                     -- f64, CPU
        local function one(t) return t:to("bf16"):cuda() end
        local single = h.attention_both(one(q), one(k), one(v), one(dout), o)
        local function shards(t)
          return { ft.dist.shard(t, 0, 2, layout):to("bf16"):to("cuda:0"),
                   ft.dist.shard(t, 1, 2, layout):to("bf16"):to("cuda:1") }
        end
        local qs, ks, vs, ds = shards(q), shards(k), shards(v), shards(dout)
        local ro = { causal = causal, layout = layout }
        local out, lse = comm:ring_attention(qs, ks, vs, ro)
        local dq, dk, dv = comm:ring_attention_backward(ds, qs, ks, vs, out, lse, ro)
        local got = { out = ft.dist.unshard(out, layout), dq = ft.dist.unshard(dq, layout),
                      dk = ft.dist.unshard(dk, layout), dv = ft.dist.unshard(dv, layout) }
        for _, name in ipairs { "out", "dq", "dk", "dv" } do
          local e = ft.max_abs_diff(got[name]:cpu():double(), ref[name])
          local es = ft.max_abs_diff(single[name]:cpu():double(), ref[name])
          assert.is_true(e <= 2 * es + 4 * 2^-7,
            ("causal %s %s %s: ring error %.3e, one GPU %.3e"):format(tostring(causal), layout, name, e, es))
        end
      end
    end
    comm:free()
  end)
end)
