# The rooms of docs/design.md, checked on the sources: each folder of src/ includes only its own
# headers and those of the rooms it may use (devices and communicators know nothing of plans,
# the model and the layout only of common, ...), reaching a room through its internal headers
# (src/<room>/...) or its public ones (include/zeroflat/...); a public header includes only
# what its room may use; the command line and the Python binding see the public API only, with
# one exception (the private torch.save reader, below); and no public header pulls in a CUDA,
# NCCL or MPI header. A folder of src/ or a public header
# that this file does not place in a room fails the check too, so a new one gets its rules.
# Argument: -DSOURCE_DIR=.
cmake_minimum_required(VERSION 3.25)  # script mode: today's policies (IN_LIST, ...)

# The rooms, and the rooms each may use besides itself (docs/design.md, "Rooms").
set(rooms common system layout model device comm plan exec source save)
set(uses_common "")
set(uses_system common)
set(uses_layout common)
set(uses_model common)
set(uses_device common system)
set(uses_comm common device)
set(uses_plan common system layout model device comm)
set(uses_exec common system layout model device comm plan)
set(uses_source common system layout model device comm plan exec)
set(uses_save common)

# The room each public header belongs to: the one whose sources implement it.
set(room_of_common common)
set(room_of_probe system)
set(room_of_layout layout)
set(room_of_dtensor layout)
set(room_of_model model)
set(room_of_checkpoint model)
set(room_of_device device)
set(room_of_comm comm)
set(room_of_plan plan)
set(room_of_agree plan)
set(room_of_report plan)
set(room_of_engine exec)
set(room_of_rehearsal exec)
set(room_of_loader source)
set(room_of_deepspeed_checkpoint source)
set(room_of_dcp_checkpoint source)
set(room_of_resume source)
set(room_of_save save)

set(failures "")
macro(fail what)
  set(failures "${failures}\n  ${what}")
endmacro()

function(sources_of out dir)
  file(GLOB_RECURSE files "${SOURCE_DIR}/${dir}/*.h" "${SOURCE_DIR}/${dir}/*.cc"
                          "${SOURCE_DIR}/${dir}/*.cu" "${SOURCE_DIR}/${dir}/*.cuh")
  set(${out} ${files} PARENT_SCOPE)
endfunction()

# Checks the quoted includes of `files`, which belong to `room`.
function(check_room_includes room files)
  set(may ${room} ${uses_${room}})
  foreach(f ${files})
    string(REPLACE "${SOURCE_DIR}/" "" rel "${f}")
    file(STRINGS "${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
    foreach(line ${lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]*)\".*$" "\\1" inc "${line}")
      if(inc MATCHES "^zeroflat/([a-z_0-9]+)\\.h$")
        set(header "${CMAKE_MATCH_1}")
        if(header STREQUAL "config")
          continue()  # the generated list of backends: anyone may ask
        elseif(header STREQUAL "zeroflat")
          fail("${rel}: includes ${inc}, the whole API: include what it uses")
          continue()
        elseif(NOT DEFINED room_of_${header})
          fail("${rel}: includes ${inc}, which layers_check.cmake places in no room")
          continue()
        endif()
        set(target "${room_of_${header}}")
      elseif(inc MATCHES "^([a-z_0-9]+)/")
        set(target "${CMAKE_MATCH_1}")
      else()
        fail("${rel}: includes \"${inc}\": expected zeroflat/... or <room>/...")
        continue()
      endif()
      if(NOT target IN_LIST may)
        list(JOIN may ", " may_text)
        fail("${rel}: includes ${inc} (${target}), but ${room} may use only: ${may_text}")
      endif()
    endforeach()
  endforeach()
  set(failures "${failures}" PARENT_SCOPE)
endfunction()

# Every folder of src/ is a room with rules.
file(GLOB entries RELATIVE "${SOURCE_DIR}/src" "${SOURCE_DIR}/src/*")
foreach(entry ${entries})
  if(IS_DIRECTORY "${SOURCE_DIR}/src/${entry}" AND NOT entry IN_LIST rooms)
    fail("src/${entry}: a folder of src/ without rules: give it a row in docs/design.md and its uses in tests/layers_check.cmake")
  endif()
endforeach()
foreach(room ${rooms})
  sources_of(files "src/${room}")
  check_room_includes(${room} "${files}")
endforeach()

# Public headers: each includes only what its room may use.
file(GLOB headers "${SOURCE_DIR}/include/zeroflat/*.h")
foreach(h ${headers})
  get_filename_component(name "${h}" NAME_WE)
  if(name STREQUAL "zeroflat")
    continue()  # the umbrella header includes everything, by design
  elseif(NOT DEFINED room_of_${name})
    fail("${h}: a public header in no room: place it in tests/layers_check.cmake")
    continue()
  endif()
  check_room_includes(${room_of_${name}} "${h}")
endforeach()

# Rules on text that are not about rooms.
function(forbid dirs regex why)
  foreach(dir ${dirs})
    sources_of(files "${dir}")
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

# The command line and the binding: the public API, and of src/ only the torch.save reader
# (`zeroflat inspect` prints a file's saved state; the binding makes Python values of it) and the
# checkpoints' saved states it parsed.
set(outside_may model/torch_file.h source/saved_state.h)
foreach(dir tools python)
  sources_of(files "${dir}")
  foreach(f ${files})
    string(REPLACE "${SOURCE_DIR}/" "" rel "${f}")
    file(STRINGS "${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
    foreach(line ${lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]*)\".*$" "\\1" inc "${line}")
      if(inc MATCHES "^(common|system|layout|model|device|comm|plan|exec|source|save)/" AND
         NOT inc IN_LIST outside_may)
        fail("${rel}: includes ${inc} (the public API is include/)")
      endif()
    endforeach()
  endforeach()
endforeach()
forbid("include"
       "#include <(cuda|nccl|mpi)"
       "no CUDA, NCCL or MPI header in the public API")

if(failures)
  message(FATAL_ERROR "layering broken:${failures}")
endif()
message(STATUS "layers hold")
