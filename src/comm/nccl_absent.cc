// make_nccl_communicator in a build without NCCL.
#include "zeroflat/comm.h"
#include "zeroflat/common.h"

namespace zeroflat {

bool have_nccl() noexcept {
  return false;
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator&, Device&,
                                                     std::chrono::milliseconds) {
  throw Unsupported(
      "the nccl communicator: this build has no NCCL (configure with CUDA and NCCL present; "
      "see docs/environment.md)");
}

}  // namespace zeroflat
