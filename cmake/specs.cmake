# Tests: each tests/test_*.c is a C program against the public header; each
# spec/*_spec.lua is run by busted under the Lua 5.4 interpreter, with the
# module taken from this build tree.

file(GLOB FT_C_TESTS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/tests/test_*.c)
foreach(src ${FT_C_TESTS})
  get_filename_component(name ${src} NAME_WE)
  add_executable(${name} ${src})
  target_include_directories(${name} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/lib)
  target_link_libraries(${name} PRIVATE flashtile m)
  add_test(NAME c_${name} COMMAND ${name})
  set_tests_properties(c_${name} PROPERTIES ENVIRONMENT "TMPDIR=${CMAKE_BINARY_DIR}")
endforeach()

find_program(FT_LUA_EXECUTABLE NAMES lua5.4 lua REQUIRED)
find_program(FT_BUSTED NAMES busted REQUIRED)

# Under the sanitizers the interpreter itself is not instrumented, so the
# ASan runtime has to be loaded first. libgomp is preloaded too: it keeps a
# small allocation from its start-up that LeakSanitizer would report once
# the Lua state unloads the module (and libgomp with it) at exit.
set(FT_SPEC_ENV "")
if(FT_SANITIZE)
  execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=libasan.so
                  OUTPUT_VARIABLE FT_ASAN_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(FT_PRELOAD "${FT_ASAN_RUNTIME}")
  if(OpenMP_C_FOUND)
    execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=libgomp.so.1
                    OUTPUT_VARIABLE FT_GOMP_RUNTIME OUTPUT_STRIP_TRAILING_WHITESPACE)
    string(APPEND FT_PRELOAD " ${FT_GOMP_RUNTIME}")
  endif()
  list(APPEND FT_SPEC_ENV
       "LD_PRELOAD=${FT_PRELOAD}"
       "ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:allocator_may_return_null=1"
       "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
endif()

file(GLOB FT_SPECS CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/spec/*_spec.lua)
foreach(spec ${FT_SPECS})
  get_filename_component(name ${spec} NAME_WE)
  add_test(NAME ${name}
    COMMAND ${FT_LUA_EXECUTABLE} ${FT_BUSTED} --cpath=${CMAKE_BINARY_DIR}/?.so
            --output=utfTerminal ${spec}
    WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${FT_SPEC_ENV}")
endforeach()

# On a Hopper GPU the flash kernels of kernels/*_sm90.cu take f16/bf16; the
# same spec again with FT_NO_WGMMA=1 keeps the mma.sync kernels (what other
# GPUs run) checked there too.
if(FT_CUDA_ENABLED)
  add_test(NAME cuda_attention_spec_mma
    COMMAND ${FT_LUA_EXECUTABLE} ${FT_BUSTED} --cpath=${CMAKE_BINARY_DIR}/?.so
            --output=utfTerminal ${CMAKE_CURRENT_SOURCE_DIR}/spec/cuda_attention_spec.lua
    WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  set(FT_MMA_ENV ${FT_SPEC_ENV})
  list(APPEND FT_MMA_ENV "FT_NO_WGMMA=1")
  set_tests_properties(cuda_attention_spec_mma PROPERTIES ENVIRONMENT "${FT_MMA_ENV}")
endif()
