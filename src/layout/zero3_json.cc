// The JSON document of a ZeRO-3 layout, as `zeroflat layout --stage 3 --json` prints it.
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>

#include "zeroflat/common.h"
#include "zeroflat/layout.h"

namespace zeroflat {

void Zero3Layout::write_json(std::ostream& out, std::optional<std::uint64_t> only_rank) const {
  using nlohmann::ordered_json;
  const std::uint64_t w = options_.world;
  if (only_rank && *only_rank >= w) {
    throw InvalidArgument("rank " + std::to_string(*only_rank) + " is outside [0, " +
                          std::to_string(w) + ")");
  }
  const std::uint64_t per_rank = num_params() + 1;
  if (!only_rank && w > kMaxJsonEntries / per_rank) {
    throw InvalidArgument("the document of all " + std::to_string(w) +
                          " ranks would list more than " + std::to_string(kMaxJsonEntries) +
                          " paddings (every rank lists every parameter's); ask for one rank's");
  }
  ordered_json head;
  head["stage"] = 3;
  head["world"] = w;
  head["sub_group_size"] = options_.sub_group_size;
  head["dtype"] = std::string(dtype_name(options_.dtype));
  head["numel"] = numel_;
  head["buffer_numel"] = buffer_numel_;
  head["buffer_bytes"] = buffer_bytes();
  ordered_json params = ordered_json::array();
  for (std::uint64_t i = 0; i < num_params(); ++i) {
    params.push_back(ordered_json{{"group", group_of_[i]},
                                  {"numel", numels_[i]},
                                  {"partition_numel", partition_[i]},
                                  {"padding", padding(i)},
                                  {"offset", offsets_[i]}});
  }
  head["params"] = std::move(params);
  ordered_json subs = ordered_json::array();
  for (const Zero3SubGroup& s : sub_groups_) {
    subs.push_back(ordered_json{{"group", s.group},
                                {"params", {s.first_param, s.num_params}},
                                {"offset", s.offset},
                                {"numel", s.numel}});
  }
  head["sub_groups"] = std::move(subs);
  std::string text = head.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  text.pop_back();  // the closing brace: the ranks follow
  out << text << ",\"ranks\":[";
  const std::uint64_t first = only_rank.value_or(0);
  const std::uint64_t last = only_rank ? *only_rank + 1 : w;
  for (std::uint64_t r = first; r < last; ++r) {
    const std::uint64_t data = data_numel(r);
    ordered_json j;
    j["rank"] = r;
    j["data_numel"] = data;
    j["padding"] = buffer_numel_ - data;
    j["groups_padding"] = groups_padding(r);
    out << (r > first ? "," : "") << j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  }
  out << "]}";
}

}  // namespace zeroflat
