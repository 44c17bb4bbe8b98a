// The cuda device's batched gather: the work table the host builds, and the walk every warp of
// the kernel runs over it. Plain C++ outside nvcc, so that a host test runs the very same walk.
//
// The destination [0, num_bytes) is described by runs that tile it exactly: every segment is a
// run, every gap (padding) is a run of zeros, and a sentinel run starts at num_bytes. The range is
// cut into equal tiles; block b of the grid takes tiles b, b + grid, b + 2 * grid, ... so every
// block moves the same number of bytes, whatever the mix of tensor sizes. Inside a tile the
// pieces of runs are cut into units of 32 lanes x kUnroll 16-byte vectors that go round-robin to
// the block's warps: one huge tensor keeps every warp busy, and so do a hundred tiny ones.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "zeroflat/device.h"

#if defined(__CUDACC__)
#define ZEROFLAT_HD __host__ __device__
#else
#define ZEROFLAT_HD
#endif

namespace zeroflat::detail::gather {

// Threads per block of the gather kernel, and 16-byte vectors each lane keeps in flight.
inline constexpr unsigned kThreads = 256;
inline constexpr int kUnroll = 4;
// Tiles per block: enough that a slow tile (misaligned or many tiny tensors) averages out,
// few enough that the tile table stays small.
inline constexpr std::uint64_t kTilesPerBlock = 16;
// Below this a tile costs more to find than to copy.
inline constexpr std::uint64_t kMinTileBytes = std::uint64_t{16} << 10;
// Tile boundaries are multiples of this (relative to dst), so that they fall on vector
// boundaries whenever dst is 16-byte aligned and add no ragged edges.
inline constexpr std::uint64_t kTileAlign = 512;

// One run of the destination, from begin to the next run's begin. src == 0: zeros.
struct Run {
  std::uint64_t src;
  std::uint64_t begin;
};

// What the kernel receives (by value): pointers the GPU can dereference.
struct Plan {
  unsigned char* dst = nullptr;
  std::uint64_t num_bytes = 0;
  std::uint64_t tile_bytes = 0;
  std::uint64_t num_tiles = 0;
  const Run* runs = nullptr;                  // num_runs + 1 entries, the last {0, num_bytes}
  const std::uint64_t* tile_first = nullptr;  // per tile, the run holding its first byte
};

// How a gather of num_bytes from num_segments segments is cut, and the most table bytes it
// needs (the tile table, then the runs).
struct Geometry {
  std::uint64_t tile_bytes = 0;
  std::uint64_t num_tiles = 0;
  std::uint64_t num_blocks = 0;
  std::uint64_t runs_offset = 0;  // bytes into the table
  std::uint64_t max_table_bytes = 0;
};

inline std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);
}

// num_bytes > 0, max_blocks > 0.
inline Geometry make_geometry(std::uint64_t num_bytes, std::size_t num_segments,
                              std::uint64_t max_blocks) {
  Geometry g;
  std::uint64_t tile = ceil_div(num_bytes, max_blocks * kTilesPerBlock);
  tile = ceil_div(tile, kTileAlign) * kTileAlign;
  if (tile < kMinTileBytes) tile = kMinTileBytes;
  g.tile_bytes = tile;
  g.num_tiles = ceil_div(num_bytes, tile);
  g.num_blocks = g.num_tiles < max_blocks ? g.num_tiles : max_blocks;
  g.runs_offset = ceil_div(g.num_tiles * sizeof(std::uint64_t), 16) * 16;
  // Each segment adds at most itself and the gap before it; then the trailing gap and the
  // sentinel.
  g.max_table_bytes = g.runs_offset + (2 * std::uint64_t{num_segments} + 2) * sizeof(Run);
  return g;
}

// Writes the tile table and the run table into table (at least g.max_table_bytes, 16-byte
// aligned). Segments must satisfy Device::gather's contract (check_gather_segments). Returns the
// bytes written.
inline std::uint64_t build_table(void* table, const Geometry& g, std::uint64_t num_bytes,
                                 std::span<const Segment> segments) {
  auto* tile_first = static_cast<std::uint64_t*>(table);
  auto* runs = reinterpret_cast<Run*>(static_cast<unsigned char*>(table) + g.runs_offset);
  std::uint64_t n = 0;
  std::uint64_t cursor = 0;
  for (const Segment& s : segments) {
    if (s.num_bytes == 0) continue;
    if (s.dst_offset > cursor) runs[n++] = Run{0, cursor};
    runs[n++] = Run{reinterpret_cast<std::uintptr_t>(s.src), s.dst_offset};
    cursor = s.dst_offset + s.num_bytes;
  }
  if (cursor < num_bytes) runs[n++] = Run{0, cursor};
  runs[n] = Run{0, num_bytes};
  // One merge walk: tile t starts inside the last run that begins at or before its first byte.
  std::uint64_t r = 0;
  for (std::uint64_t t = 0; t < g.num_tiles; ++t) {
    const std::uint64_t lo = t * g.tile_bytes;
    while (runs[r + 1].begin <= lo) ++r;
    tile_first[t] = r;
  }
  return g.runs_offset + (n + 1) * sizeof(Run);
}

// --- the walk -----------------------------------------------------------------------------------

#if defined(__CUDACC__)
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  std::uint32_t x, y, z, w;
};
#endif

template <bool kStreaming>
ZEROFLAT_HD inline Vec16 load16(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  if constexpr (kStreaming) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
#else
  Vec16 v;
  std::memcpy(&v, p, 16);
  return v;
#endif
}

template <bool kStreaming>
ZEROFLAT_HD inline void store16(unsigned char* p, const Vec16& v) {
#if defined(__CUDA_ARCH__)
  if constexpr (kStreaming) {
    __stcs(reinterpret_cast<uint4*>(p), v);
  } else {
    // An explicit global store: through a plain pointer the compiler would emit a generic one.
    __stwb(reinterpret_cast<uint4*>(p), v);
  }
#else
  std::memcpy(p, &v, 16);
#endif
}

// The low 32 bits of (hi:lo) >> r, r < 32.
ZEROFLAT_HD inline std::uint32_t funnel_right(std::uint32_t lo, std::uint32_t hi, unsigned r) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_r(lo, hi, r);
#else
  return static_cast<std::uint32_t>(((static_cast<std::uint64_t>(hi) << 32) | lo) >> r);
#endif
}

// Bytes [shift, shift + 16) of the 32 bytes lo:hi (little-endian), 0 < shift < 16: the source
// vector of a run whose source and destination disagree in their position within 16 bytes,
// assembled from the two aligned vectors it straddles.
ZEROFLAT_HD inline Vec16 shift_bytes(const Vec16& lo, const Vec16& hi, unsigned shift) {
  std::uint32_t a0, a1, a2, a3, a4;
  // Constant register indices (a runtime array index would spill the words to local memory);
  // shift is the same for the whole run, so the branch does not diverge.
  switch (shift >> 2) {
    case 0:
      a0 = lo.x, a1 = lo.y, a2 = lo.z, a3 = lo.w, a4 = hi.x;
      break;
    case 1:
      a0 = lo.y, a1 = lo.z, a2 = lo.w, a3 = hi.x, a4 = hi.y;
      break;
    case 2:
      a0 = lo.z, a1 = lo.w, a2 = hi.x, a3 = hi.y, a4 = hi.z;
      break;
    default:
      a0 = lo.w, a1 = hi.x, a2 = hi.y, a3 = hi.z, a4 = hi.w;
      break;
  }
  const unsigned r = (shift & 3u) * 8u;
  Vec16 out;
  out.x = funnel_right(a0, a1, r);
  out.y = funnel_right(a1, a2, r);
  out.z = funnel_right(a2, a3, r);
  out.w = funnel_right(a3, a4, r);
  return out;
}

#if defined(__CUDA_ARCH__)
#define ZEROFLAT_UNROLL _Pragma("unroll")
#else
#define ZEROFLAT_UNROLL
#endif

// The vector loops of one lane. The lane's first vector is at d (and s); rem counts the piece's
// vectors from there on; after each unit the lane moves on by stride vectors (to the warp's next
// unit). Within a unit the lane handles kU vectors 32 apart, so each access of the warp covers
// 512 contiguous bytes, and all kU loads are in flight before the first store.
template <int kU, bool kStreaming>
ZEROFLAT_HD inline void zero_vectors(unsigned char* d, std::int64_t rem, std::int64_t stride) {
  Vec16 zero;
  zero.x = zero.y = zero.z = zero.w = 0;
  for (; rem > 0; rem -= stride, d += 16 * stride) {
    ZEROFLAT_UNROLL
    for (int j = 0; j < kU; ++j) {
      if (32 * j < rem) store16<kStreaming>(d + 512 * j, zero);
    }
  }
}

template <int kU, bool kStreaming>
ZEROFLAT_HD inline void copy_vectors(unsigned char* d, const unsigned char* s, std::int64_t rem,
                                     std::int64_t stride) {
  for (; rem > 0; rem -= stride, d += 16 * stride, s += 16 * stride) {
    Vec16 v[kU];
    ZEROFLAT_UNROLL
    for (int j = 0; j < kU; ++j) {
      if (32 * j < rem) v[j] = load16<kStreaming>(s + 512 * j);
    }
    ZEROFLAT_UNROLL
    for (int j = 0; j < kU; ++j) {
      if (32 * j < rem) store16<kStreaming>(d + 512 * j, v[j]);
    }
  }
}

// s is the aligned vector that holds the first source byte of d's vector, at s + shift. Two
// aligned loads per vector (the second is mostly the next lane's first, an L1 hit), in two
// rounds per unit so that the registers stay those of the aligned loop.
template <int kU, bool kStreaming>
ZEROFLAT_HD inline void shift_vectors(unsigned char* d, const unsigned char* s, unsigned shift,
                                      std::int64_t rem, std::int64_t stride) {
  constexpr int kHalf = kU > 1 ? kU / 2 : 1;
  for (; rem > 0; rem -= stride, d += 16 * stride, s += 16 * stride) {
    ZEROFLAT_UNROLL
    for (int h = 0; h < kU; h += kHalf) {
      Vec16 lo[kHalf], hi[kHalf];
      ZEROFLAT_UNROLL
      for (int j = 0; j < kHalf; ++j) {
        if (32 * (h + j) < rem) {
          lo[j] = load16<kStreaming>(s + 512 * (h + j));
          hi[j] = load16<kStreaming>(s + 512 * (h + j) + 16);
        }
      }
      ZEROFLAT_UNROLL
      for (int j = 0; j < kHalf; ++j) {
        if (32 * (h + j) < rem) {
          store16<kStreaming>(d + 512 * (h + j), shift_bytes(lo[j], hi[j], shift));
        }
      }
    }
  }
}

// Lane `lane` of warp `warp`'s share of one piece: len bytes to d from s (null: zeros). The
// piece's body is the 16-byte-aligned vectors of d; its ragged edges (at most 15 bytes at each
// end) are written byte by byte by the warp that owns its first unit. The units of a tile go
// round-robin over the warps, piece after piece: owner (the same in every warp) is the warp of
// the piece's first unit, and moves on past the piece's units.
template <int kU, bool kStreaming>
ZEROFLAT_HD inline void copy_piece(unsigned char* d, const unsigned char* s, std::uint64_t len,
                                   unsigned warp, unsigned num_warps, unsigned lane,
                                   unsigned& owner) {
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(d);
  const std::uintptr_t b = a + len;
  const std::uintptr_t d0 = (a + 15) & ~std::uintptr_t{15};
  const std::uintptr_t d1 = b & ~std::uintptr_t{15};
  std::uint64_t num_vec = 0;
  std::uintptr_t head_end = b;
  std::uintptr_t tail_begin = b;
  if (d1 > d0) {
    num_vec = (d1 - d0) / 16;
    head_end = d0;
    tail_begin = d1;
  }
  constexpr std::uint64_t kPerUnit = 32u * kU;
  const std::uint64_t units = num_vec == 0 ? 1 : (num_vec + kPerUnit - 1) / kPerUnit;
  const unsigned first = (warp + num_warps - owner) % num_warps;
  // 32-bit remainders (a 64-bit one is a long subroutine on a GPU); a piece lies in one tile,
  // so its unit count fits in 32 bits in any real gather, and the 64-bit path stays correct.
  const unsigned step = units <= 0xFFFFFFFFu ? static_cast<unsigned>(units) % num_warps
                                             : static_cast<unsigned>(units % num_warps);
  owner = (owner + step) % num_warps;
  if (first >= units) return;

  if (first == 0) {
    // head + tail <= 30 < 32 lanes: one byte each.
    const std::uint64_t head = head_end - a;
    const std::uint64_t tail = b - tail_begin;
    std::uint64_t off = ~std::uint64_t{0};
    if (lane < head) {
      off = lane;
    } else if (lane < head + tail) {
      off = (tail_begin - a) + (lane - head);
    }
    if (off != ~std::uint64_t{0}) d[off] = s == nullptr ? 0 : s[off];
  }
  if (num_vec == 0) return;
  const std::uint64_t at = first * kPerUnit + lane;  // this lane's first vector
  const auto rem = static_cast<std::int64_t>(num_vec) - static_cast<std::int64_t>(at);
  const auto stride = static_cast<std::int64_t>(kPerUnit * num_warps);
  unsigned char* const dv = reinterpret_cast<unsigned char*>(d0) + 16 * at;
  if (s == nullptr) {
    zero_vectors<kU, kStreaming>(dv, rem, stride);
    return;
  }
  const unsigned char* const sv = s + (d0 - a) + 16 * at;
  const unsigned shift = static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(sv) & 15u);
  if (shift == 0) {
    copy_vectors<kU, kStreaming>(dv, sv, rem, stride);
  } else {
    // Both aligned vectors hold bytes of the run, so neither read leaves the run's pages.
    shift_vectors<kU, kStreaming>(dv, sv - shift, shift, rem, stride);
  }
}

// Everything one lane of the grid writes: the tiles of block `block`, its warp's units in them.
template <int kU, bool kStreaming>
ZEROFLAT_HD inline void walk(const Plan& p, std::uint64_t block, std::uint64_t num_blocks,
                             unsigned warp, unsigned num_warps, unsigned lane) {
  for (std::uint64_t t = block; t < p.num_tiles; t += num_blocks) {
    const std::uint64_t lo = t * p.tile_bytes;
    const std::uint64_t hi = lo + p.tile_bytes < p.num_bytes ? lo + p.tile_bytes : p.num_bytes;
    unsigned owner = 0;
    for (std::uint64_t r = p.tile_first[t];; ++r) {
      const Run run = p.runs[r];
      if (run.begin >= hi) break;
      const std::uint64_t end = p.runs[r + 1].begin;
      const std::uint64_t a = run.begin > lo ? run.begin : lo;
      const std::uint64_t b = end < hi ? end : hi;
      const unsigned char* src =
          run.src == 0 ? nullptr
                       : reinterpret_cast<const unsigned char*>(run.src) + (a - run.begin);
      copy_piece<kU, kStreaming>(p.dst + a, src, b - a, warp, num_warps, lane, owner);
    }
  }
}

}  // namespace zeroflat::detail::gather
