// The cuda device and the nccl communicator: the gather kernel's walk (run on the host, every
// build), what a machine without a GPU answers, and, on a GPU, every Device operation against the
// cpu device and host references.
#include "device/cuda_device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "device/cuda_gather.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/config.h"
#include "zeroflat/device.h"
#include "zeroflat/engine.h"
#include "zeroflat/model.h"

namespace zeroflat {
namespace {

using Bytes = std::vector<unsigned char>;

Bytes random_bytes(std::size_t n, std::mt19937_64& rng) {
  Bytes out(n);
  for (auto& b : out) b = static_cast<unsigned char>(rng() | 1);  // never 0: padding stands out
  return out;
}

// What Device::gather must produce: segments at their offsets, zeros elsewhere.
Bytes reference_gather(std::uint64_t num_bytes, const std::vector<Segment>& segments) {
  Bytes out(num_bytes, 0);
  for (const Segment& s : segments) {
    if (s.num_bytes > 0) std::memcpy(out.data() + s.dst_offset, s.src, s.num_bytes);
  }
  return out;
}

// Sorted, disjoint segments over [0, num_bytes) with gaps, empty segments and every alignment,
// reading from src (which must hold at least the sum of their sizes plus 16 per segment).
std::vector<Segment> random_segments(std::uint64_t num_bytes, const unsigned char* src,
                                     std::size_t src_bytes, std::size_t max_len,
                                     std::mt19937_64& rng) {
  std::vector<Segment> out;
  std::uint64_t at = rng() % 3 == 0 ? rng() % 40 : 0;
  std::size_t from = rng() % 16;
  while (at < num_bytes) {
    std::uint64_t len = rng() % (max_len + 1);
    if (rng() % 8 == 0) len = 0;
    len = std::min<std::uint64_t>(len, num_bytes - at);
    if (from + len + 16 > src_bytes) break;
    out.push_back(Segment{src + from, at, len});
    from += len + rng() % 16;
    at += len;
    if (rng() % 3 == 0) at += rng() % 50;  // padding
  }
  return out;
}

// Runs the kernel's walk for every lane of a grid of num_blocks x num_warps warps, one lane at a
// time: lanes share nothing, so this is exactly what the GPU computes.
void emulate_gather(unsigned char* dst, std::uint64_t num_bytes,
                    const std::vector<Segment>& segments, std::uint64_t max_blocks,
                    unsigned num_warps) {
  const auto g = detail::gather::make_geometry(num_bytes, segments.size(), max_blocks);
  std::vector<std::uint64_t> table(g.max_table_bytes / 8 + 2);
  const std::uint64_t used = detail::gather::build_table(table.data(), g, num_bytes, segments);
  ASSERT_LE(used, g.max_table_bytes);
  detail::gather::Plan plan;
  plan.dst = dst;
  plan.num_bytes = num_bytes;
  plan.tile_bytes = g.tile_bytes;
  plan.num_tiles = g.num_tiles;
  plan.tile_first = table.data();
  plan.runs = reinterpret_cast<const detail::gather::Run*>(
      reinterpret_cast<const unsigned char*>(table.data()) + g.runs_offset);
  ASSERT_LE(g.num_blocks, max_blocks);
  for (std::uint64_t b = 0; b < g.num_blocks; ++b) {
    for (unsigned w = 0; w < num_warps; ++w) {
      for (unsigned lane = 0; lane < 32; ++lane) {
        detail::gather::walk<detail::gather::kUnroll, false>(plan, b, g.num_blocks, w, num_warps,
                                                             lane);
      }
    }
  }
}

// --- the walk, on the host
// ------------------------------------------------------------------------

TEST(GatherWalk, TheTableTilesTheDestinationExactly) {
  std::mt19937_64 rng(7);
  Bytes src = random_bytes(1 << 20, rng);
  const std::uint64_t n = 300'000;
  auto segments = random_segments(n, src.data(), src.size(), 5000, rng);
  const auto g = detail::gather::make_geometry(n, segments.size(), 5);
  EXPECT_EQ(g.tile_bytes % detail::gather::kTileAlign, 0u);
  EXPECT_GE(g.tile_bytes * g.num_tiles, n);
  EXPECT_LT(g.tile_bytes * (g.num_tiles - 1), n);
  std::vector<std::uint64_t> table(g.max_table_bytes / 8 + 2);
  detail::gather::build_table(table.data(), g, n, segments);
  const auto* runs = reinterpret_cast<const detail::gather::Run*>(
      reinterpret_cast<const unsigned char*>(table.data()) + g.runs_offset);
  // Runs start at 0, strictly increase, alternate with no two zero runs in a row, end at n.
  EXPECT_EQ(runs[0].begin, 0u);
  std::size_t k = 0;
  while (runs[k].begin < n) {
    EXPECT_LT(runs[k].begin, runs[k + 1].begin) << "run " << k;
    if (k > 0) {
      EXPECT_FALSE(runs[k].src == 0 && runs[k - 1].src == 0) << "run " << k;
    }
    ++k;
  }
  EXPECT_EQ(runs[k].begin, n);
  for (std::uint64_t t = 0; t < g.num_tiles; ++t) {
    const std::uint64_t r = table[t];
    EXPECT_LE(runs[r].begin, t * g.tile_bytes) << "tile " << t;
    EXPECT_GT(runs[r + 1].begin, t * g.tile_bytes) << "tile " << t;
  }
}

TEST(GatherWalk, WritesEveryByteOnceForAnyAlignmentAndGrid) {
  std::mt19937_64 rng(42);
  for (int round = 0; round < 60; ++round) {
    const std::uint64_t n = 1 + rng() % (round < 30 ? 5000 : 250'000);
    const std::size_t max_len = round % 3 == 0 ? 40 : (round % 3 == 1 ? 3000 : 70'000);
    // Sources with 16 bytes of slack each side: the aligned loads of a run's edges may touch
    // bytes next to it (on a GPU always inside the same page).
    Bytes src = random_bytes(n + 64 * 1024 + 32, rng);
    auto segments = random_segments(n, src.data() + 16, src.size() - 32, max_len, rng);
    const std::size_t misalign = rng() % 16;
    Bytes dst(n + 64, 0xEE);
    const std::uint64_t max_blocks = 1 + rng() % 7;
    const unsigned warps = 1 + static_cast<unsigned>(rng() % 8);
    emulate_gather(dst.data() + 16 + misalign, n, segments, max_blocks, warps);
    const Bytes want = reference_gather(n, segments);
    ASSERT_EQ(0, std::memcmp(dst.data() + 16 + misalign, want.data(), n))
        << "round " << round << ": " << n << " bytes, " << segments.size()
        << " segments, dst misaligned by " << misalign << ", " << max_blocks << " blocks x "
        << warps << " warps";
    // Nothing outside [0, n) is touched.
    for (std::size_t i = 0; i < 16 + misalign; ++i) ASSERT_EQ(dst[i], 0xEE) << round;
    for (std::size_t i = 16 + misalign + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE) << round;
  }
}

TEST(GatherWalk, OneHugeRunAcrossTilesAndOnlyPadding) {
  std::mt19937_64 rng(3);
  const std::uint64_t n = (1 << 20) + 77;
  Bytes src = random_bytes(n + 64, rng);
  std::vector<Segment> one = {Segment{src.data() + 19, 5, n - 9}};
  Bytes dst(n, 0xEE);
  emulate_gather(dst.data(), n, one, 4, 8);
  EXPECT_EQ(dst, reference_gather(n, one));
  Bytes zeros(n, 0xEE);
  emulate_gather(zeros.data(), n, {}, 3, 4);
  EXPECT_EQ(zeros, Bytes(n, 0));
}

TEST(GatherWalk, ShiftsEveryPhaseOfSourceAgainstDestination) {
  std::mt19937_64 rng(11);
  Bytes src = random_bytes(4096, rng);
  for (int src_phase = 0; src_phase < 16; ++src_phase) {
    for (int dst_phase = 0; dst_phase < 16; ++dst_phase) {
      const std::uint64_t n = 3000;
      std::vector<Segment> seg = {Segment{src.data() + 32 + src_phase, 0, n}};
      Bytes dst(n + 32, 0);
      emulate_gather(dst.data() + dst_phase, n, seg, 1, 2);
      ASSERT_EQ(0, std::memcmp(dst.data() + dst_phase, src.data() + 32 + src_phase, n))
          << "src phase " << src_phase << ", dst phase " << dst_phase;
    }
  }
}

// --- no GPU
// ---------------------------------------------------------------------------------------

TEST(CudaNoGpu, MakeCudaDeviceSaysWhyThereIsNone) {
  std::unique_ptr<Device> dev;
  try {
    dev = detail::make_cuda_device("cuda:0", {});
  } catch (const Unsupported& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cuda"), std::string::npos) << what;
#if ZEROFLAT_HAVE_CUDA
    EXPECT_NE(what.find("no usable GPU"), std::string::npos) << what;
    EXPECT_THROW((void)detail::make_cuda_device("cuda", {}), Unsupported);
#else
    EXPECT_NE(what.find("no CUDA"), std::string::npos) << what;
#endif
    return;
  }
  GTEST_SKIP() << "a GPU answers here (" << dev->name() << "): nothing to refuse";
}

TEST(CudaNoGpu, MalformedSpecsAreInvalidBeforeAnyGpuIsAsked) {
#if ZEROFLAT_HAVE_CUDA
  for (const char* spec : {"cuda:", "cuda:x", "cuda:-1", "cuda:1a", "cuda:99999", "gpu:0"}) {
    EXPECT_THROW((void)detail::make_cuda_device(spec, {}), InvalidArgument) << spec;
  }
#else
  EXPECT_THROW((void)detail::make_cuda_device("cuda:0", {}), Unsupported);
#endif
}

TEST(CudaNoGpu, TheNcclCommunicatorNeedsACudaDevice) {
  LocalGroup group(1);
  auto bootstrap = group.rank(0);
  auto cpu = make_device("cpu", DeviceOptions{1});
#if ZEROFLAT_HAVE_NCCL
  EXPECT_TRUE(have_nccl());
  EXPECT_THROW((void)make_nccl_communicator(*bootstrap, *cpu), InvalidArgument);
#else
  EXPECT_FALSE(have_nccl());
  EXPECT_THROW((void)make_nccl_communicator(*bootstrap, *cpu), Unsupported);
#endif
}

// --- on a GPU
// -------------------------------------------------------------------------------------

#if ZEROFLAT_HAVE_CUDA

class CudaGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    try {
      dev_ = detail::make_cuda_device("cuda:0", DeviceOptions{2});
    } catch (const Unsupported& e) {
      GTEST_SKIP() << "no GPU: " << e.what();
    }
  }
  detail::CudaDevice& cuda() { return static_cast<detail::CudaDevice&>(*dev_); }

  // Host bytes to fresh device memory (released at the end of the test).
  void* upload(const Bytes& host) {
    void* p = dev_->allocate(host.size());
    owned_.push_back({p, host.size()});
    dev_->copy(p, host.data(), host.size());
    return p;
  }
  Bytes download(const void* p, std::size_t n) {
    Bytes out(n);
    dev_->copy(out.data(), p, n);
    return out;
  }
  void TearDown() override {
    for (auto [p, n] : owned_) dev_->release(p, n);
  }

  std::unique_ptr<Device> dev_;
  std::vector<std::pair<void*, std::size_t>> owned_;
};

TEST_F(CudaGpu, NamesItselfAndIsNotHostAccessible) {
  EXPECT_EQ(dev_->name(), "cuda:0");
  EXPECT_FALSE(dev_->host_accessible());
  EXPECT_EQ(cuda().ordinal(), 0);
  EXPECT_NE(cuda().stream(), nullptr);
  EXPECT_GT(cuda().gather_blocks(), 0u);
  EXPECT_THROW((void)detail::make_cuda_device("cuda:4096", {}), InvalidArgument);
}

TEST_F(CudaGpu, GathersManyMisalignedTensorsAndZeroesThePadding) {
  std::mt19937_64 rng(1);
  for (int round = 0; round < 8; ++round) {
    const std::uint64_t n = round < 4 ? 200'000 + rng() % 100'000 : 24'000'000 + rng() % 1000;
    const std::size_t max_len = round % 2 == 0 ? 3000 : 2'000'000;
    Bytes host_src = random_bytes(n + (1 << 20), rng);
    const auto* src = static_cast<const unsigned char*>(upload(host_src));
    auto device_segments = random_segments(n, src + 16, host_src.size() - 32, max_len, rng);
    std::vector<Segment> host_segments = device_segments;
    for (Segment& s : host_segments) {
      s.src = host_src.data() + (static_cast<const unsigned char*>(s.src) - src);
    }
    const std::size_t misalign = round % 4 == 3 ? 6 : 0;  // bf16-aligned, not 16
    auto* dst = static_cast<unsigned char*>(upload(Bytes(n + 64, 0xEE)));
    dev_->gather(dst + misalign, n, device_segments);
    const Bytes got = download(dst, n + 64);
    const Bytes want = reference_gather(n, host_segments);
    ASSERT_EQ(0, std::memcmp(got.data() + misalign, want.data(), n))
        << "round " << round << ": " << device_segments.size() << " segments";
    for (std::size_t i = 0; i < misalign; ++i) EXPECT_EQ(got[i], 0xEE);
    for (std::size_t i = misalign + n; i < got.size(); ++i) EXPECT_EQ(got[i], 0xEE);
  }
}

TEST_F(CudaGpu, GathersIntoHostStagingMemory) {
  std::mt19937_64 rng(2);
  const std::uint64_t n = 5'000'000;
  Bytes host_src = random_bytes(n + 4096, rng);
  const auto* src = static_cast<const unsigned char*>(upload(host_src));
  auto segments = random_segments(n, src + 16, host_src.size() - 32, 100'000, rng);
  std::vector<Segment> host_segments = segments;
  for (Segment& s : host_segments) {
    s.src = host_src.data() + (static_cast<const unsigned char*>(s.src) - src);
  }
  auto* staging = static_cast<unsigned char*>(dev_->allocate_host(n));
  std::memset(staging, 0xEE, n);
  dev_->gather(staging, n, segments);
  const Bytes want = reference_gather(n, host_segments);
  EXPECT_EQ(0, std::memcmp(staging, want.data(), n));
  EXPECT_EQ(dev_->memory_info().host_allocated_bytes, n);
  dev_->release_host(staging, n);
  EXPECT_EQ(dev_->memory_info().host_allocated_bytes, 0u);
  EXPECT_EQ(dev_->memory_info().peak_host_allocated_bytes, n);
}

TEST_F(CudaGpu, RefusesDestinationsTheGpuCannotWriteAndBrokenSegments) {
  Bytes host_src(1024, 1);
  const auto* src = static_cast<const unsigned char*>(upload(host_src));
  std::vector<Segment> segments = {Segment{src, 0, 512}};
  Bytes pageable(1024);
  EXPECT_THROW(dev_->gather(pageable.data(), 1024, segments), InvalidArgument);
  auto* dst = static_cast<unsigned char*>(upload(Bytes(1024)));
  std::vector<Segment> out_of_range = {Segment{src, 800, 512}};
  EXPECT_THROW(dev_->gather(dst, 1024, out_of_range), InvalidArgument);
  std::vector<Segment> host_source = {Segment{host_src.data(), 0, 512}};
  EXPECT_THROW(dev_->gather(dst, 1024, host_source), InvalidArgument);
  // The device still works after the refusals.
  dev_->gather(dst, 1024, segments);
  EXPECT_EQ(download(dst, 1024), reference_gather(1024, {Segment{host_src.data(), 0, 512}}));
}

TEST_F(CudaGpu, CopiesInEveryDirection) {
  std::mt19937_64 rng(3);
  const std::size_t n = 3'000'001;
  const Bytes data = random_bytes(n, rng);
  void* a = dev_->allocate(n);
  void* b = dev_->allocate(n);
  auto* h1 = static_cast<unsigned char*>(dev_->allocate_host(n));
  auto* h2 = static_cast<unsigned char*>(dev_->allocate_host(n));
  dev_->copy(a, data.data(), n);  // pageable host -> device
  dev_->copy(b, a, n);            // device -> device
  dev_->copy(h1, b, n);           // device -> staging
  EXPECT_EQ(0, std::memcmp(h1, data.data(), n));
  dev_->copy(h2, h1, n);  // staging -> staging
  dev_->copy(a, h2, n);   // staging -> device
  EXPECT_EQ(download(a, n), data);
  EXPECT_THROW(dev_->copy(a, static_cast<unsigned char*>(a) + 1, 100), InvalidArgument);
  dev_->copy(a, b, 0);  // nothing to do
  dev_->release_host(h2, n);
  dev_->release_host(h1, n);
  dev_->release(b, n);
  dev_->release(a, n);
}

TEST_F(CudaGpu, UpcastsLikeTheCpuDevice) {
  auto cpu = make_device("cpu", DeviceOptions{1});
  std::mt19937_64 rng(4);
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const std::size_t numel = 1'000'003;
    const std::size_t esize = element_size(dtype);
    Bytes src(numel * esize);
    for (std::size_t i = 0; i < numel; ++i) {
      // Finite values of the dtype: clear the exponent's top bit.
      if (esize == 2) {
        auto v = static_cast<std::uint16_t>(rng() & 0xBFFF);
        std::memcpy(src.data() + 2 * i, &v, 2);
      } else {
        auto v = static_cast<std::uint32_t>(rng() & 0xBFFFFFFF);
        std::memcpy(src.data() + 4 * i, &v, 4);
      }
    }
    std::vector<float> want(numel);
    cpu->upcast_to_fp32(want.data(), src.data(), dtype, numel);
    const void* d_src = upload(src);
    auto* d_dst = static_cast<float*>(dev_->allocate(numel * 4));
    dev_->upcast_to_fp32(d_dst, d_src, dtype, numel);
    std::vector<float> got(numel);
    dev_->copy(got.data(), d_dst, numel * 4);
    dev_->release(d_dst, numel * 4);
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), numel * 4)) << dtype_name(dtype);
  }
  EXPECT_THROW(
      dev_->upcast_to_fp32(static_cast<float*>(upload(Bytes(64))),
                           static_cast<unsigned char*>(upload(Bytes(64))) + 1, DType::kBF16, 8),
      InvalidArgument);
}

TEST_F(CudaGpu, ChecksumEqualsTheCpuDevices) {
  auto cpu = make_device("cpu", DeviceOptions{2});
  std::mt19937_64 rng(5);
  for (std::uint64_t n :
       {std::uint64_t{0}, std::uint64_t{1}, kChecksumChunkBytes - 1, kChecksumChunkBytes,
        kChecksumChunkBytes + 3, 17 * kChecksumChunkBytes + 12'345, 40 * kChecksumChunkBytes}) {
    const Bytes data = random_bytes(n, rng);
    const std::uint64_t want = cpu->checksum(data.data(), n);
    EXPECT_EQ(want, checksum_serial(data.data(), n));
    const void* d = n > 0 ? upload(data) : nullptr;
    EXPECT_EQ(dev_->checksum(d, n), want) << n << " bytes";
  }
}

TEST_F(CudaGpu, AccountsEveryAllocation) {
  const MemoryInfo before = dev_->memory_info();
  EXPECT_GT(before.total_bytes, 0u);
  EXPECT_LE(before.free_bytes, before.total_bytes);
  void* a = dev_->allocate(1 << 20);
  void* b = dev_->allocate(3 << 20);
  void* z1 = dev_->allocate(0);
  void* z2 = dev_->allocate(0);
  EXPECT_NE(z1, z2);
  for (void* p : {a, b, z1, z2}) EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(dev_->memory_info().allocated_bytes, before.allocated_bytes + (4u << 20));
  dev_->release(a, 1 << 20);
  void* c = dev_->allocate(2 << 20);
  const MemoryInfo mid = dev_->memory_info();
  EXPECT_EQ(mid.allocated_bytes, before.allocated_bytes + (5u << 20));
  EXPECT_EQ(mid.peak_allocated_bytes, before.allocated_bytes + (5u << 20));
  dev_->release(b, 3 << 20);
  dev_->release(c, 2 << 20);
  dev_->release(z1, 0);
  dev_->release(z2, 0);
  dev_->release(nullptr, 123);
  const MemoryInfo after = dev_->memory_info();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.peak_allocated_bytes, before.allocated_bytes + (5u << 20));
}

TEST_F(CudaGpu, RefusesWhatDoesNotFitNamingTheSize) {
  const MemoryInfo before = dev_->memory_info();
  for (std::uint64_t n : {std::uint64_t{1} << 50, before.total_bytes}) {
    try {
      (void)dev_->allocate(n);
      FAIL() << "allocated " << n << " bytes";
    } catch (const OutOfMemory& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("cuda:0"), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(n)), std::string::npos) << what;
    }
  }
  EXPECT_EQ(dev_->memory_info().allocated_bytes, before.allocated_bytes);
  // Still usable after the refusals.
  void* p = dev_->allocate(4096);
  dev_->release(p, 4096);
}

TEST_F(CudaGpu, FlattensAGroupLikeTheCpuDevice) {
  auto cpu = make_device("cpu", DeviceOptions{2});
  const ModelSpec model = catalog_model("tiny-moe");  // sizes not multiples of 8 on purpose
  std::mt19937_64 rng(6);
  std::vector<Bytes> host(model.tensors.size());
  std::vector<TensorRef> on_cpu, on_gpu;
  for (std::size_t i = 0; i < model.tensors.size(); ++i) {
    const TensorSpec& t = model.tensors[i];
    host[i] = random_bytes(t.numel * 2, rng);
    on_cpu.push_back({host[i].data(), t.numel, t.shape, DType::kBF16, cpu.get()});
    on_gpu.push_back({upload(host[i]), t.numel, t.shape, DType::kBF16, dev_.get()});
  }
  LayoutOptions options;
  options.dp = 4;
  const FlatGroup want = flatten_group(*cpu, on_cpu, options);
  const FlatGroup got = flatten_group(*dev_, on_gpu, options);
  ASSERT_EQ(got.layout.flat_bytes(), want.layout.flat_bytes());
  EXPECT_EQ(dev_->checksum(got.flat.data(), got.layout.flat_bytes()),
            cpu->checksum(want.flat.data(), want.layout.flat_bytes()));
  EXPECT_EQ(download(got.flat.data(), got.layout.flat_bytes()),
            Bytes(static_cast<const unsigned char*>(want.flat.data()),
                  static_cast<const unsigned char*>(want.flat.data()) + want.layout.flat_bytes()));
  for (std::uint64_t rank = 0; rank < 4; ++rank) {
    DeviceBuffer m_cpu = make_master_partition(*cpu, want, rank);
    DeviceBuffer m_gpu = make_master_partition(*dev_, got, rank);
    ASSERT_EQ(m_cpu.num_bytes(), m_gpu.num_bytes());
    EXPECT_EQ(download(m_gpu.data(), m_gpu.num_bytes()),
              Bytes(static_cast<const unsigned char*>(m_cpu.data()),
                    static_cast<const unsigned char*>(m_cpu.data()) + m_cpu.num_bytes()))
        << "rank " << rank;
  }
}

class NcclGpu : public CudaGpu {};

TEST_F(NcclGpu, AllGathersInPlaceWithOneRank) {
  if (!have_nccl()) GTEST_SKIP() << "this build has no NCCL";
  LocalGroup group(1);
  auto bootstrap = group.rank(0);
  auto comm = make_nccl_communicator(*bootstrap, *dev_, std::chrono::seconds(60));
  EXPECT_EQ(comm->name(), "nccl");
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);
  std::mt19937_64 rng(8);
  const Bytes data = random_bytes(3 << 20, rng);
  void* buffer = upload(data);
  comm->all_gather_inplace(buffer, data.size(), *dev_);
  EXPECT_EQ(download(buffer, data.size()), data);
  comm->all_gather_inplace(buffer, 0, *dev_);
  std::vector<std::uint64_t> v = {3, 9};
  comm->all_reduce_max(v);
  comm->all_reduce_min(v);
  EXPECT_EQ(v, (std::vector<std::uint64_t>{3, 9}));
  comm->barrier();
  auto cpu = make_device("cpu", DeviceOptions{1});
  EXPECT_THROW(comm->all_gather_inplace(buffer, 16, *cpu), InvalidArgument);
  comm->abort("test: rank 0 gives up");
  comm->abort("twice is fine");
  try {
    comm->all_gather_inplace(buffer, data.size(), *dev_);
    FAIL() << "an aborted communicator gathered";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 gives up"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comm->barrier(), CommError);
}

#endif  // ZEROFLAT_HAVE_CUDA

}  // namespace
}  // namespace zeroflat
