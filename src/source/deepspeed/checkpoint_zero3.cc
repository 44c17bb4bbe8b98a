// The DeepSpeed checkpoint builder's ZeRO-3 checkpoints: each rank's partitions of every parameter, per sub-group, and the
// frozen parameters' fragments (builder.h).
#include <algorithm>
#include <map>

#include "source/deepspeed/builder.h"
#include "zeroflat/layout.h"

namespace zeroflat::detail {

void Builder::zero3(const std::vector<std::uint32_t>& models, const std::vector<std::uint32_t>& optims) {
  const std::uint64_t world = optims.size();
  const std::uint32_t m0 = models.front();
  // param_shapes: one dict per sub-group, the same in every rank's file.
  const auto& ps = torch(m0).list_at("param_shapes");
  for (std::uint32_t f : models) {
    if (!same_value(torch(f).at("param_shapes"), torch(m0).at("param_shapes"))) {
      throw differ(m0, f, "param_shapes", "one set of parameters", "another");
    }
    for (const char* key : {"global_steps", "dp_world_size"}) {
      const TorchValue* a = torch(m0).find(key);
      const TorchValue* b = torch(f).find(key);
      if (a && b && !same_value(*a, *b)) {
        throw differ(m0, f, key, std::to_string(a->integer), std::to_string(b->integer));
      }
    }
  }
  const std::uint64_t num_sub = ps.size();
  for (std::uint32_t f : optims) {
    const std::uint64_t c = count(f, "optimizer_state_dict/partition_count");
    if (c != world) throw world_mismatch(f, "optimizer_state_dict/partition_count", c, optims);
    const auto& flat = torch(f).list_at("optimizer_state_dict/fp32_flat_groups");
    if (flat.size() != num_sub) {
      throw fail(f, "optimizer_state_dict/fp32_flat_groups",
                 std::to_string(flat.size()) + " sub-groups, but " + name(m0) +
                     "'s param_shapes lists " + std::to_string(num_sub));
    }
  }
  // Sub-group -> optimizer group: the torch optimizer's param_groups list, per group, the
  // indices of its sub-groups' fp32 partitions.
  const std::string pg_key = "optimizer_state_dict/optimizer_state_dict/param_groups";
  const std::uint32_t o0 = optims.front();
  const auto& pgs = torch(o0).list_at(pg_key);
  std::vector<std::uint64_t> group_of(num_sub, UINT64_MAX);
  std::uint64_t next = 0;
  for (std::uint64_t g = 0; g < pgs.size(); ++g) {
    const std::string key = pg_key + "/" + std::to_string(g) + "/params";
    const auto& idx = torch(o0).list_at(key);
    for (std::uint64_t k = 0; k < idx.size(); ++k) {
      const std::uint64_t s = count(o0, key + "/" + std::to_string(k));
      if (s != next || s >= num_sub) {
        throw fail(o0, key, "sub-group " + std::to_string(s) + " where " +
                                std::to_string(next) + " was expected (" +
                                std::to_string(num_sub) + " sub-groups, in group order)");
      }
      group_of[s] = g;
      ++next;
    }
  }
  if (next != num_sub) {
    throw fail(o0, pg_key, "the groups list " + std::to_string(next) + " sub-groups, " +
                               name(m0) + "'s param_shapes " + std::to_string(num_sub));
  }
  for (std::uint32_t f : optims) {
    if (!same_value(torch(f).at(pg_key), torch(o0).at(pg_key))) {
      // Hyperparameters may differ only if the run was odd; the membership must not.
      for (std::uint64_t g = 0; g < pgs.size(); ++g) {
        const std::string key = pg_key + "/" + std::to_string(g) + "/params";
        const TorchValue* a = torch(f).find(key);
        if (a == nullptr || !same_value(*a, torch(o0).at(key))) {
          throw differ(o0, f, key, "one grouping of sub-groups", "another");
        }
      }
    }
  }
  ck_.groups.resize(pgs.size());
  for (std::uint64_t s = 0; s < num_sub; ++s) {
    const std::string ss = std::to_string(s);
    std::vector<DeepSpeedParam> params = shapes(m0, "param_shapes/" + ss);
    DeepSpeedGroup& group = ck_.groups[group_of[s]];
    DeepSpeedSubGroup sg;
    sg.group = group_of[s];
    sg.first_param = group.params.size();
    sg.num_params = params.size();
    std::uint64_t at = 0;
    for (DeepSpeedParam& p : params) {
      p.sub_group = s;
      p.offset = at;
      at += zero3_partition_numel(p.numel, world);  // each <= numel: no overflow past 2^64
      group.numel += p.numel;
    }
    sg.partition_numel = at;
    for (std::uint32_t f : optims) {
      DeepSpeedPartition part;
      part.fp32 = tensor(f, "optimizer_state_dict/fp32_flat_groups/" + ss);
      if (part.fp32.numel != at) {
        throw fail(f, "optimizer_state_dict/fp32_flat_groups/" + ss,
                   std::to_string(part.fp32.numel) + " elements, but sub-group " + ss + "'s " +
                       std::to_string(params.size()) + " parameters (" + name(m0) +
                       "'s param_shapes) partitioned over " + std::to_string(world) +
                       " ranks take " + std::to_string(at));
      }
      part.states = states_at(f, "optimizer_state_dict/optimizer_state_dict/state/" + ss);
      sg.ranks.push_back(std::move(part));
    }
    group.flat_numel += at * world;
    group.sub_groups.push_back(ck_.sub_groups.size());
    for (DeepSpeedParam& p : params) group.params.push_back(std::move(p));
    ck_.sub_groups.push_back(std::move(sg));
  }
  const TorchValue* sgs = config("zero_optimization/sub_group_size");
  ck_.sub_group_size = kDefaultSubGroupSize;
  if (sgs && sgs->kind == TorchKind::kInt && sgs->integer >= 0) {
    ck_.sub_group_size = static_cast<std::uint64_t>(sgs->integer);
  } else if (sgs && sgs->kind == TorchKind::kFloat && sgs->real >= 0 && sgs->real < 1.8e19) {
    ck_.sub_group_size = static_cast<std::uint64_t>(sgs->real);
  }
}

}  // namespace zeroflat::detail
