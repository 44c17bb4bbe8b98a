// Host memory kernels: streaming copies and fills, the per-thread gather, up-casts.
#include "device/host_kernels.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>

#include "zeroflat/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define ZEROFLAT_X86 1
#else
#define ZEROFLAT_X86 0
#endif

namespace zeroflat::detail {
namespace {

constexpr std::size_t kLine = 64;
// Below this size a segment is copied with ordinary stores: the streaming body would be a few
// lines at most, and the head and tail already use ordinary stores.
constexpr std::size_t kStreamMin = 256;

#if ZEROFLAT_X86
void stream_copy_body(unsigned char* dst, const unsigned char* src, std::size_t n) noexcept {
  // dst is 64-byte aligned; n is a multiple of 64.
  for (std::size_t i = 0; i < n; i += kLine) {
    const auto* s = reinterpret_cast<const __m128i*>(src + i);
    auto* d = reinterpret_cast<__m128i*>(dst + i);
    __m128i a = _mm_loadu_si128(s + 0);
    __m128i b = _mm_loadu_si128(s + 1);
    __m128i c = _mm_loadu_si128(s + 2);
    __m128i e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d + 0, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
}

__attribute__((target("avx"))) void stream_copy_body_avx(unsigned char* dst,
                                                         const unsigned char* src,
                                                         std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; i += kLine) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
}

// AVX (and F16C) usable: the CPU has them and the OS saves the YMM state.
struct CpuFeatures {
  bool avx = false;
  bool f16c = false;
};
CpuFeatures detect_cpu() noexcept {
  CpuFeatures f;
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return f;
  const bool osxsave = (ecx & (1u << 27)) != 0;
  if (!osxsave) return f;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const bool ymm_state = (lo & 0x6u) == 0x6u;
  f.avx = ymm_state && (ecx & (1u << 28)) != 0;
  f.f16c = f.avx && (ecx & (1u << 29)) != 0;
  return f;
}
const CpuFeatures kCpu = detect_cpu();
const bool kHaveAvx = kCpu.avx;

void stream_zero_body(unsigned char* dst, std::size_t n) noexcept {
  const __m128i z = _mm_setzero_si128();
  for (std::size_t i = 0; i < n; i += kLine) {
    auto* d = reinterpret_cast<__m128i*>(dst + i);
    _mm_stream_si128(d + 0, z);
    _mm_stream_si128(d + 1, z);
    _mm_stream_si128(d + 2, z);
    _mm_stream_si128(d + 3, z);
  }
}

__attribute__((target("f16c,avx"))) void upcast_fp16_f16c(float* dst, const std::uint16_t* src,
                                                          std::uint64_t n) noexcept {
  std::uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}
#endif

float fp16_to_float_portable(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits = 0;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<std::uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

float fp16_to_float(std::uint16_t h) noexcept {
  return fp16_to_float_portable(h);
}

void copy_bytes(void* dst_v, const void* src_v, std::size_t n, bool streaming) noexcept {
  auto* dst = static_cast<unsigned char*>(dst_v);
  const auto* src = static_cast<const unsigned char*>(src_v);
#if ZEROFLAT_X86
  if (streaming && n >= kStreamMin) {
    std::size_t head = (kLine - reinterpret_cast<std::uintptr_t>(dst) % kLine) % kLine;
    std::memcpy(dst, src, head);
    std::size_t body = (n - head) & ~(kLine - 1);
    if (kHaveAvx) {
      stream_copy_body_avx(dst + head, src + head, body);
    } else {
      stream_copy_body(dst + head, src + head, body);
    }
    std::memcpy(dst + head + body, src + head + body, n - head - body);
    return;
  }
#else
  (void)streaming;
#endif
  std::memcpy(dst, src, n);
}

void zero_bytes(void* dst_v, std::size_t n, bool streaming) noexcept {
  auto* dst = static_cast<unsigned char*>(dst_v);
#if ZEROFLAT_X86
  if (streaming && n >= kStreamMin) {
    std::size_t head = (kLine - reinterpret_cast<std::uintptr_t>(dst) % kLine) % kLine;
    std::memset(dst, 0, head);
    std::size_t body = (n - head) & ~(kLine - 1);
    stream_zero_body(dst + head, body);
    std::memset(dst + head + body, 0, n - head - body);
    return;
  }
#else
  (void)streaming;
#endif
  std::memset(dst, 0, n);
}

void store_fence() noexcept {
#if ZEROFLAT_X86
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

namespace {

// The plain walk: each segment's part of [begin, end) copied, the gaps zeroed.
void gather_plain(unsigned char* dst, std::span<const Segment> segments, std::uint64_t begin,
                  std::uint64_t end, bool streaming) noexcept {
  if (begin >= end) return;
  auto it = std::partition_point(segments.begin(), segments.end(), [&](const Segment& s) {
    return s.dst_offset + s.num_bytes <= begin;
  });
  std::uint64_t cursor = begin;
  for (; it != segments.end() && it->dst_offset < end; ++it) {
    const std::uint64_t lo = std::max(it->dst_offset, begin);
    const std::uint64_t hi = std::min(it->dst_offset + it->num_bytes, end);
    if (lo > cursor) zero_bytes(dst + cursor, lo - cursor, streaming);
    if (hi > lo) {
      copy_bytes(dst + lo, static_cast<const unsigned char*>(it->src) + (lo - it->dst_offset),
                 hi - lo, streaming);
      cursor = hi;
    } else {
      cursor = std::max(cursor, lo);
    }
  }
  if (end > cursor) zero_bytes(dst + cursor, end - cursor, streaming);
}

#if ZEROFLAT_X86
// Streams whole destination lines [begin, end) (both 64-byte aligned in memory): runs of lines
// inside one segment are copied straight from it, runs of padding are zeroed, and a line where
// segments meet (or a segment meets padding) is assembled in registers' worth of stack and
// streamed as one line. Every destination line is written exactly once, without being read
// first, however small the tensors.
void gather_lines(unsigned char* dst, std::span<const Segment> segments, std::uint64_t begin,
                  std::uint64_t end) noexcept {
  auto it = std::partition_point(segments.begin(), segments.end(), [&](const Segment& s) {
    return s.dst_offset + s.num_bytes <= begin;
  });
  std::uint64_t line = begin;
  while (line < end) {
    while (it != segments.end() && it->dst_offset + it->num_bytes <= line) ++it;
    if (it != segments.end() && it->dst_offset <= line) {
      // Whole lines inside this segment.
      const std::uint64_t seg_end = it->dst_offset + it->num_bytes;
      const std::uint64_t run_end = std::min(end, line + (seg_end - line) / kLine * kLine);
      if (run_end > line) {
        const auto* src = static_cast<const unsigned char*>(it->src) + (line - it->dst_offset);
        if (kHaveAvx) {
          stream_copy_body_avx(dst + line, src, run_end - line);
        } else {
          stream_copy_body(dst + line, src, run_end - line);
        }
        line = run_end;
        continue;
      }
    } else {
      // Whole lines of padding before the next segment.
      const std::uint64_t next = it == segments.end() ? end : it->dst_offset;
      const std::uint64_t run_end = std::min(end, line + (next - line) / kLine * kLine);
      if (run_end > line) {
        stream_zero_body(dst + line, run_end - line);
        line = run_end;
        continue;
      }
    }
    // A line where pieces meet.
    alignas(16) unsigned char tmp[kLine] = {};
    for (auto j = it; j != segments.end() && j->dst_offset < line + kLine; ++j) {
      const std::uint64_t lo = std::max(j->dst_offset, line);
      const std::uint64_t hi = std::min(j->dst_offset + j->num_bytes, line + kLine);
      if (hi > lo) {
        std::memcpy(tmp + (lo - line),
                    static_cast<const unsigned char*>(j->src) + (lo - j->dst_offset), hi - lo);
      }
    }
    stream_copy_body(dst + line, tmp, kLine);
    line += kLine;
  }
}
#endif

}  // namespace

void gather_range(unsigned char* dst, std::span<const Segment> segments, std::uint64_t begin,
                  std::uint64_t end, bool streaming) noexcept {
  if (begin >= end) return;
#if ZEROFLAT_X86
  if (streaming) {
    // Ordinary stores up to the first 64-byte line of memory and after the last one; whole
    // lines streamed in between.
    const auto base = reinterpret_cast<std::uintptr_t>(dst);
    const std::uintptr_t lo_abs = (base + begin + kLine - 1) / kLine * kLine;
    const std::uintptr_t hi_abs = (base + end) / kLine * kLine;
    if (lo_abs < hi_abs) {
      const std::uint64_t lo = lo_abs - base;
      const std::uint64_t hi = hi_abs - base;
      gather_plain(dst, segments, begin, lo, false);
      gather_lines(dst, segments, lo, hi);
      gather_plain(dst, segments, hi, end, false);
      return;
    }
  }
#endif
  gather_plain(dst, segments, begin, end, streaming);
}

void upcast_range(float* dst, const void* src, DType dtype, std::uint64_t numel) noexcept {
  switch (dtype) {
    case DType::kBF16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      auto* d = reinterpret_cast<std::uint32_t*>(dst);
      for (std::uint64_t i = 0; i < numel; ++i) d[i] = static_cast<std::uint32_t>(s[i]) << 16;
      return;
    }
    case DType::kFP16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
#if ZEROFLAT_X86
      if (kCpu.f16c) {
        upcast_fp16_f16c(dst, s, numel);
        return;
      }
#endif
      for (std::uint64_t i = 0; i < numel; ++i) dst[i] = fp16_to_float_portable(s[i]);
      return;
    }
    case DType::kFP32:
      std::memcpy(dst, src, numel * sizeof(float));
      return;
  }
}

namespace {

std::uint32_t bits_of(float f) noexcept {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// fp32 to bf16, round to nearest even. A NaN becomes 0xFFFF, as torch's vectorized CPU
// conversion makes it (its scalar conversion makes 0x7FC0; both are NaN).
std::uint16_t to_bf16(float f) noexcept {
  const std::uint32_t b = bits_of(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffff;
  return static_cast<std::uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// fp32 to IEEE half as the F16C instruction converts (the one torch uses on x86): round to
// nearest even, subnormals kept, overflow to infinity, a NaN quieted with the top of its
// payload kept.
std::uint16_t to_fp16(float f) noexcept {
  const std::uint32_t b = bits_of(f);
  const auto sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  const std::uint32_t mag = b & 0x7fffffffu;
  if (mag > 0x7f800000u) {
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
  }
  if (mag >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (mag < 0x38800000u) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24, rounded to nearest even by
    // the float unit (the default rounding mode); 1024 lands on the smallest normal.
    float a;
    std::memcpy(&a, &mag, 4);
    return static_cast<std::uint16_t>(sign |
                                      static_cast<std::uint16_t>(std::nearbyint(a * 16777216.0f)));
  }
  const std::uint32_t exponent = (mag >> 23) - 127 + 15;
  const std::uint32_t mantissa = mag & 0x7fffffu;
  std::uint32_t h = exponent << 10 | mantissa >> 13;
  const std::uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves the exponent up
  return static_cast<std::uint16_t>(sign | h);
}

void narrow_portable(std::uint16_t* d, const float* s, DType to, std::uint64_t n) noexcept {
  if (to == DType::kBF16) {
    for (std::uint64_t i = 0; i < n; ++i) d[i] = to_bf16(s[i]);
  } else {
    for (std::uint64_t i = 0; i < n; ++i) d[i] = to_fp16(s[i]);
  }
}

#if ZEROFLAT_X86
__attribute__((target("f16c,avx"))) void narrow_fp16_f16c(std::uint16_t* d, const float* s,
                                                          std::uint64_t n) noexcept {
  std::uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
  }
  for (; i < n; ++i) d[i] = to_fp16(s[i]);
}
#endif

// fp32 to bf16 or fp16.
void narrow(std::uint16_t* d, const float* s, DType to, std::uint64_t n) noexcept {
#if ZEROFLAT_X86
  if (to == DType::kFP16 && kCpu.f16c) {
    narrow_fp16_f16c(d, s, n);
    return;
  }
#endif
  narrow_portable(d, s, to, n);
}

}  // namespace

void convert_range(void* dst, DType to, const void* src, DType from, std::uint64_t numel) noexcept {
  if (to == from) {
    if (dst != src) std::memcpy(dst, src, numel * element_size(to));
    return;
  }
  if (to == DType::kFP32) {
    upcast_range(static_cast<float*>(dst), src, from, numel);
    return;
  }
  auto* d = static_cast<std::uint16_t*>(dst);
  if (from == DType::kFP32) {
    narrow(d, static_cast<const float*>(src), to, numel);
    return;
  }
  // bf16 and fp16 to each other, through fp32 (as torch converts them), a block at a time.
  constexpr std::uint64_t kBlock = 1024;
  float wide[kBlock];
  const auto* s = static_cast<const unsigned char*>(src);
  for (std::uint64_t i = 0; i < numel; i += kBlock) {
    const std::uint64_t n = std::min(kBlock, numel - i);
    upcast_range(wide, s + i * 2, from, n);
    if (to == DType::kBF16) {
      // torch's fp16 -> bf16 makes a NaN 0x7FC0 (its scalar conversion).
      for (std::uint64_t k = 0; k < n; ++k) {
        d[i + k] = std::isnan(wide[k]) ? std::uint16_t{0x7fc0} : to_bf16(wide[k]);
      }
    } else {
      narrow(d + i, wide, to, n);
    }
  }
}

std::uint16_t float_to_bf16(float f) noexcept {
  return to_bf16(f);
}
std::uint16_t float_to_fp16(float f) noexcept {
  return to_fp16(f);
}

void check_gather_segments(const void* dst, std::uint64_t num_bytes,
                           std::span<const Segment> segments) {
  const auto dst_lo = reinterpret_cast<std::uintptr_t>(dst);
  const std::uintptr_t dst_hi = dst_lo + num_bytes;
  std::uint64_t prev_end = 0;     // end of the last non-empty segment
  std::uint64_t prev_offset = 0;  // offset of the last segment, empty or not
  for (std::size_t k = 0; k < segments.size(); ++k) {
    const Segment& s = segments[k];
    auto where = [&] {
      return "gather segment " + std::to_string(k) + " (dst_offset " +
             std::to_string(s.dst_offset) + ", " + std::to_string(s.num_bytes) + " bytes)";
    };
    std::uint64_t seg_end = 0;
    if (__builtin_add_overflow(s.dst_offset, s.num_bytes, &seg_end) || seg_end > num_bytes) {
      throw InvalidArgument(where() + " ends past the destination's " + std::to_string(num_bytes) +
                            " bytes");
    }
    // Every segment, empty ones too, must keep the order: the per-thread walk finds its first
    // segment by binary search on it.
    if (s.dst_offset < prev_end || s.dst_offset < prev_offset) {
      throw InvalidArgument(where() + " overlaps or precedes the previous segment, which ends at " +
                            std::to_string(prev_end) + ": segments must be sorted and disjoint");
    }
    if (s.num_bytes > 0) {
      if (s.src == nullptr) throw InvalidArgument(where() + " has a null source");
      const auto src_lo = reinterpret_cast<std::uintptr_t>(s.src);
      if (src_lo < dst_hi && dst_lo < src_lo + s.num_bytes) {
        throw InvalidArgument(where() + " reads from the destination buffer itself");
      }
      prev_end = seg_end;
    }
    prev_offset = s.dst_offset;
  }
}

bool use_streaming_stores(std::uint64_t num_bytes) noexcept {
  // Past the last-level cache, ordinary stores cost a read of every destination line as well
  // as the write; streaming stores skip that read.
  static const std::uint64_t threshold = [] {
    long llc = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
    llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return llc > 0 ? static_cast<std::uint64_t>(llc) : std::uint64_t{32} << 20;
  }();
  return num_bytes >= threshold;
}

}  // namespace zeroflat::detail
