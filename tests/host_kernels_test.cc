// Host kernels: streaming copies and fills at every alignment, the gather, the up-casts.
#include "device/host_kernels.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "device/cpu_device.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {
namespace {

TEST(HostKernels, CopyAndZeroAtEveryAlignmentAndSize) {
  // Random bytes: a line or a 4 KiB block written to the wrong place shows (the streaming body
  // goes out four 4 KiB blocks at a time, a line of each in turn, then the rest line by line).
  std::vector<unsigned char> src(65536 + 128), dst(65536 + 128);
  std::mt19937 gen(11);
  for (unsigned char& c : src) c = static_cast<unsigned char>(gen());
  for (bool streaming : {false, true}) {
    for (std::size_t n : {0u, 1u, 63u, 64u, 255u, 256u, 257u, 1000u, 4096u, 16384u, 16384u + 64u * 5u + 3u,
                          3u * 16384u + 4096u + 100u, 65536u}) {
      for (std::size_t d_off = 0; d_off < 64; d_off += 7) {
        for (std::size_t s_off : {0u, 1u, 33u}) {
          std::fill(dst.begin(), dst.end(), 0xEE);
          copy_bytes(dst.data() + d_off, src.data() + s_off, n, streaming);
          store_fence();
          ASSERT_EQ(0, std::memcmp(dst.data() + d_off, src.data() + s_off, n));
          ASSERT_EQ(dst[d_off + n], 0xEE) << "wrote past the end";
          if (d_off > 0) ASSERT_EQ(dst[d_off - 1], 0xEE) << "wrote before the start";
          zero_bytes(dst.data() + d_off, n, streaming);
          store_fence();
          for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(dst[d_off + i], 0);
          ASSERT_EQ(dst[d_off + n], 0xEE);
        }
      }
    }
  }
}

// A sysfs cache tree under a temporary folder: index<i>/{level,type,size,shared_cpu_list}.
struct FakeCpuDir {
  std::string dir;
  FakeCpuDir() {
    char tmpl[] = "/tmp/zeroflat-cpu-XXXXXX";
    dir = ::mkdtemp(tmpl);
  }
  ~FakeCpuDir() { std::filesystem::remove_all(dir); }
  void cache(int index, const std::string& level, const std::string& type,
             const std::string& size, const std::string& cpus) const {
    const std::string d = dir + "/cache/index" + std::to_string(index);
    std::filesystem::create_directories(d);
    const std::pair<const char*, std::string> files[] = {
        {"level", level}, {"type", type}, {"size", size}, {"shared_cpu_list", cpus}};
    for (const auto& [name, text] : files) std::ofstream(d + "/" + name) << text << "\n";
  }
};

TEST(StreamCopy, TheCacheShareIsTheLeastShareOfTheLevelsFromTwoUp) {
  FakeCpuDir cpu;
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 0u) << "no cache tree";
  cpu.cache(0, "1", "Data", "32K", "0");
  cpu.cache(1, "1", "Instruction", "32K", "0");
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 0u) << "the first level alone says nothing";
  cpu.cache(2, "2", "Unified", "2048K", "0");
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 2u << 20);
  // A virtual machine's view of its host's last level: larger than the level below per CPU.
  cpu.cache(3, "3", "Unified", "491520K", "0-1");
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 2u << 20);
  cpu.cache(3, "3", "Unified", "8M", "0-3,8,10-12");  // 8 CPUs: 1 MiB each, under the L2
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 1u << 20);
  cpu.cache(4, "4", "Instruction", "1K", "0");  // not a data cache: ignored
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 1u << 20);
  cpu.cache(3, "3", "Unified", "1536K", "garbage");  // unreadable sharing: counted as one CPU
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 1536u << 10);
  cpu.cache(3, "3", "Unified", "12Q", "0");  // an unknown unit: that level says nothing
  EXPECT_EQ(cache_share_bytes(cpu.dir.c_str()), 2u << 20);
}

// Reference: the gather written the obvious way.
std::vector<unsigned char> naive_gather(std::uint64_t n, const std::vector<Segment>& segs) {
  std::vector<unsigned char> out(n, 0);
  for (const Segment& s : segs) {
    std::memcpy(out.data() + s.dst_offset, s.src, s.num_bytes);
  }
  return out;
}

TEST(HostKernels, GatherRangeEqualsNaiveForAnySplit) {
  std::mt19937_64 rng(42);
  std::vector<unsigned char> pool(1 << 16);
  for (auto& b : pool) b = static_cast<unsigned char>(rng());
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<Segment> segs;
    std::uint64_t at = rng() % 5;
    const int count = static_cast<int>(rng() % 20);
    for (int k = 0; k < count; ++k) {
      std::uint64_t len = rng() % 4 == 0 ? 0 : rng() % 2000;
      segs.push_back(Segment{pool.data() + rng() % 1000, at, len});
      at += len + (rng() % 3 == 0 ? rng() % 70 : 0);
    }
    const std::uint64_t n = at + rng() % 100;
    std::vector<unsigned char> want = naive_gather(n, segs);
    for (unsigned parts : {1u, 2u, 3u, 8u}) {
      for (bool streaming : {false, true}) {
        std::vector<unsigned char> got(n + 1, 0xCD);
        // Arbitrary cut points, not only grain-aligned ones.
        std::vector<std::uint64_t> cuts = {0, n};
        for (unsigned p = 1; p < parts; ++p) cuts.push_back(rng() % (n + 1));
        std::sort(cuts.begin(), cuts.end());
        for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
          gather_range(got.data(), segs, cuts[c], cuts[c + 1], streaming);
        }
        store_fence();
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), n)) << "iter " << iter;
        ASSERT_EQ(got[n], 0xCD);
      }
    }
  }
}

// Ordinary stores go in 64 KiB pieces: copies and gathers across many piece boundaries, at odd
// offsets, still equal the obvious copy.
TEST(HostKernels, OrdinaryCopiesAndGathersAcrossPieces) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> pool(1 << 20);
  for (auto& b : pool) b = static_cast<unsigned char>(rng());
  std::vector<unsigned char> dst((1 << 20) + 64, 0xEE);
  copy_ordinary(dst.data() + 3, pool.data() + 5, (1 << 20) - 5);
  ASSERT_EQ(0, std::memcmp(dst.data() + 3, pool.data() + 5, (1 << 20) - 5));
  EXPECT_EQ(dst[2], 0xEE);
  EXPECT_EQ(dst[3 + (1 << 20) - 5], 0xEE);
  for (int iter = 0; iter < 20; ++iter) {
    std::vector<Segment> segs;
    std::uint64_t at = rng() % 5;
    for (int k = 0; k < 12; ++k) {
      const std::uint64_t len = rng() % 150000;
      segs.push_back(Segment{pool.data() + rng() % 100000, at, len});
      at += len + (rng() % 2 == 0 ? rng() % 70000 : 0);
    }
    const std::uint64_t n = at + rng() % 1000;
    const std::vector<unsigned char> want = naive_gather(n, segs);
    std::vector<unsigned char> got(n + 1, 0xCD);
    const std::uint64_t cut = rng() % (n + 1);
    gather_range(got.data(), segs, 0, cut, false);
    gather_range(got.data(), segs, cut, n, false);
    ASSERT_EQ(0, std::memcmp(got.data(), want.data(), n)) << "iter " << iter;
    ASSERT_EQ(got[n], 0xCD);
  }
}

// Faulting fresh memory in ahead of its writes keeps what is there and leaves it resident; a
// range the kernel cannot populate (unmapped, read-only) is left alone, without a fault.
TEST(HostKernels, PrefaultKeepsValuesAndFaultsTheRangeIn) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t n = 512 * page;
  auto* p = static_cast<unsigned char*>(
      mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(static_cast<void*>(p), MAP_FAILED);
  p[3 * page + 5] = 42;
  p[n - 1] = 7;
  ASSERT_TRUE(mostly_untouched(p, n));
  prefault_for_write(p + 1, n - 2);  // not page-aligned: the whole pages inside it
  EXPECT_EQ(p[3 * page + 5], 42);
  EXPECT_EQ(p[n - 1], 7);
  EXPECT_EQ(p[100 * page], 0);
#ifdef MADV_POPULATE_WRITE
  unsigned char probe = 0;
  if (madvise(&probe - reinterpret_cast<std::uintptr_t>(&probe) % page, page,
              MADV_POPULATE_WRITE) == 0) {
    EXPECT_FALSE(mostly_untouched(p, n));  // a kernel that populates: every page is there
  }
#endif
  prefault_for_write(p, 0);
  munmap(p, n);
  prefault_for_write(p, n);  // unmapped now: nothing happens
  void* ro = mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(ro, MAP_FAILED);
  prefault_for_write(ro, n);
  EXPECT_EQ(static_cast<unsigned char*>(ro)[n / 2], 0);
  munmap(ro, n);
  // The device's up-cast into a fresh buffer, chunk by chunk, gives every value.
  CpuDevice dev(DeviceOptions{2});
  const std::uint64_t numel = (std::uint64_t{3} << 20) + 17;
  std::vector<std::uint16_t> src(numel);
  for (std::uint64_t i = 0; i < numel; ++i) src[i] = static_cast<std::uint16_t>(0x3F80 + i % 97);
  auto* out = static_cast<float*>(dev.allocate(numel * 4));
  ASSERT_TRUE(mostly_untouched(out, numel * 4));
  dev.upcast_to_fp32(out, src.data(), DType::kBF16, numel);
  for (std::uint64_t i = 0; i < numel; ++i) {  // every element: chunk edges are where it breaks
    const std::uint32_t bits = std::uint32_t{src[i]} << 16;
    float want;
    std::memcpy(&want, &bits, 4);
    ASSERT_EQ(out[i], want) << i;
  }
  dev.release(out, numel * 4);
}

// The chunked writer hands out [0, n) once, in order, in chunks of kPrefaultChunk bytes but the
// last, each faulted in before its write.
TEST(HostKernels, PrefaultThenWriteCoversTheRangeOnceInChunks) {
  for (const std::uint64_t n : {std::uint64_t{0}, std::uint64_t{5}, kPrefaultChunk,
                                3 * kPrefaultChunk + 4100}) {
    std::vector<unsigned char> buf(n + 1, 0);
    std::uint64_t next = 0;
    std::uint64_t calls = 0;
    prefault_then_write(buf.data(), n, [&](std::uint64_t at, std::uint64_t k) {
      EXPECT_EQ(at, next);
      EXPECT_GT(k, 0u);
      EXPECT_TRUE(k == kPrefaultChunk || at + k == n) << at << " " << k;
      std::memset(buf.data() + at, 1, k);
      next = at + k;
      ++calls;
    });
    EXPECT_EQ(next, n);
    EXPECT_EQ(calls, (n + kPrefaultChunk - 1) / kPrefaultChunk);
    EXPECT_EQ(std::count(buf.begin(), buf.end(), 1), static_cast<std::ptrdiff_t>(n));
  }
}

// Memory just mapped is told from memory written, which decides how a destination is written.
TEST(HostKernels, UntouchedMemoryIsToldFromWrittenMemory) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t n = 256 * page;
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_TRUE(mostly_untouched(p, n));
  EXPECT_TRUE(mostly_untouched(p, n, 3));
  std::memset(p, 1, n / 4);  // a quarter written: still mostly untouched
  EXPECT_TRUE(mostly_untouched(p, n));
  EXPECT_TRUE(mostly_untouched(p, n, 3));  // first page written, middle and last not
  std::memset(p, 1, n * 3 / 4);  // the middle sample written too
  EXPECT_FALSE(mostly_untouched(p, n, 3));
  EXPECT_FALSE(mostly_untouched(p, n));  // 12 of 16 samples written
  std::memset(p, 1, n);
  EXPECT_FALSE(mostly_untouched(p, n));
  EXPECT_FALSE(mostly_untouched(p, 2 * page, 3));  // fewer whole pages than samples
  EXPECT_FALSE(use_streaming_stores(p, 0));
  munmap(p, n);
  // Too short to sample, or not memory at all: not untouched.
  std::vector<unsigned char> small(4 * page);
  EXPECT_FALSE(mostly_untouched(small.data(), small.size()));
  EXPECT_FALSE(mostly_untouched(p, n));  // unmapped now: mincore fails
  // The device's gather into a fresh buffer larger than any cache writes every byte right.
  CpuDevice dev(DeviceOptions{2});
  const std::uint64_t big = std::uint64_t{300} << 20;
  std::vector<unsigned char> src(std::uint64_t{1} << 20);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 13 + 5);
  std::vector<Segment> segs;
  for (std::uint64_t at = 0; at + src.size() <= big; at += src.size() + 4096) {
    segs.push_back(Segment{src.data(), at, src.size()});
  }
  auto* out = static_cast<unsigned char*>(dev.allocate(big));
  ASSERT_TRUE(mostly_untouched(out, big));
  dev.gather(out, big, segs);
  for (const Segment& sg : segs) {
    ASSERT_EQ(0, std::memcmp(out + sg.dst_offset, src.data(), src.size())) << sg.dst_offset;
    if (sg.dst_offset + sg.num_bytes < big) ASSERT_EQ(out[sg.dst_offset + sg.num_bytes], 0);
  }
  auto* copy = static_cast<unsigned char*>(dev.allocate(big));
  dev.copy(copy, out, big);
  EXPECT_EQ(0, std::memcmp(copy, out, big));
  dev.release(copy, big);
  dev.release(out, big);
}

TEST(HostKernels, SegmentContractIsChecked) {
  std::vector<unsigned char> src(100), dst(100);
  auto bad = [&](std::vector<Segment> segs) {
    EXPECT_THROW(check_gather_segments(dst.data(), dst.size(), segs), InvalidArgument);
  };
  bad({{src.data(), 90, 20}});                        // past the end
  bad({{src.data(), 10, 10}, {src.data(), 15, 10}});  // overlap
  bad({{src.data(), 30, 10}, {src.data(), 10, 10}});  // unsorted
  bad({{nullptr, 0, 4}});                             // null source
  bad({{dst.data() + 50, 0, 10}});                    // reads the destination
  bad({{src.data(), UINT64_MAX, 2}});                 // offset overflow
  check_gather_segments(dst.data(), dst.size(),
                        std::vector<Segment>{{nullptr, 5, 0}, {src.data(), 5, 5}});
}

float reference_half(std::uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  double v = exp == 0    ? std::ldexp(mant / 1024.0, -14)
             : exp == 31 ? (mant ? NAN : INFINITY)
                         : std::ldexp(1 + mant / 1024.0, exp - 15);
  return static_cast<float>(sign ? -v : v);
}

TEST(HostKernels, UpcastEveryHalfAndBFloat16Value) {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> out(65536);
  upcast_range(out.data(), all.data(), DType::kFP16, all.size());
  for (std::uint32_t i = 0; i < 65536; ++i) {
    float want = reference_half(static_cast<std::uint16_t>(i));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(out[i])) << i;
    } else {
      ASSERT_EQ(std::memcmp(&out[i], &want, 4), 0) << "half 0x" << std::hex << i;
    }
  }
  upcast_range(out.data(), all.data(), DType::kBF16, all.size());
  for (std::uint32_t i = 0; i < 65536; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &out[i], 4);
    ASSERT_EQ(bits, i << 16);
  }
  // The portable path (machines without F16C) against the same reference.
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const float got = fp16_to_float(static_cast<std::uint16_t>(i));
    const float want = reference_half(static_cast<std::uint16_t>(i));
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(got)) << i;
    } else {
      ASSERT_EQ(std::memcmp(&got, &want, 4), 0) << "portable half 0x" << std::hex << i;
    }
  }
  // Odd counts exercise the scalar tail of the vector path.
  std::vector<float> tail(13);
  upcast_range(tail.data(), all.data() + 0x3C00, DType::kFP16, 13);
  EXPECT_EQ(tail[0], 1.0f);
}

// holds_upcast against the up-cast itself: every 16-bit value's own up-cast holds, and one
// flipped bit anywhere (every bit position, across the 2048-element blocks and in the last partial
// one) does not, -0.0 against 0.0 and one NaN against another included.
TEST(HostKernels, HoldsUpcastIsBitForBitOverEveryValue) {
  std::vector<std::uint16_t> all(65536 + 5);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i * 40503u);
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    std::vector<float> wide(all.size());
    upcast_range(wide.data(), all.data(), dtype, all.size());
    ASSERT_TRUE(holds_upcast(wide.data(), all.data(), dtype, all.size()));
    for (std::size_t at : {std::size_t{0}, std::size_t{2047}, std::size_t{2048}, all.size() - 1}) {
      for (int bit = 0; bit < 32; ++bit) {
        std::vector<float> other = wide;
        std::uint32_t b;
        std::memcpy(&b, &other[at], 4);
        b ^= std::uint32_t{1} << bit;
        std::memcpy(&other[at], &b, 4);
        ASSERT_FALSE(holds_upcast(other.data(), all.data(), dtype, all.size()))
            << dtype_name(dtype) << " element " << at << " bit " << bit;
        // Only the elements asked for are compared.
        ASSERT_TRUE(holds_upcast(other.data(), all.data(), dtype, at));
      }
    }
  }
  const std::uint16_t zero = 0;
  const float minus_zero = -0.0f;
  EXPECT_FALSE(holds_upcast(&minus_zero, &zero, DType::kBF16, 1));
  EXPECT_FALSE(holds_upcast(&minus_zero, &zero, DType::kFP16, 1));
  const std::uint16_t nan16 = 0x7e01;  // fp16: a NaN with payload 0x201
  float nan_up = 0;
  upcast_range(&nan_up, &nan16, DType::kFP16, 1);
  EXPECT_TRUE(holds_upcast(&nan_up, &nan16, DType::kFP16, 1));
  const float quiet = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(holds_upcast(&quiet, &nan16, DType::kFP16, 1));
  const std::vector<float> same{1.5f, -0.0f, quiet};
  EXPECT_TRUE(holds_upcast(same.data(), same.data(), DType::kFP32, same.size()));
  EXPECT_TRUE(holds_upcast(nullptr, nullptr, DType::kBF16, 0));
}

// Rounding to a 16-bit type, by a different route than the library's: every finite
// non-negative value of the type as a double (exact), sorted, plus the value infinity rounds
// from (the next power of two, as IEEE rounding treats it); the nearest one wins, a tie goes to
// the even bit pattern.
class Nearest {
 public:
  explicit Nearest(DType type) {
    for (std::uint32_t b = 0; b < 0x8000u; ++b) {
      const auto h = static_cast<std::uint16_t>(b);
      float f = 0;
      upcast_range(&f, &h, type, 1);
      if (std::isnan(f)) continue;
      values_.emplace_back(std::isinf(f) ? (type == DType::kBF16 ? std::ldexp(1.0, 128) : 65536.0)
                                         : static_cast<double>(f),
                           h);
    }
    std::sort(values_.begin(), values_.end());
  }
  // The bits of x rounded, for a finite or infinite non-NaN x.
  std::uint16_t operator()(float x) const {
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(static_cast<double>(x));
    if (std::isinf(a)) return sign | values_.back().second;
    auto hi = std::lower_bound(values_.begin(), values_.end(), std::make_pair(a, std::uint16_t{0}));
    if (hi == values_.end()) return sign | values_.back().second;
    if (hi->first == a || hi == values_.begin()) return sign | hi->second;
    auto lo = hi - 1;
    const double dl = a - lo->first;
    const double dh = hi->first - a;
    if (dl < dh) return sign | lo->second;
    if (dh < dl) return sign | hi->second;
    return sign | ((lo->second & 1u) == 0 ? lo->second : hi->second);
  }

 private:
  std::vector<std::pair<double, std::uint16_t>> values_;
};

std::uint16_t convert_one(float x, DType to) {
  std::uint16_t out = 0;
  convert_range(&out, to, &x, DType::kFP32, 1);
  return out;
}

TEST(HostKernels, NarrowingRoundsToNearestEvenLikeAnIndependentReference) {
  for (DType to : {DType::kBF16, DType::kFP16}) {
    SCOPED_TRACE(std::string(dtype_name(to)));
    const Nearest nearest(to);
    std::vector<float> xs;
    // Every value of the type, the midpoints between neighbours (ties), one float either side
    // of them, and random bit patterns over every exponent.
    for (std::uint32_t b = 0; b < 0x7fffu; ++b) {
      const auto h = static_cast<std::uint16_t>(b);
      const auto h1 = static_cast<std::uint16_t>(b + 1);
      float f = 0, g = 0;
      upcast_range(&f, &h, to, 1);
      upcast_range(&g, &h1, to, 1);
      if (std::isnan(f)) continue;
      xs.push_back(f);
      if (std::isnan(g)) continue;
      const float mid =
          std::isinf(g) ? static_cast<float>(static_cast<double>(f) +
                                             (static_cast<double>(f) - std::nextafter(f, 0.0f)) / 2)
                        : static_cast<float>((static_cast<double>(f) + g) / 2);
      xs.push_back(mid);
      xs.push_back(std::nextafter(mid, 0.0f));
      xs.push_back(std::nextafter(mid, INFINITY));
    }
    std::mt19937 rng(7);
    for (int i = 0; i < 400000; ++i) {
      std::uint32_t bits = rng();
      float f;
      std::memcpy(&f, &bits, 4);
      if (!std::isnan(f)) xs.push_back(f);
    }
    xs.push_back(INFINITY);
    xs.push_back(65519.99f);
    xs.push_back(65520.0f);
    xs.push_back(3.4028235e38f);
    std::vector<float> negated(xs.size());
    std::transform(xs.begin(), xs.end(), negated.begin(), [](float v) { return -v; });
    xs.insert(xs.end(), negated.begin(), negated.end());
    // The whole array at once (the vector path where the machine has one), then one by one on
    // the scalar path.
    std::vector<std::uint16_t> out(xs.size());
    convert_range(out.data(), to, xs.data(), DType::kFP32, xs.size());
    int bad = 0;
    for (std::size_t i = 0; i < xs.size() && bad < 5; ++i) {
      const std::uint16_t want = nearest(xs[i]);
      const std::uint16_t scalar = to == DType::kBF16 ? float_to_bf16(xs[i]) : float_to_fp16(xs[i]);
      if (out[i] != want || scalar != want) {
        ++bad;
        ADD_FAILURE() << "x = " << xs[i] << ": got " << std::hex << out[i] << " (scalar " << scalar
                      << "), want " << want;
      }
    }
  }
}

TEST(HostKernels, NaNStaysNaNAndSixteenBitTypesConvertThroughFloat) {
  const std::uint32_t nans[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffc12345u, 0x7fa00000u};
  for (std::uint32_t bits : nans) {
    float f;
    std::memcpy(&f, &bits, 4);
    for (DType to : {DType::kBF16, DType::kFP16}) {
      float back = 0;
      const std::uint16_t h = convert_one(f, to);
      upcast_range(&back, &h, to, 1);
      EXPECT_TRUE(std::isnan(back)) << std::hex << bits << " -> " << h;
    }
  }
  // bf16 <-> fp16, every input: equal to widening (exact) then narrowing.
  for (DType from : {DType::kBF16, DType::kFP16}) {
    const DType to = from == DType::kBF16 ? DType::kFP16 : DType::kBF16;
    std::vector<std::uint16_t> in(65536), out(65536);
    for (std::uint32_t b = 0; b < 65536; ++b) in[b] = static_cast<std::uint16_t>(b);
    convert_range(out.data(), to, in.data(), from, in.size());
    for (std::uint32_t b = 0; b < 65536; ++b) {
      float f = 0, g = 0;
      upcast_range(&f, &in[b], from, 1);
      upcast_range(&g, &out[b], to, 1);
      if (std::isnan(f)) {
        EXPECT_TRUE(std::isnan(g)) << std::hex << b;
      } else {
        ASSERT_EQ(out[b], convert_one(f, to)) << std::hex << b;
      }
    }
  }
  // Widening is exact, and a type to itself is a copy.
  std::vector<std::uint16_t> in(65536), same(65536);
  for (std::uint32_t b = 0; b < 65536; ++b) in[b] = static_cast<std::uint16_t>(b);
  convert_range(same.data(), DType::kBF16, in.data(), DType::kBF16, in.size());
  EXPECT_EQ(same, in);
  std::vector<float> wide(65536);
  convert_range(wide.data(), DType::kFP32, in.data(), DType::kBF16, in.size());
  for (std::uint32_t b = 0; b < 65536; ++b) {
    std::uint32_t w;
    std::memcpy(&w, &wide[b], 4);
    ASSERT_EQ(w, b << 16);
  }
}

TEST(CpuDevice, AllocationAccountingAndAlignment) {
  CpuDevice dev(DeviceOptions{2});
  for (std::uint64_t n : {0ull, 1ull, 100ull, 3ull << 20, (2ull << 20) + 1}) {
    const MemoryInfo before = dev.memory_info();
    void* p = dev.allocate(n);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 64, 0u);
    if (n > 0) {
      std::memset(p, 1, n);  // the whole range is writable
    }
    EXPECT_EQ(dev.memory_info().allocated_bytes, before.allocated_bytes + n);
    dev.release(p, n);
    EXPECT_EQ(dev.memory_info().allocated_bytes, before.allocated_bytes);
  }
  EXPECT_EQ(dev.memory_info().peak_allocated_bytes, 3ull << 20);
  EXPECT_GT(dev.memory_info().total_bytes, 0u);
  // Sizes whose rounding would wrap around 64 bits are refused, not shrunk.
  EXPECT_THROW((void)dev.allocate(UINT64_MAX - (1ull << 20)), OutOfMemory);
  EXPECT_THROW((void)dev.allocate(UINT64_MAX), OutOfMemory);
}

}  // namespace
}  // namespace zeroflat::detail
