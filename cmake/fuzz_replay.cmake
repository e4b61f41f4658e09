# cmake/fuzz_replay.cmake - the fuzz targets' inputs as plain tests, in
# every build (included at the end of cmake/specs.cmake; no clang or
# libFuzzer needed).
#
#   fuzz_replay_npy, fuzz_replay_safetensors
#       tests/fuzz/replay.c's main drives the target's
#       LLVMFuzzerTestOneInput (tests/fuzz/fuzz_<format>.c, built here
#       without libFuzzer) over the seed corpus, whose ok-/err- names say
#       which files must load and which must be rejected, and over every
#       input that once made a loader fail (tests/fuzz/regressions/<format>/),
#       so that each bug the fuzzer finds stays a test. Under FT_SANITIZE
#       they run with AddressSanitizer, LeakSanitizer and UBSan.
#   fuzz_corpus
#       the committed corpus is exactly what tests/fuzz/gen_corpus.c writes.

foreach(format npy safetensors)
  add_executable(fuzz_replay_${format}
    ${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/replay.c
    ${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/fuzz_${format}.c)
  target_include_directories(fuzz_replay_${format} PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/lib)
  target_link_libraries(fuzz_replay_${format} PRIVATE flashtile)
  add_test(NAME fuzz_replay_${format}
    COMMAND fuzz_replay_${format} --expect-by-name
            ${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/corpus/${format}
            ${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/regressions/${format})
  set(FT_FUZZ_REPLAY_ENV "TMPDIR=${CMAKE_BINARY_DIR}" ${FT_SANITIZER_ENV})
  set_tests_properties(fuzz_replay_${format} PROPERTIES ENVIRONMENT "${FT_FUZZ_REPLAY_ENV}")
endforeach()

add_executable(fuzz_corpus_gen ${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/gen_corpus.c)
add_test(NAME fuzz_corpus
  COMMAND fuzz_corpus_gen --check ${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/corpus)
