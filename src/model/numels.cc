// Lists of element counts, as `zeroflat layout --numels` takes them: "5,7,3" or "@FILE".
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/files.h"
#include "model/strict_json.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

// "5,7,3", "5 7 3", one per line: commas and white space separate items; an empty item between
// commas is an error. Fast: a million items parse in a few milliseconds.
std::vector<std::uint64_t> parse_list(std::string_view text, const std::string& source) {
  std::vector<std::uint64_t> out;
  std::size_t line = 1, token_start = 0, token_line = 1;
  bool in_token = false, item_since_comma = false, saw_comma = false;
  auto where = [&](std::size_t index, std::size_t at_line) {
    return "element count #" + std::to_string(index) + " of " + source +
           (source == "--numels" ? "" : " (line " + std::to_string(at_line) + ")");
  };
  auto flush = [&](std::size_t end) {
    if (!in_token) return;
    in_token = false;
    item_since_comma = true;
    const std::string_view tok = text.substr(token_start, end - token_start);
    std::uint64_t v = 0;
    bool ok = !tok.empty();
    for (char c : tok) {
      if (c < '0' || c > '9' || __builtin_mul_overflow(v, std::uint64_t{10}, &v) ||
          __builtin_add_overflow(v, static_cast<std::uint64_t>(c - '0'), &v)) {
        ok = false;
        break;
      }
    }
    if (!ok) (void)parse_u64(tok, where(out.size() + 1, token_line));  // throws with the reason
    if (out.size() == kMaxNumels) {
      throw InvalidArgument(source + " holds more than " + format_count(kMaxNumels) +
                            " element counts");
    }
    out.push_back(v);
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool sep = c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r';
    if (!sep) {
      if (!in_token) {
        in_token = true;
        token_start = i;
        token_line = line;
      }
      continue;
    }
    flush(i);
    if (c == ',') {
      if (!item_since_comma) {
        throw InvalidArgument(where(out.size() + 1, line) +
                              " is empty: two commas, or a comma first, with nothing between");
      }
      item_since_comma = false;
      saw_comma = true;
    }
    if (c == '\n') ++line;
  }
  flush(text.size());
  if (saw_comma && !item_since_comma) {
    throw InvalidArgument(where(out.size() + 1, line) + " is empty: the list ends with a comma");
  }
  return out;
}

std::string read_numels_file(const std::string& path) {
  std::string content = detail::read_small_file(path, kMaxNumelsFileBytes, "a list of element counts");
  if (content.rfind("\xEF\xBB\xBF", 0) == 0) content.erase(0, 3);  // a UTF-8 byte order mark
  return content;
}

}  // namespace

std::vector<std::uint64_t> parse_numels(std::string_view text) {
  if (text.empty() || text.find_first_not_of(" \t\n") == std::string::npos) {
    throw InvalidArgument("--numels is empty: expected element counts such as 5,7,3 or @FILE");
  }
  if (text[0] != '@') {
    std::vector<std::uint64_t> out = parse_list(text, "--numels");
    if (out.empty()) {
      throw InvalidArgument("--numels is empty: expected element counts such as 5,7,3 or @FILE");
    }
    return out;
  }
  const std::string path(text.substr(1));
  // Appended rather than "'" + std::string&&: GCC 12 warns (-Wrestrict) on that operator+ when
  // it inlines it, a false positive of that release.
  std::string shown = "'";
  shown.append(printable(path, 200)).append("'");
  return parse_numels_file_text(read_numels_file(path), shown);
}

std::vector<std::uint64_t> parse_numels_file_text(std::string_view content,
                                                  const std::string& shown) {
  const std::size_t first = content.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) throw InvalidArgument(shown + " holds no element counts");
  if (content[first] != '[') {
    std::vector<std::uint64_t> out = parse_list(content, shown);
    if (out.empty()) throw InvalidArgument(shown + " holds no element counts");
    return out;
  }
  // A flat JSON list: anything nested is refused before a parser recurses into it.
  const nlohmann::json doc = detail::parse_strict_json(content, shown, 1);
  if (!doc.is_array()) throw InvalidArgument(shown + " is not a JSON list");
  if (doc.size() > kMaxNumels) {
    throw InvalidArgument(shown + " holds more than " + format_count(kMaxNumels) +
                          " element counts");
  }
  std::vector<std::uint64_t> out;
  out.reserve(doc.size());
  for (std::size_t i = 0; i < doc.size(); ++i) {
    const nlohmann::json& v = doc[i];
    if (v.is_number_unsigned()) {
      out.push_back(v.get<std::uint64_t>());
    } else if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
      out.push_back(static_cast<std::uint64_t>(v.get<std::int64_t>()));
    } else if (v.is_number_float() && v.get<double>() >= 18446744073709551615.0) {
      throw InvalidArgument(shown + ": item " + std::to_string(i) + " (" + v.dump() +
                            ") does not fit in 64 bits");
    } else {
      throw InvalidArgument(shown + ": item " + std::to_string(i) + " (" +
                            printable(v.dump(), 40) + ") is not a non-negative integer");
    }
  }
  if (out.empty()) throw InvalidArgument(shown + " holds an empty list");
  return out;
}

}  // namespace zeroflat
