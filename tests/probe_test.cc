// The probe on machines zeroflat does not run on: fakes for NVML, the CUDA runtime, cgroups.
#include "zeroflat/probe.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
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

TEST(ProbeHost, MeminfoFromItsText) {
  const Answer<MemoryPair> ok = parse_meminfo(
      "MemTotal:       131961976 kB\nMemFree:        130614160 kB\n"
      "MemAvailable:   131455204 kB\nHugePages_Total:       0\n");
  ASSERT_TRUE(ok.value);
  EXPECT_EQ(ok.value->total_bytes, 131961976ull * 1024);
  EXPECT_EQ(ok.value->free_bytes, 131455204ull * 1024);
  // A sandbox that answers zeros (seen for a process holding a GPU) gives no answer: the cgroup
  // decides, not "nothing free".
  const Answer<MemoryPair> zeros =
      parse_meminfo("MemTotal:              0 kB\nMemAvailable:          0 kB\n");
  EXPECT_FALSE(zeros.value);
  EXPECT_NE(zeros.error.find("MemTotal 0"), std::string::npos) << zeros.error;
  EXPECT_FALSE(parse_meminfo("MemTotal: 1024 kB\n").value);        // no MemAvailable
  EXPECT_FALSE(parse_meminfo("MemTotal: x kB\nMemAvailable: 1 kB").value);
  EXPECT_FALSE(parse_meminfo("MemTotal: 99999999999999999999 kB\nMemAvailable: 1 kB").value);
  // Available never above the total; no final newline.
  const Answer<MemoryPair> capped = parse_meminfo("MemAvailable: 9 kB\nMemTotal: 4 kB");
  ASSERT_TRUE(capped.value);
  EXPECT_EQ(capped.value->free_bytes, 4096u);

  HostProbeSources s;
  s.meminfo = [] { return parse_meminfo("MemTotal: 0 kB\nMemAvailable: 0 kB\n"); };
  s.cgroup = [] {
    return Answer<CgroupMemory>::ok(CgroupMemory{2, 128 * kGB, 3 * kGB, "process_api"});
  };
  const ProbeResult r = probe_host(s);
  EXPECT_TRUE(r.available);
  EXPECT_EQ(r.free_bytes, 125 * kGB);
  EXPECT_EQ(r.used, "cgroup v2");
}

TEST(ProbeHost, SysinfoAnswersWhereMeminfoDoesNot) {
  HostProbeSources s;
  s.meminfo = [] { return parse_meminfo("MemTotal: 0 kB\nMemAvailable: 0 kB\n"); };
  s.sysinfo = [] { return Answer<MemoryPair>::ok({64 * kGB, 20 * kGB}); };
  s.cgroup = [] { return Answer<CgroupMemory>::ok(CgroupMemory{2, std::nullopt, 0, "x"}); };
  s.local_ranks = 2;
  ProbeResult r = probe_host(s);
  EXPECT_TRUE(r.available);
  EXPECT_EQ(r.used, "sysinfo");
  EXPECT_EQ(r.free_bytes, 10 * kGB);
  // A limit with less room still decides.
  s.cgroup = [] { return Answer<CgroupMemory>::ok(CgroupMemory{2, 16 * kGB, 10 * kGB, "x"}); };
  r = probe_host(s);
  EXPECT_EQ(r.used, "cgroup v2");
  EXPECT_EQ(r.free_bytes, 3 * kGB);
  // Asked only where meminfo fails: a meminfo answer is never second-guessed.
  s.meminfo = [] { return Answer<MemoryPair>::ok({64 * kGB, 40 * kGB}); };
  s.sysinfo = [] { return Answer<MemoryPair>::fail("must not be asked"); };
  s.cgroup = [] { return Answer<CgroupMemory>::ok(CgroupMemory{2, std::nullopt, 0, "x"}); };
  r = probe_host(s);
  EXPECT_EQ(r.used, "MemAvailable");
  for (const SourceReport& src : r.sources) EXPECT_NE(src.source, "sysinfo");
  // Neither answers: no figure, both reasons kept.
  s.meminfo = [] { return Answer<MemoryPair>::fail("no /proc"); };
  s.sysinfo = [] { return Answer<MemoryPair>::fail("sysinfo reports totalram 0"); };
  r = probe_host(s);
  EXPECT_FALSE(r.available);
  EXPECT_EQ(r.sources.size(), 3u);
  // This machine's sysinfo answers, within its meminfo total.
  const Answer<MemoryPair> here = read_sysinfo();
  ASSERT_TRUE(here.value) << here.error;
  EXPECT_GT(here.value->free_bytes, 0u);
  EXPECT_LE(here.value->free_bytes, here.value->total_bytes);
}

TEST(ProbeHost, ThisMachineAnswers) {
  ProbeResult r = probe_host(system_host_sources(1));
  EXPECT_TRUE(r.available);
  EXPECT_GT(r.free_bytes, 0u);
  EXPECT_LE(r.free_bytes, r.total_bytes);
}

}  // namespace
}  // namespace zeroflat

namespace zeroflat {
namespace {

class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::path(::testing::TempDir()) /
            ("zf_cgroup_" + std::to_string(getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  void put(const std::string& rel, const std::string& content) {
    const std::filesystem::path p = root_ / rel;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << content;
  }
  std::filesystem::path root_;
};

TEST_F(CgroupTree, V2AnAncestorsLimitDecidesWhenItLeavesLessRoom) {
  // job.slice has 8 GB with 6 GB in use; the process's own cgroup allows 16 GB with 1 GB in use.
  put("memory.current", "100\n");  // the mount root: no memory.max
  put("job.slice/memory.max", "8000000000\n");
  put("job.slice/memory.current", "6500000000\n");
  put("job.slice/memory.stat", "anon 1\ninactive_file 500000000\n");
  put("job.slice/step/memory.max", "16000000000\n");
  put("job.slice/step/memory.current", "1000000000\n");
  Answer<CgroupMemory> a = read_cgroup_memory(root_.string(), "0::/job.slice/step\n");
  ASSERT_TRUE(a.value) << a.error;
  EXPECT_EQ(a.value->version, 2);
  EXPECT_EQ(*a.value->limit_bytes, 8'000'000'000u);
  EXPECT_EQ(a.value->usage_bytes, 6'000'000'000u);  // page cache not counted
  EXPECT_NE(a.value->path.find("job.slice/memory.max"), std::string::npos);
  // No limit anywhere: the leaf, unlimited.
  put("job.slice/memory.max", "max\n");
  put("job.slice/step/memory.max", "max\n");
  a = read_cgroup_memory(root_.string(), "0::/job.slice/step\n");
  ASSERT_TRUE(a.value);
  EXPECT_FALSE(a.value->limit_bytes);
}

TEST_F(CgroupTree, V1UsesTheHierarchicalLimitAndIgnoresNoLimit) {
  put("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");  // "no limit"
  put("memory/docker/abc/memory.usage_in_bytes", "3000000000\n");
  put("memory/docker/abc/memory.stat",
      "hierarchical_memory_limit 4000000000\ntotal_inactive_file 1000000000\n");
  Answer<CgroupMemory> a =
      read_cgroup_memory(root_.string(), "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n");
  ASSERT_TRUE(a.value) << a.error;
  EXPECT_EQ(a.value->version, 1);
  EXPECT_EQ(*a.value->limit_bytes, 4'000'000'000u);
  EXPECT_EQ(a.value->usage_bytes, 2'000'000'000u);
  // The controller mounted at the container's own root (the path is the host's).
  std::filesystem::remove_all(root_ / "memory/docker");
  put("memory/memory.limit_in_bytes", "2000000000\n");
  put("memory/memory.usage_in_bytes", "500000000\n");
  a = read_cgroup_memory(root_.string(), "4:memory:/docker/abc\n");
  ASSERT_TRUE(a.value);
  EXPECT_EQ(*a.value->limit_bytes, 2'000'000'000u);
  // Nothing mounted: an error, not an exception.
  EXPECT_FALSE(read_cgroup_memory((root_ / "nothing").string(), "0::/\n").value);
  EXPECT_FALSE(read_cgroup_memory(root_.string(), "garbage").value);
}

}  // namespace
}  // namespace zeroflat
