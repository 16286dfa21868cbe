# wsync_build_flags: the INTERFACE target every wsync target links; it carries the language level,
# the warning set and the sanitizer flags, so all modules build the same way.
add_library(wsync_build_flags INTERFACE)
target_compile_features(wsync_build_flags INTERFACE cxx_std_20)
target_compile_options(wsync_build_flags INTERFACE -Wall -Wextra -Wpedantic -Wshadow
                       -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Woverloaded-virtual)
if(WSYNC_ENABLE_WERROR)
  target_compile_options(wsync_build_flags INTERFACE -Werror)
endif()
if(WSYNC_SANITIZER STREQUAL "address")
  target_compile_options(wsync_build_flags INTERFACE -fsanitize=address,undefined
                         -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(wsync_build_flags INTERFACE -fsanitize=address,undefined)
elseif(WSYNC_SANITIZER STREQUAL "thread")
  target_compile_options(wsync_build_flags INTERFACE -fsanitize=thread -fno-omit-frame-pointer)
  target_link_options(wsync_build_flags INTERFACE -fsanitize=thread)
elseif(WSYNC_SANITIZER STREQUAL "fuzzer")
  # libFuzzer (Clang only; the `fuzz` preset): every module is instrumented for coverage and
  # checked by ASan+UBSan; only the fuzz targets link libFuzzer's main (fuzz/CMakeLists.txt).
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "WSYNC_SANITIZER=fuzzer needs Clang (libFuzzer); use the fuzz preset")
  endif()
  target_compile_options(wsync_build_flags INTERFACE -fsanitize=fuzzer-no-link,address,undefined
                         -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(wsync_build_flags INTERFACE -fsanitize=address,undefined)
elseif(NOT WSYNC_SANITIZER STREQUAL "")
  message(FATAL_ERROR
          "WSYNC_SANITIZER must be '', 'address', 'thread' or 'fuzzer', not '${WSYNC_SANITIZER}'")
endif()

# wsync_add_component(NAME SOURCES ... [DEPS ...] [PRIVATE_DEPS ...])
# Builds module NAME as the static library wsync_NAME with its public headers in include/ and,
# when tests are on, one GoogleTest binary from every *.test.cpp beside the sources, so no
# hand-kept list of tests can rot.
function(wsync_add_component name)
  cmake_parse_arguments(arg "" "" "SOURCES;DEPS;PRIVATE_DEPS;TEST_DEPS" ${ARGN})
  set(target wsync_${name})
  add_library(${target} STATIC ${arg_SOURCES})
  add_library(wsync::${name} ALIAS ${target})
  target_include_directories(${target} PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}/include"
                             PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
  target_link_libraries(${target} PUBLIC wsync_build_flags ${arg_DEPS} PRIVATE ${arg_PRIVATE_DEPS})
  if(WSYNC_ENABLE_TESTS)
    file(GLOB_RECURSE tests CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/*.test.cpp")
    if(tests)
      add_executable(${target}_test ${tests})
      target_link_libraries(${target}_test PRIVATE ${target} ${arg_PRIVATE_DEPS} ${arg_TEST_DEPS}
                            GTest::gtest GTest::gtest_main rapidcheck)
      target_include_directories(${target}_test PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}"
                                 "${PROJECT_SOURCE_DIR}/tests/support")
      include(GoogleTest)
      gtest_discover_tests(${target}_test TEST_PREFIX "${name}." DISCOVERY_TIMEOUT 60
                           PROPERTIES LABELS "unit")
    endif()
  endif()
endfunction()
