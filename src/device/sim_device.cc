// The `sim:SIZE` device.
#include "device/sim_device.h"

#include <chrono>
#include <thread>

#include <sys/mman.h>

#include "device/host_kernels.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {

SimDevice::SimDevice(std::string name, const DevicePreset& node, const DeviceOptions& options)
    : name_(std::move(name)),
      node_(node),
      capacity_(node.capacity_bytes),
      no_data_(options.no_data),
      host_(options),
      link_bytes_per_second_(options.link_bytes_per_second),
      link_latency_seconds_(options.link_latency_seconds) {
  if (!(link_bytes_per_second_ >= 0) || !(link_latency_seconds_ >= 0)) {
    throw InvalidArgument("a simulated link needs a bandwidth and a latency of at least 0");
  }
}

void* SimDevice::map(std::uint64_t num_bytes) {
  if (!no_data_) return host_allocate(num_bytes);
  // Address space only: unique, aligned, and any access faults instead of corrupting.
  void* p = mmap(nullptr, num_bytes == 0 ? 1 : num_bytes, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    throw OutOfMemory(name_ + ": cannot reserve " + format_bytes(num_bytes) + " of address space");
  }
  return p;
}

void SimDevice::unmap(void* ptr, std::uint64_t num_bytes) noexcept {
  if (no_data_) {
    munmap(ptr, num_bytes == 0 ? 1 : num_bytes);
  } else {
    host_release(ptr, num_bytes);
  }
}

void* SimDevice::allocate(std::uint64_t num_bytes) {
  if (!device_bytes_.try_add(num_bytes, capacity_)) {
    throw OutOfMemory(name_ + ": cannot allocate " + format_bytes(num_bytes) + " with " +
                      format_bytes(device_bytes_.current()) + " of " + format_bytes(capacity_) +
                      " in use");
  }
  try {
    return map(num_bytes);
  } catch (...) {
    device_bytes_.sub(num_bytes);
    throw;
  }
}

void SimDevice::release(void* ptr, std::uint64_t num_bytes) noexcept {
  if (ptr == nullptr) return;
  unmap(ptr, num_bytes);
  device_bytes_.sub(num_bytes);
}

void* SimDevice::allocate_host(std::uint64_t num_bytes) {
  void* p = map(num_bytes);
  host_bytes_.add(num_bytes);
  return p;
}

void SimDevice::release_host(void* ptr, std::uint64_t num_bytes) noexcept {
  if (ptr == nullptr) return;
  unmap(ptr, num_bytes);
  host_bytes_.sub(num_bytes);
}

void SimDevice::copy(void* dst, const void* src, std::uint64_t num_bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!no_data_) host_.copy(dst, src, num_bytes);
  if (link_bytes_per_second_ > 0 || link_latency_seconds_ > 0) {
    const double seconds =
        link_latency_seconds_ + (link_bytes_per_second_ > 0
                                     ? static_cast<double>(num_bytes) / link_bytes_per_second_
                                     : 0.0);
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<std::chrono::nanoseconds>(
                                           std::chrono::duration<double>(seconds)));
  }
}

void SimDevice::gather(void* dst, std::uint64_t num_bytes, std::span<const Segment> segments) {
  if (no_data_) {
    check_gather_segments(dst, num_bytes, segments);
    return;
  }
  host_.gather(dst, num_bytes, segments);
}

void SimDevice::upcast_to_fp32(float* dst, const void* src, DType dtype, std::uint64_t numel) {
  if (no_data_) return;
  host_.upcast_to_fp32(dst, src, dtype, numel);
}

std::uint64_t SimDevice::checksum(const void* ptr, std::uint64_t num_bytes) {
  if (no_data_) throw Unsupported(name_ + " keeps no data (--no-data): there is nothing to hash");
  return host_.checksum(ptr, num_bytes);
}

MemoryInfo SimDevice::memory_info() {
  MemoryInfo info;
  info.total_bytes = capacity_;
  info.allocated_bytes = device_bytes_.current();
  info.free_bytes = capacity_ - info.allocated_bytes;
  info.peak_allocated_bytes = device_bytes_.peak();
  info.host_allocated_bytes = host_bytes_.current();
  info.peak_host_allocated_bytes = host_bytes_.peak();
  return info;
}

ProbeResult SimDevice::probe_memory(const ProbeContext&) {
  const MemoryInfo m = memory_info();
  ProbeResult r;
  r.device = name_;
  r.available = true;
  r.integrated = node_.integrated;
  r.total_bytes = m.total_bytes;
  r.free_bytes = m.free_bytes;
  r.used = "sim accounting";
  r.sources.push_back({"sim accounting", true, m.total_bytes, m.free_bytes,
                       "a simulated device of this capacity, " + format_bytes(m.allocated_bytes) +
                           " allocated through it" + (no_data_ ? " (no data)" : "")});
  return r;
}

ProbeResult SimDevice::probe_host_memory(const ProbeContext& context) {
  const unsigned ranks = context.local_ranks > 0 ? context.local_ranks : 1;
  const std::uint64_t staged = host_bytes_.current();
  const std::uint64_t room = node_.host_bytes_per_node > staged ? node_.host_bytes_per_node - staged : 0;
  ProbeResult r;
  r.device = "host of " + name_;
  r.available = true;
  r.total_bytes = node_.host_bytes_per_node;
  r.free_bytes = room / ranks;
  r.used = "simulated host";
  r.sources.push_back({"simulated host", true, node_.host_bytes_per_node, room,
                       "the host memory of the simulated node (--host), not this machine's"});
  if (ranks > 1) {
    r.notes.push_back("shared among " + std::to_string(ranks) + " ranks on this host: " +
                      format_bytes(room) + " / " + std::to_string(ranks));
  }
  return r;
}

}  // namespace zeroflat::detail
