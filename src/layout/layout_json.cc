// The JSON documents of a layout, as `zeroflat layout --json` prints them: for a group as given,
// or for a group as a DeepSpeed release lays it out (input indices, left-out parameters).
#include <functional>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "zeroflat/common.h"
#include "zeroflat/layout.h"

namespace zeroflat {
namespace {

using nlohmann::ordered_json;

// How a document names things: layout indices as they are, or mapped to the caller's inputs.
struct Naming {
  const std::vector<std::uint64_t>* kept = nullptr;  // layout index -> input index
  std::uint64_t num_inputs = 0;
  std::function<std::uint64_t(std::uint64_t)> padding;  // a rank's padding, if not the layout's
  ordered_json extra;                                    // fields after the head
};

std::uint64_t name(const Naming& n, std::uint64_t i) {
  return n.kept ? (*n.kept)[i] : i;
}

std::vector<std::uint64_t> names(const Naming& n, const std::vector<std::uint64_t>& v) {
  std::vector<std::uint64_t> out;
  out.reserve(v.size());
  for (std::uint64_t i : v) out.push_back(name(n, i));
  return out;
}

void write_document(const Layout& l, std::ostream& out, std::optional<std::uint64_t> only_rank,
                    const Naming& naming) {
  const LayoutOptions& o = l.options();
  if (only_rank && *only_rank >= o.dp) {
    throw InvalidArgument("rank " + std::to_string(*only_rank) + " is outside [0, " +
                          std::to_string(o.dp) + ")");
  }
  const std::uint64_t per_rank = l.num_params() + 1;
  if (!only_rank && o.dp > kMaxJsonEntries / per_rank) {
    throw InvalidArgument("the document of all " + std::to_string(o.dp) +
                          " ranks would list more than " + std::to_string(kMaxJsonEntries) +
                          " parameter entries (every rank lists every parameter); ask for one "
                          "rank's");
  }
  ordered_json head;
  head["dp"] = o.dp;
  head["alignment"] = l.alignment();
  head["dtype"] = std::string(dtype_name(o.dtype));
  head["numel"] = l.numel();
  head["padding"] = l.padding();
  head["flat_numel"] = l.flat_numel();
  head["flat_bytes"] = l.flat_bytes();
  head["partition_numel"] = l.partition_numel();
  head["order"] = names(naming, l.order());
  if (naming.kept) {
    ordered_json offsets = ordered_json::array();
    for (std::uint64_t i = 0; i < naming.num_inputs; ++i) offsets.push_back(nullptr);
    for (std::uint64_t k = 0; k < naming.kept->size(); ++k) {
      offsets[(*naming.kept)[k]] = l.offsets()[k];
    }
    head["offsets"] = std::move(offsets);
  } else {
    head["offsets"] = l.offsets();
  }
  for (const auto& [k, v] : naming.extra.items()) head[k] = v;
  std::string text = head.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  text.pop_back();  // the closing brace: the ranks follow
  out << text << ",\"ranks\":[";
  const std::uint64_t first = only_rank.value_or(0);
  const std::uint64_t last = only_rank ? *only_rank + 1 : o.dp;
  for (std::uint64_t r = first; r < last; ++r) {
    RankLayout rl = l.rank(r);
    ordered_json j;
    j["rank"] = rl.rank;
    j["start"] = rl.start;
    j["end"] = rl.end;
    j["padding"] = naming.padding ? naming.padding(r) : rl.padding;
    j["params_in_partition"] = names(naming, rl.params_in_partition);
    j["params_not_in_partition"] = names(naming, rl.params_not_in_partition);
    j["first_offset"] = rl.first_offset;
    ordered_json frags = ordered_json::array();
    for (const Fragment& f : rl.fragments) {
      frags.push_back(ordered_json{{"param", name(naming, f.param)},
                                   {"partition_offset", f.partition_offset},
                                   {"param_offset", f.param_offset},
                                   {"numel", f.numel}});
    }
    j["fragments"] = std::move(frags);
    out << (r > first ? "," : "") << j.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  }
  out << "]}";
}

}  // namespace

void Layout::write_json(std::ostream& out, std::optional<std::uint64_t> only_rank) const {
  write_document(*this, out, only_rank, Naming{});
}

std::string Layout::to_json() const {
  std::ostringstream out;
  write_json(out);
  return out.str();
}

void ReleaseLayout::write_json(std::ostream& out, std::optional<std::uint64_t> only_rank) const {
  Naming naming;
  naming.kept = &kept;
  naming.num_inputs = num_inputs;
  naming.padding = [this](std::uint64_t r) { return rank_padding(r); };
  naming.extra["deepspeed"] = {{"release", rules.release},
                               {"rules", rules.rules},
                               {"tested", rules.tested}};
  ordered_json left = ordered_json::array();
  for (const auto& [i, why] : left_out) {
    left.push_back({{"param", i}, {"why", std::string(left_out_name(why))}});
  }
  naming.extra["left_out"] = std::move(left);
  write_document(layout, out, only_rank, naming);
}

}  // namespace zeroflat
