// Host memory kernels: copy (common/stream_copy.h) and zero-fill with streaming stores, a
// gather over a range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

// The dtype conversions (upcast_range, convert_range, ...) live in common, below the devices,
// because the model's checkpoint writer uses them too; the kernels' users get them from here.
#include "common/convert.h"
#include "common/prefault.h"
#include "common/stream_copy.h"  // copy_bytes, store_fence, larger_than_cache
#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat::detail {

// Copies n bytes with ordinary stores only, in pieces small enough that memcpy does not stream
// them: for a destination never touched (see use_streaming_stores).
void copy_ordinary(void* dst, const void* src, std::size_t n) noexcept;

// copy_ordinary into memory never touched, a chunk's pages faulted in before it is written.
void copy_fresh(void* dst, const void* src, std::size_t n) noexcept;

// Writes n zero bytes, with the same streaming rule.
void zero_bytes(void* dst, std::size_t n, bool streaming) noexcept;

// Writes the byte range [begin, end) of a gather into dst (dst points at byte 0 of the whole
// destination): the parts of segments inside the range are copied, the rest is zeroed. Without
// streaming, in pieces of at most 64 KiB (a larger memcpy may stream on its own).
// segments must be sorted and non-overlapping (see Device::gather).
void gather_range(unsigned char* dst, std::span<const Segment> segments, std::uint64_t begin,
                  std::uint64_t end, bool streaming) noexcept;

// Checks the contract of Device::gather; throws InvalidArgument naming the first bad segment.
void check_gather_segments(const void* dst, std::uint64_t num_bytes,
                           std::span<const Segment> segments);

// Whether the destination [dst, dst + num_bytes) should be written with streaming stores: it
// is larger than the last-level cache (ordinary stores would also read every line first) and
// its pages are already there. Into pages not yet touched ordinary stores are faster: each
// fault leaves its freshly zeroed 4 KiB page in the cache, where ordinary stores land, while a
// streaming store has to evict it (measured: a 1.5 GB gather into a fresh mapping 0.52 s with
// ordinary stores against 0.61 s streamed).
bool use_streaming_stores(const void* dst, std::uint64_t num_bytes) noexcept;

}  // namespace zeroflat::detail
