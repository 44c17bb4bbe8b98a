# The layers of docs/design.md, checked on the sources: devices, communicators and the layout
# know nothing of plans or execution; the command line and the Python binding see the public
# API only; the public headers pull in no CUDA, NCCL or MPI header. Argument: -DSOURCE_DIR=.
set(failures "")
function(forbid dirs regex why)
  foreach(dir ${dirs})
    file(GLOB_RECURSE files "${SOURCE_DIR}/${dir}/*.h" "${SOURCE_DIR}/${dir}/*.cc"
                            "${SOURCE_DIR}/${dir}/*.cu" "${SOURCE_DIR}/${dir}/*.cuh")
    foreach(f ${files})
      file(STRINGS "${f}" hits REGEX "${regex}")
      if(hits)
        string(REPLACE "${SOURCE_DIR}/" "" rel "${f}")
        set(failures "${failures}\n  ${rel}: ${hits} (${why})")
      endif()
    endforeach()
  endforeach()
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

forbid("src/device;src/comm;src/layout;src/system"
       "#include \"(plan/|exec/|zeroflat/(plan|executor|engine|agree|report|rehearsal)\\.h)"
       "a layer below the planner and the executor")
forbid("tools;python"
       "#include \"(common|device|comm|exec|plan|layout|model|system)/"
       "the public API is include/")
forbid("include"
       "#include <(cuda|nccl|mpi)"
       "no CUDA, NCCL or MPI header in the public API")
if(failures)
  message(FATAL_ERROR "layering broken:${failures}")
endif()
message(STATUS "layers hold")
