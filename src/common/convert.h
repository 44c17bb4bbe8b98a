// Element type conversions on the host, bit for bit as torch's Tensor.to rounds on x86 CPUs.
// Pure arithmetic on memory the caller owns: the devices' host kernels and the model's
// checkpoint writer both use them.
#pragma once

#include <cstdint>

#include "zeroflat/common.h"

namespace zeroflat::detail {

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

}  // namespace zeroflat::detail
