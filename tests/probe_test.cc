// The probe on machines zeroflat does not run on: fakes for NVML, the CUDA runtime, cgroups.
#include "zeroflat/probe.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace zeroflat {
namespace {

constexpr std::uint64_t kGB = 1'000'000'000;

const SourceReport* source(const ProbeResult& r, const std::string& name) {
  for (const SourceReport& s : r.sources) {
    if (s.source == name) return &s;
  }
  return nullptr;
}

CudaProbeSources h100(std::uint64_t nvml_free, std::uint64_t cuda_free) {
  CudaProbeSources s;
  s.cuda = [=](int index) {
    if (index != 0) return Answer<CudaDeviceFacts>::fail("no such device");
    CudaDeviceFacts f;
    f.pci_bus_id = "0000:1B:00.0";
    f.mem_get_info = MemoryPair{80 * kGB, cuda_free};
    return Answer<CudaDeviceFacts>::ok(f);
  };
  s.nvml = [=](const std::string& pci) {
    if (pci != "0000:1B:00.0") return Answer<MemoryPair>::fail("wrong device asked: " + pci);
    return Answer<MemoryPair>::ok({80 * kGB, nvml_free});
  };
  s.host = [] { return Answer<MemoryPair>::ok({512 * kGB, 400 * kGB}); };
  return s;
}

TEST(ProbeCuda, NvmlSeesTheWholeDeviceAndIsPreferred) {
  ProbeResult r = probe_cuda(0, h100(30 * kGB, 35 * kGB));
  EXPECT_TRUE(r.available);
  EXPECT_EQ(r.used, "nvml");
  EXPECT_EQ(r.free_bytes, 30 * kGB);
  ASSERT_NE(source(r, "cudaMemGetInfo"), nullptr);
  EXPECT_EQ(source(r, "cudaMemGetInfo")->free_bytes, 35 * kGB);  // kept, not used
}

TEST(ProbeCuda, Gb10NvmlNotSupportedFallsBackAndTheHostCapsIt) {
  CudaProbeSources s = h100(0, 100 * kGB);
  s.cuda = [](int) {
    CudaDeviceFacts f;
    f.pci_bus_id = "000F:01:00.0";
    f.integrated = true;
    f.mem_get_info = MemoryPair{128 * kGB, 100 * kGB};
    return Answer<CudaDeviceFacts>::ok(f);
  };
  s.nvml = [](const std::string&) {
    return Answer<MemoryPair>::fail("nvmlDeviceGetMemoryInfo: Not Supported (3)");
  };
  s.host = [] { return Answer<MemoryPair>::ok({128 * kGB, 90 * kGB}); };
  ProbeResult r = probe_cuda(0, s);
  EXPECT_TRUE(r.available);
  EXPECT_FALSE(source(r, "nvml")->ok);
  EXPECT_NE(source(r, "nvml")->detail.find("Not Supported"), std::string::npos);
  EXPECT_EQ(r.free_bytes, 90 * kGB);  // cudaMemGetInfo's 100, capped by the host's 90
  EXPECT_NE(r.used.find("cudaMemGetInfo"), std::string::npos);
  EXPECT_NE(r.used.find("host"), std::string::npos);
}

TEST(ProbeCuda, MigSliceNeverUsesDeviceLevelNvmlNumbers) {
  CudaProbeSources s = h100(70 * kGB, 9 * kGB);  // NVML would say the parent GPU's 70 GB
  s.visible_devices = "MIG-5c89ad5e-3d2a-5d0c-8a6c-1f2a3b4c5d6e";
  bool nvml_asked = false;
  s.nvml = [&](const std::string&) {
    nvml_asked = true;
    return Answer<MemoryPair>::ok({80 * kGB, 70 * kGB});
  };
  ProbeResult r = probe_cuda(0, s);
  EXPECT_FALSE(nvml_asked);
  EXPECT_EQ(r.used, "cudaMemGetInfo");
  EXPECT_EQ(r.free_bytes, 9 * kGB);
  // And where NVML itself refuses (NO_PERMISSION), the same fallback.
  CudaProbeSources t = h100(0, 9 * kGB);
  t.nvml = [](const std::string&) { return Answer<MemoryPair>::fail("No Permission (4)"); };
  EXPECT_EQ(probe_cuda(0, t).free_bytes, 9 * kGB);
}

TEST(ProbeCuda, UuidsInVisibleDevicesAreNotParsedAsIndices) {
  CudaProbeSources s = h100(30 * kGB, 35 * kGB);
  s.visible_devices =
      "GPU-8f2a1b3c-aaaa-bbbb-cccc-0123456789ab,GPU-11111111-2222-3333-4444-555555555555";
  // The fake NVML only answers for the CUDA device's own PCI bus id.
  ProbeResult r = probe_cuda(0, s);
  EXPECT_EQ(r.used, "nvml");
  EXPECT_EQ(r.free_bytes, 30 * kGB);
}

TEST(ProbeCuda, WithoutNvmlCudaAnswersAndTheProcessViewIsReported) {
  CudaProbeSources s = h100(0, 0);
  s.nvml = nullptr;  // not installed
  ProbeResult r = probe_cuda(0, s);
  EXPECT_EQ(r.used, "cudaMemGetInfo");
  s.cuda = [](int) {
    CudaDeviceFacts f;
    f.pci_bus_id = "0000:1B:00.0";
    f.mem_get_info_error = "cudaMemGetInfo failed: out of memory (2)";
    return Answer<CudaDeviceFacts>::ok(f);
  };
  s.nvml = [](const std::string&) { return Answer<MemoryPair>::ok({80 * kGB, 50 * kGB}); };
  s.process_allocated_bytes = 20 * kGB;
  ProbeResult v = probe_cuda(0, s);
  EXPECT_EQ(v.used, "nvml");
  EXPECT_EQ(source(v, "process view")->free_bytes, 60 * kGB);
}

TEST(ProbeCuda, NoGpuIsReportedNotThrown) {
  CudaProbeSources s;
  s.cuda = [](int) -> Answer<CudaDeviceFacts> {
    return Answer<CudaDeviceFacts>::fail(
        "cudaGetDeviceCount failed: CUDA driver version is insufficient (35)");
  };
  ProbeResult r = probe_cuda(0, s);
  EXPECT_FALSE(r.available);
  EXPECT_NE(r.notes.at(0).find("(35)"), std::string::npos);
  // A source that throws is an error, not an exception out of the probe.
  s.cuda = [](int) -> Answer<CudaDeviceFacts> { throw std::runtime_error("driver exploded"); };
  ProbeResult t = probe_cuda(0, s);
  EXPECT_FALSE(t.available);
  EXPECT_EQ(t.sources.at(0).detail, "driver exploded");
  EXPECT_FALSE(probe_cuda(0, CudaProbeSources{}).available);
}

TEST(ProbeCuda, NvmlDescribingMoreThanTheDeviceIsNotUsed) {
  // A MIG slice the environment does not name: NVML answers for the whole GPU.
  CudaProbeSources s = h100(70 * kGB, 9 * kGB);
  s.cuda = [](int) {
    CudaDeviceFacts f;
    f.pci_bus_id = "0000:1B:00.0";
    f.mem_get_info = MemoryPair{10 * kGB, 9 * kGB};
    return Answer<CudaDeviceFacts>::ok(f);
  };
  ProbeResult r = probe_cuda(0, s);
  EXPECT_EQ(r.used, "cudaMemGetInfo");
  EXPECT_EQ(r.free_bytes, 9 * kGB);
  EXPECT_NE(source(r, "nvml")->detail.find("differs"), std::string::npos);
}

TEST(ProbeCuda, FrameworkCachedBytesAreCredited) {
  CudaProbeSources s = h100(30 * kGB, 30 * kGB);
  s.framework_cached_free_bytes = 5 * kGB;
  ProbeResult r = probe_cuda(0, s);
  EXPECT_EQ(r.free_bytes, 35 * kGB);
  s.framework_cached_free_bytes = 500 * kGB;  // never more than the device
  EXPECT_EQ(probe_cuda(0, s).free_bytes, 80 * kGB);
}

TEST(ProbeHost, TheSmallerOfMemAvailableAndTheCgroupSharedAmongRanks) {
  HostProbeSources s;
  s.meminfo = [] { return Answer<MemoryPair>::ok({64 * kGB, 40 * kGB}); };
  s.cgroup = [] {
    return Answer<CgroupMemory>::ok(
        CgroupMemory{2, 16 * kGB, 4 * kGB, "/sys/fs/cgroup/memory.max"});
  };
  s.local_ranks = 4;
  ProbeResult r = probe_host(s);
  EXPECT_TRUE(r.available);
  EXPECT_EQ(r.used, "cgroup v2");
  EXPECT_EQ(r.free_bytes, 12 * kGB / 4);
  // No cgroup limit: MemAvailable, shared.
  s.cgroup = [] { return Answer<CgroupMemory>::ok(CgroupMemory{1, std::nullopt, 0, "v1"}); };
  r = probe_host(s);
  EXPECT_EQ(r.used, "MemAvailable");
  EXPECT_EQ(r.free_bytes, 10 * kGB);
  // Unreadable cgroup: still MemAvailable, the error kept.
  s.cgroup = [] { return Answer<CgroupMemory>::fail("cannot read /proc/self/cgroup"); };
  s.local_ranks = 1;
  r = probe_host(s);
  EXPECT_EQ(r.free_bytes, 40 * kGB);
  EXPECT_FALSE(r.sources.back().ok);
  // Usage above the limit leaves nothing, not a wrapped-around number.
  s.cgroup = [] { return Answer<CgroupMemory>::ok(CgroupMemory{2, 4 * kGB, 5 * kGB, "x"}); };
  EXPECT_EQ(probe_host(s).free_bytes, 0u);
}

TEST(ProbeHost, ThisMachineAnswers) {
  ProbeResult r = probe_host(system_host_sources(1));
  EXPECT_TRUE(r.available);
  EXPECT_GT(r.free_bytes, 0u);
  EXPECT_LE(r.free_bytes, r.total_bytes);
}

}  // namespace
}  // namespace zeroflat
