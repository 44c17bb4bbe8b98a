// Strict JSON parsing for untrusted files.
#include "model/strict_json.h"

#include <set>
#include <vector>

#include "zeroflat/error.h"

namespace zeroflat::detail {

nlohmann::json parse_strict_json(std::string_view text, const std::string& source, int max_depth) {
  // Depth first, cheaply, so that no parser ever recurses deeply on hostile input.
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) {
        throw InvalidArgument(source + ": JSON nested deeper than " + std::to_string(max_depth) +
                              " levels");
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  auto callback = [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      keys.emplace_back();
    } else if (event == E::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == E::key && !keys.empty() && duplicate.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second) duplicate = k;
    }
    return true;
  };
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 3: ..." -> keep the tail.
    if (auto at = what.find("] "); at != std::string::npos) what = what.substr(at + 2);
    throw InvalidArgument(source + ": not valid JSON: " + what);
  }
  if (!duplicate.empty()) {
    throw InvalidArgument(source + ": key '" + duplicate + "' appears twice in one object");
  }
  return doc;
}

}  // namespace zeroflat::detail
