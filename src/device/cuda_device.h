// The `cuda:N` device: memory of one GPU, a stream of its own, and the batched gather kernel.
//
// This header needs no CUDA header (the stream is declared by its struct), so the registry and
// the NCCL communicator include it in every build; the class exists only in builds with CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/thread_pool.h"
#include "device/accounting.h"
#include "zeroflat/device.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace zeroflat::detail {

// Every operation runs on the device's own stream (non-blocking with respect to the legacy
// default stream) and has completed when the call returns, so pointers and host staging memory
// are safe to use from anywhere afterwards. Methods may be called from any host thread: each
// makes its GPU current first.
class CudaDevice final : public Device {
 public:
  // Opens GPU `ordinal` (0 <= ordinal < cudaGetDeviceCount). Throws InternalError when CUDA
  // refuses (the message names the call).
  CudaDevice(int ordinal, const DeviceOptions& options);
  ~CudaDevice() override;

  std::string name() const override { return name_; }
  bool host_accessible() const noexcept override { return false; }

  // cudaMallocAsync on the device's stream (cudaMalloc where the GPU has no memory pools). The
  // release hands the memory back to the GPU before it returns (the pool keeps nothing), so
  // memory_info() and other allocators see it free. Throws OutOfMemory naming the size.
  void* allocate(std::uint64_t num_bytes) override;
  void release(void* ptr, std::uint64_t num_bytes) noexcept override;
  // Pinned host memory, mapped into the GPU's address space (cudaHostAllocMapped | Portable):
  // a gather can write it directly across the host link.
  void* allocate_host(std::uint64_t num_bytes) override;
  void release_host(void* ptr, std::uint64_t num_bytes) noexcept override;
  void copy(void* dst, const void* src, std::uint64_t num_bytes) override;
  // One kernel launch for the whole group, driven by a table of runs (see cuda_gather.h). dst
  // must be this GPU's memory, managed memory, or host memory from allocate_host (any pinned,
  // mapped host memory); anything else is InvalidArgument. Sources must be memory this GPU can
  // read; the first and the last are checked, the others are trusted (a per-segment check would
  // cost more than the copy).
  void gather(void* dst, std::uint64_t num_bytes, std::span<const Segment> segments) override;
  void upcast_to_fp32(float* dst, const void* src, DType dtype, std::uint64_t numel) override;
  // The bytes come to the host through pinned buffers, chunk by chunk, and are hashed there by
  // the device's host threads while the next window is in flight: the same value as the cpu
  // device by construction.
  std::uint64_t checksum(const void* ptr, std::uint64_t num_bytes) override;
  // total and free from cudaMemGetInfo (the whole GPU, other processes included), after the
  // stream has drained so that releases are visible. Internal scratch (the gather's table, a
  // few bytes per tensor) is not counted in allocated_bytes: the planner does not plan it.
  MemoryInfo memory_info() override;
  // NVML (whole device), cudaMemGetInfo, the process view; integrated GPUs capped by the host's
  // available memory; the framework's cached-free bytes credited (probe_cuda in probe.h).
  ProbeResult probe_memory(const ProbeContext& context) override;
  void synchronize() override;

  int ordinal() const noexcept { return ordinal_; }
  CUstream_st* stream() const noexcept { return stream_; }
  // Makes this GPU current on the calling thread (the CUDA runtime's current device is per
  // thread). Throws InternalError.
  void activate() const;

  // Blocks of the gather kernel that run at once on this GPU (SMs x resident blocks per SM).
  unsigned gather_blocks() const noexcept { return gather_blocks_; }

 private:
  // The pointer the GPU uses for a gather destination, after checking what it is.
  unsigned char* kernel_destination(void* dst, std::uint64_t num_bytes) const;
  void check_readable(const void* src, std::size_t index) const;
  // Grows the gather's pinned and device tables to at least num_bytes (caller holds
  // gather_mutex_).
  void reserve_table(std::uint64_t num_bytes);

  int ordinal_;
  std::string name_;
  CUstream_st* stream_ = nullptr;
  bool use_pool_ = false;  // cudaMallocAsync available
  unsigned gather_blocks_ = 0;
  std::uint64_t total_bytes_ = 0;

  std::mutex gather_mutex_;  // the table buffers below
  void* table_host_ = nullptr;
  void* table_device_ = nullptr;
  std::uint64_t table_capacity_ = 0;

  std::mutex pool_mutex_;  // one checksum on the host threads at a time
  ThreadPool pool_;

  ByteCounter device_bytes_;
  ByteCounter host_bytes_;
};

// The factory of `cuda` and `cuda:N` ("cuda" is cuda:0). Throws InvalidArgument for a malformed
// spec or an index past the GPUs this process sees, Unsupported when there is no usable GPU
// (the message names the CUDA error) or, in a build without CUDA, always.
std::unique_ptr<Device> make_cuda_device(std::string_view spec, const DeviceOptions& options);

}  // namespace zeroflat::detail
