// Element type conversions on the host, bit for bit as torch rounds: up-casts to fp32, fp32 to
// bf16 and fp16, and between the two 16-bit types.
#include "common/convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/cpu_features.h"

namespace zeroflat::detail {
namespace {

#if ZEROFLAT_X86
const bool kF16c = cpu_features().f16c;

__attribute__((target("f16c,avx"))) void upcast_fp16_f16c(float* dst, const std::uint16_t* src,
                                                          std::uint64_t n) noexcept {
  std::uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]);
}
#endif

float fp16_to_float_portable(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t bits = 0;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | static_cast<std::uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | mant << 13;
  } else {
    bits = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

float fp16_to_float(std::uint16_t h) noexcept {
  return fp16_to_float_portable(h);
}
void upcast_range(float* dst, const void* src, DType dtype, std::uint64_t numel) noexcept {
  switch (dtype) {
    case DType::kBF16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
      auto* d = reinterpret_cast<std::uint32_t*>(dst);
      for (std::uint64_t i = 0; i < numel; ++i) d[i] = static_cast<std::uint32_t>(s[i]) << 16;
      return;
    }
    case DType::kFP16: {
      const auto* s = static_cast<const std::uint16_t*>(src);
#if ZEROFLAT_X86
      if (kF16c) {
        upcast_fp16_f16c(dst, s, numel);
        return;
      }
#endif
      for (std::uint64_t i = 0; i < numel; ++i) dst[i] = fp16_to_float_portable(s[i]);
      return;
    }
    case DType::kFP32:
      std::memcpy(dst, src, numel * sizeof(float));
      return;
  }
}

namespace {

std::uint32_t bits_of(float f) noexcept {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// fp32 to bf16, round to nearest even. A NaN becomes 0xFFFF, as torch's vectorized CPU
// conversion makes it (its scalar conversion makes 0x7FC0; both are NaN).
std::uint16_t to_bf16(float f) noexcept {
  const std::uint32_t b = bits_of(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffff;
  return static_cast<std::uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// fp32 to IEEE half as the F16C instruction converts (the one torch uses on x86): round to
// nearest even, subnormals kept, overflow to infinity, a NaN quieted with the top of its
// payload kept.
std::uint16_t to_fp16(float f) noexcept {
  const std::uint32_t b = bits_of(f);
  const auto sign = static_cast<std::uint16_t>((b >> 16) & 0x8000u);
  const std::uint32_t mag = b & 0x7fffffffu;
  if (mag > 0x7f800000u) {
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((mag >> 13) & 0x3ffu));
  }
  if (mag >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (mag < 0x38800000u) {
    // Below the smallest normal half (2^-14): a multiple of 2^-24, rounded to nearest even by
    // the float unit (the default rounding mode); 1024 lands on the smallest normal.
    float a;
    std::memcpy(&a, &mag, 4);
    return static_cast<std::uint16_t>(sign |
                                      static_cast<std::uint16_t>(std::nearbyint(a * 16777216.0f)));
  }
  const std::uint32_t exponent = (mag >> 23) - 127 + 15;
  const std::uint32_t mantissa = mag & 0x7fffffu;
  std::uint32_t h = exponent << 10 | mantissa >> 13;
  const std::uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry moves the exponent up
  return static_cast<std::uint16_t>(sign | h);
}

void narrow_portable(std::uint16_t* d, const float* s, DType to, std::uint64_t n) noexcept {
  if (to == DType::kBF16) {
    for (std::uint64_t i = 0; i < n; ++i) d[i] = to_bf16(s[i]);
  } else {
    for (std::uint64_t i = 0; i < n; ++i) d[i] = to_fp16(s[i]);
  }
}

#if ZEROFLAT_X86
__attribute__((target("f16c,avx"))) void narrow_fp16_f16c(std::uint16_t* d, const float* s,
                                                          std::uint64_t n) noexcept {
  std::uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
  }
  for (; i < n; ++i) d[i] = to_fp16(s[i]);
}
#endif

// fp32 to bf16 or fp16.
void narrow(std::uint16_t* d, const float* s, DType to, std::uint64_t n) noexcept {
#if ZEROFLAT_X86
  if (to == DType::kFP16 && kF16c) {
    narrow_fp16_f16c(d, s, n);
    return;
  }
#endif
  narrow_portable(d, s, to, n);
}

}  // namespace

void convert_range(void* dst, DType to, const void* src, DType from, std::uint64_t numel) noexcept {
  if (to == from) {
    if (dst != src) std::memcpy(dst, src, numel * element_size(to));
    return;
  }
  if (to == DType::kFP32) {
    upcast_range(static_cast<float*>(dst), src, from, numel);
    return;
  }
  auto* d = static_cast<std::uint16_t*>(dst);
  if (from == DType::kFP32) {
    narrow(d, static_cast<const float*>(src), to, numel);
    return;
  }
  // bf16 and fp16 to each other, through fp32 (as torch converts them), a block at a time.
  constexpr std::uint64_t kBlock = 1024;
  float wide[kBlock];
  const auto* s = static_cast<const unsigned char*>(src);
  for (std::uint64_t i = 0; i < numel; i += kBlock) {
    const std::uint64_t n = std::min(kBlock, numel - i);
    upcast_range(wide, s + i * 2, from, n);
    if (to == DType::kBF16) {
      // torch's fp16 -> bf16 makes a NaN 0x7FC0 (its scalar conversion).
      for (std::uint64_t k = 0; k < n; ++k) {
        d[i + k] = std::isnan(wide[k]) ? std::uint16_t{0x7fc0} : to_bf16(wide[k]);
      }
    } else {
      narrow(d + i, wide, to, n);
    }
  }
}

std::uint16_t float_to_bf16(float f) noexcept {
  return to_bf16(f);
}
std::uint16_t float_to_fp16(float f) noexcept {
  return to_fp16(f);
}

}  // namespace zeroflat::detail

namespace zeroflat {

bool holds_upcast(const float* wide, const void* narrow, DType dtype,
                  std::uint64_t numel) noexcept {
  constexpr std::uint64_t kBlock = 2048;
  const auto* w = reinterpret_cast<const unsigned char*>(wide);
  if (dtype == DType::kBF16) {
    // A bf16 value's fp32 bits are its own 16 above 16 zeros: compared as integers, a block
    // at a time without a branch per element.
    const auto* s = static_cast<const std::uint16_t*>(narrow);
    for (std::uint64_t i = 0; i < numel; i += kBlock) {
      const std::uint64_t n = std::min(kBlock, numel - i);
      std::uint32_t diff = 0;
      for (std::uint64_t k = 0; k < n; ++k) {
        std::uint32_t b;
        std::memcpy(&b, w + (i + k) * 4, 4);
        diff |= b ^ (static_cast<std::uint32_t>(s[i + k]) << 16);
      }
      if (diff != 0) return false;
    }
    return true;
  }
  const auto* s = static_cast<const unsigned char*>(narrow);
  // fp32 into fp32: the up-cast is the identity, so the bytes themselves are compared.
  if (dtype == DType::kFP32) return numel == 0 || std::memcmp(w, s, numel * 4) == 0;
  const std::uint64_t es = element_size(dtype);
  float up[kBlock];
  for (std::uint64_t i = 0; i < numel; i += kBlock) {
    const std::uint64_t n = std::min(kBlock, numel - i);
    detail::upcast_range(up, s + i * es, dtype, n);
    if (std::memcmp(up, w + i * 4, n * 4) != 0) return false;
  }
  return true;
}

}  // namespace zeroflat
