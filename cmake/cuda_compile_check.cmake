# Compile check of every csrc/cuda/*.cu with nvcc for sm_80 and sm_90 (nothing runs at build time),
# and a small host program, cuda_test_launchers, that links the launchers against cudart. As a ctest
# it skips (exit code 77) without a GPU and checks a few launches against the host formula with one.
# Without nvcc this file prints a message and does nothing, so CPU-only machines still configure.
#
# Options: ZERO_EXT_CUDA_WERROR (ON): nvcc and host-compiler warnings in the .cu files are errors.
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "zero_ext: nvcc not found (set CUDACXX or put nvcc on PATH); "
                 "skipping the CUDA compile check")
  return()
endif()

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
option(ZERO_EXT_CUDA_WERROR "Treat warnings in csrc/cuda/*.cu as errors" ON)

file(GLOB ZERO_EXT_CUDA_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/csrc/cuda/*.cu")
add_library(zero_ext_cuda_kernels OBJECT ${ZERO_EXT_CUDA_SOURCES})
# SASS only, as setup.py builds them (TORCH_CUDA_ARCH_LIST="8.0;9.0": A100 and H100/H200).
set_target_properties(zero_ext_cuda_kernels PROPERTIES
  CUDA_ARCHITECTURES "80-real;90-real"
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  POSITION_INDEPENDENT_CODE ON)
# torch's CUDAExtension compiles .cu files with these defines (no implicit half/bf16 operators or
# conversions); the check mirrors them so code that only builds here cannot slip through.
target_compile_definitions(zero_ext_cuda_kernels PRIVATE
  __CUDA_NO_HALF_OPERATORS__ __CUDA_NO_HALF_CONVERSIONS__ __CUDA_NO_BFLOAT16_CONVERSIONS__
  __CUDA_NO_HALF2_OPERATORS__)
# No fast-math (the AdamW formula must round like the CPU kernel and torch); -fmad stays at nvcc's
# default, as in setup.py.
target_compile_options(zero_ext_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>
  $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${ZERO_EXT_CUDA_WERROR}>>:--Werror=all-warnings>)

add_executable(cuda_test_launchers csrc/cuda/tests/test_launchers.cpp
                                   $<TARGET_OBJECTS:zero_ext_cuda_kernels>)
target_link_libraries(cuda_test_launchers PRIVATE CUDA::cudart)
add_test(NAME cuda_test_launchers COMMAND cuda_test_launchers)
set_tests_properties(cuda_test_launchers PROPERTIES SKIP_RETURN_CODE 77)
message(STATUS "zero_ext: CUDA compile check of ${CMAKE_CUDA_COMPILER} "
               "(${CMAKE_CUDA_COMPILER_VERSION}) for sm_80, sm_90")
