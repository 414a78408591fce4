# Small helpers shared by every folder.

# ptk_add_library(NAME SOURCES... DEPS...) -> target ptk_NAME, alias ptk::NAME
function(ptk_add_library name)
  cmake_parse_arguments(A "" "" "SOURCES;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(ptk_${name} STATIC ${A_SOURCES})
  add_library(ptk::${name} ALIAS ptk_${name})
  target_include_directories(ptk_${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(ptk_${name} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
endfunction()

# ptk_add_tool(ptk-NAME SOURCE DEPS...) -> an executable in build/bin
function(ptk_add_tool name source)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE ${ARGN})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
  install(TARGETS ${name} RUNTIME DESTINATION bin)
endfunction()

# The tests' precompiled header (tests/test_pch.h), built once by an object library whose compile
# options are the tests' own (the same directory, definitions and GoogleTest), reused by every test.
# It holds no header whose meaning depends on a definition that only some tests have (fmt's
# FMT_SHARED, simdjson's threads): GCC would reject the header for those (-Winvalid-pch says so).
macro(ptk_test_pch)
  if(NOT TARGET ptk_test_pch)
    add_library(ptk_test_pch OBJECT ${PROJECT_SOURCE_DIR}/tests/test_pch.cpp)
    target_link_libraries(ptk_test_pch PRIVATE GTest::gtest GTest::gmock)
    target_include_directories(ptk_test_pch PRIVATE ${PROJECT_SOURCE_DIR})
    target_compile_definitions(ptk_test_pch PRIVATE
      PTK_SOURCE_DIR="${PROJECT_SOURCE_DIR}" PTK_BINARY_DIR="${PROJECT_BINARY_DIR}")
    target_precompile_headers(ptk_test_pch PRIVATE ${PROJECT_SOURCE_DIR}/tests/test_pch.h)
  endif()
endmacro()

# ptk_add_test(NAME SOURCES... DEPS... LABELS...) -> gtest binary registered with CTest
function(ptk_add_test name)
  cmake_parse_arguments(A "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${A_SOURCES})
  target_link_libraries(${name} PRIVATE ${A_DEPS} GTest::gtest GTest::gtest_main GTest::gmock)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_definitions(${name} PRIVATE
    PTK_SOURCE_DIR="${PROJECT_SOURCE_DIR}" PTK_BINARY_DIR="${PROJECT_BINARY_DIR}")
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  if(PTK_PRECOMPILED_HEADERS)
    ptk_test_pch()
    target_precompile_headers(${name} REUSE_FROM ptk_test_pch)
    # GCC 12 reports -Warray-bounds and -Wstringop-overflow inside libstdc++'s char_traits (std::string's
    # operator+ at -O1, known false positives) once the standard headers come from a precompiled header:
    # their system-header silence is lost. The tests turn those two off; the libraries and tools keep them.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      target_compile_options(${name} PRIVATE -Wno-array-bounds -Wno-stringop-overflow)
    endif()
  endif()
  add_test(NAME ${name} COMMAND ${name})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 600)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${A_LABELS}" TIMEOUT ${A_TIMEOUT}
    ENVIRONMENT "PTK_BIN_DIR=${PROJECT_BINARY_DIR}/bin")
endfunction()

# ptk_add_gpu_test(NAME SOURCES... DEPS...) -> a CUDA test (only where nvcc was found) labelled gpu.
# Its main (tests/gpu_test_main.cpp) exits 77 only without an NVIDIA driver or with one that reports no
# device (CTest shows it skipped); any other CUDA error fails it.
function(ptk_add_gpu_test name)
  cmake_parse_arguments(A "" "TIMEOUT" "SOURCES;DEPS" ${ARGN})
  if(NOT PTK_WITH_CUDA)
    return()
  endif()
  if(NOT TARGET ptk_gpu_test_main)  # the main, compiled once for all of them
    add_library(ptk_gpu_test_main OBJECT ${PROJECT_SOURCE_DIR}/tests/gpu_test_main.cpp)
    target_link_libraries(ptk_gpu_test_main PRIVATE CUDA::cudart GTest::gtest)
  endif()
  add_executable(${name} ${A_SOURCES} $<TARGET_OBJECTS:ptk_gpu_test_main>)
  target_link_libraries(${name} PRIVATE ${A_DEPS} CUDA::cudart GTest::gtest GTest::gmock)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 600)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "gpu" TIMEOUT ${A_TIMEOUT} SKIP_RETURN_CODE 77)
endfunction()
