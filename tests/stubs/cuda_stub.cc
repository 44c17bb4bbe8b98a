// A stand-in for the CUDA runtime and NVML, built by the tests and loaded by zeroflat's probe
// in their place (cuda_sources_from): the dlopen and ABI layer is exercised here, without a
// GPU. The test configures it through the zeroflat_stub_* functions. Built twice: with
// nvmlDeviceGetMemoryInfo_v2, and without it (ZEROFLAT_STUB_NO_V2, an old driver).
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Gpu {
  std::string bus;
  std::uint64_t total = 0;
  std::uint64_t nvml_free = 0;
  std::uint64_t cuda_free = 0;
  int integrated = 0;
};

struct Config {
  std::vector<Gpu> gpus;  // in the runtime's order (CUDA_VISIBLE_DEVICES already applied)
  int count_error = 0;    // cudaGetDeviceCount's result (35: no driver)
  int nvml_init_error = 0;
  int nvml_v2_error = 0;  // nvmlDeviceGetMemoryInfo_v2 (25: version mismatch)
  int nvml_v1_error = 0;  // nvmlDeviceGetMemoryInfo (3: NOT_SUPPORTED, 4: NO_PERMISSION)
  int current = 0;
  unsigned v2_version_seen = 0;
};

Config& config() {
  static Config c;
  return c;
}

struct NvmlMemoryV1 {
  unsigned long long total, free, used;
};
struct NvmlMemoryV2 {
  unsigned int version;
  unsigned long long total, reserved, free, used;
};

}  // namespace

extern "C" {

// --- configuration, for the test --------------------------------------------------------------
void zeroflat_stub_reset() {
  config() = Config{};
}
void zeroflat_stub_add_gpu(const char* bus, std::uint64_t total, std::uint64_t nvml_free,
                           std::uint64_t cuda_free, int integrated) {
  config().gpus.push_back(Gpu{bus, total, nvml_free, cuda_free, integrated});
}
void zeroflat_stub_errors(int count_error, int nvml_init_error, int nvml_v2_error,
                          int nvml_v1_error) {
  Config& c = config();
  c.count_error = count_error;
  c.nvml_init_error = nvml_init_error;
  c.nvml_v2_error = nvml_v2_error;
  c.nvml_v1_error = nvml_v1_error;
}
int zeroflat_stub_current_device() {
  return config().current;
}
unsigned zeroflat_stub_v2_version_seen() {
  return config().v2_version_seen;
}

// --- the CUDA runtime -------------------------------------------------------------------------
int cudaGetDeviceCount(int* count) {
  if (config().count_error != 0) return config().count_error;
  *count = static_cast<int>(config().gpus.size());
  return 0;
}
int cudaGetDevice(int* device) {
  *device = config().current;
  return 0;
}
int cudaSetDevice(int device) {
  if (device < 0 || device >= static_cast<int>(config().gpus.size())) return 101;
  config().current = device;
  return 0;
}
int cudaMemGetInfo(std::size_t* free, std::size_t* total) {
  const Gpu& g = config().gpus.at(static_cast<std::size_t>(config().current));
  *free = g.cuda_free;
  *total = g.total;
  return 0;
}
int cudaDeviceGetPCIBusId(char* out, int len, int device) {
  if (device < 0 || device >= static_cast<int>(config().gpus.size())) return 101;
  std::strncpy(out, config().gpus[static_cast<std::size_t>(device)].bus.c_str(),
               static_cast<std::size_t>(len));
  return 0;
}
int cudaDeviceGetAttribute(int* value, int attribute, int device) {
  if (device < 0 || device >= static_cast<int>(config().gpus.size())) return 101;
  *value = attribute == 18 ? config().gpus[static_cast<std::size_t>(device)].integrated : 0;
  return 0;
}
const char* cudaGetErrorString(int error) {
  return error == 35 ? "CUDA driver version is insufficient for CUDA runtime version"
                     : "stub CUDA error";
}

// --- NVML ---------------------------------------------------------------------------------------
int nvmlInit_v2() {
  return config().nvml_init_error;
}
int nvmlDeviceGetHandleByPciBusId_v2(const char* bus, void** device) {
  for (Gpu& g : config().gpus) {
    if (g.bus == bus) {
      *device = &g;
      return 0;
    }
  }
  return 6;  // NVML_ERROR_NOT_FOUND
}
int nvmlDeviceGetMemoryInfo(void* device, NvmlMemoryV1* m) {
  if (config().nvml_v1_error != 0) return config().nvml_v1_error;
  const Gpu& g = *static_cast<const Gpu*>(device);
  *m = NvmlMemoryV1{g.total, g.nvml_free, g.total - g.nvml_free};
  return 0;
}
#ifndef ZEROFLAT_STUB_NO_V2
int nvmlDeviceGetMemoryInfo_v2(void* device, NvmlMemoryV2* m) {
  config().v2_version_seen = m->version;
  if (config().nvml_v2_error != 0) return config().nvml_v2_error;
  // The versioned struct: the caller must say which layout it passes (NVML's own check).
  if (m->version != (static_cast<unsigned>(sizeof(NvmlMemoryV2)) | (2u << 24))) return 25;
  const Gpu& g = *static_cast<const Gpu*>(device);
  m->total = g.total;
  m->reserved = 0;
  m->free = g.nvml_free;
  m->used = g.total - g.nvml_free;
  return 0;
}
#endif
const char* nvmlErrorString(int error) {
  switch (error) {
    case 3:
      return "Not Supported";
    case 4:
      return "Insufficient Permissions";
    case 6:
      return "Not Found";
    case 25:
      return "Argument version mismatch";
    default:
      return "stub NVML error";
  }
}

}  // extern "C"
