// Parsing and printing of sizes, counts and durations as the command line accepts and shows
// them, and text for messages: lists, and names from untrusted files made safe to print.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace zeroflat {

// Plain bytes ("1048576") or a number with a unit: B, KB/MB/GB/TB/PB/EB (powers of 1000),
// KiB/MiB/GiB/TiB/PiB/EiB (powers of 1024), case-insensitive (every unit format_bytes prints);
// fractions allowed ("1.5GB"). The result must be a whole number of bytes that fits in 64 bits.
// Throws InvalidArgument naming the text.
std::uint64_t parse_size(std::string_view text);
// The same, the error also naming what the size is for (an option: "--margin").
std::uint64_t parse_size(std::string_view text, std::string_view what);

// A non-negative decimal integer that fits in 64 bits; what names the value in the error.
std::uint64_t parse_u64(std::string_view text, std::string_view what);

// "1.43 GB" (powers of 1000, three significant digits) and "1.33 GiB" (powers of 1024).
std::string format_bytes(std::uint64_t num_bytes);
std::string format_bytes_binary(std::uint64_t num_bytes);

// "20,562,192,384".
std::string format_count(std::uint64_t count);

// "50 us", "3.1 ms", "70.83 s": whole microseconds below 1 ms, tenths of a millisecond below
// 1 s, hundredths of a second above.
std::string format_seconds(double seconds);

// "a, b, c".
std::string join(const std::vector<std::string>& items, std::string_view separator = ", ");

// Text from an untrusted source, safe to print on a terminal or in a message: printable ASCII
// only (every other byte becomes '?'), at most max_chars characters, then "...".
std::string printable(std::string_view text, std::size_t max_chars = 80);

}  // namespace zeroflat
