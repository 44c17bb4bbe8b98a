// The DeepSpeed checkpoint builder's ZeRO-1 and ZeRO-2 checkpoints: each rank's fp32 partition of every optimizer group and its
// optimizer states, laid out as the saving release laid out the flat buffer (builder.h).
#include <algorithm>
#include <map>

#include "source/deepspeed/builder.h"
#include "zeroflat/layout.h"

namespace zeroflat::detail {

void Builder::zero12(std::uint32_t model, const std::vector<std::uint32_t>& optims) {
  const std::uint64_t world = optims.size();
  const TorchValue& ps = torch(model).at("param_shapes");
  if (!ps.is_sequence()) {
    throw fail(model, "param_shapes", "expected a list of groups, found " +
                                          std::string(torch_kind_name(ps.kind)));
  }
  const std::uint64_t num_groups = ps.items.size();
  // Per rank: one fp32 partition per group, and partition_count saying the world.
  for (std::uint32_t f : optims) {
    const auto& fp32 = torch(f).list_at("optimizer_state_dict/single_partition_of_fp32_groups");
    if (fp32.size() != num_groups) {
      throw fail(f, "optimizer_state_dict/single_partition_of_fp32_groups",
                 std::to_string(fp32.size()) + " partitions, but " + name(model) +
                     "'s param_shapes lists " + std::to_string(num_groups) + " groups");
    }
    const TorchValue& pc = torch(f).at("optimizer_state_dict/partition_count");
    std::vector<TorchValue> counts = pc.is_sequence() ? pc.items : std::vector<TorchValue>{pc};
    for (std::size_t g = 0; g < counts.size(); ++g) {
      const std::string entry = pc.is_sequence()
                                    ? "optimizer_state_dict/partition_count/" + std::to_string(g)
                                    : "optimizer_state_dict/partition_count";
      const std::uint64_t c = count(f, entry);
      if (c != world) throw world_mismatch(f, entry, c, optims);
    }
  }
  ck_.round_robin = config_flag("zero_optimization/round_robin_gradients");
  for (std::uint64_t g = 0; g < num_groups; ++g) {
    const std::string gs = std::to_string(g);
    std::vector<DeepSpeedParam> flat = shapes(model, "param_shapes/" + gs);
    const std::uint64_t n = flat.size();
    // Parameter alignment paddings (0.19.7+): after each parameter but the last.
    std::vector<std::uint64_t> align(n, 0);
    const std::string align_key = "optimizer_state_dict/param_alignment_paddings/" + gs;
    for (std::uint32_t f : optims) {
      const TorchValue* a = torch(f).find(align_key);
      if (a == nullptr) continue;
      const auto& items = torch(f).list_at(align_key);
      if (items.size() != n) {
        throw fail(f, align_key, std::to_string(items.size()) + " paddings for " +
                                     std::to_string(n) + " parameters");
      }
      for (std::uint64_t i = 0; i < n; ++i) {
        const std::uint64_t v = count(f, align_key + "/" + std::to_string(i));
        if (f != optims.front() && v != align[i]) {
          throw differ(optims.front(), f, align_key, std::to_string(align[i]), std::to_string(v));
        }
        align[i] = v;
        if (v != 0) ck_.parameter_alignment = true;
      }
    }
    if (config_flag("zero_optimization/parameter_alignment")) ck_.parameter_alignment = true;
    std::uint64_t at = 0;
    for (std::uint64_t i = 0; i < n; ++i) {
      flat[i].offset = at;
      flat[i].sub_group = g;
      if (__builtin_add_overflow(at, flat[i].numel, &at) ||
          __builtin_add_overflow(at, align[i], &at)) {
        throw fail(model, "param_shapes/" + gs, "the group's elements overflow 64 bits");
      }
    }
    const std::uint64_t data_end =
        n == 0 ? 0 : flat.back().offset + flat.back().numel;

    // Each rank's partition: the saved fp32 tensor plus its padding, the same size on all.
    DeepSpeedSubGroup sg;
    sg.group = g;
    sg.num_params = n;
    std::vector<std::uint64_t> pads;
    std::uint64_t pad_sum = 0;
    for (std::uint32_t f : optims) {
      DeepSpeedPartition part;
      part.fp32 = tensor(f, "optimizer_state_dict/single_partition_of_fp32_groups/" + gs);
      part.padding = count(f, "optimizer_state_dict/group_paddings/" + gs);
      pad_sum += part.padding;
      const TorchValue& base = torch(f).at("optimizer_state_dict/base_optimizer_state");
      if (base.kind == TorchKind::kDict) {
        // The torch optimizer's own state_dict: one parameter (the partition) per group.
        part.states = states_at(f, "optimizer_state_dict/base_optimizer_state/state/" + gs);
      } else if (base.is_sequence()) {
        // elastic_checkpoint: a list of per-group states, padding removed.
        part.states = states_at(f, "optimizer_state_dict/base_optimizer_state/" + gs);
      } else {
        throw fail(f, "optimizer_state_dict/base_optimizer_state",
                   "expected the optimizer's state (a dict, or a list per group), found " +
                       std::string(torch_kind_name(base.kind)));
      }
      sg.ranks.push_back(std::move(part));
    }
    // The partition size: saved without its padding (DeepSpeed's
    // _get_groups_without_padding), or with it; the paddings add up to the flat buffer's.
    auto fits = [&](bool lean) -> std::optional<std::uint64_t> {
      std::optional<std::uint64_t> size;
      for (const DeepSpeedPartition& p : sg.ranks) {
        const std::uint64_t s = p.fp32.numel + (lean ? p.padding : 0);
        if (size && *size != s) return std::nullopt;
        size = s;
      }
      std::uint64_t total = 0;
      if (!size || __builtin_mul_overflow(*size, world, &total) || total < data_end ||
          total - data_end != pad_sum) {
        return std::nullopt;
      }
      return size;
    };
    std::optional<std::uint64_t> part_numel = fits(true);
    if (!part_numel) part_numel = fits(false);
    if (!part_numel) {
      std::string sizes;
      for (std::size_t r = 0; r < sg.ranks.size(); ++r) {
        sizes += (r ? ", " : "") + std::to_string(sg.ranks[r].fp32.numel) + " + " +
                 std::to_string(sg.ranks[r].padding);
      }
      throw fail(optims.front(), "optimizer_state_dict/single_partition_of_fp32_groups/" + gs,
                 "group " + gs + "'s partitions (elements + padding per rank: " + sizes +
                     ") do not hold its " + std::to_string(data_end) + " elements of " +
                     std::to_string(n) + " parameters (" + name(model) +
                     "'s param_shapes) over " + std::to_string(world) + " ranks");
    }
    sg.partition_numel = *part_numel;
    const std::uint64_t P = sg.partition_numel;
    // param_slice_mappings: each parameter's fragment (numel, start) in each rank's
    // partition, as the flat layout above places it. Not with round_robin_gradients: DeepSpeed
    // (0.14 to 0.19.8) maps each parameter's fragment as if its group were flattened in group
    // order, while the buffer holds them in round-robin order, so its mappings (and the
    // universal checkpoints made from them) misplace the parameters; the data lies where
    // param_shapes and the paddings say.
    for (std::uint64_t r = 0; r < world && !ck_.round_robin; ++r) {
      const std::uint32_t f = optims[r];
      const std::string key = "optimizer_state_dict/param_slice_mappings/" + gs;
      const TorchValue* m = torch(f).find(key);
      if (m == nullptr) continue;  // BF16_Optimizer of some releases: none
      if (m->kind != TorchKind::kDict) {
        throw fail(f, key, "expected a dict of name -> fragment_address, found " +
                               std::string(torch_kind_name(m->kind)));
      }
      std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> have;
      for (const auto& [k, v] : m->entries) {
        if (k.kind != TorchKind::kString) continue;
        const std::string entry = key + "/" + torch_path_segment(k);
        have[k.text] = {count(f, entry + "/numel"), count(f, entry + "/start")};
      }
      const std::uint64_t lo = r * P, hi = lo + P;
      for (const DeepSpeedParam& p : flat) {
        const std::uint64_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
        auto it = have.find(p.name);
        if (b >= e) {
          if (it != have.end() && it->second.first != 0) {
            throw fail(f, key + "/" + torch_path_segment_of(p.name),
                       "a fragment of " + std::to_string(it->second.first) +
                           " elements, but the parameter lies outside rank " +
                           std::to_string(r) + "'s partition [" + std::to_string(lo) + ", " +
                           std::to_string(hi) + ") of the flat buffer");
          }
          continue;
        }
        if (it == have.end()) {
          throw fail(f, key, "no fragment of '" + printable(p.name) + "', whose elements [" +
                                 std::to_string(b) + ", " + std::to_string(e) +
                                 ") of the flat buffer lie in rank " + std::to_string(r) +
                                 "'s partition");
        }
        if (it->second.first != e - b || it->second.second != b - lo) {
          throw fail(f, key + "/" + torch_path_segment_of(p.name),
                     "fragment (numel " + std::to_string(it->second.first) + ", start " +
                         std::to_string(it->second.second) + "), but param_shapes and the "
                         "paddings place it at (numel " + std::to_string(e - b) + ", start " +
                         std::to_string(b - lo) + ")");
        }
        have.erase(it);
      }
      for (const auto& [pn, frag] : have) {
        if (frag.first != 0) {
          throw fail(f, key + "/" + torch_path_segment_of(pn),
                     "a fragment of a parameter that is not in group " + gs +
                         "'s param_shapes");
        }
      }
    }
    // Group order: round-robin stored bucket 0's parameters first, then bucket 1's, ...
    DeepSpeedGroup group;
    group.params.resize(n);
    std::vector<std::uint64_t> order;
    if (ck_.round_robin) {
      for (std::uint64_t b = 0; b < world; ++b) {
        for (std::uint64_t i = b; i < n; i += world) order.push_back(i);
      }
    } else {
      for (std::uint64_t i = 0; i < n; ++i) order.push_back(i);
    }
    for (std::uint64_t k = 0; k < n; ++k) {
      group.numel += flat[k].numel;
      group.params[order[k]] = std::move(flat[k]);
    }
    group.flat_numel = P * world;
    group.sub_groups.push_back(ck_.sub_groups.size());
    ck_.sub_groups.push_back(std::move(sg));
    ck_.groups.push_back(std::move(group));
  }
}

}  // namespace zeroflat::detail
