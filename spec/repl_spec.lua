-- scripts/repl.lua, the REPL that scripts/ftlua opens: mistakes cost one
-- line, and the session, its tensors and its memory go on.
local h = require "helper"
local ft = h.ft

--- Runs the REPL on the given input lines; returns its output lines.
local function repl(lines)
  local input = os.tmpname()
  local f = assert(io.open(input, "w"))
  f:write(table.concat(lines, "\n"), "\n")
  f:close()
  -- the interpreter running this spec, with this spec's module paths
  local lua = arg and arg[-1] or "lua5.4"
  local cmd = ("LUA_PATH=%q LUA_CPATH=%q %q scripts/repl.lua < %q 2>&1"):format(
    package.path, package.cpath, lua, input)
  local p = assert(io.popen(cmd))
  local out = p:read("*a")
  p:close()
  os.remove(input)
  local result = {}
  for line in out:gmatch("[^\n]+") do result[#result + 1] = line end
  return result, out
end

describe("the REPL", function()
  it("prints an error as one line and goes on with the session's tensors intact", function()
    local out, all = repl {
      'q = ft.tensor({{1, 2, 3}, {4, 5, 6}}, {dtype = "f64"})',
      "q:view(5, 3)",
      'ft.zeros(2, {dtype = "f8"})',
      "q:sum()",
    }
    assert.is_nil(all:find("stack traceback", 1, true), all)
    local errors = {}
    for _, line in ipairs(out) do
      if line:find("bad argument", 1, true) then errors[#errors + 1] = line end
    end
    assert.are.equal(2, #errors, all)
    assert.is_truthy(errors[1]:find("shape {5, 3} has 15 elements, tensor {2, 3} has 6", 1, true), all)
    assert.is_truthy(errors[2]:find("unknown dtype 'f8'", 1, true), all)
    -- a float sum prints as Lua prints it: 21.0 from 5.3 on, 21 before
    assert.is_truthy(all:find("> " .. tostring(21.0), 1, true), all)
  end)

  it("prints values, continues incomplete statements, and survives a freed tensor", function()
    local _, all = repl {
      "1 +",
      "2",
      "for i = 1, 2 do",
      "  print(i * 10)",
      "end",
      "t = ft.ones(3)",
      "t:free()",
      "t:sum()",
      "#{1, 2}",
    }
    assert.is_truthy(all:find(">> 3", 1, true), all)
    assert.is_truthy(all:find("10\n20", 1, true), all)
    assert.is_truthy(all:find("tensor has been freed", 1, true), all)
    assert.is_truthy(all:find("> 2\n", 1, true), all)
  end)
end)
