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

}  // namespace zeroflat
