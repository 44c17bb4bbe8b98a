// Saturating and checked arithmetic on byte and element counts, for accounts that must never
// wrap.
#pragma once

#include <cstdint>
#include <string>

#include "zeroflat/common.h"

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

// a + b; throws InvalidArgument naming `what` when the sum does not fit in 64 bits.
inline std::uint64_t checked_add(std::uint64_t a, std::uint64_t b, const char* what) {
  std::uint64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) {
    throw InvalidArgument(std::string(what) + " overflows 64 bits (" + std::to_string(a) + " + " +
                          std::to_string(b) + ")");
  }
  return out;
}

// a * b; throws InvalidArgument naming `what` when the product does not fit in 64 bits.
inline std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const char* what) {
  std::uint64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    throw InvalidArgument(std::string(what) + " overflows 64 bits (" + std::to_string(a) + " * " +
                          std::to_string(b) + ")");
  }
  return out;
}

}  // namespace zeroflat::detail
