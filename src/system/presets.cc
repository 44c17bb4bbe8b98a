// The hardware presets (probe.h): accelerators by name, their bandwidths and their nodes.
#include "zeroflat/probe.h"

namespace zeroflat {
namespace {

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kTiB = std::uint64_t{1} << 40;

}  // namespace

std::vector<DevicePreset> device_presets() {
  // Copy bandwidths count bytes copied (each read once and written once): about half of the
  // memory's read+write figure. Host memory is that of a typical 8-accelerator node.
  return {
      {"h100-80gb", 81559 * kMiB, 2 * kTiB, {1.4e12, 50e9, 360e9, 100e9}, false},
      {"h200", 143771 * kMiB, 2 * kTiB, {2.15e12, 50e9, 360e9, 100e9}, false},
      {"a100-80gb", 81920 * kMiB, 2 * kTiB, {0.8e12, 25e9, 230e9, 80e9}, false},
      {"a100-40gb", 40960 * kMiB, 1 * kTiB, {0.65e12, 25e9, 230e9, 80e9}, false},
      {"gb10", 128'000'000'000ull, 0, {0.12e12, 100e9, 10e9, 100e9}, true},
  };
}

std::optional<DevicePreset> find_preset(std::string_view name) {
  for (DevicePreset& p : device_presets()) {
    if (p.name == name) return p;
  }
  return std::nullopt;
}

DevicePreset generic_preset(std::uint64_t capacity_bytes) {
  return {"custom", capacity_bytes, kGenericNodeHostBytes, {0.5e12, 20e9, 100e9, 50e9}, false};
}

}  // namespace zeroflat
