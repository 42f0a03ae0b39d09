# Helpers that turn one folder of src/ into one library (+ its tests), so that the layering of
# ../shared/spec/04-architecture.md is visible in the build: nibble_<layer> links only the
# layers below it. Tests live next to the code as *_test.cpp (CPU) and *_test.cu (GPU).

# Flags every nibble target gets. Format code must be bit-exact across CPU and GPU, so
# floating-point contraction (FMA) is off everywhere and fast-math is never used.
function(nibble_target_defaults target)
  target_compile_features(${target} PUBLIC cxx_std_20)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -ffp-contract=off>
    $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20 --fmad=false --expt-relaxed-constexpr -Xcompiler=-ffp-contract=off>
    # nvcc's front end rejects fmt 9's consteval format-string checks: check them in C++ only.
    $<$<COMPILE_LANGUAGE:CUDA>:-DFMT_CONSTEVAL= -DFMT_USE_CONSTEXPR=1>)
  if(NIBBLE_NATIVE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
  endif()
  if(NIBBLE_SANITIZE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer>)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()

# nibble_layer(<dir> DEPS ... [TEST_DEPS ...]): library nibble_<dir with / -> _> from src/<dir>/*.cpp.
# A folder with no .cpp yet becomes an INTERFACE library (headers only). TEST_DEPS: extra
# libraries only the layer's test program links (e.g. formats tests read golden files with io).
function(nibble_layer dir)
  cmake_parse_arguments(ARG "" "" "DEPS;TEST_DEPS" ${ARGN})
  string(REPLACE "/" "_" name ${dir})
  set(target nibble_${name})
  file(GLOB srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${dir}/*.cpp)
  list(FILTER srcs EXCLUDE REGEX "_test\\.cpp$")
  if(srcs)
    add_library(${target} STATIC ${srcs})
    nibble_target_defaults(${target})
    target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR}/src)
    target_link_libraries(${target} PUBLIC ${ARG_DEPS})
    target_compile_definitions(${target} PUBLIC NIBBLE_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  else()
    add_library(${target} INTERFACE)
    target_include_directories(${target} INTERFACE ${PROJECT_SOURCE_DIR}/src)
    target_link_libraries(${target} INTERFACE ${ARG_DEPS})
    target_compile_features(${target} INTERFACE cxx_std_20)
    target_compile_definitions(${target} INTERFACE NIBBLE_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
  endif()
  if(NIBBLE_TESTS)
    nibble_tests(${dir} DEPS ${target} ${ARG_TEST_DEPS})
  endif()
endfunction()

# Test programs' own C++ (the *_test.cpp files; the code under test is in the libraries, built
# with the build type's flags) is compiled at -O1: their compile time is mostly the optimizer's
# (inlining, vectorization), -O1 cuts it by about 30% (trainer_test.cpp: 26.6 s -> 18.8 s), and
# without fast-math or FP contraction the results are the same bits at any level.
function(nibble_test_code_flags target)
  if(CMAKE_BUILD_TYPE MATCHES "^(Release|RelWithDebInfo)$")
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-O1>)
  endif()
endfunction()

# nibble_tests(<dir> DEPS ...): one GoogleTest program per folder from src/<dir>/*_test.cpp.
function(nibble_tests dir)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  string(REPLACE "/" "_" name ${dir})
  file(GLOB tests CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${dir}/*_test.cpp)
  if(NOT tests)
    return()
  endif()
  set(target nibble_${name}_tests)
  add_executable(${target} ${tests})
  nibble_target_defaults(${target})
  if(NOT name STREQUAL "formats")  # the format tests enumerate every float in their own loops: full -O
    nibble_test_code_flags(${target})
  endif()
  target_link_libraries(${target} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main)
  target_compile_definitions(${target} PRIVATE
    NIBBLE_TESTDATA_DIR="${PROJECT_SOURCE_DIR}/../shared/testdata"
    NIBBLE_BINARY_DIR="${CMAKE_BINARY_DIR}")
  set_target_properties(${target} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  gtest_discover_tests(${target} DISCOVERY_TIMEOUT 60 PROPERTIES LABELS "${name}" SKIP_RETURN_CODE 77)
endfunction()

# The CUDA backend: src/<dir>/*.cu + *.cpp; GPU tests from *_test.cu (they GTEST_SKIP without
# a device, so CI's GPU-less run still builds and starts them).
function(nibble_cuda_layer dir)
  cmake_parse_arguments(ARG "" "" "DEPS" ${ARGN})
  string(REPLACE "/" "_" name ${dir})
  set(target nibble_${name})
  file(GLOB srcs CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${dir}/*.cu ${PROJECT_SOURCE_DIR}/src/${dir}/*.cpp)
  list(FILTER srcs EXCLUDE REGEX "_test\\.(cu|cpp)$")
  add_library(${target} STATIC ${srcs})
  nibble_target_defaults(${target})
  set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF CUDA_ARCHITECTURES ${NIBBLE_CUDA_ARCH})
  target_include_directories(${target} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${target} PUBLIC ${ARG_DEPS})
  target_compile_definitions(${target} PUBLIC NIBBLE_HAVE_CUDA=1)
  if(NIBBLE_TESTS)
    file(GLOB tests CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/src/${dir}/*_test.cu ${PROJECT_SOURCE_DIR}/src/${dir}/*_test.cpp)
    if(tests)
      add_executable(${target}_tests ${tests})
      nibble_target_defaults(${target}_tests)
      nibble_test_code_flags(${target}_tests)
      set_target_properties(${target}_tests PROPERTIES CUDA_ARCHITECTURES ${NIBBLE_CUDA_ARCH})
      target_link_libraries(${target}_tests PRIVATE ${target} nibble_io GTest::gtest GTest::gtest_main)
      target_compile_definitions(${target}_tests PRIVATE
        NIBBLE_TESTDATA_DIR="${PROJECT_SOURCE_DIR}/../shared/testdata")
      set_target_properties(${target}_tests PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
      # Registered as one ctest entry (discovery would need a GPU-capable run at build time).
      add_test(NAME ${target}_tests COMMAND ${target}_tests)
      set_tests_properties(${target}_tests PROPERTIES LABELS "gpu" SKIP_RETURN_CODE 77)
    endif()
  endif()
endfunction()
