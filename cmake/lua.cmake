# cmake/lua.cmake - which Lua flashtile is built for.
#
#   -DFT_LUA=5.1|5.2|5.3|5.4|luajit   that Lua (an error when it is missing)
#   (FT_LUA empty)                    the newest found: 5.4, 5.3, 5.2, 5.1,
#                                     then LuaJIT
#   -DFT_LUA_INCDIR=dir               these headers, whatever their version
#                                     (read from lua.h; luajit.h beside it
#                                     means LuaJIT); a rock's build passes
#                                     luarocks's LUA_INCDIR here
#   -DFT_LUA_INTERPRETER=path         this interpreter for the specs
#
# Each Lua is looked for through pkg-config first (Debian's modules lua5.4,
# lua5.3, lua5.2, lua5.1 and luajit; other systems' lua-5.4, lua54, lua),
# then with find_path/find_program/find_library under the usual names, and
# finally as a bare include/lua.h (a Lua installed from its sources), whose
# version is read from the header. Whatever is found, the version in lua.h
# decides.
#
# Sets (plain variables):
#   FT_LUA_NAME            5.1, 5.2, 5.3, 5.4 or luajit
#   FT_LUA_VERSION         the Lua API version: 5.1 to 5.4 (5.1 for LuaJIT);
#                          also the name of the install directories
#                          (lib/lua/<V>, share/lua/<V>)
#   FT_LUA_INCLUDE_DIR     the directory of lua.h
#   FT_LUA_EXECUTABLE      the interpreter, or empty
#   FT_LUA_LIBRARY         the shared library a host program links, or empty
#   FT_LUA_STATIC_LIBRARY  the static library, or empty
#
# The Lua module itself links none of these: the host (the interpreter or
# an embedding program) provides Lua's symbols.

set(FT_LUA "" CACHE STRING "Lua to build for: 5.1, 5.2, 5.3, 5.4 or luajit (empty: the newest found)")
set_property(CACHE FT_LUA PROPERTY STRINGS "" 5.4 5.3 5.2 5.1 luajit)
set(FT_LUA_INCDIR "" CACHE PATH "Lua headers to build against (overrides the search; version read from lua.h)")
set(FT_LUA_INTERPRETER "" CACHE FILEPATH "Lua interpreter for the specs (overrides the search)")

find_package(PkgConfig QUIET)

# ft_lua_header_version(<dir> <out-version> <out-name>): "5.4"/"5.4" from
# <dir>/lua.h, "5.1"/"luajit" when <dir>/luajit.h exists; empty if unreadable.
function(ft_lua_header_version dir out_version out_name)
  set(version "")
  set(name "")
  if(EXISTS "${dir}/lua.h")
    file(STRINGS "${dir}/lua.h" num_line REGEX "^#define[ \t]+LUA_VERSION_NUM[ \t]+[0-9]+")
    if(num_line MATCHES "LUA_VERSION_NUM[ \t]+([0-9])0*([0-9]+)")
      set(version "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
      set(name "${version}")
      if(EXISTS "${dir}/luajit.h")
        set(name luajit)
      endif()
    endif()
  endif()
  set(${out_version} "${version}" PARENT_SCOPE)
  set(${out_name} "${name}" PARENT_SCOPE)
endfunction()

# ft_lua_interpreter_version(<exe> <out>): _VERSION's number ("5.4"), "" if it does not run.
function(ft_lua_interpreter_version exe out)
  set(version "")
  if(exe)
    execute_process(COMMAND "${exe}" -e "io.write(_VERSION)"
                    OUTPUT_VARIABLE v ERROR_QUIET RESULT_VARIABLE rc TIMEOUT 10)
    if(rc EQUAL 0 AND v MATCHES "^Lua ([0-9]+\\.[0-9]+)")
      set(version "${CMAKE_MATCH_1}")
    endif()
  endif()
  set(${out} "${version}" PARENT_SCOPE)
endfunction()

# ft_lua_candidate(<name>): looks for one Lua (5.4 ... or luajit); sets
# FT_LUA_C_FOUND and FT_LUA_C_INCLUDE_DIR / _EXECUTABLE / _LIBRARY /
# _STATIC_LIBRARY in the caller. Results of the searches are cached per
# candidate (FT_LUA_<tag>_*), so a later configure asking for another Lua
# finds it without clearing anything.
function(ft_lua_candidate name)
  if(name STREQUAL "luajit")
    set(tag JIT)
    set(api 5.1)
    set(pc_modules luajit)
    set(header luajit.h)
    set(suffixes luajit-2.1 luajit-2.0 luajit)
    set(exe_names luajit)
    set(lib_names luajit-5.1 luajit)
    set(static_names libluajit-5.1.a libluajit.a)
  else()
    string(REPLACE "." "" compact "${name}")
    set(tag ${compact})
    set(api ${name})
    set(pc_modules lua${name} lua-${name} lua${compact})
    set(header lua.h)
    set(suffixes lua${name} lua-${name} lua${compact})
    set(exe_names lua${name} lua-${name} lua${compact})
    set(lib_names lua${name} lua-${name} lua${compact})
    set(static_names liblua${name}.a liblua-${name}.a liblua${compact}.a)
  endif()

  set(inc "")
  set(lib "")
  # pkg-config first
  if(PKG_CONFIG_FOUND)
    foreach(m ${pc_modules})
      pkg_check_modules(FT_LUA_PC_${tag}_${m} QUIET ${m})
      if(FT_LUA_PC_${tag}_${m}_FOUND)
        foreach(d ${FT_LUA_PC_${tag}_${m}_INCLUDE_DIRS})
          if(NOT inc AND EXISTS "${d}/${header}")
            set(inc "${d}")
          endif()
        endforeach()
        if(NOT inc AND EXISTS "${FT_LUA_PC_${tag}_${m}_INCLUDEDIR}/${header}")
          set(inc "${FT_LUA_PC_${tag}_${m}_INCLUDEDIR}")
        endif()
        list(GET FT_LUA_PC_${tag}_${m}_LINK_LIBRARIES 0 lib)
        if(inc)
          break()
        endif()
      endif()
    endforeach()
  endif()
  # then the usual names
  if(NOT inc)
    find_path(FT_LUA_${tag}_INCLUDE_DIR NAMES ${header} PATH_SUFFIXES ${suffixes})
    if(FT_LUA_${tag}_INCLUDE_DIR)
      set(inc "${FT_LUA_${tag}_INCLUDE_DIR}")
    endif()
  endif()
  # the header's own word decides
  if(inc)
    ft_lua_header_version("${inc}" v n)
    if(NOT n STREQUAL name)
      set(inc "")
    endif()
  endif()

  find_program(FT_LUA_${tag}_EXECUTABLE NAMES ${exe_names})
  set(exe "${FT_LUA_${tag}_EXECUTABLE}")
  if(NOT exe)
    set(exe "")
  endif()
  if(NOT lib)
    find_library(FT_LUA_${tag}_LIBRARY NAMES ${lib_names})
    if(FT_LUA_${tag}_LIBRARY)
      set(lib "${FT_LUA_${tag}_LIBRARY}")
    endif()
  endif()
  find_library(FT_LUA_${tag}_STATIC_LIBRARY NAMES ${static_names})
  set(static "${FT_LUA_${tag}_STATIC_LIBRARY}")
  if(NOT static)
    set(static "")
  endif()

  set(FT_LUA_C_FOUND FALSE PARENT_SCOPE)
  if(inc)
    set(FT_LUA_C_FOUND TRUE PARENT_SCOPE)
  endif()
  set(FT_LUA_C_INCLUDE_DIR "${inc}" PARENT_SCOPE)
  set(FT_LUA_C_EXECUTABLE "${exe}" PARENT_SCOPE)
  set(FT_LUA_C_LIBRARY "${lib}" PARENT_SCOPE)
  set(FT_LUA_C_STATIC_LIBRARY "${static}" PARENT_SCOPE)
endfunction()

# A bare include/lua.h (and lua, liblua): a Lua built from its sources.
function(ft_lua_generic)
  find_path(FT_LUA_ANY_INCLUDE_DIR NAMES lua.h)
  find_program(FT_LUA_ANY_EXECUTABLE NAMES lua)
  find_library(FT_LUA_ANY_LIBRARY NAMES lua)
  find_library(FT_LUA_ANY_STATIC_LIBRARY NAMES liblua.a)
  set(FT_LUA_G_NAME "" PARENT_SCOPE)
  if(FT_LUA_ANY_INCLUDE_DIR)
    ft_lua_header_version("${FT_LUA_ANY_INCLUDE_DIR}" v n)
    set(FT_LUA_G_NAME "${n}" PARENT_SCOPE)
    set(FT_LUA_G_INCLUDE_DIR "${FT_LUA_ANY_INCLUDE_DIR}" PARENT_SCOPE)
    set(exe "")
    ft_lua_interpreter_version("${FT_LUA_ANY_EXECUTABLE}" ev)
    if(ev STREQUAL v AND NOT n STREQUAL "luajit")
      set(exe "${FT_LUA_ANY_EXECUTABLE}")
    endif()
    set(FT_LUA_G_EXECUTABLE "${exe}" PARENT_SCOPE)
    set(lib "")
    set(static "")
    if(NOT n STREQUAL "luajit")
      if(FT_LUA_ANY_LIBRARY)
        set(lib "${FT_LUA_ANY_LIBRARY}")
      endif()
      if(FT_LUA_ANY_STATIC_LIBRARY)
        set(static "${FT_LUA_ANY_STATIC_LIBRARY}")
      endif()
    endif()
    set(FT_LUA_G_LIBRARY "${lib}" PARENT_SCOPE)
    set(FT_LUA_G_STATIC_LIBRARY "${static}" PARENT_SCOPE)
  endif()
endfunction()

set(FT_LUA_KNOWN 5.4 5.3 5.2 5.1 luajit)
if(FT_LUA AND NOT FT_LUA IN_LIST FT_LUA_KNOWN)
  message(FATAL_ERROR "FT_LUA=${FT_LUA}: expected one of 5.1, 5.2, 5.3, 5.4, luajit (or empty for the newest found)")
endif()

set(FT_LUA_NAME "")
set(FT_LUA_INCLUDE_DIR "")
set(FT_LUA_EXECUTABLE "")
set(FT_LUA_LIBRARY "")
set(FT_LUA_STATIC_LIBRARY "")

if(FT_LUA_INCDIR)
  # Headers named directly: their version decides, FT_LUA must agree.
  ft_lua_header_version("${FT_LUA_INCDIR}" FT_LUA_HDR_VERSION FT_LUA_HDR_NAME)
  if(NOT FT_LUA_HDR_NAME)
    message(FATAL_ERROR "FT_LUA_INCDIR=${FT_LUA_INCDIR}: no readable lua.h there")
  endif()
  if(FT_LUA AND NOT FT_LUA STREQUAL FT_LUA_HDR_NAME)
    message(FATAL_ERROR "FT_LUA=${FT_LUA} but the lua.h in FT_LUA_INCDIR=${FT_LUA_INCDIR} is ${FT_LUA_HDR_NAME}")
  endif()
  ft_lua_candidate(${FT_LUA_HDR_NAME})
  set(FT_LUA_NAME "${FT_LUA_HDR_NAME}")
  set(FT_LUA_INCLUDE_DIR "${FT_LUA_INCDIR}")
  set(FT_LUA_EXECUTABLE "${FT_LUA_C_EXECUTABLE}")
  set(FT_LUA_LIBRARY "${FT_LUA_C_LIBRARY}")
  set(FT_LUA_STATIC_LIBRARY "${FT_LUA_C_STATIC_LIBRARY}")
else()
  if(FT_LUA)
    set(FT_LUA_WANTED ${FT_LUA})
  else()
    set(FT_LUA_WANTED ${FT_LUA_KNOWN})
  endif()
  foreach(cand ${FT_LUA_WANTED})
    ft_lua_candidate(${cand})
    if(FT_LUA_C_FOUND)
      set(FT_LUA_NAME "${cand}")
      set(FT_LUA_INCLUDE_DIR "${FT_LUA_C_INCLUDE_DIR}")
      set(FT_LUA_EXECUTABLE "${FT_LUA_C_EXECUTABLE}")
      set(FT_LUA_LIBRARY "${FT_LUA_C_LIBRARY}")
      set(FT_LUA_STATIC_LIBRARY "${FT_LUA_C_STATIC_LIBRARY}")
      break()
    endif()
  endforeach()
  if(NOT FT_LUA_NAME)
    ft_lua_generic()
    if(FT_LUA_G_NAME AND (NOT FT_LUA OR FT_LUA STREQUAL FT_LUA_G_NAME))
      set(FT_LUA_NAME "${FT_LUA_G_NAME}")
      set(FT_LUA_INCLUDE_DIR "${FT_LUA_G_INCLUDE_DIR}")
      set(FT_LUA_EXECUTABLE "${FT_LUA_G_EXECUTABLE}")
      set(FT_LUA_LIBRARY "${FT_LUA_G_LIBRARY}")
      set(FT_LUA_STATIC_LIBRARY "${FT_LUA_G_STATIC_LIBRARY}")
    endif()
  endif()
  if(NOT FT_LUA_NAME)
    if(FT_LUA)
      set(FT_LUA_MISSING "Lua ${FT_LUA}")
      if(FT_LUA STREQUAL "luajit")
        set(FT_LUA_MISSING "LuaJIT")
        set(FT_LUA_APT libluajit-5.1-dev)
      else()
        set(FT_LUA_APT liblua${FT_LUA}-dev)
      endif()
      message(FATAL_ERROR "FT_LUA=${FT_LUA}: the headers of ${FT_LUA_MISSING} were not found "
                          "(Debian: apt-get install ${FT_LUA_APT}; or name them with -DFT_LUA_INCDIR=...)")
    endif()
    message(FATAL_ERROR "No Lua headers found (5.1 to 5.4 or LuaJIT; Debian: apt-get install "
                        "liblua5.4-dev; or name them with -DFT_LUA_INCDIR=...)")
  endif()
endif()

if(FT_LUA_NAME STREQUAL "luajit")
  set(FT_LUA_VERSION 5.1)
else()
  set(FT_LUA_VERSION ${FT_LUA_NAME})
endif()

if(FT_LUA_INTERPRETER)
  set(FT_LUA_EXECUTABLE "${FT_LUA_INTERPRETER}")
endif()
# An interpreter of another version would run the specs against a module
# built for the wrong API.
if(FT_LUA_EXECUTABLE)
  ft_lua_interpreter_version("${FT_LUA_EXECUTABLE}" FT_LUA_EXE_VERSION)
  if(NOT FT_LUA_EXE_VERSION STREQUAL FT_LUA_VERSION)
    message(FATAL_ERROR "The Lua interpreter ${FT_LUA_EXECUTABLE} is Lua '${FT_LUA_EXE_VERSION}', "
                        "but the headers (${FT_LUA_INCLUDE_DIR}) are ${FT_LUA_NAME}")
  endif()
endif()

message(STATUS "flashtile: Lua ${FT_LUA_NAME} (headers ${FT_LUA_INCLUDE_DIR}; "
               "interpreter ${FT_LUA_EXECUTABLE}; FT_LUA=${FT_LUA})")
