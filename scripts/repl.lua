-- flashtile's REPL: Lua with `ft` loaded, where a mistake costs one line.
-- lua -i prints a stack traceback under every error; here an error prints
-- its message alone and the session, its tensors and device memory go on.
-- An expression prints its values (tensors as tostring shows them); an
-- incomplete statement asks for more lines, as lua -i does. Runs under Lua
-- 5.1 to 5.4 and LuaJIT.
--
--   scripts/ftlua            (runs this; line editing through rlwrap when installed)
--   lua scripts/repl.lua     (from a clone: flashtile from lua/ and build/ or $FT_BUILD_DIR)
local ok
ok, ft = pcall(require, "flashtile")
if not ok then
  local here = debug.getinfo(1, "S").source:match("^@(.-)[^/\\]*$") or ""
  ft = dofile(here .. "lib/paths.lua").require("repl.lua", here)
end

local unpack = table.unpack or unpack
local function pack(...) return { n = select("#", ...), ... } end

local function print_values(n, ...)
  if n == 0 then return end
  local out = {}
  for i = 1, n do out[i] = tostring((select(i, ...))) end
  print(table.concat(out, "\t"))
end

--- Compiles source as chunk "=stdin" (Lua 5.1's load takes no string).
local function load_text(source)
  if _VERSION == "Lua 5.1" then return loadstring(source, "=stdin") end
  return load(source, "=stdin", "t")
end

--- Compiles a chunk the way lua -i does: an expression first, then a
-- statement. Returns the function, or nil and the message, or nil and
-- "incomplete" when more input could complete it.
local function compile(source)
  local f, expr_err = load_text("return " .. source)
  if f then return f end
  local g, err = load_text(source)
  if g then return g end
  -- the parser ends at the end of the input: "... near <eof>" (Lua 5.1 and
  -- LuaJIT quote it: "near '<eof>'")
  if err:find("<eof>'?$") or expr_err:find("<eof>'?$") then return nil, "incomplete" end
  return nil, err
end

--- The next line of input with its newline, or nil at the end.
local function read_line()
  local line = io.read("*l")
  return line and line .. "\n"
end

print(("flashtile %s, %s (Ctrl-D to leave)"):format(ft.version,
  rawget(_G, "jit") and jit.version or _VERSION))
while true do
  io.write("> ")
  io.flush()
  local source = read_line()
  if not source then io.write("\n") break end
  local f, err = compile(source)
  while not f and err == "incomplete" do
    io.write(">> ")
    io.flush()
    local more = read_line()
    if not more then break end
    source = source .. more
    f, err = compile(source)
  end
  if f then
    local res = pack(pcall(f))
    if res[1] then
      print_values(res.n - 1, unpack(res, 2, res.n))
    else
      print(tostring(res[2]))
    end
  elseif err ~= "incomplete" then
    print(err)
  end
end
