// Small text helpers shared by error messages.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace zeroflat::detail {

// "a, b, c".
inline std::string join(const std::vector<std::string>& items, std::string_view sep = ", ") {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out += sep;
    out += item;
  }
  return out;
}

// Text from an untrusted file, safe to print: printable ASCII only (others become '?'), at most
// 80 characters, "..." when cut.
inline std::string printable(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 80)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  if (s.size() > 80) out += "...";
  return out;
}

}  // namespace zeroflat::detail
