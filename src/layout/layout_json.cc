// The JSON document of a layout, as `zeroflat layout --json` prints it.
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "zeroflat/error.h"
#include "zeroflat/layout.h"

namespace zeroflat {

void Layout::write_json(std::ostream& out, std::optional<std::uint64_t> only_rank) const {
  using nlohmann::ordered_json;
  if (only_rank && *only_rank >= options_.dp) {
    throw InvalidArgument("rank " + std::to_string(*only_rank) + " is outside [0, " +
                          std::to_string(options_.dp) + ")");
  }
  const std::uint64_t per_rank = numels_.size() + 1;
  if (!only_rank && options_.dp > kMaxJsonEntries / per_rank) {
    throw InvalidArgument("the document of all " + std::to_string(options_.dp) +
                          " ranks would list more than " + std::to_string(kMaxJsonEntries) +
                          " parameter entries (every rank lists every parameter); ask for one "
                          "rank's");
  }
  ordered_json head;
  head["dp"] = options_.dp;
  head["alignment"] = alignment_;
  head["dtype"] = std::string(dtype_name(options_.dtype));
  head["numel"] = numel_;
  head["padding"] = padding();
  head["flat_numel"] = flat_numel_;
  head["flat_bytes"] = flat_bytes();
  head["partition_numel"] = partition_numel_;
  head["order"] = order_;
  head["offsets"] = offsets_;
  std::string text = head.dump();
  text.pop_back();  // the closing brace: the ranks follow
  out << text << ",\"ranks\":[";
  const std::uint64_t first = only_rank.value_or(0);
  const std::uint64_t last = only_rank ? *only_rank + 1 : options_.dp;
  for (std::uint64_t r = first; r < last; ++r) {
    RankLayout rl = rank(r);
    ordered_json j;
    j["rank"] = rl.rank;
    j["start"] = rl.start;
    j["end"] = rl.end;
    j["padding"] = rl.padding;
    j["params_in_partition"] = rl.params_in_partition;
    j["params_not_in_partition"] = rl.params_not_in_partition;
    j["first_offset"] = rl.first_offset;
    ordered_json frags = ordered_json::array();
    for (const Fragment& f : rl.fragments) {
      frags.push_back(ordered_json{{"param", f.param},
                                   {"partition_offset", f.partition_offset},
                                   {"param_offset", f.param_offset},
                                   {"numel", f.numel}});
    }
    j["fragments"] = std::move(frags);
    out << (r > first ? "," : "") << j.dump();
  }
  out << "]}";
}

std::string Layout::to_json() const {
  std::ostringstream out;
  write_json(out);
  return out.str();
}

}  // namespace zeroflat
