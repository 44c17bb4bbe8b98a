// Kernels of the cuda device: the batched gather and the fp32 up-cast. Included by the device
// and by benchmarks/gpu_bench.cu, which times variants of the gather side by side.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "device/cuda_gather.h"

namespace zeroflat::detail {

// Resident blocks per SM the gather kernel is compiled for: with kU = 4 the kernel fits in 64
// registers, so four blocks of 256 threads share an SM with 64 KiB of loads in flight.
constexpr int gather_min_blocks(int unroll) {
  return unroll >= 8 ? 2 : 4;
}

// The whole gather in one launch: a persistent grid (at most the blocks that fit on the GPU at
// once) walks the tiles of the plan (see cuda_gather.h). kStreaming marks loads and stores
// evict-first.
template <int kU, bool kStreaming>
__global__ void __launch_bounds__(gather::kThreads, gather_min_blocks(kU))
    gather_kernel(const gather::Plan plan) {
  gather::walk<kU, kStreaming>(plan, blockIdx.x, gridDim.x, threadIdx.x / 32u, blockDim.x / 32u,
                               threadIdx.x % 32u);
}

// dtype codes of upcast_kernel.
inline constexpr int kUpcastBF16 = 0;
inline constexpr int kUpcastFP16 = 1;
inline constexpr int kUpcastFP32 = 2;

// dst[i] = float(src[i]) for i < numel, grid-stride. Neighbouring threads read neighbouring
// elements, so both sides coalesce whatever the alignment.
template <int kDType>
__global__ void upcast_kernel(float* __restrict__ dst, const void* __restrict__ src,
                              std::uint64_t numel) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < numel;
       i += stride) {
    if constexpr (kDType == kUpcastBF16) {
      const auto bits = static_cast<const std::uint16_t*>(src)[i];
      dst[i] = __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
    } else if constexpr (kDType == kUpcastFP16) {
      dst[i] = __half2float(static_cast<const __half*>(src)[i]);
    } else {
      dst[i] = static_cast<const float*>(src)[i];
    }
  }
}

}  // namespace zeroflat::detail
