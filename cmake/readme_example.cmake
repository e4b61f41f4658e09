# cmake -DREADME=README.md -DEXAMPLE=tests/embed_example.c -P readme_example.cmake
# Fails unless README.md holds EXAMPLE's text as a ```c block whose first
# line is EXAMPLE's first line.
file(READ "${README}" readme)
file(READ "${EXAMPLE}" example)
string(FIND "${readme}" "```c\n${example}```" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md does not show ${EXAMPLE} as it is: copy the file into its ```c block")
endif()
message(STATUS "README.md shows ${EXAMPLE} as it is")
