# pdserve_library(NAME <name> SOURCES ... DEPS ...)
# Declares the library pdserve_<name> (alias pdserve::<name>); headers are
# included as "<name>/<header>.h" from services/.
function(pdserve_library)
  cmake_parse_arguments(ARG "" "NAME" "SOURCES;DEPS" ${ARGN})
  set(_target pdserve_${ARG_NAME})
  add_library(${_target} STATIC ${ARG_SOURCES})
  add_library(pdserve::${ARG_NAME} ALIAS ${_target})
  target_include_directories(${_target} PUBLIC ${CMAKE_SOURCE_DIR}/services
                                               ${CMAKE_BINARY_DIR}/services)
  target_link_libraries(${_target} PUBLIC ${ARG_DEPS})
endfunction()

# pdserve_test(NAME <name> SOURCES ... DEPS ... [LABELS unit|integration|e2e|gpu|badinput ...])
# One GoogleTest binary; every TEST is discovered as its own CTest test.
function(pdserve_test)
  cmake_parse_arguments(ARG "" "NAME;TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 600)
  endif()
  add_executable(${ARG_NAME} ${ARG_SOURCES})
  target_link_libraries(${ARG_NAME} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock
                                            GTest::gtest_main)
  target_compile_definitions(${ARG_NAME}
    PRIVATE PDSERVE_MODELS_DIR="${PDSERVE_MODELS_DIR}"
            PDSERVE_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  # gtest_discover_tests passes properties through a generated script that
  # splits lists ("unit;badinput" would lose "badinput"), so the labels of a
  # test are joined into one label, e.g. "unit_badinput". `ctest -L` takes a
  # regular expression: -L badinput and -L unit both select it.
  string(REPLACE ";" "_" _labels "${ARG_LABELS}")
  if("badinput" IN_LIST ARG_LABELS)
    # Collected into the `badinput_tests` target: the sanitizer build compiles
    # only these.
    set_property(GLOBAL APPEND PROPERTY PDSERVE_BADINPUT_TESTS ${ARG_NAME})
  endif()
  if("gpu" IN_LIST ARG_LABELS)
    set_property(GLOBAL APPEND PROPERTY PDSERVE_GPU_TESTS ${ARG_NAME})
  endif()
  gtest_discover_tests(${ARG_NAME}
    PROPERTIES LABELS "${_labels}" TIMEOUT ${ARG_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
endfunction()
