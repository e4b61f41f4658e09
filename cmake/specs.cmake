# Tests: each tests/test_*.c is a C program against the public header; each
# spec/*_spec.lua is run by busted under the interpreter of the Lua chosen
# in cmake/lua.cmake, with the module taken from this build tree; the
# embedding hosts (tests/embed_host.c) run Lua inside a C program.

file(GLOB FT_C_TESTS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/tests/test_*.c)
foreach(src ${FT_C_TESTS})
  get_filename_component(name ${src} NAME_WE)
  add_executable(${name} ${src})
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/lib)
  target_link_libraries(${name} PRIVATE flashtile m)
  add_test(NAME c_${name} COMMAND ${name})
  set_tests_properties(c_${name} PROPERTIES ENVIRONMENT "TMPDIR=${CMAKE_BINARY_DIR}")
endforeach()

# ---- busted, under the chosen interpreter --------------------------------------
if(NOT FT_LUA_EXECUTABLE)
  message(FATAL_ERROR "The specs need the Lua ${FT_LUA_NAME} interpreter, which was not found "
                      "(Debian: apt-get install lua${FT_LUA_VERSION}, or luajit; or name it with "
                      "-DFT_LUA_INTERPRETER=...; or configure with -DFT_BUILD_TESTS=OFF)")
endif()
find_program(FT_BUSTED NAMES busted REQUIRED)
# Debian's busted is a Lua script, run here by the chosen interpreter; a
# busted that is a shell wrapper (as luarocks installs it) runs as it is,
# with the Lua it was installed for.
file(STRINGS ${FT_BUSTED} FT_BUSTED_SHEBANG LIMIT_COUNT 1)
if(FT_BUSTED_SHEBANG MATCHES "lua")
  set(FT_BUSTED_COMMAND ${FT_LUA_EXECUTABLE} ${FT_BUSTED})
  execute_process(COMMAND ${FT_LUA_EXECUTABLE} -e "require 'busted.runner'"
                  RESULT_VARIABLE FT_BUSTED_RC OUTPUT_QUIET ERROR_QUIET)
  if(NOT FT_BUSTED_RC EQUAL 0)
    message(FATAL_ERROR "busted's modules are not installed for ${FT_LUA_EXECUTABLE} "
                        "(require 'busted.runner' fails); install busted for Lua ${FT_LUA_VERSION}")
  endif()
else()
  set(FT_BUSTED_COMMAND ${FT_BUSTED})
  message(STATUS "flashtile: ${FT_BUSTED} is not a Lua script; the specs run under the Lua it chooses")
endif()

# Under the sanitizers the interpreter itself is not instrumented, so the
# ASan runtime has to be loaded first. libgomp is preloaded too: it keeps a
# small allocation from its start-up that LeakSanitizer would report once
# the Lua state unloads the module (and libgomp with it) at exit.
# The specs' compiled mods (kernels/attention/rtc.cu) go to the build tree's
# cache, not the user's.
set(FT_SPEC_ENV "FT_CACHE_DIR=${CMAKE_BINARY_DIR}/rtc-cache")
set(FT_SANITIZER_ENV "")
if(FT_SANITIZE)
  execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=libasan.so
                  OUTPUT_VARIABLE FT_ASAN_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(FT_PRELOAD "${FT_ASAN_RUNTIME}")
  if(OpenMP_C_FOUND)
    execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=libgomp.so.1
                    OUTPUT_VARIABLE FT_GOMP_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
    string(APPEND FT_PRELOAD " ${FT_GOMP_RUNTIME}")
  endif()
  list(APPEND FT_SANITIZER_ENV
       "ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1"
       "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
  list(APPEND FT_SPEC_ENV "LD_PRELOAD=${FT_PRELOAD}" ${FT_SANITIZER_ENV})
endif()

file(GLOB FT_SPECS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/spec/*_spec.lua)
foreach(spec ${FT_SPECS})
  get_filename_component(name ${spec} NAME_WE)
  add_test(NAME ${name}
    COMMAND ${FT_BUSTED_COMMAND} --cpath=${CMAKE_BINARY_DIR}/?.so
            --output=utfTerminal ${spec}
    WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${FT_SPEC_ENV}")
endforeach()

# The GPU specs again with a variable that picks other kernels: spec
# <name> runs as <name>_<suffix> with VAR=1 (the specs named after var, or
# the three attention specs).
function(ft_spec_again suffix var)
  set(env ${FT_SPEC_ENV})
  list(APPEND env "${var}=1")
  set(names ${ARGN})
  if(NOT names)
    set(names cuda_attention_spec cuda_variants_spec cuda_mods_spec)
  endif()
  foreach(name ${names})
    add_test(NAME ${name}_${suffix}
      COMMAND ${FT_BUSTED_COMMAND} --cpath=${CMAKE_BINARY_DIR}/?.so
              --output=utfTerminal ${CMAKE_CURRENT_SOURCE_DIR}/spec/${name}.lua
      WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
    set_tests_properties(${name}_${suffix} PROPERTIES ENVIRONMENT "${env}")
  endforeach()
endfunction()

# On a Hopper GPU the flash kernels of kernels/attention/sm90/ take f16/bf16;
# with FT_NO_WGMMA=1 the mma.sync kernels (what other GPUs run) are checked
# there too. Which Hopper kernel runs depends on the length
# (flash_tiles.cuh): FT_WS=1 takes the warp-specialised forward at every
# length, FT_PERSIST=1 its persistent form (head dims 65 to 128) at every
# length, FT_NO_WS=1 the wgmma forward and backward kernels instead of the
# warp-specialised ones; FT_TURNS=1 the d 128 forward with turns at every
# length (by default from 8192 keys), FT_LAZY_RESCALE=1 and
# FT_NO_LAZY_RESCALE=1 the forward whose O is rescaled only when a row's
# maximum grows by 2^8, at every head dim, and the one that rescales at
# every new maximum (by default: head dims 65 to 128 the first;
# lib/switches.c); FT_NO_CAP_MAX=1 the forward of a bf16 softcap, built-in
# or a narrow Lua score, with a running maximum.
if(FT_CUDA_ENABLED)
  ft_spec_again(mma FT_NO_WGMMA)
  ft_spec_again(ws FT_WS)
  ft_spec_again(nows FT_NO_WS)
  ft_spec_again(persist FT_PERSIST cuda_attention_spec cuda_variants_spec)
  ft_spec_again(turns FT_TURNS)
  ft_spec_again(lazy FT_LAZY_RESCALE cuda_attention_spec cuda_variants_spec)
  ft_spec_again(nolazy FT_NO_LAZY_RESCALE cuda_attention_spec cuda_variants_spec)
  ft_spec_again(nocap FT_NO_CAP_MAX cuda_variants_spec cuda_mods_spec)
endif()

# ---- embedding hosts -------------------------------------------------------------
# tests/embed_host.c, built two ways; each runs two Lua states on two threads.
#   embed_host_static   the binding linked in (flashtile_lua_static), registered
#                       with luaL_requiref; Lua from its shared library.
#   embed_host_dynamic  Lua linked statically and its symbols exported (-Wl,-E);
#                       the binding loaded from flashtile/core.so, as `lua` does.
find_package(Threads REQUIRED)
add_library(flashtile_lua_static STATIC lua/lflashtile.c)
target_include_directories(flashtile_lua_static PUBLIC ${FT_LUA_INCLUDE_DIR})
target_link_libraries(flashtile_lua_static PUBLIC flashtile)

# tests/embed_example.c is the host README.md shows under "Embedding": it is
# built and run here (beside embed_host_static, the same way), and
# readme_embed_example checks that the README's copy is this file.
if(FT_LUA_LIBRARY)
  foreach(host embed_host_static embed_example)
    string(REPLACE "_static" "" src ${host})
    add_executable(${host} tests/${src}.c)
    target_link_libraries(${host} PRIVATE flashtile_lua_static ${FT_LUA_LIBRARY}
                          Threads::Threads m ${CMAKE_DL_LIBS})
    add_test(NAME ${host} COMMAND ${host} ${CMAKE_CURRENT_SOURCE_DIR}/lua)
    set_tests_properties(${host} PROPERTIES ENVIRONMENT "${FT_SANITIZER_ENV}")
  endforeach()
  set_tests_properties(embed_example PROPERTIES
    PASS_REGULAR_EXPRESSION "seed 1: [0-9.e+-]+ [0-9.e+-]+\nseed 2|seed 2: [0-9.e+-]+ [0-9.e+-]+\nseed 1")
else()
  message(STATUS "flashtile: no shared Lua ${FT_LUA_NAME} library found; embed_host_static and embed_example not built")
endif()

if(FT_LUA_STATIC_LIBRARY)
  add_executable(embed_host_dynamic tests/embed_host.c)
  target_compile_definitions(embed_host_dynamic PRIVATE FT_EMBED_DYNAMIC=1)
  target_include_directories(embed_host_dynamic PRIVATE ${FT_LUA_INCLUDE_DIR})
  target_link_libraries(embed_host_dynamic PRIVATE ${FT_LUA_STATIC_LIBRARY}
                        Threads::Threads m ${CMAKE_DL_LIBS})
  # Export Lua's symbols from the executable, for flashtile/core.so.
  set_target_properties(embed_host_dynamic PROPERTIES ENABLE_EXPORTS ON)
  add_dependencies(embed_host_dynamic flashtile_core)
  add_test(NAME embed_host_dynamic
           COMMAND embed_host_dynamic ${CMAKE_CURRENT_SOURCE_DIR}/lua ${CMAKE_BINARY_DIR})
  set_tests_properties(embed_host_dynamic PROPERTIES ENVIRONMENT "${FT_SANITIZER_ENV}")
else()
  message(STATUS "flashtile: no static Lua ${FT_LUA_NAME} library found; embed_host_dynamic not built")
endif()

add_test(NAME readme_embed_example
  COMMAND ${CMAKE_COMMAND} -DREADME=${CMAKE_CURRENT_SOURCE_DIR}/README.md
          -DEXAMPLE=${CMAKE_CURRENT_SOURCE_DIR}/tests/embed_example.c
          -P ${CMAKE_CURRENT_SOURCE_DIR}/cmake/readme_example.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/fuzz_replay.cmake) # the fuzz inputs as tests (tests/fuzz)
