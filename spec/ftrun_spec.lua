-- scripts/ftrun, the launcher of one process per GPU (ft.dist's second
-- process model), run as a user runs it from a clone. The ranks here are
-- small Lua scripts that need no GPU and no flashtile: they report the
-- environment ftrun gives them, fail, or wait to be killed.
local h = require "helper"
local ft = h.ft

local quote, exists, read_all, absolute = h.quote, h.exists, h.read_all, h.absolute
local ROOT, BUILD = h.ROOT, assert(h.BUILD, "flashtile/core.so is not on package.cpath")
assert(exists(ROOT .. "/scripts/ftrun"), "the specs run from the repository's root")
local sh = h.sh
local function write_all(path, s)
  local f = assert(io.open(path, "wb"))
  f:write(s)
  f:close()
end


local tmpdir, rmdir = h.tmpdir, h.rmdir

local lines_of = h.lines_of

--- Runs `scripts/ftrun <args>` from the root with this spec's build tree,
-- temporary files under tmp and the extra variables of env ("A=1 B=2"):
-- its stdout, its stderr, its exit status and its wall-clock seconds. (No
-- sanitizer runtime is preloaded into bash, whose leaks it would report.)
local function ftrun(args, tmp, env)
  local errfile = os.tmpname()
  local cmd = ("cd %s && env -u LD_PRELOAD FT_BUILD_DIR=%s TMPDIR=%s %s scripts/ftrun %s 2> %s")
    :format(quote(ROOT), quote(BUILD), quote(tmp), env or "", args, quote(errfile))
  local t0 = ft.clock()
  local out, status = sh(cmd)
  local seconds = ft.clock() - t0
  local err = read_all(errfile)
  os.remove(errfile)
  return out, err, status, seconds
end

describe("scripts/ftrun", function()
  local work, tmp -- the scripts of a test; ftrun's TMPDIR
  before_each(function()
    work, tmp = tmpdir(), tmpdir()
  end)
  after_each(function()
    rmdir(work)
    rmdir(tmp)
  end)

  it("runs every rank once with its environment, a shared id file in a private directory and prefixed output", function()
    local script = work .. "/env.lua"
    write_all(script, [[
local function env(name) return os.getenv(name) or "(unset)" end
local id = env("FT_ID_FILE")
-- rank 0 finds no id file yet, and writes one as ft.dist.init does
local existed = "-"
if env("FT_RANK") == "0" then
  existed = tostring(io.open(id, "rb") ~= nil)
  local f = assert(io.open(id, "wb"))
  f:write("unique id")
  f:close()
end
local args = {}
for i = 1, select("#", ...) do args[i] = (select(i, ...)) end
print(("rank=%s local=%s world=%s device=%s nvls=%s existed=%s id=%s args=%s"):format(env("FT_RANK"),
  env("FT_LOCAL_RANK"), env("FT_WORLD_SIZE"), env("FT_DEVICE"), env("NCCL_NVLS_ENABLE"), existed,
  id, table.concat(args, "|")))
io.stderr:write("to stderr from ", env("FT_RANK"), "\n")
]])
    local out, err, status, seconds = ftrun("-n 3 " .. quote(script) .. " a 'b c' --flag", tmp,
      "NCCL_NVLS_ENABLE=1")
    assert.are.equal(0, status, out .. err)
    assert.is_true(seconds < 10, ("%.1f s"):format(seconds))

    local ranks, id = {}, nil
    local lines = lines_of(out)
    assert.are.equal(3, #lines, out)
    for _, line in ipairs(lines) do
      local r, rest = line:match("^%[(%d)%] (.*)$")
      assert.is_truthy(r, line)
      assert.is_nil(ranks[r], "rank " .. r .. " ran twice:\n" .. out)
      ranks[r] = true
      local file = rest:match(" id=(%S+) ")
      assert.is_truthy(file, line)
      assert.are.equal(("rank=%s local=%s world=3 device=%s nvls=0 existed=%s id=%s args=a|b c|--flag")
        :format(r, r, r, r == "0" and "false" or "-", file), rest)
      id = id or file
      assert.are.equal(id, file, "one id file for every rank:\n" .. out)
    end
    assert.is_true(ranks["0"] and ranks["1"] and ranks["2"], out)

    -- a file in a directory of its own under TMPDIR, gone with the directory
    local dir = id:match("^(.*)/[^/]+$")
    assert.are.equal(tmp, dir:match("^(.*)/[^/]+$"), id)
    assert.is_false(exists(id))
    assert.are.equal("", (sh("ls -A " .. quote(tmp))))

    -- stderr lines on stderr, prefixed too
    local errs = lines_of(err)
    table.sort(errs)
    assert.are.same({ "[0] to stderr from 0", "[1] to stderr from 1", "[2] to stderr from 2" }, errs)
  end)

  it("after a rank fails waits --timeout seconds, kills the rest and exits with the rank's status", function()
    local script, pidfile, fifo = work .. "/fail.lua", work .. "/pid", work .. "/never"
    assert(sh("mkfifo " .. quote(fifo)))
    write_all(script, ([[
local rank = os.getenv("FT_RANK")
if rank == "1" then
  -- this process's pid, then a wait for a writer that never comes
  local pid = io.open("/proc/self/stat"):read("*l"):match("^%%d+")
  local f = assert(io.open(%q, "wb"))
  f:write(pid)
  f:close()
  io.open(%q, "rb")
  print("rank 1 should not get here")
elseif rank == "0" then
  local t0 = os.time()
  while not io.open(%q, "rb") and os.time() - t0 < 5 do end
  print("rank 0 fails")
  os.exit(3)
end
]]):format(pidfile, fifo, pidfile))
    local out, err, status, seconds = ftrun("--timeout 1 -n 3 " .. quote(script), tmp)
    assert.are.equal(3, status, out .. err)
    assert.is_true(seconds < 8, ("%.1f s"):format(seconds))
    assert.are.equal("[0] rank 0 fails\n", out)
    assert.is_truthy(err:find("ftrun: rank 0 exited with status 3\n", 1, true), err)
    assert.is_truthy(err:find("ftrun: killed rank 1 with TERM", 1, true), err)
    assert.is_nil(err:find("rank 2", 1, true), err)
    local pid = read_all(pidfile)
    assert.is_truthy(pid:find("^%d+$"), pid)
    local _, alive = sh("kill -0 " .. pid)
    assert.are_not.equal(0, alive, "rank 1 (pid " .. pid .. ") is still running")
    assert.are.equal("", (sh("ls -A " .. quote(tmp))))
  end)

  it("rejects bad usage with one line naming the problem, the usage and exit status 2", function()
    local script = work .. "/ok.lua"
    write_all(script, "print('ran')\n")
    local cases = {
      { "-n 0 " .. quote(script), "-n: '0' is not an integer >= 1" },
      { "-n x " .. quote(script), "-n: 'x' is not an integer >= 1" },
      { "--nproc -2 " .. quote(script), "-n: '-2' is not an integer >= 1" },
      { quote(script), "the number of processes is missing (-n N)" },
      { "-n 2", "no script given" },
      { "-n 2 " .. quote(work .. "/missing.lua"), "no such script: " .. work .. "/missing.lua" },
      { "-n 2 --timeout soon " .. quote(script), "--timeout: 'soon' is not a whole number of seconds >= 0" },
      { "-n 2 --bogus " .. quote(script), "unknown option '--bogus'" },
      { "-n", "option '-n' needs a value" },
    }
    for _, case in ipairs(cases) do
      local out, err, status = ftrun(case[1], tmp)
      assert.are.equal(2, status, case[1] .. ": " .. out .. err)
      assert.are.equal("", out, case[1])
      local lines = lines_of(err)
      assert.are.equal(2, #lines, err)
      assert.are.equal("ftrun: " .. case[2], lines[1])
      assert.is_truthy(lines[2]:find("^usage: scripts/ftrun %-n N "), err)
    end
    assert.are.equal("", (sh("ls -A " .. quote(tmp))))

    local out, err, status = ftrun("--help", tmp)
    assert.are.equal(0, status, out .. err)
    assert.is_truthy(out:find("^usage: scripts/ftrun %-n N %[%-%-timeout SECONDS%] script%.lua %[args%.%.%.%]\n"), out)
    assert.is_truthy(out:find("NCCL_NVLS_ENABLE=0", 1, true), out)
    assert.are.equal("", err)
    -- --nproc N and -nN as -n N
    for _, args in ipairs { "--nproc 2", "--nproc=2", "-n2" } do
      out, err, status = ftrun(args .. " " .. quote(script), tmp)
      assert.are.equal(0, status, args .. ": " .. out .. err)
      local lines = lines_of(out)
      table.sort(lines)
      assert.are.same({ "[0] ran", "[1] ran" }, lines)
    end
  end)
end)
