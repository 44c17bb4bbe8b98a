// Host memory kernels: streaming copies and fills, the per-thread gather.
#include "device/host_kernels.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "common/cpu_features.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {
namespace {

// Ordinary stores go in pieces of this many bytes: glibc's memcpy and memset switch to streaming
// stores themselves for a single call past a share of the cache.
constexpr std::uint64_t kPlainPiece = std::uint64_t{64} << 10;

#if ZEROFLAT_X86
void stream_zero_body(unsigned char* dst, std::size_t n) noexcept {
  const __m128i z = _mm_setzero_si128();
  for (std::size_t i = 0; i < n; i += kStreamLine) {
    auto* d = reinterpret_cast<__m128i*>(dst + i);
    _mm_stream_si128(d + 0, z);
    _mm_stream_si128(d + 1, z);
    _mm_stream_si128(d + 2, z);
    _mm_stream_si128(d + 3, z);
  }
}
#endif

}  // namespace

void copy_ordinary(void* dst_v, const void* src_v, std::size_t n) noexcept {
  auto* dst = static_cast<unsigned char*>(dst_v);
  const auto* src = static_cast<const unsigned char*>(src_v);
  for (std::size_t at = 0; at < n; at += kPlainPiece) {
    std::memcpy(dst + at, src + at, std::min<std::size_t>(kPlainPiece, n - at));
  }
}

void copy_fresh(void* dst_v, const void* src_v, std::size_t n) noexcept {
  auto* dst = static_cast<unsigned char*>(dst_v);
  const auto* src = static_cast<const unsigned char*>(src_v);
  prefault_then_write(dst, n, [&](std::uint64_t at, std::uint64_t k) {
    copy_ordinary(dst + at, src + at, k);
  });
}

void zero_bytes(void* dst_v, std::size_t n, bool streaming) noexcept {
  auto* dst = static_cast<unsigned char*>(dst_v);
#if ZEROFLAT_X86
  if (streaming && n >= kStreamMinBytes) {
    const std::uintptr_t misalign = reinterpret_cast<std::uintptr_t>(dst) % kStreamLine;
    std::size_t head = (kStreamLine - misalign) % kStreamLine;
    std::memset(dst, 0, head);
    std::size_t body = (n - head) & ~(kStreamLine - 1);
    stream_zero_body(dst + head, body);
    std::memset(dst + head + body, 0, n - head - body);
    return;
  }
#else
  (void)streaming;
#endif
  std::memset(dst, 0, n);
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
      const std::uint64_t whole = (seg_end - line) / kStreamLine * kStreamLine;
      const std::uint64_t run_end = std::min(end, line + whole);
      if (run_end > line) {
        const auto* src = static_cast<const unsigned char*>(it->src) + (line - it->dst_offset);
        stream_lines(dst + line, src, run_end - line);
        line = run_end;
        continue;
      }
    } else {
      // Whole lines of padding before the next segment.
      const std::uint64_t next = it == segments.end() ? end : it->dst_offset;
      const std::uint64_t run_end = std::min(end, line + (next - line) / kStreamLine * kStreamLine);
      if (run_end > line) {
        stream_zero_body(dst + line, run_end - line);
        line = run_end;
        continue;
      }
    }
    // A line where pieces meet.
    alignas(16) unsigned char tmp[kStreamLine] = {};
    for (auto j = it; j != segments.end() && j->dst_offset < line + kStreamLine; ++j) {
      const std::uint64_t lo = std::max(j->dst_offset, line);
      const std::uint64_t hi = std::min(j->dst_offset + j->num_bytes, line + kStreamLine);
      if (hi > lo) {
        std::memcpy(tmp + (lo - line),
                    static_cast<const unsigned char*>(j->src) + (lo - j->dst_offset), hi - lo);
      }
    }
    stream_lines(dst + line, tmp, kStreamLine);
    line += kStreamLine;
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
    const std::uintptr_t lo_abs = (base + begin + kStreamLine - 1) / kStreamLine * kStreamLine;
    const std::uintptr_t hi_abs = (base + end) / kStreamLine * kStreamLine;
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
  if (streaming) {
    gather_plain(dst, segments, begin, end, true);
    return;
  }
  for (std::uint64_t lo = begin; lo < end; lo += kPlainPiece) {
    gather_plain(dst, segments, lo, std::min(end, lo + kPlainPiece), false);
  }
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

bool use_streaming_stores(const void* dst, std::uint64_t num_bytes) noexcept {
  return larger_than_cache(num_bytes) && !mostly_untouched(dst, num_bytes);
}

}  // namespace zeroflat::detail
