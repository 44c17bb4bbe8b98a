// Element types: sizes, names, parsing.
#include "zeroflat/common.h"

#include <string>

#include "zeroflat/common.h"

namespace zeroflat {

std::uint32_t element_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBF16:
    case DType::kFP16:
      return 2;
    case DType::kFP32:
      return 4;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
  }
  return "?";
}

std::optional<DType> try_parse_dtype(std::string_view text) noexcept {
  if (text == "bf16" || text == "bfloat16") return DType::kBF16;
  if (text == "fp16" || text == "float16" || text == "half") return DType::kFP16;
  if (text == "fp32" || text == "float32" || text == "float") return DType::kFP32;
  return std::nullopt;
}

DType parse_dtype(std::string_view text) {
  if (auto dtype = try_parse_dtype(text)) return *dtype;
  throw InvalidArgument("unknown dtype '" + printable(text) + "': expected bf16, fp16 or fp32");
}

}  // namespace zeroflat
