// The JSON document of a layout, as `zeroflat layout --json` prints it.
#include <nlohmann/json.hpp>

#include "zeroflat/layout.h"

namespace zeroflat {

std::string Layout::to_json(int indent) const {
  using nlohmann::ordered_json;
  ordered_json doc;
  doc["dp"] = options_.dp;
  doc["alignment"] = alignment_;
  doc["dtype"] = std::string(dtype_name(options_.dtype));
  doc["numel"] = numel_;
  doc["padding"] = padding();
  doc["flat_numel"] = flat_numel_;
  doc["flat_bytes"] = flat_bytes();
  doc["partition_numel"] = partition_numel_;
  doc["order"] = order_;
  doc["offsets"] = offsets_;
  ordered_json ranks = ordered_json::array();
  for (std::uint64_t r = 0; r < options_.dp; ++r) {
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
    ranks.push_back(std::move(j));
  }
  doc["ranks"] = std::move(ranks);
  return doc.dump(indent);
}

}  // namespace zeroflat
