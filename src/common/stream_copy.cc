// Copies with streaming stores (stream_copy.h).
#include "common/stream_copy.h"

#include <unistd.h>

#include <atomic>
#include <cstring>

#include "common/cpu_features.h"

namespace zeroflat::detail {
namespace {

constexpr std::size_t kCopyLine = 64;
// Below this size a copy uses ordinary stores: the streaming body would be a few lines at most,
// and the head and tail already use ordinary stores.
constexpr std::size_t kCopyStreamMin = 256;

#if ZEROFLAT_X86
void stream_lines_sse(unsigned char* dst, const unsigned char* src, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; i += kCopyLine) {
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

__attribute__((target("avx"))) void stream_lines_avx(unsigned char* dst, const unsigned char* src,
                                                     std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; i += kCopyLine) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
  }
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
  if (streaming && n >= kCopyStreamMin) {
    const std::uintptr_t misalign = reinterpret_cast<std::uintptr_t>(dst) % kCopyLine;
    const std::size_t head = (kCopyLine - misalign) % kCopyLine;
    std::memcpy(dst, src, head);
    const std::size_t body = (n - head) & ~(kCopyLine - 1);
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

bool larger_than_cache(std::uint64_t num_bytes) noexcept {
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
