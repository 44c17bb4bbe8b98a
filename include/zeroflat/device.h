// The Device interface: where parameter memory lives and where flattening copies run.
// - A Device allocates, releases, gathers many (src, dst, bytes) runs into one buffer in a single
//   call, up-casts, hashes, reports memory (its own accounting, and every free-memory source it
//   has, through the probe) and synchronizes. Backends register by name ("cpu", "sim:SIZE",
//   "cuda:N") so the CLI and the bindings pick them with a string.
// - Threads: a Device is used by one rank. Its methods may be called from any thread, but not
//   concurrently with each other unless a method says so: the cpu device runs one team
//   operation at a time and serializes callers; memory_info() and the probes are safe to call
//   concurrently with anything. Different Device objects are independent.
// - Lifetime: a Device must outlive everything that holds its memory: every DeviceBuffer, every
//   FlatGroup and result (their buffers, views and master partitions), and every communicator
//   made for it (nccl).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/probe.h"

namespace zeroflat {

// One contiguous run of a gather: num_bytes bytes from src to dst + dst_offset.
struct Segment {
  const void* src = nullptr;
  std::uint64_t dst_offset = 0;
  std::uint64_t num_bytes = 0;
};

// A device's own view of its memory, in bytes.
struct MemoryInfo {
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::uint64_t allocated_bytes = 0;       // currently allocated through this Device
  std::uint64_t peak_allocated_bytes = 0;  // high-water mark of allocated_bytes
  // Host staging memory taken through allocate_host (pinned on a GPU), and its high-water mark.
  std::uint64_t host_allocated_bytes = 0;
  std::uint64_t peak_host_allocated_bytes = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // "cpu", "cuda:0", "sim:80GiB".
  virtual std::string name() const = 0;
  // True when the CPU can read and write this device's pointers directly.
  virtual bool host_accessible() const noexcept = 0;
  // False for a device that only accounts for memory and keeps no bytes (sim:SIZE with
  // no_data): copies, gathers and all-gathers on it move nothing.
  virtual bool keeps_data() const noexcept { return true; }

  // Returns at least num_bytes of uninitialized memory, aligned to at least 64 bytes (a
  // zero-byte request returns a valid, unique pointer). Throws OutOfMemory naming the size.
  virtual void* allocate(std::uint64_t num_bytes) = 0;
  // Releases memory from allocate(); num_bytes must be the size that was asked for.
  // Null is ignored.
  virtual void release(void* ptr, std::uint64_t num_bytes) noexcept = 0;

  // Host memory for staging (page-locked on a GPU, so that copies to and from it run at the
  // link's speed and a kernel can write it directly), accounted apart from device memory. The
  // same contract as allocate(). Throws OutOfMemory.
  virtual void* allocate_host(std::uint64_t num_bytes) = 0;
  virtual void release_host(void* ptr, std::uint64_t num_bytes) noexcept = 0;
  // Copies num_bytes from src to dst, each one this device's memory or its host staging memory
  // (any direction). The ranges must not overlap.
  virtual void copy(void* dst, const void* src, std::uint64_t num_bytes) = 0;
  // Writes the byte range [0, num_bytes) of dst in one call: every segment's bytes go to
  // dst + dst_offset, and every byte no segment covers becomes zero. Segments must be sorted by
  // dst_offset, must not overlap each other, must lie inside [0, num_bytes), and must not
  // overlap dst's range in their sources. Sources belong to this device; dst is this device's
  // memory or its host staging memory (then the bytes cross the host link in the same pass). Throws
  // InvalidArgument when the segments break these rules (checked before any byte is written).
  // Source pointers cannot all be checked on a GPU without a driver call each: the cuda device
  // checks the first and the last; a bad one in between faults the kernel.
  virtual void gather(void* dst, std::uint64_t num_bytes, std::span<const Segment> segments) = 0;

  // dst[i] = float(src[i]) for i < numel; src holds elements of dtype. dst must not overlap src.
  virtual void upcast_to_fp32(float* dst, const void* src, DType dtype, std::uint64_t numel) = 0;

  // The zeroflat checksum of [ptr, ptr + num_bytes) (see common.h): the same bytes give the
  // same value on every device and with any number of threads.
  virtual std::uint64_t checksum(const void* ptr, std::uint64_t num_bytes) = 0;

  virtual MemoryInfo memory_info() = 0;

  // What this device's free-memory sources say (probe.h): every source with its answer or its
  // error, which one decided, and the bytes this rank may still allocate here. Never throws.
  // The default reports the device's own accounting (memory_info()).
  virtual ProbeResult probe_memory(const ProbeContext& context);
  // The host memory this rank may stage through: MemAvailable and cgroups, shared among the
  // local ranks (the default), or a simulated node's (sim devices). Never throws.
  virtual ProbeResult probe_host_memory(const ProbeContext& context);
  // The accelerator this device is, when it matches a preset (probe.h): a sim device of a
  // preset, or of a plain size in a generic node. None: the planner costs it as a generic device
  // of its capacity.
  virtual std::optional<DevicePreset> hardware() const { return std::nullopt; }

  // Waits until every operation issued on this device has completed.
  virtual void synchronize() {}
};

// Owns one allocation on a Device; releases it on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device& device, std::uint64_t num_bytes)
      : device_(&device), data_(device.allocate(num_bytes)), num_bytes_(num_bytes) {}
  // Takes ownership of num_bytes at ptr, which device.allocate() returned.
  static DeviceBuffer adopt(Device& device, void* ptr, std::uint64_t num_bytes) noexcept {
    DeviceBuffer b;
    b.device_ = &device;
    b.data_ = ptr;
    b.num_bytes_ = num_bytes;
    return b;
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  ~DeviceBuffer() { reset(); }

  void reset() noexcept {
    if (device_ != nullptr) device_->release(data_, num_bytes_);
    device_ = nullptr;
    data_ = nullptr;
    num_bytes_ = 0;
  }
  void swap(DeviceBuffer& other) noexcept {
    std::swap(device_, other.device_);
    std::swap(data_, other.data_);
    std::swap(num_bytes_, other.num_bytes_);
  }

  void* data() const noexcept { return data_; }
  std::uint64_t num_bytes() const noexcept { return num_bytes_; }
  Device* device() const noexcept { return device_; }
  explicit operator bool() const noexcept { return device_ != nullptr; }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  std::uint64_t num_bytes_ = 0;
};

struct DeviceOptions {
  // Worker threads for host-side work; 0 picks default_num_threads() (see common.h).
  unsigned num_threads = 0;
  // sim devices only: keep no data at all (allocations are accounted, copies skipped).
  bool no_data = false;
  // sim devices only: the host memory of the simulated node, in bytes (shared by its local
  // ranks). None: the preset's node (sim:h100-80gb), else a generic node (probe.h).
  std::optional<std::uint64_t> node_host_bytes = std::nullopt;
  // sim devices only: the host-to-device link, simulated: each copy() takes at least
  // link_latency_seconds + bytes / link_bytes_per_second (the copy waits out the rest), as a
  // synchronous pinned cudaMemcpy does; 0: copies at host memory speed, no latency.
  double link_bytes_per_second = 0;
  double link_latency_seconds = 0;
};

using DeviceFactory =
    std::function<std::unique_ptr<Device>(std::string_view spec, const DeviceOptions& options)>;

// Host memory as the cpu device allocates it: sizes of kFreshMappingBytes (2 MiB) and more are
// fresh anonymous mappings, 2 MiB-aligned and, when huge_pages (none: unless ZEROFLAT_HOST_MEMORY
// says "plain" or "torch", common.h), advised for transparent huge pages (a first touch then
// costs one fault per 2 MiB, not per 4 KiB; but where the kernel's THP defrag is "madvise",
// every fault of an advised buffer may compact memory first), smaller ones cache-line-aligned
// heap memory. Nothing is touched: the first writer faults the pages in (the cpu device's gather
// does, split by bytes over its threads), and a fresh mapping reads as zeros until then. A
// framework can hand it out as its own tensor's storage, releasing it with release_host_memory.
// Throws OutOfMemory.
inline constexpr std::uint64_t kFreshMappingBytes = std::uint64_t{2} << 20;
void* allocate_host_memory(std::uint64_t num_bytes, std::optional<bool> huge_pages = std::nullopt);
// Releases memory from allocate_host_memory; num_bytes must be the size that was asked for.
void release_host_memory(void* ptr, std::uint64_t num_bytes) noexcept;

// Makes the device a spec names: "cpu" always; other backends once registered. Throws
// InvalidArgument for an unknown or malformed spec, naming it and listing the known ones.
std::unique_ptr<Device> make_device(std::string_view spec, const DeviceOptions& options = {});

// Registers a backend for specs equal to prefix or starting with prefix + ":".
void register_device(std::string prefix, DeviceFactory factory);

// The registered prefixes, sorted.
std::vector<std::string> device_prefixes();

}  // namespace zeroflat
