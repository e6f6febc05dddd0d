# Every C++/CUDA source of the repository is formatted as .clang-format says:
#   cmake -DSOURCE_DIR=<repo> -DCLANG_FORMAT=<clang-format-14> -P cmake/CheckFormat.cmake
# Run by ctest as `format` where clang-format 14 is installed (scripts/install-deps.sh installs
# it; other versions format differently, so they are not used). Lists each file that differs
# and how to fix it.
cmake_minimum_required(VERSION 3.25)
if(NOT SOURCE_DIR OR NOT CLANG_FORMAT)
  message(FATAL_ERROR "CheckFormat.cmake: pass -DSOURCE_DIR=<repo> -DCLANG_FORMAT=<program>")
endif()
set(globs)
foreach(dir src tests bench tools python)
  foreach(ext h cpp cu cuh)
    list(APPEND globs ${SOURCE_DIR}/${dir}/*.${ext})
  endforeach()
endforeach()
file(GLOB_RECURSE files RELATIVE ${SOURCE_DIR} ${globs})
list(FILTER files EXCLUDE REGEX "^(tests/data|python/build)/")
set(bad)
foreach(file ${files})
  execute_process(COMMAND ${CLANG_FORMAT} --dry-run --Werror ${file}
                  WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
  if(NOT rc EQUAL 0)
    list(APPEND bad ${file})
  endif()
endforeach()
list(LENGTH files n)
if(bad)
  list(JOIN bad "\n  " listed)
  message(FATAL_ERROR "format: these files differ from .clang-format:\n  ${listed}\n"
                      "Fix: ${CLANG_FORMAT} -i <file>")
endif()
message(STATUS "format: ${n} files follow .clang-format")
