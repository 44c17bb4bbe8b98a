// make_mpi_communicator in a build without MPI.
#include "zeroflat/comm.h"
#include "zeroflat/common.h"

namespace zeroflat {

bool have_mpi() noexcept {
  return false;
}

std::unique_ptr<Communicator> make_mpi_communicator(std::chrono::milliseconds) {
  throw Unsupported(
      "the mpi communicator: this build has no MPI (apt install libopenmpi-dev openmpi-bin, "
      "then configure again; scripts/setup.sh does both)");
}

}  // namespace zeroflat
