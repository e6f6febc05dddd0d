# The layering of src/xmoe (docs/architecture.md), checked on every #include:
#   cmake -DSOURCE_DIR=<repo> -P cmake/CheckLayers.cmake
# Each folder may include itself and the folders listed for it, nothing above or beside. A
# violation prints file:line, the include and the layers the folder may use, and fails.
# Run by ctest as `layering`.

cmake_minimum_required(VERSION 3.25)

# folder -> the folders below it that it may include (bottom to top).
set(allowed_core "")
set(allowed_backend core)
set(allowed_ops core backend)
set(allowed_comm core backend)
set(allowed_config core)
set(allowed_io core)
set(allowed_moe core ops comm config)
set(allowed_parallel core ops comm config moe)
set(allowed_sched core ops comm config io moe parallel)
set(allowed_model core ops comm config moe parallel sched)
set(allowed_optim core ops comm config)
set(allowed_data core config io)
set(allowed_train core ops comm config io moe parallel sched model optim data)
set(allowed_plan core ops comm config io moe parallel sched model optim data train)
set(layers core backend ops comm config io moe parallel sched model optim data train plan)

if(NOT SOURCE_DIR)
  message(FATAL_ERROR "CheckLayers.cmake: pass -DSOURCE_DIR=<repository root>")
endif()
file(GLOB_RECURSE sources RELATIVE ${SOURCE_DIR}
     ${SOURCE_DIR}/src/xmoe/*.h ${SOURCE_DIR}/src/xmoe/*.cpp ${SOURCE_DIR}/src/xmoe/*.cu
     ${SOURCE_DIR}/src/xmoe/*.cuh)
set(violations 0)
set(checked 0)
foreach(file ${sources})
  string(REGEX MATCH "^src/xmoe/([a-z_]+)/" _ ${file})
  set(from ${CMAKE_MATCH_1})
  if(NOT from IN_LIST layers)
    message(SEND_ERROR "${file}: folder '${from}' is not a layer of cmake/CheckLayers.cmake")
    math(EXPR violations "${violations} + 1")
    continue()
  endif()
  # One list element per line: semicolons would split a line and brackets join lines in a
  # CMake list, so they go first.
  file(READ ${SOURCE_DIR}/${file} text)
  string(REPLACE ";" "," text "${text}")
  string(REPLACE "[" "(" text "${text}")
  string(REPLACE "]" ")" text "${text}")
  string(REPLACE "\n" ";" lines "${text}")
  set(line_number 0)
  foreach(line IN LISTS lines)
    math(EXPR line_number "${line_number} + 1")
    if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*\"xmoe/([a-z_]+)/")
      continue()
    endif()
    set(to ${CMAKE_MATCH_1})
    math(EXPR checked "${checked} + 1")
    if(to STREQUAL from OR to IN_LIST allowed_${from})
      continue()
    endif()
    string(REPLACE ";" ", " may "${allowed_${from}}")
    message(SEND_ERROR "${file}:${line_number}: ${line}\n"
                       "  ${from}/ may include only itself and: ${may}")
    math(EXPR violations "${violations} + 1")
  endforeach()
endforeach()
list(LENGTH sources files)
if(violations GREATER 0)
  message(FATAL_ERROR "layering: ${violations} include(s) go up or sideways (${files} files)")
endif()
message(STATUS "layering: ${checked} includes in ${files} files follow the layers")
