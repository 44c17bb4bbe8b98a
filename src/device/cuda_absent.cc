// make_cuda_device in a build without CUDA.
#include <string>

#include "device/cuda_device.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {

std::unique_ptr<Device> make_cuda_device(std::string_view spec, const DeviceOptions&) {
  throw Unsupported("device '" + printable(spec) +
                    "': this build has no CUDA (configure where nvcc and the CUDA runtime are "
                    "installed, with -DZEROFLAT_WITH_CUDA=AUTO or ON)");
}

}  // namespace zeroflat::detail
