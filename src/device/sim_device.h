// The `sim:SIZE` device: a device of a given capacity with exact accounting of every allocation,
// backed by host memory, or by no memory at all (no_data) so that a 61 GB model on 8 ranks can
// be rehearsed on a laptop.
#pragma once

#include <atomic>
#include <memory>

#include "device/accounting.h"
#include "device/cpu_device.h"
#include "zeroflat/device.h"

namespace zeroflat::detail {

class SimDevice final : public Device {
 public:
  // `node` is the accelerator simulated (capacity, bandwidths, integrated) and the node it sits
  // in: its host_bytes_per_node is the simulated host memory, shared by the node's local ranks
  // (the host stage is planned against it, never against this machine's).
  SimDevice(std::string name, const DevicePreset& node, const DeviceOptions& options);

  std::string name() const override { return name_; }
  // With no_data, pointers are reserved address space that faults on any access.
  bool host_accessible() const noexcept override { return !no_data_; }
  bool keeps_data() const noexcept override { return !no_data_; }

  // Throws OutOfMemory when the allocation would take usage past the capacity.
  void* allocate(std::uint64_t num_bytes) override;
  void release(void* ptr, std::uint64_t num_bytes) noexcept override;
  // Host staging memory: host memory, or address space only without data. Not limited by the
  // capacity (that is the device's), counted apart.
  void* allocate_host(std::uint64_t num_bytes) override;
  void release_host(void* ptr, std::uint64_t num_bytes) noexcept override;
  // Without data: copies nothing. With a simulated link (DeviceOptions::link_*): takes the
  // link's latency plus the bytes' time at its bandwidth, at least.
  void copy(void* dst, const void* src, std::uint64_t num_bytes) override;
  // Without data: checks the segments, copies nothing.
  void gather(void* dst, std::uint64_t num_bytes, std::span<const Segment> segments) override;
  void upcast_to_fp32(float* dst, const void* src, DType dtype, std::uint64_t numel) override;
  // Without data there is nothing to hash: throws Unsupported.
  std::uint64_t checksum(const void* ptr, std::uint64_t num_bytes) override;
  MemoryInfo memory_info() override;
  // "sim accounting": the capacity and what is allocated through this device.
  ProbeResult probe_memory(const ProbeContext& context) override;
  // "simulated host": the node's host memory less what this device stages, shared by the local
  // ranks.
  ProbeResult probe_host_memory(const ProbeContext& context) override;
  std::optional<DevicePreset> hardware() const override { return node_; }

 private:
  std::string name_;
  DevicePreset node_;
  std::uint64_t capacity_;
  bool no_data_;
  CpuDevice host_;                     // the threads and kernels of the backed mode
  double link_bytes_per_second_ = 0;   // the simulated host link (0: none)
  double link_latency_seconds_ = 0;
  void* map(std::uint64_t num_bytes);  // address space or host memory
  void unmap(void* ptr, std::uint64_t num_bytes) noexcept;
  ByteCounter device_bytes_;
  ByteCounter host_bytes_;
};

}  // namespace zeroflat::detail
