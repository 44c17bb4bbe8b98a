# Sources of the optional backends (CUDA device, NCCL and MPI communicators), added to the
# `zeroflat` library target when configure found them (see ZEROFLAT_HAVE_* above).
if(ZEROFLAT_HAVE_MPI)
  target_sources(zeroflat PRIVATE src/comm/mpi_comm.cc)
  # The installed package names the library plainly (as it does xxhash), not by this machine's
  # path; MPI's include directories are needed only to build the library.
  target_link_libraries(zeroflat PRIVATE $<BUILD_INTERFACE:MPI::MPI_C> $<INSTALL_INTERFACE:mpi>)
else()
  target_sources(zeroflat PRIVATE src/comm/mpi_absent.cc)
endif()
include(ZeroflatCuda)
