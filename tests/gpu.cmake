# Tests of the cuda device and the nccl communicator, in one executable built in every build.
#  label cpu: the gather kernel's walk run on the host, and what a machine without a usable GPU
#             (or a build without CUDA) answers;
#  label gpu: everything on a real GPU; each test skips, naming the reason, where none answers
#             (ctest then reports it as skipped, not passed).
add_executable(cuda_device_test cuda_device_test.cc)
target_link_libraries(cuda_device_test PRIVATE zeroflat GTest::gtest_main)
target_include_directories(cuda_device_test PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_compile_options(cuda_device_test PRIVATE -Wall -Wextra -Wshadow
  $<$<BOOL:${ZEROFLAT_WARNINGS_AS_ERRORS}>:-Werror>)
gtest_discover_tests(cuda_device_test
  TEST_FILTER "GatherWalk.*:CudaNoGpu.*"
  PROPERTIES LABELS cpu DISCOVERY_TIMEOUT 300)
gtest_discover_tests(cuda_device_test
  TEST_FILTER "CudaGpu.*:NcclGpu.*"
  PROPERTIES LABELS gpu DISCOVERY_TIMEOUT 300 TIMEOUT 300)
