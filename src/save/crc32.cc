// CRC-32 of the zip format (save.h): reflected polynomial 0xEDB88320, by carry-less
// multiplication where the CPU has it (PCLMULQDQ), else eight bytes a step from eight tables;
// two ranges' CRCs combined by multiplying in GF(2) modulo the polynomial.
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>

#include "common/cpu_features.h"
#include "zeroflat/save.h"

namespace zeroflat {
namespace {

static_assert(std::endian::native == std::endian::little, "the eight-byte step reads little-endian");

constexpr std::uint32_t kPoly = 0xEDB88320u;

using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s) {
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  }
  return t;
}

constexpr Tables kTables = make_tables();

// a * b modulo the polynomial, both in the reflected order (x^0 is the top bit).
constexpr std::uint32_t mult_mod(std::uint32_t a, std::uint32_t b) {
  std::uint32_t product = 0;
  for (std::uint32_t m = 1u << 31; m != 0; m >>= 1) {
    if (a & m) {
      product ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(2^k) modulo the polynomial, k = 0..63.
constexpr std::array<std::uint32_t, 64> make_powers() {
  std::array<std::uint32_t, 64> p{};
  p[0] = 1u << 30;  // x^1
  for (std::size_t k = 1; k < 64; ++k) p[k] = mult_mod(p[k - 1], p[k - 1]);
  return p;
}

constexpr std::array<std::uint32_t, 64> kPowers = make_powers();

#if ZEROFLAT_X86
__attribute__((target("pclmul,sse4.1"))) inline __m128i load(const unsigned char* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}

// lane * x^(distance) folded onto the next data.
__attribute__((target("pclmul,sse4.1"))) inline __m128i step(__m128i lane, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(lane, k, 0x00), _mm_clmulepi64_si128(lane, k, 0x11)),
                       next);
}

// Carry-less multiplication folds the input, 64 bytes a step in four 128-bit lanes, into 128
// bits, then 64, then 32 by a Barrett reduction. The constants are x^k mod P for the folding
// distances (bit-reflected) and P with its Barrett quotient, as published for CRC-32 with
// PCLMULQDQ. Takes and returns the CRC without its final inversion; n >= 64 and a multiple of 16.
__attribute__((target("pclmul,sse4.1"))) std::uint32_t fold(std::uint32_t c, const unsigned char* p,
                                                              std::uint64_t n) {
  // Each as its two 64-bit halves, the low one first.
  const __m128i fold4 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
  const __m128i fold1 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
  const __m128i to32 = _mm_set_epi64x(0, 0x163cd6124);
  const __m128i barrett = _mm_set_epi64x(0x1f7011641, 0x1db710641);  // mu, P
  __m128i lane[4];
  for (int i = 0; i < 4; ++i) lane[i] = load(p + 16 * i);
  lane[0] = _mm_xor_si128(lane[0], _mm_cvtsi32_si128(static_cast<int>(c)));
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    for (int i = 0; i < 4; ++i) lane[i] = step(lane[i], fold4, load(p + 16 * i));
  }
  __m128i x = lane[0];
  for (int i = 1; i < 4; ++i) x = step(x, fold1, lane[i]);
  for (; n >= 16; p += 16, n -= 16) x = step(x, fold1, load(p));
  // 128 bits to 64.
  const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
  x = _mm_xor_si128(_mm_srli_si128(x, 8), _mm_clmulepi64_si128(x, fold1, 0x10));
  x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, low32), to32, 0x00));
  // 64 bits to 32: Barrett.
  __m128i q = _mm_clmulepi64_si128(_mm_and_si128(x, low32), barrett, 0x10);
  q = _mm_clmulepi64_si128(_mm_and_si128(q, low32), barrett, 0x00);
  return static_cast<std::uint32_t>(_mm_extract_epi32(_mm_xor_si128(x, q), 1));
}

bool has_fold() noexcept {
  static const bool yes = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
    return (ecx & (1u << 1)) != 0 && (ecx & (1u << 19)) != 0;  // PCLMULQDQ, SSE4.1
  }();
  return yes;
}
#endif

}  // namespace

std::uint32_t crc32(std::uint32_t crc, const void* data, std::uint64_t num_bytes) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
#if ZEROFLAT_X86
  if (num_bytes >= 64 && has_fold()) {
    const std::uint64_t n = num_bytes & ~std::uint64_t{15};
    c = fold(c, p, n);
    p += n;
    num_bytes -= n;
  }
#endif
  while (num_bytes > 0 && (reinterpret_cast<std::uintptr_t>(p) & 7u) != 0) {
    c = kTables[0][(c ^ *p++) & 0xffu] ^ (c >> 8);
    --num_bytes;
  }
  while (num_bytes >= 8) {
    std::uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;
    c = kTables[7][v & 0xffu] ^ kTables[6][(v >> 8) & 0xffu] ^ kTables[5][(v >> 16) & 0xffu] ^
        kTables[4][(v >> 24) & 0xffu] ^ kTables[3][(v >> 32) & 0xffu] ^
        kTables[2][(v >> 40) & 0xffu] ^ kTables[1][(v >> 48) & 0xffu] ^ kTables[0][v >> 56];
    p += 8;
    num_bytes -= 8;
  }
  while (num_bytes-- > 0) c = kTables[0][(c ^ *p++) & 0xffu] ^ (c >> 8);
  return ~c;
}

std::uint32_t crc32_combine(std::uint32_t first, std::uint32_t second,
                            std::uint64_t second_bytes) noexcept {
  // first * x^(8 * second_bytes), plus second.
  std::uint32_t shift = 1u << 31;  // x^0
  std::uint64_t n = second_bytes;
  for (std::size_t k = 3; n != 0 && k < 64; ++k, n >>= 1) {
    if (n & 1u) shift = mult_mod(kPowers[k], shift);
  }
  return mult_mod(shift, first) ^ second;
}

}  // namespace zeroflat
