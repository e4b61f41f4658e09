-- The scripts a user runs from a clone (scripts/bench.lua, demo.lua,
-- train_tiny.lua, profile.lua, repl.lua and gpu-check), run as a user runs
-- them: a fresh interpreter (the one running this spec) with no LUA_PATH or
-- LUA_CPATH, so that each script has to find flashtile from its own path.
local h = require "helper"
local ft = h.ft

local quote, exists, read_all, absolute = h.quote, h.exists, h.read_all, h.absolute
local ROOT, BUILD = h.ROOT, assert(h.BUILD, "flashtile/core.so is not on package.cpath")
assert(exists(ROOT .. "/scripts/bench.lua"), "the specs run from the repository's root")
local sh = h.sh

--- The interpreter running this spec, as a command: arg's lowest negative
-- index, else the command line of this process, else its usual name;
-- taken only when it reports the same version as this one.
local LUA = (function()
  local function version_of_this() return _VERSION .. (rawget(_G, "jit") and (" " .. jit.version) or "") end
  local want = version_of_this()
  local candidates = {}
  if type(arg) == "table" and arg[-1] then
    local i = -1
    while arg[i - 1] do i = i - 1 end
    candidates[#candidates + 1] = arg[i]
  end
  local f = io.open("/proc/self/cmdline", "rb")
  if f then
    candidates[#candidates + 1] = f:read("*a"):match("^[^%z]+")
    f:close()
  end
  candidates[#candidates + 1] = rawget(_G, "jit") and "luajit" or ("lua" .. _VERSION:match("%d+%.%d+"))
  for _, c in ipairs(candidates) do
    local out, status = sh(quote(c) .. [[ -e "io.write(_VERSION .. (rawget(_G, 'jit') and (' ' .. jit.version) or ''))"]])
    if status == 0 and out == want then return c end
  end
  error("cannot find the command of this interpreter (" .. want .. ")")
end)()

-- every variable through which a user's environment could lead Lua to a
-- module (those of all versions) or to a build tree
local CLEAN = "env -u LUA_PATH -u LUA_CPATH -u LUA_INIT -u FT_BUILD_DIR"
for _, v in ipairs { "5_1", "5_2", "5_3", "5_4" } do
  CLEAN = CLEAN .. (" -u LUA_PATH_%s -u LUA_CPATH_%s -u LUA_INIT_%s"):format(v, v, v)
end

--- Runs `lua <script> <args>` with a clean environment (plus the given
-- variables, e.g. "FT_BUILD_DIR=..."), from dir (default: the root).
local function lua(script, args, o)
  o = o or {}
  local cmd = ("cd %s && %s %s %s %s %s"):format(quote(o.dir or ROOT), CLEAN, o.env or "", quote(LUA),
    quote(script), args or "")
  if o.input then cmd = cmd .. " < " .. quote(o.input) end
  return sh(cmd)
end

local lines_of = h.lines_of

local tmpdir, rmdir = h.tmpdir, h.rmdir

local BENCH_OPTIONS = { "--device", "--impl", "--dtype", "--hdim", "--seqlen", "--causal", "--pass",
  "--tokens", "--width", "--warmup", "--reps", "--reference", "--csv", "--plot", "--no-check", "--help" }
local FLAGS = { ["--no-check"] = true, ["--help"] = true }

local SCRIPTS = { "bench.lua", "demo.lua", "train_tiny.lua", "profile.lua", "repl.lua",
  "mods_demo.lua", "generate.lua" }

describe("the scripts from a clone, with no LUA_PATH or LUA_CPATH", function()
  describe("scripts/bench.lua", function()
    it("--help needs no build, lists every option as it is typed and exits 0", function()
      local empty = tmpdir()
      -- from the root and from elsewhere, built or not
      for _, run in ipairs {
        { "scripts/bench.lua", {} },
        { ROOT .. "/scripts/bench.lua", { dir = empty, env = "FT_BUILD_DIR=" .. quote(empty) } },
      } do
        local out, status = lua(run[1], "--help", run[2])
        assert.are.equal(0, status, out)
        assert.is_truthy(out:find("^usage: lua scripts/bench.lua %[options%]"), out)
        for _, opt in ipairs(BENCH_OPTIONS) do
          assert.is_truthy(out:find("\n  " .. opt:gsub("%-", "%%-") .. "[ ,]"), opt .. " in\n" .. out)
        end
        assert.is_truthy(out:find("bench/sdpa-h200.csv", 1, true), out)
        assert.is_nil(out:find("shared/", 1, true), out)
        assert.is_nil(out:find("../", 1, true), out)
        local empty_listing = sh("ls -A " .. quote(empty))
        assert.are.equal("", empty_listing)
      end
      rmdir(empty)
      assert.is_true(exists(ROOT .. "/bench/sdpa-h200.csv"))
      -- -h too
      local out, status = lua("scripts/bench.lua", "-h")
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("--no-check", 1, true), out)
    end)

    it("takes every option --help lists, spelt as it shows it", function()
      for _, opt in ipairs(BENCH_OPTIONS) do
        local args = FLAGS[opt] and opt or (opt .. " x")
        local out, status = lua("scripts/bench.lua", args .. " --help")
        assert.are.equal(0, status, opt .. ": " .. out)
        assert.is_truthy(out:find("^usage:"), out)
      end
      -- --name=value too
      local out, status = lua("scripts/bench.lua", "--hdim=64 --help")
      assert.are.equal(0, status, out)
    end)

    it("rejects a bad option at once with one line and exit status 2", function()
      local cases = {
        { "--bogus 1", "unknown option '--bogus' (try --help)" },
        { "dtype f16", "unknown option 'dtype' (try --help)" },
        { "--reps", "option '--reps' needs a value" },
        { "--hdim 64,x --device cpu", "--hdim: 'x' is not a positive integer" },
        { "--reps 0 --device cpu", "--reps: '0' is not a positive integer" },
        { "--rounds 0 --device cpu", "--rounds: '0' is not a positive integer" },
        { "--warmup 1.5 --device cpu", "--warmup: '1.5' is not an integer >= 0" },
        { "--causal yes --device cpu", "--causal: 'yes' is not true or false" },
        { "--pass both --device cpu", "--pass: 'both' is not fwd or bwd" },
        { "--dtype f8 --device cpu", "--dtype: 'f8' is not a dtype (f16, bf16, f32, fp8_e4m3)" },
        { "--device tpu", "--device must be cuda, cuda:N or cpu, got 'tpu'" },
        { "--device cpu --impl flash", "--impl: 'flash' is not an implementation on the cpu" },
        { "--impl tiled", "--impl: 'tiled' is not an implementation on cuda" },
        { "--device cpu --impl +FT_WS", "--impl: '+FT_WS' is not an implementation on the cpu" },
      }
      for _, case in ipairs(cases) do
        local out, status, seconds = lua("scripts/bench.lua", case[1])
        assert.are.equal(2, status, case[1] .. ": " .. out)
        assert.are.equal(1, #lines_of(out), out)
        assert.is_truthy(out:find("bench.lua: " .. case[2], 1, true), case[1] .. ": " .. out)
        assert.is_true(seconds < 5, ("%s took %.1f s"):format(case[1], seconds))
      end
    end)

    it("finds flashtile in the clone's build/ by itself and times the CPU implementations", function()
      -- a clone whose build/ is this spec's build tree, run from elsewhere
      local clone, work = tmpdir(), tmpdir()
      assert(sh(("ln -s %s %s/scripts && ln -s %s %s/lua && ln -s %s %s/build"):format(quote(ROOT .. "/scripts"),
        quote(clone), quote(ROOT .. "/lua"), quote(clone), quote(BUILD), quote(clone))))
      local csv, svg = work .. "/r.csv", work .. "/r.svg"
      local out, status = lua(clone .. "/scripts/bench.lua",
        "--device cpu --dtype f32 --hdim 16 --seqlen 32,64 --causal true --pass fwd,bwd --impl tiled,naive"
        .. " --tokens 64 --width 32 --warmup 0 --reps 1 --rounds 2 --csv " .. quote(csv) .. " --plot " .. quote(svg),
        { dir = work })
      assert.are.equal(0, status, out)
      assert.is_nil(out:find("FAILED", 1, true), out)
      assert.is_truthy(out:find("| tiled | f32 | 2 | 2 | 32 | 16 | true | fwd |", 1, true), out)
      assert.is_truthy(out:find("| naive | f32 | 1 | 2 | 64 | 16 | true | bwd |", 1, true), out)
      local rows = lines_of(read_all(csv))
      assert.are.equal(1 + 8, #rows)
      assert.are.equal("variant,impl,dtype,B,H,N,d,causal,pass,ms,tflops,peak_bytes,ratio_flash,ratio_cudnn,error,of_gemm,"
        .. "ratio_run,ratio_run_impl", rows[1])
      -- two implementations: each row against the last one, naive, from this run
      assert.is_truthy(out:find("| of gemm | vs naive here |", 1, true), out)
      for i = 2, #rows do
        local ratio, impl = rows[i]:match(",([%d.]+),(%a+)$")
        assert.are.equal("naive", impl, rows[i])
        assert.is_true(tonumber(ratio) > 0, rows[i])
        if rows[i]:find("^none,naive,") then assert.are.equal("1.000", ratio, rows[i]) end
      end
      assert.is_truthy(read_all(svg):find("^<svg"))
      rmdir(clone)
      rmdir(work)
    end)

    it("takes an implementation with kernel switches on (IMPL+SWITCH), next to the same configuration without", function()
      local work = tmpdir()
      local csv = work .. "/r.csv"
      local out, status = lua(ROOT .. "/scripts/bench.lua",
        "--device cpu --dtype f32 --hdim 16 --seqlen 32,64 --causal true --pass fwd --impl tiled+FT_NO_DECODE,tiled"
        .. " --tokens 64 --width 32 --warmup 0 --reps 1 --csv " .. quote(csv) .. " --plot " .. quote(work .. "/r.svg"),
        { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
      assert.are.equal(0, status, out)
      assert.is_nil(out:find("FAILED", 1, true), out)
      local rows = lines_of(read_all(csv))
      assert.are.equal(1 + 4, #rows)
      for i = 2, #rows, 2 do -- one configuration's two rows one after the other
        assert.is_truthy(rows[i]:find("^none,tiled%+FT_NO_DECODE,f32,"), rows[i])
        assert.is_truthy(rows[i + 1]:find("^none,tiled,f32,"), rows[i + 1])
        assert.are.equal(rows[i]:match("^[^,]*,[^,]*,([^,]*,[^,]*,[^,]*,[^,]*,[^,]*,[^,]*,[^,]*)"),
          rows[i + 1]:match("^[^,]*,[^,]*,([^,]*,[^,]*,[^,]*,[^,]*,[^,]*,[^,]*,[^,]*)"))
        assert.is_truthy(rows[i]:find(",[%d.]+,tiled$"), rows[i])
      end
      -- the ratios' lowest, median and highest, by pass, from the rows
      local ratios = {}
      for i = 2, #rows, 2 do
        ratios[#ratios + 1] = tonumber(rows[i]:match(",([%d.]+),tiled$"))
      end
      table.sort(ratios)
      local mn, md, mx = out:match("tiled%+FT_NO_DECODE / tiled here, fwd: min ([%d.]+)x %(f32 d=16 N=%d+ causal%), "
        .. "median ([%d.]+)x, max ([%d.]+)x %(f32 d=16 N=%d+ causal%), 2 rows")
      assert.is_truthy(mn, out)
      -- (the CSV's ratios have three decimals, the line's two)
      assert.is_true(math.abs(ratios[1] - tonumber(mn)) <= 0.006, out)
      assert.is_true(math.abs((ratios[1] + ratios[2]) / 2 - tonumber(md)) <= 0.006, out)
      assert.is_true(math.abs(ratios[2] - tonumber(mx)) <= 0.006, out)
      -- a switch that is not one: one line, status 2, before any timing
      local bad, bad_status = lua(ROOT .. "/scripts/bench.lua", "--device cpu --impl tiled+FT_BOGUS",
        { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
      assert.are.equal(2, bad_status, bad)
      assert.are.equal(1, #lines_of(bad), bad)
      assert.is_truthy(bad:find("bench.lua: --impl: 'FT_BOGUS' in 'tiled+FT_BOGUS' is not a kernel switch", 1, true), bad)
      rmdir(work)
    end)

    it("times the variants, each checked first, TFLOP/s over the visible scores", function()
      local work = tmpdir()
      local out, status = lua(ROOT .. "/scripts/bench.lua",
        "--device cpu --dtype f32 --hdim 8 --seqlen 64 --causal true --pass fwd,bwd --impl tiled"
        .. " --variant none,window:8,alibi,softcap:5,sink,dropout:0.2 --tokens 64 --width 16"
        .. " --warmup 0 --reps 1", { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
      assert.are.equal(0, status, out)
      assert.is_nil(out:find("FAILED", 1, true), out)
      for _, v in ipairs { "none", "window:8", "alibi", "softcap:5", "sink", "dropout:0.2" } do
        assert.is_truthy(out:find("| " .. v .. " | tiled | f32 | 1 | 2 | 64 | 8 | true | bwd |", 1, true), out)
      end
      local _, bad = lua(ROOT .. "/scripts/bench.lua", "--device cpu --variant window:-3", { dir = work })
      assert.are.equal(2, bad)
      rmdir(work)
    end)

    it("takes the build tree from FT_BUILD_DIR", function()
      local work = tmpdir()
      local out, status = lua(ROOT .. "/scripts/bench.lua",
        "--device cpu --dtype f32 --hdim 8 --seqlen 16 --causal false --pass fwd --impl tiled"
        .. " --tokens 16 --width 8 --warmup 0 --reps 1", { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("| tiled | f32 | 1 | 1 | 16 | 8 | false | fwd |", 1, true), out)
      -- one implementation: no ratio of this run
      assert.is_nil(out:find(" here |", 1, true), out)
      -- the default files, in the current directory
      assert.is_true(exists(work .. "/bench-results.csv") and exists(work .. "/bench-results.svg"))
      rmdir(work)
    end)

    it("--decode times decoding with a KV cache, contiguous and paged, against a copy of the same run", function()
      local work = tmpdir()
      local out, status = lua(ROOT .. "/scripts/bench.lua", "--device cpu --decode --warmup 0 --reps 1",
        { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("a device%-to%-device copy in the same run: %d+ GB/s"), out)
      assert.is_truthy(out:find("| B x Nk | ms | KV GB/s | of the copy | paged (64) ms |", 1, true), out)
      assert.is_truthy(out:find("\n| 1 x 4096 | "), out)
      assert.is_truthy(out:find("\n| 4 x 2048 | "), out)
      assert.is_true(exists(work .. "/bench-results.csv"))
      -- --impl: a row for each, its kernel switches on while it runs
      out, status = lua(ROOT .. "/scripts/bench.lua",
        "--device cpu --decode --warmup 0 --reps 1 --impl tiled+FT_NO_DECODE,tiled",
        { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("| B x Nk | impl | ms |", 1, true), out)
      assert.is_truthy(out:find("\n| 1 x 4096 | tiled+FT_NO_DECODE | ", 1, true), out)
      assert.is_truthy(out:find("\n| 1 x 4096 | tiled | ", 1, true), out)
      -- --splits: the CUDA kernel's, refused on the cpu and without --decode
      for _, args in ipairs { "--device cpu --decode --splits 4", "--device cpu --splits 4" } do
        out, status = lua(ROOT .. "/scripts/bench.lua", args, { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
        assert.are.equal(2, status, args .. ": " .. out)
        assert.is_truthy(out:find("--splits", 1, true), out)
      end
      rmdir(work)
    end)

    it("without a usable GPU stops at once with one line, leaving no files", function()
      if ft.cuda.is_available() then
        pending("a CUDA GPU is available here: the benchmark runs on it")
        return
      end
      local work = tmpdir()
      for _, args in ipairs { "", "--device cuda --impl naive", "--device cuda:0 --reference bench/sdpa-h200.csv" } do
        local out, status, seconds = lua(ROOT .. "/scripts/bench.lua", args,
          { dir = work, env = "FT_BUILD_DIR=" .. quote(BUILD) })
        assert.are.equal(1, status, args .. ": " .. out)
        local lines = lines_of(out)
        assert.are.equal(1, #lines, out)
        assert.is_truthy(lines[1]:find("^bench%.lua: "), out)
        assert.is_truthy(lines[1]:find(ft.cuda.is_built() and "no CUDA GPU is available" or "built without CUDA",
          1, true), out)
        assert.is_truthy(lines[1]:find("--device cpu", 1, true), out)
        assert.is_true(seconds < 5, ("'%s' took %.1f s to stop"):format(args, seconds))
        assert.are.equal("", (sh("ls -A " .. quote(work))))
      end
      rmdir(work)
    end)
  end)

  describe("every runnable script", function()
    it("without a built flashtile says to run scripts/test in one line, exit status 1", function()
      local empty = tmpdir()
      for _, script in ipairs(SCRIPTS) do
        local out, status = lua("scripts/" .. script, "",
          { env = "FT_BUILD_DIR=" .. quote(empty), input = "/dev/null" })
        assert.are.equal(1, status, script .. ": " .. out)
        local lines = lines_of(out)
        assert.are.equal(1, #lines, script .. ": " .. out)
        assert.are.equal(("%s: flashtile is not built yet (no %s/flashtile/core.so): run scripts/test first to build flashtile")
          :format(script, empty), lines[1])
      end
      rmdir(empty)
    end)

    it("gets past the module paths from a clean environment", function()
      local env = "FT_BUILD_DIR=" .. quote(BUILD)
      local out, status = lua("scripts/train_tiny.lua", "--help", { env = env })
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("^usage: train_tiny.lua"), out)
      out, status = lua("scripts/train_tiny.lua", "--steps 2 --control false --device cpu", { env = env })
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("final loss %d"), out)

      out, status = lua("scripts/demo.lua", "1 2 16 8", { env = env })
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("max |naive - ", 1, true), out)
      for _, bad in ipairs { "1 2 16", "1 2 x 8", "1 2 16 0" } do
        out, status = lua("scripts/demo.lua", bad, { env = env })
        assert.are.equal(2, status, bad .. ": " .. out)
        assert.is_truthy(out:find("^demo.lua: bad arguments '" .. bad .. "'\nusage: "), out)
      end

      out, status = lua("scripts/mods_demo.lua", "cpu", { env = env })
      assert.are.equal(0, status, out)
      for _, want in ipairs { "equals plain attention with a zero table: 0",
                              "softcap 30: equals the built-in: 0",
                              "a Lua if on a traced value: gives" } do
        assert.is_truthy(out:find(want, 1, true), out)
      end
      -- the document alone is a shorter call: its products may round
      -- differently (the BLAS kernels a shape takes), within f32's rounding
      local doc_diff = tonumber(out:match("document 2 against it alone, causal, max |difference|: (%S+)"))
      assert.is_truthy(doc_diff and doc_diff <= 1e-5, out)

      local input = os.tmpname()
      local f = assert(io.open(input, "w"))
      f:write("1 +\n1\nft.ones(2):sum()\n")
      f:close()
      out, status = lua("scripts/repl.lua", "", { env = env, input = input })
      os.remove(input)
      assert.are.equal(0, status, out)
      assert.is_truthy(out:find("> >> 2\n> 2", 1, true), out)

      out, status = lua("scripts/profile.lua", "8 x", { env = env })
      assert.are.equal(2, status, out)
      assert.is_truthy(out:find("^profile.lua: seqlen must be a positive integer, got 'x'"), out)
      if not ft.cuda.is_available() then
        out, status = lua("scripts/profile.lua", "", { env = env })
        assert.are.equal(1, status, out)
        assert.are.equal(1, #lines_of(out), out)
        assert.is_truthy(out:find("^profile.lua: "), out)
      end
    end)

    it("compile under every Lua on this machine and use nothing of 5.3's or 5.4's alone", function()
      local files = { "bench.lua", "demo.lua", "train_tiny.lua", "profile.lua", "repl.lua", "lib/paths.lua" }
      local tried = 0
      for _, interp in ipairs { "lua5.1", "lua5.2", "lua5.3", "lua5.4", "luajit" } do
        if select(2, sh("command -v " .. interp)) == 0 then
          tried = tried + 1
          for _, file in ipairs(files) do
            local path = ROOT .. "/scripts/" .. file
            local out, status = sh(("%s -e %s"):format(interp,
              quote(("local f, err = loadfile(%q) if not f then print(err) os.exit(1) end"):format(path))))
            assert.are.equal(0, status, interp .. ": " .. out)
          end
        end
      end
      assert.is_true(tried >= 1)
      -- what compiles everywhere but is missing at run time in 5.1, 5.2 or LuaJIT
      for _, file in ipairs(files) do
        local n = 0
        for line in read_all(ROOT .. "/scripts/" .. file):gmatch("[^\n]*") do
          n = n + 1
          local code = line:gsub("%-%-.*$", "")
          for _, bad in ipairs { "table.pack(", "math.type(", "utf8.", 'read("a")', 'read("l")', 'read("L")',
                                 "read('a')", "read('l')", "read('L')", "goto " } do
            assert.is_nil(code:find(bad, 1, true), ("scripts/%s:%d: %s"):format(file, n, line))
          end
        end
      end
    end)
  end)

  describe("scripts/gpu-check", function()
    it("without a usable GPU fails with one line before building", function()
      local _, smi = sh("nvidia-smi -L")
      if smi == 0 and ft.cuda.is_available() then
        pending("a CUDA GPU is usable here: gpu-check would build and run everything")
        return
      end
      if smi == 0 then
        pending("nvidia-smi works here: gpu-check would build first, then stop")
        return
      end
      local logs = tmpdir() .. "/logs"
      -- (a gpu-check that went on to build would be stopped here, and fail;
      -- no sanitizer runtime preloaded into bash, whose leaks it would report)
      local out, status, seconds = sh("env -u LD_PRELOAD timeout 60 " .. quote(ROOT .. "/scripts/gpu-check")
        .. " " .. quote(logs))
      assert.are.equal(1, status, out)
      assert.are.equal(1, #lines_of(out), out)
      assert.is_truthy(out:find("^gpu%-check: no CUDA GPU usable: nvidia%-smi "), out)
      assert.is_false(exists(logs .. "/configure.log"), "it configured a build")
      assert.is_true(seconds < 10, ("%.1f s"):format(seconds))
      rmdir(logs:gsub("/logs$", ""))
    end)
  end)
end)
