-- One forward and one backward call of one configuration on the GPU, for a
-- profiler to look at (ncu -k <kernel> -c 1 ...; nothing is timed here).
--
--   scripts/ftlua scripts/profile.lua [d] [seqlen] [dtype] [causal]
--   e.g. ncu --clock-control none -k regex:wgmma -c 2 scripts/ftlua scripts/profile.lua 64 4096
local ft = require "flashtile"
local d = tonumber(arg[1] or "64")
local n = tonumber(arg[2] or "4096")
local dtype = arg[3] or "f16"
local causal = arg[4] == "true"
local B, H = 16384 // n, 2048 // d
local function input(seed)
    return ft.randn({B, n, H, d}, {dtype = dtype, device = "cuda", seed = seed})
end
local q, k, v, dout = input(1), input(2), input(3), input(4)
local opts = {causal = causal}
local out, lse = ft.attention(q, k, v, opts)
local dq = ft.attention_backward(dout, q, k, v, out, lse, opts)
ft.cuda.synchronize()
print(("B=%d H=%d N=%d d=%d %s causal=%s: done"):format(B, H, n, d, dtype, tostring(causal)))
