// Hardware presets: accelerators and the nodes they sit in, by name, with the bandwidths of the
// planner's cost model. A fact table below both the devices (a `sim:h100-80gb` is sized by it)
// and the planner (which costs step lists with it).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zeroflat {

// Bandwidths of the cost model, in bytes per second. Copy bandwidths count each byte copied
// once (a copy reads and writes it).
struct Bandwidths {
  double device_copy = 0;    // on the device
  double host_link = 0;      // host <-> device, each direction, pinned
  double allgather_bus = 0;  // NCCL-style bus bandwidth of the all-gather
  double host_copy = 0;      // host memory copies of the whole node, shared by its ranks
  double read = 2e9;         // checkpoint reads of one rank (storage or page cache)
  // The storage every node reads the checkpoint from, shared by all of them (a network file
  // system); 0: each node reads from storage of its own at `read` (not a shared bottleneck).
  double storage = 0;
};

// An accelerator preset (the capacities of docs/planner.md).
struct DevicePreset {
  std::string name;
  std::uint64_t capacity_bytes = 0;
  std::uint64_t host_bytes_per_node = 0;  // host memory of a typical node with 8 of them
  Bandwidths bandwidths;
  bool integrated = false;  // memory shared with the host
};

// Host memory of the node a device known only by its size is assumed to sit in: that of a
// typical 8-accelerator node (`--host SIZE` says otherwise).
inline constexpr std::uint64_t kGenericNodeHostBytes = std::uint64_t{2} << 40;  // 2 TiB

std::vector<DevicePreset> device_presets();
std::optional<DevicePreset> find_preset(std::string_view name);
// A device known only by its size, with conservative bandwidths, in a generic node.
DevicePreset generic_preset(std::uint64_t capacity_bytes);

}  // namespace zeroflat
