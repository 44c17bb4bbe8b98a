// The `cpu` device: host memory, copies run by a team of host threads split by bytes.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>

#include "common/thread_pool.h"
#include "device/accounting.h"
#include "zeroflat/device.h"

namespace zeroflat::detail {

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const DeviceOptions& options);

  std::string name() const override { return "cpu"; }
  bool host_accessible() const noexcept override { return true; }
  void* allocate(std::uint64_t num_bytes) override;
  void release(void* ptr, std::uint64_t num_bytes) noexcept override;
  // Host staging memory is ordinary host memory here, counted apart.
  void* allocate_host(std::uint64_t num_bytes) override;
  void release_host(void* ptr, std::uint64_t num_bytes) noexcept override;
  void copy(void* dst, const void* src, std::uint64_t num_bytes) override;
  void gather(void* dst, std::uint64_t num_bytes, std::span<const Segment> segments) override;
  void upcast_to_fp32(float* dst, const void* src, DType dtype, std::uint64_t numel) override;
  std::uint64_t checksum(const void* ptr, std::uint64_t num_bytes) override;
  MemoryInfo memory_info() override;
  // The host's memory (MemAvailable, cgroups) as this rank's share of it: the local ranks each
  // flatten in the same memory, so capacity and free are divided among them.
  ProbeResult probe_memory(const ProbeContext& context) override;

  unsigned num_threads() const noexcept { return pool_.size(); }
  // Runs fn(t) on every thread of this device's team (see ThreadPool::run).
  void parallel(const std::function<void(unsigned)>& fn);

  // The host ceiling: libc memcpy of one contiguous range, split by bytes over the same team
  // that runs gather(). dst and src must not overlap.
  void memcpy_parallel(void* dst, const void* src, std::uint64_t num_bytes);
  // Writes zeros over a range with the team (faults fresh memory in from every thread).
  void zero_parallel(void* dst, std::uint64_t num_bytes);

 private:
  std::mutex run_mutex_;  // one team operation at a time
  ThreadPool pool_;
  ByteCounter device_bytes_;
  ByteCounter host_bytes_;
};

// Host allocation used by the cpu device: 2 MiB-aligned anonymous mappings that ask for
// transparent huge pages for large sizes (first touch then costs one fault per 2 MiB, not per
// 4 KiB), cache-line-aligned heap memory for small ones. Throws OutOfMemory.
// huge_pages: advise fresh mappings for transparent huge pages; none: as ZEROFLAT_HOST_MEMORY
// says (common.h), by default yes.
void* host_allocate(std::uint64_t num_bytes, std::optional<bool> huge_pages = std::nullopt);
void host_release(void* ptr, std::uint64_t num_bytes) noexcept;

}  // namespace zeroflat::detail
