// The probe's real sources on this machine: /proc/meminfo, cgroups, the CUDA runtime and NVML,
// the last two loaded with dlopen so that zeroflat builds and runs where they are absent.
#include <dlfcn.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>

#include "zeroflat/probe.h"
#include "zeroflat/runtime.h"

namespace zeroflat {
namespace {

std::optional<std::string> read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

std::optional<std::uint64_t> read_number(const std::string& path) {
  auto line = read_first_line(path);
  if (!line) return std::nullopt;
  try {
    std::size_t used = 0;
    const unsigned long long v = std::stoull(*line, &used);
    return static_cast<std::uint64_t>(v);
  } catch (...) {
    return std::nullopt;
  }
}

// A "key value" line of a cgroup memory.stat file; 0 when absent.
std::uint64_t stat_value(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string k;
  std::uint64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

// v2: the leaf's memory.max and each ancestor's up to the mount root; the level with the least
// room decides (a Slurm job's or a systemd slice's limit sits above the process's own cgroup).
std::optional<CgroupMemory> read_v2(const std::string& root, const std::string& leaf) {
  std::string rel = leaf == "/" ? "" : leaf;
  std::optional<CgroupMemory> best;
  std::optional<CgroupMemory> leaf_info;
  std::uint64_t best_room = UINT64_MAX;
  for (;;) {
    const std::string dir = root + rel;
    auto max = read_first_line(dir + "/memory.max");
    auto current = read_number(dir + "/memory.current");
    if (max && current) {
      const std::uint64_t inactive = stat_value(dir + "/memory.stat", "inactive_file");
      CgroupMemory m{2, std::nullopt, *current - std::min(*current, inactive), dir + "/memory.max"};
      if (*max != "max") {
        try {
          m.limit_bytes = std::stoull(*max);
        } catch (...) {
          m.limit_bytes = std::nullopt;
        }
      }
      if (!leaf_info) leaf_info = m;
      if (m.limit_bytes) {
        const std::uint64_t room =
            *m.limit_bytes > m.usage_bytes ? *m.limit_bytes - m.usage_bytes : 0;
        if (room < best_room) {
          best_room = room;
          best = m;
        }
      }
    }
    if (rel.empty()) break;
    rel = rel.substr(0, rel.rfind('/'));
  }
  return best ? best : leaf_info;
}

// v1: memory.limit_in_bytes, and memory.stat's hierarchical_memory_limit, which already takes
// the ancestors' limits into account.
std::optional<CgroupMemory> read_v1(const std::string& root, const std::string& leaf) {
  for (const std::string& base : {root + "/memory" + (leaf == "/" ? "" : leaf), root + "/memory"}) {
    auto limit = read_number(base + "/memory.limit_in_bytes");
    auto usage = read_number(base + "/memory.usage_in_bytes");
    if (!limit || !usage) continue;
    const std::uint64_t inactive = stat_value(base + "/memory.stat", "total_inactive_file");
    const std::uint64_t hierarchical =
        stat_value(base + "/memory.stat", "hierarchical_memory_limit");
    CgroupMemory m{1, std::nullopt, *usage - std::min(*usage, inactive),
                   base + "/memory.limit_in_bytes"};
    std::uint64_t effective = *limit;
    if (hierarchical > 0) effective = std::min(effective, hierarchical);
    // v1 reports "no limit" as a huge page-rounded number.
    if (effective < (std::uint64_t{1} << 60)) m.limit_bytes = effective;
    return m;
  }
  return std::nullopt;
}

Answer<CgroupMemory> read_cgroup() {
  std::ifstream in("/proc/self/cgroup");
  if (!in) return Answer<CgroupMemory>::fail("cannot read /proc/self/cgroup");
  std::ostringstream text;
  text << in.rdbuf();
  return read_cgroup_memory("/sys/fs/cgroup", text.str());
}

// --- dlopen'ed CUDA runtime -------------------------------------------------------------------

struct CudaRuntime {
  void* handle = nullptr;
  std::string error;
  int (*get_device_count)(int*) = nullptr;
  int (*get_device)(int*) = nullptr;
  int (*set_device)(int) = nullptr;
  int (*mem_get_info)(std::size_t*, std::size_t*) = nullptr;
  int (*get_pci_bus_id)(char*, int, int) = nullptr;
  int (*get_attribute)(int*, int, int) = nullptr;
  const char* (*error_string)(int) = nullptr;

  std::string describe(int code) const {
    return std::string(error_string ? error_string(code) : "error") + " (" + std::to_string(code) +
           ")";
  }
};

const CudaRuntime& cuda_runtime() {
  static CudaRuntime rt = [] {
    CudaRuntime r;
    for (const char* name :
         {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"}) {
      r.handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (r.handle != nullptr) break;
    }
    if (r.handle == nullptr) {
      r.error = "the CUDA runtime (libcudart.so) could not be loaded";
      return r;
    }
    auto sym = [&](const char* n) { return dlsym(r.handle, n); };
    r.get_device_count = reinterpret_cast<int (*)(int*)>(sym("cudaGetDeviceCount"));
    r.set_device = reinterpret_cast<int (*)(int)>(sym("cudaSetDevice"));
    r.get_device = reinterpret_cast<int (*)(int*)>(sym("cudaGetDevice"));
    r.mem_get_info = reinterpret_cast<int (*)(std::size_t*, std::size_t*)>(sym("cudaMemGetInfo"));
    r.get_pci_bus_id = reinterpret_cast<int (*)(char*, int, int)>(sym("cudaDeviceGetPCIBusId"));
    r.get_attribute = reinterpret_cast<int (*)(int*, int, int)>(sym("cudaDeviceGetAttribute"));
    r.error_string = reinterpret_cast<const char* (*)(int)>(sym("cudaGetErrorString"));
    if (!r.get_device_count || !r.set_device || !r.mem_get_info || !r.get_pci_bus_id ||
        !r.get_attribute) {
      r.error = "the CUDA runtime lacks an entry point zeroflat needs";
    }
    return r;
  }();
  return rt;
}

Answer<CudaDeviceFacts> cuda_facts(int index) {
  const CudaRuntime& rt = cuda_runtime();
  if (!rt.error.empty()) return Answer<CudaDeviceFacts>::fail(rt.error);
  int count = 0;
  // Any error means "no GPU" (without a driver this is error 35, not "no device").
  if (int e = rt.get_device_count(&count); e != 0) {
    return Answer<CudaDeviceFacts>::fail("cudaGetDeviceCount failed: " + rt.describe(e));
  }
  if (index < 0 || index >= count) {
    return Answer<CudaDeviceFacts>::fail("cuda:" + std::to_string(index) + " does not exist (" +
                                         std::to_string(count) + " visible)");
  }
  CudaDeviceFacts f;
  char bus[64] = {};
  if (int e = rt.get_pci_bus_id(bus, sizeof bus, index); e != 0) {
    return Answer<CudaDeviceFacts>::fail("cudaDeviceGetPCIBusId failed: " + rt.describe(e));
  }
  f.pci_bus_id = bus;
  int integrated = 0;
  constexpr int kCudaDevAttrIntegrated = 18;
  if (rt.get_attribute(&integrated, kCudaDevAttrIntegrated, index) == 0) {
    f.integrated = integrated != 0;
  }
  std::size_t free = 0, total = 0;
  // The current device is the caller's (and the framework's) setting: put it back afterwards.
  int previous = -1;
  if (rt.get_device == nullptr || rt.get_device(&previous) != 0) previous = -1;
  if (int e = rt.set_device(index); e != 0) {
    f.mem_get_info_error = "cudaSetDevice failed: " + rt.describe(e);
  } else if (int e2 = rt.mem_get_info(&free, &total); e2 != 0) {
    f.mem_get_info_error = "cudaMemGetInfo failed: " + rt.describe(e2);
  } else {
    f.mem_get_info = MemoryPair{total, free};
  }
  if (previous >= 0 && previous != index) rt.set_device(previous);
  return Answer<CudaDeviceFacts>::ok(f);
}

// --- dlopen'ed NVML ---------------------------------------------------------------------------

struct NvmlMemoryV1 {
  unsigned long long total, free, used;
};
struct NvmlMemoryV2 {
  unsigned int version;
  unsigned long long total, reserved, free, used;
};

struct Nvml {
  void* handle = nullptr;
  std::string error;
  int (*init)() = nullptr;
  int (*by_pci)(const char*, void**) = nullptr;
  int (*memory_v1)(void*, NvmlMemoryV1*) = nullptr;
  int (*memory_v2)(void*, NvmlMemoryV2*) = nullptr;
  const char* (*error_string)(int) = nullptr;

  std::string describe(int code) const {
    return std::string(error_string ? error_string(code) : "error") + " (" + std::to_string(code) +
           ")";
  }
};

const Nvml& nvml() {
  static Nvml n = [] {
    Nvml r;
    r.handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (r.handle == nullptr) {
      r.error = "NVML (libnvidia-ml.so.1) could not be loaded";
      return r;
    }
    auto sym = [&](const char* s) { return dlsym(r.handle, s); };
    r.init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
    r.by_pci =
        reinterpret_cast<int (*)(const char*, void**)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
    r.memory_v1 = reinterpret_cast<int (*)(void*, NvmlMemoryV1*)>(sym("nvmlDeviceGetMemoryInfo"));
    r.memory_v2 =
        reinterpret_cast<int (*)(void*, NvmlMemoryV2*)>(sym("nvmlDeviceGetMemoryInfo_v2"));
    r.error_string = reinterpret_cast<const char* (*)(int)>(sym("nvmlErrorString"));
    if (!r.init || !r.by_pci || (!r.memory_v1 && !r.memory_v2)) {
      r.error = "NVML lacks an entry point zeroflat needs";
      return r;
    }
    if (int e = r.init(); e != 0) r.error = "nvmlInit failed: " + r.describe(e);
    return r;
  }();
  return n;
}

Answer<MemoryPair> nvml_memory(const std::string& pci_bus_id) {
  const Nvml& n = nvml();
  if (!n.error.empty()) return Answer<MemoryPair>::fail(n.error);
  void* device = nullptr;
  if (int e = n.by_pci(pci_bus_id.c_str(), &device); e != 0) {
    return Answer<MemoryPair>::fail("no NVML device at PCI " + pci_bus_id + ": " + n.describe(e));
  }
  std::string v2_error;
  if (n.memory_v2) {
    NvmlMemoryV2 m{};
    m.version = static_cast<unsigned>(sizeof(NvmlMemoryV2)) | (2u << 24);
    const int e = n.memory_v2(device, &m);
    if (e == 0) return Answer<MemoryPair>::ok({m.total, m.free});
    v2_error = "v2: " + n.describe(e) + "; ";
  }
  if (n.memory_v1) {
    NvmlMemoryV1 m{};
    const int e = n.memory_v1(device, &m);
    if (e == 0) return Answer<MemoryPair>::ok({m.total, m.free});
    // NOT_SUPPORTED (3) on GB10, NO_PERMISSION (4) on MIG.
    return Answer<MemoryPair>::fail("nvmlDeviceGetMemoryInfo: " + v2_error +
                                    "v1: " + n.describe(e));
  }
  return Answer<MemoryPair>::fail("nvmlDeviceGetMemoryInfo: " + v2_error);
}

}  // namespace

Answer<MemoryPair> read_proc_meminfo() {
  std::ifstream in("/proc/meminfo");
  if (!in) return Answer<MemoryPair>::fail("cannot read /proc/meminfo");
  std::string key, unit;
  std::uint64_t kb = 0;
  std::optional<std::uint64_t> total, available;
  while (in >> key >> kb) {
    std::getline(in, unit);
    if (key == "MemTotal:") total = kb * 1024;
    if (key == "MemAvailable:") available = kb * 1024;
  }
  if (!total || !available) {
    return Answer<MemoryPair>::fail("/proc/meminfo has no MemTotal or MemAvailable");
  }
  return Answer<MemoryPair>::ok({*total, *available});
}

Answer<CgroupMemory> read_cgroup_memory(const std::string& root, std::string_view self_cgroup) {
  std::string v2_path, v1_path;
  std::istringstream lines{std::string(self_cgroup)};
  std::string line;
  while (std::getline(lines, line)) {
    // "0::/path" (v2) or "N:memory:/path" (v1; the controller list may hold several).
    const auto a = line.find(':');
    if (a == std::string::npos) continue;
    const auto b = line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) v2_path = path;
    std::stringstream list(controllers);
    std::string c;
    while (std::getline(list, c, ',')) {
      if (c == "memory") v1_path = path;
    }
  }
  if (!v1_path.empty()) {
    if (auto m = read_v1(root, v1_path)) return Answer<CgroupMemory>::ok(*m);
  }
  if (!v2_path.empty() || v1_path.empty()) {
    if (auto m = read_v2(root, v2_path.empty() ? "/" : v2_path))
      return Answer<CgroupMemory>::ok(*m);
  }
  return Answer<CgroupMemory>::fail("no cgroup memory controller found for this process");
}

HostProbeSources system_host_sources(unsigned local_ranks) {
  HostProbeSources s;
  s.meminfo = read_proc_meminfo;
  s.cgroup = read_cgroup;
  if (local_ranks == 0) {
    try {
      local_ranks = runtime_env().local_ranks.value_or(1);
    } catch (...) {
      local_ranks = 1;
    }
  }
  s.local_ranks = local_ranks;
  return s;
}

CudaProbeSources system_cuda_sources() {
  CudaProbeSources s;
  s.cuda = cuda_facts;
  s.nvml = nvml_memory;
  s.host = read_proc_meminfo;
  // Container runtimes often set only NVIDIA_VISIBLE_DEVICES.
  for (const char* var : {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      s.visible_devices = v;
      s.visible_devices_var = var;
      break;
    }
  }
  return s;
}

}  // namespace zeroflat
