// Saturating arithmetic on byte and element counts, for accounts that must never wrap.
#pragma once

#include <cstdint>

namespace zeroflat::detail {

// What a saturated count reads as: more than 64 bits can hold. A memory account that reaches it
// is larger than any device or host, so it never fits; a wrapped sum would read as a small
// number and fit.
inline constexpr std::uint64_t kSaturated = UINT64_MAX;

// a + b, or kSaturated when the sum does not fit in 64 bits.
constexpr std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? kSaturated : out;
}

// a * b, or kSaturated when the product does not fit in 64 bits.
constexpr std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b) noexcept {
  std::uint64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? kSaturated : out;
}

}  // namespace zeroflat::detail
