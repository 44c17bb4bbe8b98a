// Parsing and printing of byte sizes and counts.
#include "zeroflat/common.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

#include "zeroflat/common.h"

namespace zeroflat {
namespace {

std::string lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::uint64_t parse_u64(std::string_view text, std::string_view what) {
  auto fail = [&](const char* why) {
    return InvalidArgument(std::string(what) + ": '" + printable(text) + "' is " + why);
  };
  if (text.empty()) throw fail("empty; expected a non-negative integer");
  std::uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') throw fail("not a non-negative integer");
    if (__builtin_mul_overflow(value, std::uint64_t{10}, &value) ||
        __builtin_add_overflow(value, static_cast<std::uint64_t>(c - '0'), &value)) {
      throw fail("too large: it does not fit in 64 bits");
    }
  }
  return value;
}

std::uint64_t parse_size(std::string_view text, std::string_view what) {
  try {
    return parse_size(text);
  } catch (const InvalidArgument& e) {
    std::string message(what);
    message.append(": ").append(e.what());
    throw InvalidArgument(message);
  }
}

std::uint64_t parse_size(std::string_view text) {
  auto fail = [&](const std::string& why) {
    return InvalidArgument("size '" + printable(text) + "': " + why +
                           " (expected bytes or a number with a unit such as 512MiB, 80GiB, "
                           "1.5GB)");
  };
  std::size_t end = 0;
  while (end < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[end])) != 0 || text[end] == '.')) {
    ++end;
  }
  std::string_view number = text.substr(0, end);
  std::string unit = lower(text.substr(end));
  if (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  if (number.empty() || number == ".") throw fail("no number");
  if (number.find('.') != number.rfind('.')) throw fail("malformed number");

  struct Unit {
    const char* name;
    std::uint64_t factor;
  };
  static constexpr Unit kUnits[] = {
      {"", 1},
      {"b", 1},
      {"k", 1000},
      {"kb", 1000},
      {"m", 1000 * 1000},
      {"mb", 1000 * 1000},
      {"g", 1000ull * 1000 * 1000},
      {"gb", 1000ull * 1000 * 1000},
      {"t", 1000ull * 1000 * 1000 * 1000},
      {"tb", 1000ull * 1000 * 1000 * 1000},
      {"p", 1000ull * 1000 * 1000 * 1000 * 1000},
      {"pb", 1000ull * 1000 * 1000 * 1000 * 1000},
      {"e", 1000ull * 1000 * 1000 * 1000 * 1000 * 1000},
      {"eb", 1000ull * 1000 * 1000 * 1000 * 1000 * 1000},
      {"kib", 1ull << 10},
      {"mib", 1ull << 20},
      {"gib", 1ull << 30},
      {"tib", 1ull << 40},
      {"pib", 1ull << 50},
      {"eib", 1ull << 60},
  };
  std::uint64_t factor = 0;
  for (const Unit& u : kUnits) {
    if (unit == u.name) factor = u.factor;
  }
  if (factor == 0) throw fail("unknown unit '" + unit + "'");

  std::size_t dot = number.find('.');
  if (dot == std::string_view::npos) {
    std::uint64_t value = parse_u64(number, "size");
    std::uint64_t bytes = 0;
    if (__builtin_mul_overflow(value, factor, &bytes)) throw fail("does not fit in 64 bits");
    return bytes;
  }
  // Fractions: exact integer arithmetic on the digits, so "1.5GB" is exactly 1500000000.
  std::string_view whole = number.substr(0, dot);
  std::string_view frac = number.substr(dot + 1);
  if (frac.size() > 18) throw fail("too many decimals");
  std::uint64_t w = whole.empty() ? 0 : parse_u64(whole, "size");
  std::uint64_t f = frac.empty() ? 0 : parse_u64(frac, "size");
  std::uint64_t scale = 1;
  for (std::size_t i = 0; i < frac.size(); ++i) scale *= 10;
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(w, factor, &bytes)) throw fail("does not fit in 64 bits");
  __extension__ using U128 = unsigned __int128;
  U128 part = static_cast<U128>(f) * factor;
  if (part % scale != 0) throw fail("not a whole number of bytes");
  part /= scale;
  if (part > UINT64_MAX - bytes) throw fail("does not fit in 64 bits");
  return bytes + static_cast<std::uint64_t>(part);
}

namespace {

std::string format_scaled(std::uint64_t num_bytes, double base, const char* const* units) {
  double value = static_cast<double>(num_bytes);
  int u = 0;
  while (value >= base && units[u + 1] != nullptr) {
    value /= base;
    ++u;
  }
  char buf[64];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu %s", static_cast<unsigned long long>(num_bytes), units[0]);
  } else {
    int decimals = value < 10 ? 2 : (value < 100 ? 1 : 0);
    std::snprintf(buf, sizeof buf, "%.*f %s", decimals, value, units[u]);
  }
  return buf;
}

}  // namespace

std::string format_bytes(std::uint64_t num_bytes) {
  static const char* const kUnits[] = {"B", "kB", "MB", "GB", "TB", "PB", "EB", nullptr};
  return format_scaled(num_bytes, 1000.0, kUnits);
}

std::string format_bytes_binary(std::uint64_t num_bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", nullptr};
  return format_scaled(num_bytes, 1024.0, kUnits);
}

std::string format_count(std::uint64_t count) {
  std::string digits = std::to_string(count);
  std::string out;
  int n = static_cast<int>(digits.size());
  for (int i = 0; i < n; ++i) {
    if (i > 0 && (n - i) % 3 == 0) out += ',';
    out += digits[static_cast<std::size_t>(i)];
  }
  return out;
}

std::string format_seconds(double s) {
  char buf[32];
  if (s < 1e-3) {
    std::snprintf(buf, sizeof buf, "%.0f us", s * 1e6);
  } else if (s < 1) {
    std::snprintf(buf, sizeof buf, "%.1f ms", s * 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f s", s);
  }
  return buf;
}

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out += separator;
    out += item;
  }
  return out;
}

std::string printable(std::string_view text, std::size_t max_chars) {
  std::string out;
  for (char c : text.substr(0, max_chars)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (text.size() > max_chars) out += "...";
  return out;
}

}  // namespace zeroflat
