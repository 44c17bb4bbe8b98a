# Builds and runs consumer.cc, a program outside the project, the two ways a project gets
# zeroflat:
#   MODE=package       installs the build BUILD_DIR into a scratch prefix, then configures this
#                      folder's project, which finds it with find_package;
#   MODE=subdirectory  configures subdirectory/, which adds the source tree ZEROFLAT_SOURCE_DIR
#                      with add_subdirectory (the optional backends off: the core is what a
#                      consumer builds on, and this keeps the check quick).
# Other arguments: -DWORK_DIR= -DSOURCE_DIR= (this folder) -DCXX_FLAGS= (the build's own
# flags, so that a sanitizer build's library links) -DCXX_COMPILER= (the build's own, which
# those flags are for) -DLAUNCHER= (a compiler launcher, or empty) -DGENERATOR= (the build's own).
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()
set(common_args "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}")
if(GENERATOR)
  list(APPEND common_args -G "${GENERATOR}")
endif()
if(LAUNCHER)
  list(APPEND common_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
endif()
if(CXX_COMPILER)
  list(APPEND common_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(MODE STREQUAL "package")
  run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
  run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build"
      "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" ${common_args})
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
elseif(MODE STREQUAL "subdirectory")
  # A build type of the consumer's own, which zeroflat must leave alone (without debug
  # information: the check is of the build's structure, and the library compiles from scratch),
  # and a unity build, as large consumers choose: zeroflat's sources compile in batches too, in
  # a third of the time.
  run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/subdirectory" -B "${WORK_DIR}/build"
      "-DZEROFLAT_SOURCE_DIR=${ZEROFLAT_SOURCE_DIR}" -DCMAKE_BUILD_TYPE=Debug
      -DCMAKE_CXX_FLAGS_DEBUG=-O0 -DCMAKE_UNITY_BUILD=ON
      -DCONSUMER_BUILD_TYPE=Debug -DZEROFLAT_WITH_CUDA=OFF -DZEROFLAT_WITH_NCCL=OFF
      -DZEROFLAT_WITH_MPI=OFF -DZEROFLAT_WITH_PYTHON=OFF ${common_args})
  # Its default target: the library and the consumer, nothing of zeroflat's own tests.
  run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" --parallel 2)
else()
  message(FATAL_ERROR "MODE=${MODE}: expected package or subdirectory")
endif()
run("${WORK_DIR}/build/consumer")
