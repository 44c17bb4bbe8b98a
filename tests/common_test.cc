// Sizes, dtypes, shapes, the checksum, the fill pattern, the thread team, the runtime defaults.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <system_error>
#include <vector>

#include "common/cgroup_cpu.h"
#include "common/pattern.h"
#include "common/saturate.h"
#include "common/thread_pool.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat {
namespace {

// A cgroup file system of our own: the quota that holds is the tightest from the process's own
// cgroup up to the root, not the root's alone.
TEST(CgroupCpu, TheTightestQuotaFromTheProcesssCgroupUpToTheRoot) {
  namespace fs = std::filesystem;
  const fs::path root = fs::path(::testing::TempDir()) / ("zeroflat_cgroup_" +
                                                         std::to_string(::getpid()));
  fs::remove_all(root);
  auto put = [&](const fs::path& dir, const std::string& file, const std::string& text) {
    fs::create_directories(dir);
    std::ofstream(dir / file) << text << "\n";
  };
  // v1: no quota at the root, 1.5 cores for node0, none below it.
  put(root / "cpu", "cpu.cfs_quota_us", "-1");
  put(root / "cpu", "cpu.cfs_period_us", "100000");
  put(root / "cpu/harness/node0", "cpu.cfs_quota_us", "150000");
  put(root / "cpu/harness/node0", "cpu.cfs_period_us", "100000");
  put(root / "cpu/harness/node0/rank1", "cpu.cfs_quota_us", "-1");
  put(root / "cpu/harness/node0/rank1", "cpu.cfs_period_us", "100000");
  const std::string v1 = "12:pids:/\n4:cpu,cpuacct:/harness/node0/rank1\n0::/\n";
  EXPECT_EQ(detail::cgroup_cpu_quota(v1, root.string()), 2u);
  EXPECT_EQ(detail::cgroup_cpu_quota("4:cpu:/\n", root.string()), 0u);  // the root: none
  // v2: a child tighter than its parent.
  put(root / "v2", "cpu.max", "max 100000");
  put(root / "v2/job", "cpu.max", "400000 100000");
  put(root / "v2/job/step", "cpu.max", "50000 100000");
  EXPECT_EQ(detail::cgroup_cpu_quota("0::/job/step\n", (root / "v2").string()), 1u);
  EXPECT_EQ(detail::cgroup_cpu_quota("0::/job\n", (root / "v2").string()), 4u);
  EXPECT_EQ(detail::cgroup_cpu_quota("garbage", (root / "v2").string()), 0u);
  fs::remove_all(root);
}

TEST(Size, ParsesBytesAndUnits) {
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("1048576"), 1048576u);
  EXPECT_EQ(parse_size("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_size("80GiB"), 80ull << 30);
  EXPECT_EQ(parse_size("80gib"), 80ull << 30);
  EXPECT_EQ(parse_size("1.5GB"), 1'500'000'000u);
  EXPECT_EQ(parse_size("1.5 GiB"), 3ull << 29);
  EXPECT_EQ(parse_size("2k"), 2000u);
  EXPECT_EQ(parse_size("15TiB"), 15ull << 40);
  // Every unit format_bytes prints reads back.
  EXPECT_EQ(parse_size("18.4 EB"), 18'400'000'000'000'000'000ull);
  EXPECT_EQ(parse_size("2PB"), 2'000'000'000'000'000ull);
  EXPECT_EQ(parse_size("3PiB"), 3ull << 50);
  EXPECT_EQ(parse_size("15EiB"), 15ull << 60);
  for (std::uint64_t v : {999ull, 1'430'000'000ull, 5ull << 40, 7'000'000'000'000'000ull}) {
    EXPECT_GT(parse_size(format_bytes(v)), 0u) << format_bytes(v);
  }
  EXPECT_THROW((void)parse_size("16EiB"), InvalidArgument);  // past 64 bits
}

TEST(Size, NamesWhatTheSizeIsFor) {
  try {
    (void)parse_size("-1", "--margin");
    ADD_FAILURE() << "accepted -1";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(std::string(e.what()).rfind("--margin: size '-1'", 0), 0u) << e.what();
  }
}

TEST(Size, RejectsWithTheText) {
  for (const char* bad :
       {"", "GiB", "12XB", "1.2.3", "-1", "0.5B", "99999999999999999999", "20000000TiB", "."}) {
    try {
      (void)parse_size(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << e.what();
    }
  }
}

TEST(Size, ParseU64) {
  EXPECT_EQ(parse_u64("18446744073709551615", "x"), UINT64_MAX);
  EXPECT_THROW((void)parse_u64("18446744073709551616", "x"), InvalidArgument);
  EXPECT_THROW((void)parse_u64("", "x"), InvalidArgument);
  EXPECT_THROW((void)parse_u64("1e3", "x"), InvalidArgument);
  EXPECT_THROW((void)parse_u64(" 1", "x"), InvalidArgument);
}

TEST(Size, Formats) {
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(1'430'000'000), "1.43 GB");
  EXPECT_EQ(format_bytes_binary(3ull << 29), "1.50 GiB");
  EXPECT_EQ(format_count(20562192384), "20,562,192,384");
  EXPECT_EQ(format_count(0), "0");
  EXPECT_EQ(format_count(100), "100");
}

TEST(DTypes, NamesSizesAliases) {
  EXPECT_EQ(element_size(DType::kBF16), 2u);
  EXPECT_EQ(element_size(DType::kFP16), 2u);
  EXPECT_EQ(element_size(DType::kFP32), 4u);
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  }
  EXPECT_EQ(parse_dtype("bfloat16"), DType::kBF16);
  EXPECT_EQ(parse_dtype("half"), DType::kFP16);
  EXPECT_EQ(parse_dtype("float32"), DType::kFP32);
  EXPECT_THROW((void)parse_dtype("fp8"), InvalidArgument);
  EXPECT_THROW((void)parse_dtype("BF16x"), InvalidArgument);
}

TEST(Shapes, NumelAndOverflow) {
  EXPECT_EQ(shape_numel(Shape{}), 1u);
  EXPECT_EQ(shape_numel(Shape{4096, 2048}), 8388608u);
  EXPECT_EQ(shape_numel(Shape{3, 0, 5}), 0u);
  EXPECT_THROW((void)shape_numel(Shape{-1, 2}), InvalidArgument);
  EXPECT_THROW((void)shape_numel(Shape{1ll << 40, 1ll << 40}), InvalidArgument);
  EXPECT_EQ(shape_to_string(Shape{4096, 2048}), "[4096, 2048]");
}

TEST(Saturate, SumsAndProductsStopAtTheTopInsteadOfWrapping) {
  using detail::sat_add;
  using detail::sat_mul;
  constexpr std::uint64_t top = UINT64_MAX;
  static_assert(sat_add(2, 3) == 5 && sat_mul(4, 5) == 20);  // usable in constant expressions
  EXPECT_EQ(sat_add(top - 1, 1), top);
  EXPECT_EQ(sat_add(top - 1, 2), top);
  EXPECT_EQ(sat_add(top, top), top);
  EXPECT_EQ(sat_add(std::uint64_t{1} << 63, std::uint64_t{1} << 63), top);
  EXPECT_EQ(sat_mul(std::uint64_t{1} << 32, std::uint64_t{1} << 31), std::uint64_t{1} << 63);
  EXPECT_EQ(sat_mul(std::uint64_t{1} << 32, std::uint64_t{1} << 32), top);
  EXPECT_EQ(sat_mul(3, top / 2), top);
  EXPECT_EQ(sat_mul(0, top), 0u);
  EXPECT_EQ(detail::kSaturated, top);
}

TEST(Checksum, IndependentOfThreadCountAndSensitiveToEveryByte) {
  const std::uint64_t n = kChecksumChunkBytes * 3 + 12345;
  std::vector<unsigned char> data(n);
  for (std::uint64_t i = 0; i < n; ++i) data[i] = static_cast<unsigned char>(i * 131 + (i >> 9));
  const std::uint64_t serial = checksum_serial(data.data(), n);
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    auto dev = make_device("cpu", DeviceOptions{threads});
    EXPECT_EQ(dev->checksum(data.data(), n), serial) << threads << " threads";
  }
  for (std::uint64_t at : {std::uint64_t{0}, kChecksumChunkBytes - 1, kChecksumChunkBytes, n - 1}) {
    data[at] ^= 1;
    EXPECT_NE(checksum_serial(data.data(), n), serial) << "byte " << at;
    data[at] ^= 1;
  }
  // Length is part of the hash: a trailing zero byte changes it.
  std::vector<unsigned char> zeros(10, 0);
  EXPECT_NE(checksum_serial(zeros.data(), 9), checksum_serial(zeros.data(), 10));
  EXPECT_EQ(checksum_hex(0xabcull), "0000000000000abc");
}

TEST(Pattern, DeterministicFiniteAndDistinctPerTensor) {
  for (DType d : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    const std::uint64_t es = element_size(d);
    std::vector<unsigned char> a(1000 * es), b(1000 * es);
    fill_pattern(a.data(), d, 3, 0, 1000);
    fill_pattern(b.data(), d, 4, 0, 1000);
    EXPECT_NE(a, b);
    EXPECT_EQ(match_pattern(a.data(), d, 3, 0, 1000), 1000u);
    EXPECT_LT(match_pattern(b.data(), d, 3, 0, 1000), 1000u);
    // A fill from an element offset equals the tail of a fill from zero.
    std::vector<unsigned char> c(500 * es);
    fill_pattern(c.data(), d, 3, 500, 500);
    EXPECT_EQ(0, std::memcmp(c.data(), a.data() + 500 * es, 500 * es));
    // A mismatch is found at its exact position, also past the vector stride.
    for (std::uint64_t at : {0u, 255u, 256u, 700u, 999u}) {
      std::vector<unsigned char> x = a;
      x[at * es] ^= 1;
      EXPECT_EQ(match_pattern(x.data(), d, 3, 0, 1000), at);
    }
    for (std::uint64_t e = 0; e < 1000; ++e) {
      std::uint32_t bits = pattern_bits(d, 3, e);
      if (d == DType::kBF16) EXPECT_NE(bits & 0x7F80u, 0x7F80u);
      if (d == DType::kFP16) EXPECT_NE(bits & 0x7C00u, 0x7C00u);
      if (d == DType::kFP32) EXPECT_NE(bits & 0x7F800000u, 0x7F800000u);
    }
  }
  // Elements past 2^32 work and differ from those below.
  EXPECT_NE(pattern_bits(DType::kFP32, 1, 5), pattern_bits(DType::kFP32, 1, (1ull << 32) + 5));
  std::uint32_t across[4];
  fill_pattern(across, DType::kFP32, 9, (1ull << 32) - 2, 4);
  for (std::uint64_t k = 0; k < 4; ++k) {
    EXPECT_EQ(across[k], pattern_bits(DType::kFP32, 9, (1ull << 32) - 2 + k));
  }
}

TEST(ThreadPool, RunsEveryMemberAndPropagatesErrors) {
  for (unsigned n : {1u, 2u, 5u}) {
    detail::ThreadPool pool(n);
    std::vector<std::atomic<int>> hits(n);
    for (int round = 0; round < 50; ++round) pool.run([&](unsigned t) { hits[t]++; });
    for (unsigned t = 0; t < n; ++t) EXPECT_EQ(hits[t].load(), 50);
    EXPECT_THROW(pool.run([&](unsigned t) {
      if (t == n - 1) throw InvalidArgument("boom");
    }),
                 InvalidArgument);
    pool.run([&](unsigned t) { hits[t]++; });  // still usable
    EXPECT_EQ(hits[0].load(), 51);
  }
}

// A system that refuses a thread (a process or memory limit): the team that could not be formed
// is an error, after the threads already started are stopped and joined (no hang, no abort).
TEST(ThreadPool, AThreadTheSystemRefusesIsResourceExhausted) {
  for (unsigned refused : {1u, 3u, 7u}) {
    detail::set_thread_start_hook([&](unsigned index) {
      if (index == refused) {
        throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again));
      }
    });
    try {
      detail::ThreadPool pool(8);
      FAIL() << "formed a team of 8 although thread " << refused << " was refused";
    } catch (const ResourceExhausted& e) {
      EXPECT_NE(std::string(e.what()).find("thread " + std::to_string(refused + 1) + " of 8"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("--threads"), std::string::npos);
    }
    detail::set_thread_start_hook({});
  }
  detail::ThreadPool fine(8);  // the hook is gone: the same team forms
  EXPECT_EQ(fine.size(), 8u);
  // A device is a team too: its construction says the same.
  detail::set_thread_start_hook([](unsigned i) {
    if (i == 2) throw std::system_error(std::make_error_code(std::errc::not_enough_memory));
  });
  EXPECT_THROW((void)make_device("cpu", DeviceOptions{4}), ResourceExhausted);
  detail::set_thread_start_hook({});
}

TEST(ThreadPool, SplitRangeTilesWithGrain) {
  for (std::uint64_t total : {0ull, 1ull, 63ull, 64ull, 1000ull, 1ull << 30}) {
    for (unsigned parts : {1u, 2u, 3u, 7u}) {
      std::uint64_t at = 0;
      for (unsigned p = 0; p < parts; ++p) {
        detail::Range r = detail::split_range(total, parts, p, 64);
        EXPECT_EQ(r.begin, at);
        EXPECT_LE(r.begin, r.end);
        if (r.end != total) EXPECT_EQ(r.end % 64, 0u);
        at = r.end;
      }
      EXPECT_EQ(at, total);
    }
  }
}

TEST(Runtime, CoresAndThreads) {
  EXPECT_GE(available_cores(), 1u);
  // No ZEROFLAT_NUM_THREADS in the test environment: the cores are shared among ranks.
  if (std::getenv("ZEROFLAT_NUM_THREADS") == nullptr) {
    EXPECT_EQ(default_num_threads(1), available_cores());
    EXPECT_EQ(default_num_threads(available_cores() * 4), 1u);  // never zero
    if (available_cores() >= 2) EXPECT_EQ(default_num_threads(2), available_cores() / 2);
  }
}

}  // namespace
}  // namespace zeroflat
