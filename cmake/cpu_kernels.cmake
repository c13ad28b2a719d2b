# The torch-free CPU kernels (csrc/cpu) as a static library, and their C++ unit tests under ctest.
# No global -march: the SIMD files select their instruction set with target pragmas and isa.cpp
# picks one at run time, so this library (like the torch extension) runs on any x86-64.
find_package(OpenMP REQUIRED COMPONENTS CXX)

file(GLOB ZERO_EXT_CPU_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cpu/*.cpp")
add_library(zero_ext_cpu_kernels STATIC ${ZERO_EXT_CPU_SOURCES})
target_include_directories(zero_ext_cpu_kernels PUBLIC "${CMAKE_CURRENT_SOURCE_DIR}/csrc")
# The same flags setup.py gives the extension, so ctest checks the code that ships.
target_compile_options(zero_ext_cpu_kernels PRIVATE -O3 -fno-math-errno -Wall -Wextra
                                                    -Wno-maybe-uninitialized)
target_link_libraries(zero_ext_cpu_kernels PUBLIC OpenMP::OpenMP_CXX)
set_target_properties(zero_ext_cpu_kernels PROPERTIES POSITION_INDEPENDENT_CODE ON)

file(GLOB ZERO_EXT_CPU_TESTS CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cpu/tests/test_*.cpp")
foreach(test_source ${ZERO_EXT_CPU_TESTS})
  get_filename_component(test_name "${test_source}" NAME_WE)
  add_executable(cpu_${test_name} "${test_source}")
  target_compile_options(cpu_${test_name} PRIVATE -O2 -Wall -Wextra)
  target_link_libraries(cpu_${test_name} PRIVATE zero_ext_cpu_kernels)
  add_test(NAME cpu_${test_name} COMMAND cpu_${test_name})
endforeach()
