// The CUDA runtime and NVML as the probe's sources, both loaded with dlopen so that zeroflat
// builds and runs where they are absent.
#include <dlfcn.h>

#include <memory>
#include <string>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/probe.h"

namespace zeroflat {
namespace {

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

// The first of `names` that loads, or null. Libraries stay loaded for the life of the process.
void* open_first(const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    if (void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
  }
  return nullptr;
}

// The CUDA runtime with the entry points zeroflat needs; the error says why not.
std::shared_ptr<const CudaRuntime> load_cuda_runtime(const std::vector<std::string>& names) {
  auto r = std::make_shared<CudaRuntime>();
  r->handle = open_first(names);
  if (r->handle == nullptr) {
    r->error = "the CUDA runtime (" + join(names) + ") could not be loaded";
    return r;
  }
  auto sym = [&](const char* n) { return dlsym(r->handle, n); };
  r->get_device_count = reinterpret_cast<int (*)(int*)>(sym("cudaGetDeviceCount"));
  r->set_device = reinterpret_cast<int (*)(int)>(sym("cudaSetDevice"));
  r->get_device = reinterpret_cast<int (*)(int*)>(sym("cudaGetDevice"));
  r->mem_get_info = reinterpret_cast<int (*)(std::size_t*, std::size_t*)>(sym("cudaMemGetInfo"));
  r->get_pci_bus_id = reinterpret_cast<int (*)(char*, int, int)>(sym("cudaDeviceGetPCIBusId"));
  r->get_attribute = reinterpret_cast<int (*)(int*, int, int)>(sym("cudaDeviceGetAttribute"));
  r->error_string = reinterpret_cast<const char* (*)(int)>(sym("cudaGetErrorString"));
  if (!r->get_device_count || !r->set_device || !r->mem_get_info || !r->get_pci_bus_id ||
      !r->get_attribute) {
    r->error = "the CUDA runtime lacks an entry point zeroflat needs";
  }
  return r;
}

Answer<CudaDeviceFacts> cuda_facts(const CudaRuntime& rt, int index) {
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

std::shared_ptr<const Nvml> load_nvml(const std::vector<std::string>& names) {
  auto r = std::make_shared<Nvml>();
  r->handle = open_first(names);
  if (r->handle == nullptr) {
    r->error = "NVML (" + join(names) + ") could not be loaded";
    return r;
  }
  auto sym = [&](const char* n) { return dlsym(r->handle, n); };
  r->init = reinterpret_cast<int (*)()>(sym("nvmlInit_v2"));
  r->by_pci =
      reinterpret_cast<int (*)(const char*, void**)>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
  r->memory_v1 = reinterpret_cast<int (*)(void*, NvmlMemoryV1*)>(sym("nvmlDeviceGetMemoryInfo"));
  r->memory_v2 =
      reinterpret_cast<int (*)(void*, NvmlMemoryV2*)>(sym("nvmlDeviceGetMemoryInfo_v2"));
  r->error_string = reinterpret_cast<const char* (*)(int)>(sym("nvmlErrorString"));
  if (!r->init || !r->by_pci || (!r->memory_v1 && !r->memory_v2)) {
    r->error = "NVML lacks an entry point zeroflat needs";
    return r;
  }
  if (int e = r->init(); e != 0) r->error = "nvmlInit failed: " + r->describe(e);
  return r;
}

Answer<MemoryPair> nvml_memory(const Nvml& n, const std::string& pci_bus_id) {
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

CudaProbeSources cuda_sources_from(const std::vector<std::string>& cuda_runtime,
                                   const std::vector<std::string>& nvml) {
  std::shared_ptr<const CudaRuntime> rt = load_cuda_runtime(cuda_runtime);
  std::shared_ptr<const Nvml> nv = load_nvml(nvml);
  CudaProbeSources s;
  s.cuda = [rt](int index) { return cuda_facts(*rt, index); };
  s.nvml = [nv](const std::string& bus) { return nvml_memory(*nv, bus); };
  s.host = read_proc_meminfo;
  const VisibleDevices visible = visible_devices();
  s.visible_devices = visible.value;
  s.visible_devices_var = visible.variable;
  return s;
}

CudaProbeSources system_cuda_sources() {
  // Loaded once per process: dlopen and nvmlInit are not free.
  static const CudaProbeSources loaded = cuda_sources_from(
      {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"},
      {"libnvidia-ml.so.1"});
  CudaProbeSources s = loaded;
  const VisibleDevices visible = visible_devices();
  s.visible_devices = visible.value;
  s.visible_devices_var = visible.variable;
  return s;
}

}  // namespace zeroflat
