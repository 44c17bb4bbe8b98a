// The rehearsal fill pattern: a cheap integer hash of (tensor, element), masked to finite values.
#include "common/pattern.h"

#include <cstring>

namespace zeroflat {
namespace {

// Seed for the block of 2^32 elements holding `element`, so 32-bit arithmetic (which compilers
// vectorize) covers any tensor size.
std::uint32_t block_seed(std::uint64_t tensor, std::uint64_t element) noexcept {
  std::uint64_t x = (tensor + 1) * 0x9E3779B97F4A7C15ull ^ (element >> 32) * 0xC2B2AE3D27D4EB4Full;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<std::uint32_t>(x);
}

inline std::uint32_t mix(std::uint32_t seed, std::uint32_t e) noexcept {
  std::uint32_t x = e * 0x9E3779B1u + seed;
  x ^= x >> 15;
  x *= 0x85EBCA77u;
  x ^= x >> 13;
  return x;
}

constexpr std::uint32_t kMaskBF16 = 0x7F7Fu;      // sign 0, exponent below all-ones
constexpr std::uint32_t kMaskFP16 = 0x7BFFu;      // sign 0, exponent below all-ones
constexpr std::uint32_t kMaskFP32 = 0x7F7FFFFFu;  // sign 0, exponent below all-ones

template <typename T>
void fill_block(T* out, std::uint32_t seed, std::uint32_t e0, std::uint64_t n,
                std::uint32_t mask) noexcept {
  for (std::uint64_t i = 0; i < n; ++i) {
    out[i] = static_cast<T>(mix(seed, e0 + static_cast<std::uint32_t>(i)) & mask);
  }
}

template <typename T>
std::uint64_t match_block(const T* in, std::uint32_t seed, std::uint32_t e0, std::uint64_t n,
                          std::uint32_t mask) noexcept {
  // Compare in vectorizable strides, then find the exact position of a mismatch.
  constexpr std::uint64_t kStride = 256;
  std::uint64_t i = 0;
  for (; i + kStride <= n; i += kStride) {
    std::uint32_t bad = 0;
    for (std::uint64_t k = 0; k < kStride; ++k) {
      bad |= static_cast<std::uint32_t>(in[i + k]) ^
             (mix(seed, e0 + static_cast<std::uint32_t>(i + k)) & mask);
    }
    if (bad != 0) break;
  }
  for (; i < n; ++i) {
    if (static_cast<std::uint32_t>(in[i]) !=
        (mix(seed, e0 + static_cast<std::uint32_t>(i)) & mask)) {
      return i;
    }
  }
  return n;
}

std::uint32_t mask_of(DType dtype) noexcept {
  switch (dtype) {
    case DType::kBF16:
      return kMaskBF16;
    case DType::kFP16:
      return kMaskFP16;
    case DType::kFP32:
      return kMaskFP32;
  }
  return 0;
}

// Calls fn(offset_in_call, seed, first_low32, count) for each piece of [first, first + count)
// that stays inside one block of 2^32 elements.
template <typename Fn>
void for_blocks(std::uint64_t tensor, std::uint64_t first, std::uint64_t count, Fn fn) noexcept {
  std::uint64_t done = 0;
  while (done < count) {
    const std::uint64_t e = first + done;
    const std::uint64_t block_left = (std::uint64_t{1} << 32) - (e & 0xFFFFFFFFull);
    const std::uint64_t n = count - done < block_left ? count - done : block_left;
    if (!fn(done, block_seed(tensor, e), static_cast<std::uint32_t>(e), n)) return;
    done += n;
  }
}

}  // namespace

std::uint32_t pattern_bits(DType dtype, std::uint64_t tensor, std::uint64_t element) noexcept {
  return mix(block_seed(tensor, element), static_cast<std::uint32_t>(element)) & mask_of(dtype);
}

void fill_pattern(void* data, DType dtype, std::uint64_t tensor, std::uint64_t first,
                  std::uint64_t count) noexcept {
  const std::uint32_t mask = mask_of(dtype);
  for_blocks(tensor, first, count,
             [&](std::uint64_t at, std::uint32_t seed, std::uint32_t e0, std::uint64_t n) {
               if (element_size(dtype) == 2) {
                 fill_block(static_cast<std::uint16_t*>(data) + at, seed, e0, n, mask);
               } else {
                 fill_block(static_cast<std::uint32_t*>(data) + at, seed, e0, n, mask);
               }
               return true;
             });
}

std::uint64_t match_pattern(const void* data, DType dtype, std::uint64_t tensor,
                            std::uint64_t first, std::uint64_t count) noexcept {
  const std::uint32_t mask = mask_of(dtype);
  std::uint64_t matched = 0;
  for_blocks(
      tensor, first, count,
      [&](std::uint64_t at, std::uint32_t seed, std::uint32_t e0, std::uint64_t n) {
        std::uint64_t m =
            element_size(dtype) == 2
                ? match_block(static_cast<const std::uint16_t*>(data) + at, seed, e0, n, mask)
                : match_block(static_cast<const std::uint32_t*>(data) + at, seed, e0, n, mask);
        matched += m;
        return m == n;
      });
  return matched;
}

}  // namespace zeroflat
