// Element types of a parameter group and their sizes.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace zeroflat {

enum class DType : std::uint8_t { kBF16, kFP16, kFP32 };

// Bytes per element: 2 for bf16 and fp16, 4 for fp32.
std::uint32_t element_size(DType dtype) noexcept;

// "bf16", "fp16", "fp32".
std::string_view dtype_name(DType dtype) noexcept;

// Accepts the names above and the aliases "bfloat16", "float16", "half", "float32", "float".
std::optional<DType> try_parse_dtype(std::string_view text) noexcept;

// As try_parse_dtype; throws InvalidArgument naming the text and the accepted names.
DType parse_dtype(std::string_view text);

// Whether wide[0, numel) holds, bit for bit, the fp32 values of the numel elements of `dtype` at
// `narrow` (what up-casting them would write): -0.0 is not 0.0 here, and a NaN matches only the
// up-cast of its own bits. One pass over both, no temporary the size of either.
bool holds_upcast(const float* wide, const void* narrow, DType dtype, std::uint64_t numel) noexcept;

}  // namespace zeroflat
