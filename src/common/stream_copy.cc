// Copies with streaming stores (stream_copy.h).
#include "common/stream_copy.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "common/cpu_features.h"

namespace zeroflat::detail {
namespace {

#if ZEROFLAT_X86
// The lines go out four 4 KiB blocks at a time, a line of each in turn: four streams in flight
// instead of one. On a Xeon VM (2 MiB of L2 per core), 512 MiB one stream at a time ran at 8.8
// GB/s, four at a time at 11.7 (glibc's memcpy of the whole, which interleaves pages too: 10.7);
// at 64 MiB both ways of streaming at 13.7, memcpy (ordinary stores there) at 8.8
// (docs/performance.md).
constexpr std::size_t kBlock = 4096, kWays = 4;

inline void sse_line(unsigned char* dst, const unsigned char* src) noexcept {
  const auto* s = reinterpret_cast<const __m128i*>(src);
  auto* d = reinterpret_cast<__m128i*>(dst);
  __m128i a = _mm_loadu_si128(s + 0);
  __m128i b = _mm_loadu_si128(s + 1);
  __m128i c = _mm_loadu_si128(s + 2);
  __m128i e = _mm_loadu_si128(s + 3);
  _mm_stream_si128(d + 0, a);
  _mm_stream_si128(d + 1, b);
  _mm_stream_si128(d + 2, c);
  _mm_stream_si128(d + 3, e);
}

void stream_lines_sse(unsigned char* dst, const unsigned char* src, std::size_t n) noexcept {
  std::size_t at = 0;
  for (; at + kBlock * kWays <= n; at += kBlock * kWays) {
    for (std::size_t l = at; l < at + kBlock; l += kStreamLine) {
      for (std::size_t w = 0; w < kWays * kBlock; w += kBlock) sse_line(dst + l + w, src + l + w);
    }
  }
  for (; at < n; at += kStreamLine) sse_line(dst + at, src + at);
}

__attribute__((target("avx"), always_inline)) inline void avx_line(unsigned char* dst,
                                                                    const unsigned char* src) noexcept {
  __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
}

__attribute__((target("avx"))) void stream_lines_avx(unsigned char* dst, const unsigned char* src,
                                                     std::size_t n) noexcept {
  std::size_t at = 0;
  for (; at + kBlock * kWays <= n; at += kBlock * kWays) {
    for (std::size_t l = at; l < at + kBlock; l += kStreamLine) {
      for (std::size_t w = 0; w < kWays * kBlock; w += kBlock) avx_line(dst + l + w, src + l + w);
    }
  }
  for (; at < n; at += kStreamLine) avx_line(dst + at, src + at);
}

const bool kHaveAvx = cpu_features().avx;
#endif

}  // namespace

void stream_lines(unsigned char* dst, const unsigned char* src, std::size_t n) noexcept {
#if ZEROFLAT_X86
  if (kHaveAvx) {
    stream_lines_avx(dst, src, n);
  } else {
    stream_lines_sse(dst, src, n);
  }
#else
  std::memcpy(dst, src, n);
#endif
}

void copy_bytes(void* dst_v, const void* src_v, std::size_t n, bool streaming) noexcept {
  auto* dst = static_cast<unsigned char*>(dst_v);
  const auto* src = static_cast<const unsigned char*>(src_v);
  if (streaming && n >= kStreamMinBytes) {
    const std::uintptr_t misalign = reinterpret_cast<std::uintptr_t>(dst) % kStreamLine;
    const std::size_t head = (kStreamLine - misalign) % kStreamLine;
    std::memcpy(dst, src, head);
    const std::size_t body = (n - head) & ~(kStreamLine - 1);
    stream_lines(dst + head, src + head, body);
    std::memcpy(dst + head + body, src + head + body, n - head - body);
    return;
  }
  std::memcpy(dst, src, n);
}

void store_fence() noexcept {
#if ZEROFLAT_X86
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

namespace {

// The first line of a small file, or "" where it cannot be read.
std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// The number of CPUs in a cpulist ("0-3,8,10-11"), 0 where it is not one.
std::uint64_t cpus_in_list(const std::string& list) {
  std::uint64_t count = 0;
  std::size_t at = 0;
  while (at < list.size()) {
    std::size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    const std::string item = list.substr(at, end - at);
    at = end + 1;
    unsigned long lo = 0, hi = 0;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%lu-%lu%c", &lo, &hi, &tail) == 2 && lo <= hi) {
      count += hi - lo + 1;
    } else if (std::sscanf(item.c_str(), "%lu%c", &lo, &tail) == 1) {
      count += 1;
    } else {
      return 0;
    }
  }
  return count;
}

// A sysfs cache size ("32768K", "1M", "512"), in bytes; 0 where it is not one.
std::uint64_t cache_size(const std::string& text) {
  unsigned long long n = 0;
  char unit = 0, tail = 0;
  const int got = std::sscanf(text.c_str(), "%llu%c%c", &n, &unit, &tail);
  if (got == 1) return n;
  if (got != 2) return 0;
  if (unit == 'K') return n << 10;
  if (unit == 'M') return n << 20;
  if (unit == 'G') return n << 30;
  return 0;
}

}  // namespace

std::uint64_t cache_share_bytes(const char* cpu_dir) noexcept {
  try {
    std::uint64_t share = 0;
    for (int i = 0; i < 16; ++i) {
      const std::string dir = std::string(cpu_dir) + "/cache/index" + std::to_string(i) + "/";
      const std::string level = first_line(dir + "level");
      if (level.empty()) break;
      const std::string type = first_line(dir + "type");
      if ((type != "Unified" && type != "Data") || std::atoi(level.c_str()) < 2) continue;
      const std::uint64_t size = cache_size(first_line(dir + "size"));
      const std::uint64_t cpus = cpus_in_list(first_line(dir + "shared_cpu_list"));
      const std::uint64_t mine = size / std::max<std::uint64_t>(cpus, 1);
      if (mine > 0 && (share == 0 || mine < share)) share = mine;
    }
    return share;
  } catch (...) {
    return 0;
  }
}

bool larger_than_cache(std::uint64_t num_bytes) noexcept {
  // Past the cache, ordinary stores cost a read of every destination line as well as the
  // write, and evict the caller's working set; streaming stores do neither. The share of one
  // CPU, not the whole cache: every core of the socket may be copying at once (a rank per
  // accelerator), and the destination is not read again soon. The least share of the levels
  // from 2 up: a virtual machine may report its host's whole last-level cache (480 MiB over 2
  // CPUs on a Xeon VM, where streaming beat memcpy from 4 MiB up even into a destination just
  // written, and from 1 MiB up into one the caches had forgotten; docs/performance.md). Where
  // sysfs does not say, sysconf's last-level size over the online CPUs; at least 4 MiB.
  static const std::uint64_t threshold = [] {
    std::uint64_t share = cache_share_bytes("/sys/devices/system/cpu/cpu0");
    if (share == 0) {
      long llc = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
      llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
      const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
      if (llc > 0) share = static_cast<std::uint64_t>(llc / std::max(cpus, 1L));
    }
    return std::max<std::uint64_t>(share, std::uint64_t{4} << 20);
  }();
  return num_bytes >= threshold;
}

}  // namespace zeroflat::detail
