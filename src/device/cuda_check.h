// CUDA status codes become zeroflat exceptions at the boundary, with the call, file and line.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <string_view>

#include "zeroflat/common.h"

namespace zeroflat::detail {

// "src/device/cuda_device.cu:123": the path from the project's src/ on, not the build machine's.
inline std::string source_location(const char* file, int line) {
  std::string_view f(file);
  if (auto at = f.rfind("src/"); at != std::string_view::npos) f.remove_prefix(at);
  return std::string(f) + ":" + std::to_string(line);
}

// "out of memory (cudaErrorMemoryAllocation, error 2)".
inline std::string cuda_error_text(cudaError_t err) {
  return std::string(cudaGetErrorString(err)) + " (" + cudaGetErrorName(err) + ", error " +
         std::to_string(static_cast<int>(err)) + ")";
}

// Throws for err != cudaSuccess: OutOfMemory when CUDA ran out of memory, InternalError
// otherwise. context names the device ("cuda:0"), call is the call's text.
[[noreturn]] inline void throw_cuda_error(cudaError_t err, std::string_view context,
                                          const char* call, const char* file, int line) {
  // A failed call also sets the runtime's last error; clear it so that the next launch's check
  // reports that launch, not this call. (Sticky errors stay: the context is lost then.)
  (void)cudaGetLastError();
  std::string what = std::string(context) + (context.empty() ? "" : ": ") + call +
                     " failed: " + cuda_error_text(err) + " at " + source_location(file, line);
  if (err == cudaErrorMemoryAllocation) throw OutOfMemory(what);
  throw InternalError(what);
}

}  // namespace zeroflat::detail

// Checks a CUDA runtime call; context is a string naming the device.
#define ZEROFLAT_CUDA_CHECK(context, call)                                                    \
  do {                                                                                        \
    const cudaError_t zeroflat_cuda_status_ = (call);                                         \
    if (zeroflat_cuda_status_ != cudaSuccess) {                                               \
      ::zeroflat::detail::throw_cuda_error(zeroflat_cuda_status_, (context), #call, __FILE__, \
                                           __LINE__);                                         \
    }                                                                                         \
  } while (0)
