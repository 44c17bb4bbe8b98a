// Parsing and printing of sizes and counts, as the command line accepts them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace zeroflat {

// Plain bytes ("1048576") or a number with a unit: B, KB/MB/GB/TB (powers of 1000),
// KiB/MiB/GiB/TiB (powers of 1024), case-insensitive; fractions allowed ("1.5GB"). The result
// must be a whole number of bytes that fits in 64 bits. Throws InvalidArgument naming the text.
std::uint64_t parse_size(std::string_view text);

// A non-negative decimal integer that fits in 64 bits; what names the value in the error.
std::uint64_t parse_u64(std::string_view text, std::string_view what);

// "1.43 GB" (powers of 1000, three significant digits) and "1.33 GiB" (powers of 1024).
std::string format_bytes(std::uint64_t num_bytes);
std::string format_bytes_binary(std::uint64_t num_bytes);

// "20,562,192,384".
std::string format_count(std::uint64_t count);

}  // namespace zeroflat
