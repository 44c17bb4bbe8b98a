// CRC-32 of the zip format (save.h): reflected polynomial 0xEDB88320, eight bytes a step from
// eight tables; two ranges' CRCs combined by multiplying in GF(2) modulo the polynomial.
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>

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

}  // namespace

std::uint32_t crc32(std::uint32_t crc, const void* data, std::uint64_t num_bytes) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = ~crc;
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
