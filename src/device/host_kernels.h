// Host memory kernels: copy and zero-fill with streaming stores, a gather over a range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

// The dtype conversions (upcast_range, convert_range, ...) live in common, below the devices,
// because the model's checkpoint writer uses them too; the kernels' users get them from here.
#include "common/convert.h"
#include "zeroflat/device.h"
#include "zeroflat/dtype.h"

namespace zeroflat::detail {

// Copies n bytes. With streaming = true, 64-byte-aligned destination lines are written with
// non-temporal stores (no read-for-ownership, no cache pollution): the right choice when the
// destination is far larger than the caches. The caller must issue store_fence() before another
// thread reads the destination.
void copy_bytes(void* dst, const void* src, std::size_t n, bool streaming) noexcept;

// Writes n zero bytes, with the same streaming rule.
void zero_bytes(void* dst, std::size_t n, bool streaming) noexcept;

// Orders this thread's streaming stores before its later stores (sfence on x86).
void store_fence() noexcept;

// Writes the byte range [begin, end) of a gather into dst (dst points at byte 0 of the whole
// destination): the parts of segments inside the range are copied, the rest is zeroed.
// segments must be sorted and non-overlapping (see Device::gather).
void gather_range(unsigned char* dst, std::span<const Segment> segments, std::uint64_t begin,
                  std::uint64_t end, bool streaming) noexcept;

// Checks the contract of Device::gather; throws InvalidArgument naming the first bad segment.
void check_gather_segments(const void* dst, std::uint64_t num_bytes,
                           std::span<const Segment> segments);

// Whether a destination of this many bytes should be written with streaming stores.
bool use_streaming_stores(std::uint64_t num_bytes) noexcept;

}  // namespace zeroflat::detail
