// Strict JSON parsing for untrusted files.
#include "model/strict_json.h"

#include <set>
#include <vector>

#include "zeroflat/common.h"

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
  // Duplicate keys, in a SAX pass of its own: a parse callback would make nlohmann rescan each
  // object at its end, which is quadratic in the number of tensors.
  struct KeyCheck : nlohmann::json_sax<nlohmann::json> {
    std::vector<std::set<std::string>> keys;
    std::string duplicate;
    std::string error;
    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override {
      keys.emplace_back();
      return true;
    }
    bool key(string_t& k) override {
      if (!keys.back().insert(k).second) {
        duplicate = k;
        return false;
      }
      return true;
    }
    bool end_object() override {
      keys.pop_back();
      return true;
    }
    bool start_array(std::size_t) override { return true; }
    bool end_array() override { return true; }
    bool parse_error(std::size_t, const std::string&,
                     const nlohmann::detail::exception& e) override {
      error = e.what();
      return false;
    }
  } check;
  nlohmann::json::sax_parse(text.begin(), text.end(), &check);
  if (!check.duplicate.empty()) {
    throw InvalidArgument(source + ": key '" + printable(check.duplicate) +
                          "' appears twice in one object");
  }
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 3: ..." -> keep the tail.
    if (auto at = what.find("] "); at != std::string::npos) what = what.substr(at + 2);
    // The parser quotes the bytes it last read, which need not be text.
    throw InvalidArgument(source + ": not valid JSON: " + printable(what, 300));
  }
  return doc;
}

}  // namespace zeroflat::detail
