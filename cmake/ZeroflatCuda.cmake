# The CUDA device and the NCCL communicator, added to the `zeroflat` library when configure found
# them (ZEROFLAT_HAVE_CUDA, ZEROFLAT_HAVE_NCCL); otherwise stand-ins that throw Unsupported.
#
# The kernels compile in an object library of their own: the library's warning flags are the host
# compiler's, which nvcc takes only through -Xcompiler. Every CUDA target links the shared CUDA
# runtime, as the library does (a static copy beside it would be a second runtime in the process).
# The installed package must not carry this machine's paths, so it names the CUDA runtime and NCCL
# by their plain names, as it does xxhash: a consumer finds them on its linker path (add the
# toolkit's library directory where it is not there).
if(ZEROFLAT_HAVE_CUDA)
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  # CUDA sources are C++20 like the rest (CUDA_STANDARD on each CUDA target: the project sets
  # no directory-wide standard); CMake 3.25 does not yet know nvcc's flag for it (nvcc 12 and
  # later have it).
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(ZEROFLAT_CUDA_FLAGS
    -lineinfo
    -Xcompiler=-Wall,-Wextra,-Wshadow
    $<$<BOOL:${ZEROFLAT_WARNINGS_AS_ERRORS}>:--Werror=all-warnings>)

  add_library(zeroflat_cuda OBJECT ${PROJECT_SOURCE_DIR}/src/device/cuda_device.cu)
  target_include_directories(zeroflat_cuda PRIVATE
    ${PROJECT_SOURCE_DIR}/include ${PROJECT_BINARY_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(zeroflat_cuda PRIVATE CUDA::cudart)
  target_compile_options(zeroflat_cuda PRIVATE ${ZEROFLAT_CUDA_FLAGS})
  set_target_properties(zeroflat_cuda PROPERTIES POSITION_INDEPENDENT_CODE ON
                        CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)

  target_sources(zeroflat PRIVATE $<TARGET_OBJECTS:zeroflat_cuda>)
  target_link_libraries(zeroflat PRIVATE
    $<BUILD_INTERFACE:CUDA::cudart> $<INSTALL_INTERFACE:cudart>)

  # The GPU benchmark needs no Google Benchmark, so it exists whenever CUDA does (the GPU check
  # script builds it by name); the default build includes it with the other benchmarks.
  add_executable(gpu_bench ${PROJECT_SOURCE_DIR}/benchmarks/gpu_bench.cu)
  target_include_directories(gpu_bench PRIVATE ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(gpu_bench PRIVATE zeroflat CUDA::cudart)
  target_compile_options(gpu_bench PRIVATE ${ZEROFLAT_CUDA_FLAGS})
  set_target_properties(gpu_bench PROPERTIES
                        CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
  if(NOT ZEROFLAT_BUILD_BENCHMARKS)
    set_target_properties(gpu_bench PROPERTIES EXCLUDE_FROM_ALL ON)
  endif()
else()
  target_sources(zeroflat PRIVATE ${PROJECT_SOURCE_DIR}/src/device/cuda_absent.cc)
endif()

if(ZEROFLAT_HAVE_NCCL)
  target_sources(zeroflat PRIVATE ${PROJECT_SOURCE_DIR}/src/comm/nccl_comm.cc)
  target_include_directories(zeroflat SYSTEM PRIVATE ${NCCL_INCLUDE_DIR})
  target_link_libraries(zeroflat PRIVATE
    $<BUILD_INTERFACE:${NCCL_LIBRARY}> $<INSTALL_INTERFACE:nccl>)
else()
  target_sources(zeroflat PRIVATE ${PROJECT_SOURCE_DIR}/src/comm/nccl_absent.cc)
endif()
