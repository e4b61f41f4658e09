-- Finds flashtile for the Lua scripts of scripts/ when they run straight
-- from a clone (lua scripts/bench.lua, luajit scripts/demo.lua, ...), with
-- no LUA_PATH or LUA_CPATH set: the Lua half from the clone's lua/, the C
-- half (flashtile/core.so) from the build tree, build/ or $FT_BUILD_DIR.
-- A script first tries a plain require "flashtile" (scripts/ftlua, busted
-- and an installed module need nothing more), and loads this file only
-- when that fails:
--
--   local ok, ft = pcall(require, "flashtile")
--   if not ok then
--     local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
--     ft = dofile(here .. "lib/paths.lua").require("bench.lua", here)
--   end
--
-- When flashtile cannot be loaded even so, paths.require prints one line
-- on stderr (not built yet, or the error of the load) and exits with
-- status 1 instead of a traceback.
local paths = {}

--- The interpreter, as a user would name it: "Lua 5.2", "LuaJIT 2.1.0-beta3".
function paths.interpreter()
  return rawget(_G, "jit") and jit.version or _VERSION
end

--- The clone's root from the directory of scripts/ ("" is the current one).
function paths.root(scripts_dir)
  local dir = (scripts_dir or ""):gsub("[/\\]+$", "")
  if dir == "" or dir == "." then return ".." end
  local parent, last = dir:match("^(.-)[/\\]?([^/\\]*)$")
  if last == "." or last == ".." then return dir .. "/.." end
  if parent == "" then return dir:sub(1, 1) == "/" and "/" or "." end
  return parent
end

--- The build tree: $FT_BUILD_DIR, else root/build.
function paths.build_dir(root)
  local env = os.getenv("FT_BUILD_DIR")
  if env and env ~= "" then return (env:gsub("[/\\]+$", "")) end
  return (root == "." and "" or root .. "/") .. "build"
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local function fail(script, msg)
  io.stderr:write(script, ": ", msg, "\n")
  os.exit(1)
end

--- Puts the clone's lua/ and the build tree first on the module paths and
-- returns require "flashtile"; on failure prints one line and exits 1.
function paths.require(script, scripts_dir)
  local root = paths.root(scripts_dir)
  local build = paths.build_dir(root)
  local prefix = root == "." and "" or root .. "/"
  package.path = prefix .. "lua/?.lua;" .. prefix .. "lua/?/init.lua;" .. package.path
  package.cpath = build .. "/?.so;" .. package.cpath
  -- Lua 5.1 leaves a marker in package.loaded after a failed require
  for _, name in ipairs { "flashtile", "flashtile.core" } do
    if type(package.loaded[name]) ~= "table" then package.loaded[name] = nil end
  end
  local ok, ft = pcall(require, "flashtile")
  if ok then return ft end
  local core = build .. "/flashtile/core.so"
  if not exists(prefix .. "lua/flashtile/init.lua") then
    fail(script, ("flashtile's Lua files are not in %slua/ (is this a clone of flashtile?)"):format(prefix))
  end
  if not exists(core) then
    fail(script, ("flashtile is not built yet (no %s): run scripts/test first to build flashtile"):format(core))
  end
  -- the loader's last line says why (e.g. "undefined symbol: ...")
  local why = tostring(ft):gsub("%s+$", ""):match("([^\n]*)$"):gsub("^%s+", "")
  if why:sub(1, #core + 1) == core .. ":" then why = why:sub(#core + 2):gsub("^%s+", "") end
  fail(script, ("%s does not load under %s: %s"):format(core, paths.interpreter(), why))
end

--- A script's options from its command line (the global arg), through
-- parse(args) -> options, or nil and a message: on --help (the message is
-- usage) prints it and exits 0, on a bad argument prints the message on
-- stderr and exits 2.
--- --name value pairs of the command line into a table (dashes in names
-- become underscores), each value read as kinds[name]: "int" (a whole
-- number, else nil), "number", "bool" ("true" or "false", else nil) or
-- "string"; check(name, value, text) may return a message for a bad one.
-- Returns the table, or nil and a message (--help: nil and usage).
function paths.parse_args(args, kinds, usage, check)
  local o, i = {}, 1
  while args[i] do
    local name = args[i]:match("^%-%-([%w_%-]+)$")
    if name == "help" then return nil, usage end
    local kind = name and kinds[name]
    if not kind then return nil, ("unknown argument '%s'\n%s"):format(args[i], usage) end
    local text = args[i + 1]
    if text == nil then return nil, ("--%s needs a value\n%s"):format(name, usage) end
    local v = text
    if kind == "int" or kind == "number" then
      v = tonumber(text)
      if kind == "int" and v and (v ~= math.floor(v) or v ~= v or v == math.huge or v == -math.huge) then
        v = nil
      end
      if kind == "int" and v and math.tointeger then v = math.tointeger(v) end
    elseif kind == "bool" then
      if text == "true" then v = true elseif text == "false" then v = false else v = nil end
    end
    local err = check and check(name, v, text)
    if err then return nil, err end
    o[(name:gsub("%-", "_"))] = v
    i = i + 2
  end
  return o
end

function paths.options(parse, usage)
  local o, err = parse(arg or {})
  if o then return o end
  local help = err == usage
  ;(help and io.stdout or io.stderr):write(err, "\n")
  os.exit(help and 0 or 2)
end

return paths
