// The chunked XXH3 checksum (definition in common.h).
#include "zeroflat/common.h"

#include <xxhash.h>

#include <cstdio>
#include <vector>

namespace zeroflat {

std::uint64_t checksum_chunk(const void* data, std::uint64_t num_bytes) noexcept {
  return XXH3_64bits(data, num_bytes);
}

std::uint64_t checksum_combine(std::span<const std::uint64_t> chunk_digests,
                               std::uint64_t total_bytes) {
  std::vector<unsigned char> le((chunk_digests.size() + 1) * 8);
  auto put = [&](std::size_t slot, std::uint64_t v) {
    for (int i = 0; i < 8; ++i) le[slot * 8 + i] = static_cast<unsigned char>(v >> (8 * i));
  };
  put(0, total_bytes);
  for (std::size_t k = 0; k < chunk_digests.size(); ++k) put(k + 1, chunk_digests[k]);
  return XXH3_64bits(le.data(), le.size());
}

std::uint64_t checksum_serial(const void* data, std::uint64_t num_bytes) {
  std::vector<std::uint64_t> digests;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::uint64_t off = 0; off < num_bytes; off += kChecksumChunkBytes) {
    std::uint64_t n = num_bytes - off < kChecksumChunkBytes ? num_bytes - off : kChecksumChunkBytes;
    digests.push_back(checksum_chunk(p + off, n));
  }
  return checksum_combine(digests, num_bytes);
}

std::string checksum_hex(std::uint64_t checksum) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(checksum));
  return buf;
}

}  // namespace zeroflat
