// The probe's CUDA runtime and NVML loaders, end to end without a GPU: they dlopen a stand-in
// library (stubs/cuda_stub.cc) and must call its entry points with the right ABI, map CUDA's
// device order to NVML's devices by PCI bus id, fall back from NVML's v2 memory query to v1,
// survive NOT_SUPPORTED (GB10), skip NVML on a MIG slice, and say why when there is no driver.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "zeroflat/probe.h"

namespace zeroflat {
namespace {

constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

// The stub as the test sees it (the loader's dlopen of the same path shares its state).
class Stub {
 public:
  explicit Stub(const char* path) : path_(path) {
    handle_ = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) throw std::runtime_error(dlerror());
    fn<void (*)()>("zeroflat_stub_reset")();
  }
  ~Stub() { dlclose(handle_); }
  void add_gpu(const char* bus, std::uint64_t total, std::uint64_t nvml_free,
               std::uint64_t cuda_free, bool integrated = false) {
    fn<void (*)(const char*, std::uint64_t, std::uint64_t, std::uint64_t, int)>(
        "zeroflat_stub_add_gpu")(bus, total, nvml_free, cuda_free, integrated ? 1 : 0);
  }
  void errors(int count, int nvml_init, int nvml_v2, int nvml_v1) {
    fn<void (*)(int, int, int, int)>("zeroflat_stub_errors")(count, nvml_init, nvml_v2, nvml_v1);
  }
  int current_device() { return fn<int (*)()>("zeroflat_stub_current_device")(); }
  unsigned v2_version_seen() { return fn<unsigned (*)()>("zeroflat_stub_v2_version_seen")(); }
  CudaProbeSources sources(const std::string& visible = "") const {
    CudaProbeSources s = cuda_sources_from({path_}, {path_});
    s.visible_devices = visible;
    s.visible_devices_var = visible.empty() ? "" : "CUDA_VISIBLE_DEVICES";
    s.host = [] { return Answer<MemoryPair>::ok({64 * kGiB, 10 * kGiB}); };
    return s;
  }

 private:
  template <typename F>
  F fn(const char* name) {
    void* p = dlsym(handle_, name);
    if (p == nullptr) throw std::runtime_error(std::string("stub lacks ") + name);
    return reinterpret_cast<F>(p);
  }
  std::string path_;
  void* handle_ = nullptr;
};

const SourceReport* source(const ProbeResult& r, const std::string& name) {
  for (const SourceReport& s : r.sources) {
    if (s.source == name) return &s;
  }
  return nullptr;
}

TEST(CudaLoader, NvmlAnswersForTheDeviceCudaNamesByBusId) {
  Stub stub(ZEROFLAT_CUDA_STUB);
  // CUDA_VISIBLE_DEVICES=3,1 (or GPU- UUIDs) as the runtime applies it: its device 0 is the
  // GPU at bus 3C, device 1 the one at 1B. NVML is asked by bus id, never by index.
  stub.add_gpu("00000000:3C:00.0", 80 * kGiB, 70 * kGiB, 69 * kGiB);
  stub.add_gpu("00000000:1B:00.0", 80 * kGiB, 20 * kGiB, 19 * kGiB);
  const CudaProbeSources s = stub.sources("GPU-aaaa,GPU-bbbb");
  const ProbeResult r1 = probe_cuda(1, s);
  ASSERT_TRUE(r1.available) << r1.sources.front().detail;
  EXPECT_EQ(r1.used, "nvml");
  EXPECT_EQ(r1.free_bytes, 20 * kGiB);
  EXPECT_NE(source(r1, "nvml")->detail.find("1B:00.0"), std::string::npos);
  EXPECT_EQ(source(r1, "cudaMemGetInfo")->free_bytes, 19 * kGiB);
  EXPECT_EQ(probe_cuda(0, s).free_bytes, 70 * kGiB);
  // The v2 query was made with the versioned struct, and the caller's device put back.
  EXPECT_EQ(stub.v2_version_seen() >> 24, 2u);
  EXPECT_EQ(stub.current_device(), 0);
}

TEST(CudaLoader, FallsBackFromV2ToV1AndWorksWithoutV2) {
  {
    Stub stub(ZEROFLAT_CUDA_STUB);
    stub.add_gpu("0000:1B:00.0", 80 * kGiB, 33 * kGiB, 30 * kGiB);
    stub.errors(0, 0, 25, 0);  // the driver refuses the v2 struct
    const ProbeResult r = probe_cuda(0, stub.sources());
    EXPECT_EQ(r.used, "nvml");
    EXPECT_EQ(r.free_bytes, 33 * kGiB);
  }
  {
    Stub old(ZEROFLAT_CUDA_STUB_V1);  // a driver without nvmlDeviceGetMemoryInfo_v2
    old.add_gpu("0000:1B:00.0", 80 * kGiB, 44 * kGiB, 40 * kGiB);
    const ProbeResult r = probe_cuda(0, old.sources());
    EXPECT_EQ(r.used, "nvml");
    EXPECT_EQ(r.free_bytes, 44 * kGiB);
  }
}

TEST(CudaLoader, Gb10NvmlNotSupportedFallsToCudaCappedByTheHost) {
  Stub stub(ZEROFLAT_CUDA_STUB);
  stub.add_gpu("000F:01:00.0", 119 * kGiB, 0, 100 * kGiB, /*integrated=*/true);
  stub.errors(0, 0, 3, 3);  // NOT_SUPPORTED from both memory queries
  const ProbeResult r = probe_cuda(0, stub.sources());
  ASSERT_TRUE(r.available);
  EXPECT_TRUE(r.integrated);
  const SourceReport* nv = source(r, "nvml");
  ASSERT_NE(nv, nullptr);
  EXPECT_FALSE(nv->ok);
  EXPECT_NE(nv->detail.find("Not Supported"), std::string::npos) << nv->detail;
  EXPECT_EQ(r.free_bytes, 10 * kGiB);  // cudaMemGetInfo's 100 GiB, capped by the host's 10
  EXPECT_NE(r.used.find("cudaMemGetInfo"), std::string::npos) << r.used;
}

TEST(CudaLoader, MigSliceSkipsNvmlAndNoDriverSaysWhy) {
  Stub stub(ZEROFLAT_CUDA_STUB);
  stub.add_gpu("0000:1B:00.0", 20 * kGiB, 70 * kGiB, 15 * kGiB);
  const ProbeResult mig = probe_cuda(0, stub.sources("MIG-5f0e8a1b-0000-0000-0000-000000000000"));
  EXPECT_EQ(mig.used, "cudaMemGetInfo");
  EXPECT_EQ(mig.free_bytes, 15 * kGiB);
  EXPECT_NE(source(mig, "nvml")->detail.find("MIG"), std::string::npos);
  stub.errors(35, 0, 0, 0);
  const ProbeResult none = probe_cuda(0, stub.sources());
  EXPECT_FALSE(none.available);
  EXPECT_NE(none.sources.front().detail.find("(35)"), std::string::npos)
      << none.sources.front().detail;
  stub.errors(0, 999, 0, 0);  // nvmlInit fails: cudaMemGetInfo answers
  EXPECT_EQ(probe_cuda(0, stub.sources()).used, "cudaMemGetInfo");
}

TEST(CudaLoader, ALibraryThatIsNotThereIsASourceErrorNotAFailure) {
  const CudaProbeSources s = cuda_sources_from({"/nonexistent/libcudart.so"},
                                               {"/nonexistent/libnvidia-ml.so.1"});
  const ProbeResult r = probe_cuda(0, s);
  EXPECT_FALSE(r.available);
  EXPECT_NE(r.sources.front().detail.find("could not be loaded"), std::string::npos);
}

}  // namespace
}  // namespace zeroflat
