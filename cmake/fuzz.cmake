# cmake/fuzz.cmake - libFuzzer targets for the file loaders (-DFT_FUZZ=ON,
# included from CMakeLists.txt). Needs clang and its libFuzzer runtime
# (Debian: clang and libclang-rt-<version>-dev); configure a build
# directory of its own with CC=clang. scripts/fuzz does all of it:
#
#   CC=clang cmake -S . -B build-fuzz -DFT_FUZZ=ON -DFT_CUDA=OFF -DFT_BUILD_TESTS=OFF
#   cmake --build build-fuzz --target fuzz_npy fuzz_safetensors
#   build-fuzz/fuzz_npy -dict=tests/fuzz/npy.dict CORPUS-COPY/
#
#   fuzz_npy           ft_load_npy (tests/fuzz/fuzz_npy.c)
#   fuzz_safetensors   ft_safetensors_load and ft_safetensors_tensor
#                      (tests/fuzz/fuzz_safetensors.c)
#
# The library's sources are compiled again here, into flashtile_fuzz (a
# static library), with the fuzzer's coverage instrumentation and
# AddressSanitizer + UndefinedBehaviorSanitizer; every UBSan check aborts
# (no recovery), so undefined behaviour is reported as a crash.
# Given a file as argument, a target runs that one input: the
# reproduction of a crash.

if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "FT_FUZZ=ON needs clang (libFuzzer); the C compiler here is "
                      "${CMAKE_C_COMPILER_ID} ${CMAKE_C_COMPILER}. Configure a new build "
                      "directory with CC=clang (Debian: apt-get install clang "
                      "libclang-rt-<version>-dev), or run scripts/fuzz.")
endif()

set(FT_FUZZ_SANITIZERS -fsanitize=address,undefined -fno-sanitize-recover=all
                       -fno-omit-frame-pointer -g)

include(CheckCSourceCompiles)
set(CMAKE_REQUIRED_FLAGS "-fsanitize=fuzzer,address,undefined")
set(CMAKE_REQUIRED_LINK_OPTIONS "-fsanitize=fuzzer,address,undefined")
check_c_source_compiles("
  #include <stddef.h>
  #include <stdint.h>
  int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }"
  FT_HAVE_LIBFUZZER)
unset(CMAKE_REQUIRED_FLAGS)
unset(CMAKE_REQUIRED_LINK_OPTIONS)
if(NOT FT_HAVE_LIBFUZZER)
  string(REGEX MATCH "^[0-9]+" FT_CLANG_MAJOR "${CMAKE_C_COMPILER_VERSION}")
  message(FATAL_ERROR "FT_FUZZ=ON: ${CMAKE_C_COMPILER} cannot link -fsanitize=fuzzer: "
                      "libFuzzer's runtime is missing (Debian: apt-get install "
                      "libclang-rt-${FT_CLANG_MAJOR}-dev)")
endif()

add_library(flashtile_fuzz STATIC)
ft_library_setup(flashtile_fuzz)
target_compile_options(flashtile_fuzz PRIVATE
  "$<$<COMPILE_LANGUAGE:C>:-fsanitize=fuzzer-no-link;${FT_FUZZ_SANITIZERS}>")

foreach(format npy safetensors)
  add_executable(fuzz_${format}
    ${CMAKE_CURRENT_SOURCE_DIR}/tests/fuzz/fuzz_${format}.c)
  target_compile_options(fuzz_${format} PRIVATE -fsanitize=fuzzer ${FT_FUZZ_SANITIZERS})
  target_link_options(fuzz_${format} PRIVATE -fsanitize=fuzzer ${FT_FUZZ_SANITIZERS})
  target_link_libraries(fuzz_${format} PRIVATE flashtile_fuzz)
endforeach()
add_custom_target(fuzz DEPENDS fuzz_npy fuzz_safetensors)
