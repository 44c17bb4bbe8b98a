// The registry of device backends, by name.
#include <algorithm>
#include <map>
#include <mutex>

#include "device/cpu_device.h"
#include "device/sim_device.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/probe.h"

namespace zeroflat {
namespace detail {
// src/device/cuda_device.cu, or cuda_absent.cc in a build without CUDA (throws Unsupported).
std::unique_ptr<Device> make_cuda_device(std::string_view spec, const DeviceOptions& options);
}  // namespace detail

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, DeviceFactory> factories;
  Registry() {
    factories["cpu"] = [](std::string_view spec, const DeviceOptions& options) {
      if (spec != "cpu") {
        throw InvalidArgument("device '" + printable(spec) + "': the cpu device takes no index");
      }
      return std::unique_ptr<Device>(new detail::CpuDevice(options));
    };
    factories["cuda"] = detail::make_cuda_device;
    factories["sim"] = [](std::string_view spec, const DeviceOptions& options) {
      const auto colon = spec.find(':');
      if (colon == std::string_view::npos || colon + 1 == spec.size()) {
        throw InvalidArgument("device '" + printable(spec) +
                              "': a sim device needs a capacity or an accelerator preset, as "
                              "in sim:80GiB or sim:h100-80gb");
      }
      const std::string_view what = spec.substr(colon + 1);
      const std::optional<DevicePreset> preset = find_preset(what);
      DevicePreset node = preset ? *preset : generic_preset(parse_size(what, "sim:SIZE"));
      if (node.capacity_bytes == 0) {
        throw InvalidArgument("device '" + printable(spec) + "': the capacity must be positive");
      }
      if (options.node_host_bytes) node.host_bytes_per_node = *options.node_host_bytes;
      return std::unique_ptr<Device>(new detail::SimDevice(std::string(spec), node, options));
    };
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_device(std::string prefix, DeviceFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.factories[std::move(prefix)] = std::move(factory);
}

std::vector<std::string> device_prefixes() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> out;
  for (const auto& [name, factory] : r.factories) out.push_back(name);
  return out;
}

std::unique_ptr<Device> make_device(std::string_view spec, const DeviceOptions& options) {
  std::string prefix(spec.substr(0, spec.find(':')));
  DeviceFactory factory;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.factories.find(prefix);
    if (it != r.factories.end()) factory = it->second;
  }
  if (!factory) {
    throw InvalidArgument("unknown device '" + printable(spec) + "': this build knows " +
                          join(device_prefixes()));
  }
  return factory(spec, options);
}

}  // namespace zeroflat
