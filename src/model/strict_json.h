// Parsing untrusted JSON: bounded size and depth, no duplicate keys.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace zeroflat::detail {

// Parses text as JSON. Throws InvalidArgument ("<source>: ...") for malformed JSON, nesting
// deeper than max_depth, or an object with a key given twice.
nlohmann::json parse_strict_json(std::string_view text, const std::string& source,
                                 int max_depth = 32);

}  // namespace zeroflat::detail
