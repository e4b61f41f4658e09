-- flashtile's REPL: Lua 5.4 with `ft` loaded, where a mistake costs one
-- line. lua -i prints a stack traceback under every error; here an error
-- prints its message alone and the session, its tensors and device memory
-- go on. An expression prints its values (tensors as tostring shows them);
-- an incomplete statement asks for more lines, as lua -i does.
--
--   scripts/ftlua            (runs this; line editing through rlwrap when installed)
ft = require "flashtile"

local function print_values(n, ...)
  if n == 0 then return end
  local out = {}
  for i = 1, n do out[i] = tostring((select(i, ...))) end
  print(table.concat(out, "\t"))
end

--- Compiles a chunk the way lua -i does: an expression first, then a
-- statement. Returns the function, or nil and the message, or nil and
-- "incomplete" when more input could complete it.
local function compile(source)
  local f, expr_err = load("return " .. source, "=stdin", "t")
  if f then return f end
  local g, err = load(source, "=stdin", "t")
  if g then return g end
  if err:sub(-5) == "<eof>" or expr_err:sub(-5) == "<eof>" then return nil, "incomplete" end
  return nil, err
end

print(("flashtile %s, %s (Ctrl-D to leave)"):format(ft.version, _VERSION))
while true do
  io.write("> ")
  io.flush()
  local source = io.read("L")
  if not source then io.write("\n") break end
  local f, err = compile(source)
  while not f and err == "incomplete" do
    io.write(">> ")
    io.flush()
    local more = io.read("L")
    if not more then break end
    source = source .. more
    f, err = compile(source)
  end
  if f then
    local res = table.pack(pcall(f))
    if res[1] then
      print_values(res.n - 1, table.unpack(res, 2, res.n))
    else
      print(tostring(res[2]))
    end
  elseif err ~= "incomplete" then
    print(err)
  end
end
