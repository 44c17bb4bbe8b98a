// Host memory kernels: copy and zero-fill with streaming stores, up-casts, a gather over a range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

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

// dst[i] = float(src[i]) for i < numel.
void upcast_range(float* dst, const void* src, DType dtype, std::uint64_t numel) noexcept;

// dst[i] = src[i] converted from `from` to `to`, bit for bit as torch's Tensor.to does on x86
// CPUs: exact where the target holds every value (to fp32, or the same type), round to nearest
// even otherwise (fp32 to bf16 or fp16; bf16 and fp16 to each other through fp32), subnormals
// kept, overflow to infinity; a NaN stays a NaN (to fp16: quiet, the top of its payload kept;
// fp32 to bf16: 0xFFFF; fp16 to bf16: 0x7FC0). dst must not overlap src unless to == from and
// dst == src.
void convert_range(void* dst, DType to, const void* src, DType from, std::uint64_t numel) noexcept;
// The scalar conversions convert_range uses on machines without F16C.
std::uint16_t float_to_bf16(float f) noexcept;
std::uint16_t float_to_fp16(float f) noexcept;

// IEEE half to float in portable code: the path machines without F16C take.
float fp16_to_float(std::uint16_t h) noexcept;

// Checks the contract of Device::gather; throws InvalidArgument naming the first bad segment.
void check_gather_segments(const void* dst, std::uint64_t num_bytes,
                           std::span<const Segment> segments);

// Whether a destination of this many bytes should be written with streaming stores.
bool use_streaming_stores(std::uint64_t num_bytes) noexcept;

}  // namespace zeroflat::detail
