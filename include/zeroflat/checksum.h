// The zeroflat checksum: a 64-bit hash of a byte range that is independent of thread count and
// device.
//
// Definition: split the bytes into chunks of kChecksumChunkBytes (the last one shorter), hash
// each chunk with XXH3-64 (seed 0), then hash with XXH3-64 (seed 0) the little-endian 8-byte
// total length followed by the little-endian chunk digests. Chunks are independent, so any number
// of threads (or a GPU) computes the same value.
#pragma once

#include <cstdint>
#include <span>
#include <string>

namespace zeroflat {

inline constexpr std::uint64_t kChecksumChunkBytes = std::uint64_t{1} << 22;  // 4 MiB

// XXH3-64 of one chunk.
std::uint64_t checksum_chunk(const void* data, std::uint64_t num_bytes) noexcept;

// Combines the chunk digests of a range of total_bytes bytes into its checksum.
std::uint64_t checksum_combine(std::span<const std::uint64_t> chunk_digests,
                               std::uint64_t total_bytes);

// The checksum of a host range, computed on the calling thread.
std::uint64_t checksum_serial(const void* data, std::uint64_t num_bytes);

// 16 lowercase hex digits.
std::string checksum_hex(std::uint64_t checksum);

}  // namespace zeroflat
