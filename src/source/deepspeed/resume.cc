// The resume of a DeepSpeed checkpoint as one operation (resume.h): the buffers a rank keeps,
// with their sources (deepspeed_source, the one mapping of parameters onto saved runs), layouts
// and placements; a rank's figures from the loader's own reads.
#include "zeroflat/resume.h"

#include <algorithm>
#include <string_view>
#include <unordered_map>

#include "model/torch_file.h"
#include "source/checkpoint/files.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"

namespace zeroflat {
namespace {

std::string shown(const DeepSpeedCheckpoint& ck) { return printable(ck.dir, 200); }

ReleaseRules saving_rules(const DeepSpeedCheckpoint& ck) {
  try {
    return deepspeed_rules(ck.ds_version.empty() ? "latest" : ck.ds_version);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(shown(ck) + ": the saving release '" + printable(ck.ds_version) +
                          "' has no layout rules here (" + e.what() +
                          "); name the new run's release");
  }
}

std::vector<std::string> states_of(const DeepSpeedCheckpoint& ck, const ResumeOptions& o) {
  const std::vector<std::string> partitioned = deepspeed_partitioned_states(ck);
  if (!o.states) return partitioned;
  std::vector<std::string> out;
  for (const std::string& name : *o.states) {
    if (name == "fp32") continue;  // the weights: always read
    if (std::find(partitioned.begin(), partitioned.end(), name) == partitioned.end()) {
      std::string have;
      for (const std::string& p : partitioned) have += (have.empty() ? "" : ", ") + p;
      throw InvalidArgument(shown(ck) + ": optimizer state '" + printable(name) +
                            "' is not one the checkpoint saves per element (it has: " +
                            (have.empty() ? std::string("none") : have) + ")");
    }
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

}  // namespace

ResumePlan plan_resume(const DeepSpeedCheckpoint& ck, const ResumeOptions& o) {
  if (o.world == 0 || o.world > kMaxDp) {
    throw InvalidArgument("resuming " + shown(ck) + ": a world of " + std::to_string(o.world) +
                          " ranks (expected 1 to " + std::to_string(kMaxDp) + ")");
  }
  ResumePlan plan;
  plan.world = o.world;
  plan.stage = o.stage != 0 ? o.stage : ck.zero_stage;
  if (plan.stage < 1 || plan.stage > 3) {
    throw InvalidArgument("resuming " + shown(ck) + " under ZeRO stage " +
                          std::to_string(plan.stage) + " (expected 1, 2 or 3)");
  }
  const bool zero3 = plan.stage == 3;
  if (ck.format != DeepSpeedFormat::kUniversal && zero3 != (ck.zero_stage == 3)) {
    throw InvalidArgument(
        shown(ck) + " was saved by ZeRO-" + std::to_string(ck.zero_stage) + " and the new run is "
        "ZeRO-" + std::to_string(plan.stage) + " (ZeRO-1/2 keep each optimizer group's flat "
        "buffer, ZeRO-3 each parameter's partitions): resume it with the stage it was saved "
        "with, or convert it to a universal checkpoint (python -m "
        "deepspeed.checkpoint.ds_to_universal), which either stage resumes");
  }
  if (ck.format != DeepSpeedFormat::kUniversal && ck.sub_groups.empty()) {
    throw InvalidArgument(shown(ck) + ": no optimizer partitions to read (a module-only "
                          "checkpoint)");
  }
  const bool module = o.module_weights && !zero3 && ck.format != DeepSpeedFormat::kUniversal;
  plan.targets.push_back(module ? "module" : "fp32");
  for (std::string& s : states_of(ck, o)) plan.targets.push_back(std::move(s));
  plan.sub_group_size = ck.sub_group_size != 0 ? ck.sub_group_size : kDefaultSubGroupSize;

  // The trained parameters per group: the caller's, or the checkpoint's as the rules keep them.
  std::vector<std::vector<std::string>> names;
  std::vector<std::vector<std::uint64_t>> numels;
  if (!o.groups.empty()) {
    if (o.group_numels.size() != o.groups.size()) {
      throw InvalidArgument("plan_resume: " + std::to_string(o.groups.size()) + " groups of names, " +
                            std::to_string(o.group_numels.size()) + " of element counts");
    }
    for (std::size_t g = 0; g < o.groups.size(); ++g) {
      if (o.groups[g].size() != o.group_numels[g].size()) {
        throw InvalidArgument("plan_resume: group " + std::to_string(g) + " has " +
                              std::to_string(o.groups[g].size()) + " names and " +
                              std::to_string(o.group_numels[g].size()) + " element counts");
      }
    }
    names = o.groups;
    numels = o.group_numels;
  } else {
    if (o.select) plan.rules = o.rules ? *o.rules : saving_rules(ck);
    for (const DeepSpeedGroup& group : ck.groups) {
      std::vector<std::uint64_t> all;
      for (const DeepSpeedParam& p : group.params) all.push_back(p.numel);
      ReleaseSelection sel;
      if (plan.rules) {
        sel = select_for_release(all, {}, *plan.rules);
      } else {
        for (std::uint64_t i = 0; i < all.size(); ++i) sel.kept.push_back(i);
      }
      for (const auto& [i, why] : sel.left_out) {
        plan.left_out.push_back(group.params[i].name + " (" + std::string(left_out_name(why)) +
                                ", DeepSpeed " + plan.rules->release + ")");
      }
      names.emplace_back();
      numels.emplace_back();
      for (std::uint64_t i : sel.kept) {
        names.back().push_back(group.params[i].name);
        numels.back().push_back(all[i]);
      }
    }
  }
  for (const auto& g : names) plan.params += g.size();
  if (plan.params == 0) throw InvalidArgument(shown(ck) + ": no trainable parameter to resume");
  plan.group_numels = numels;

  // The layouts: fp32 master and states in fp32; ZeRO-1/2's flat layout with the new run's
  // alignment factor, round-robin and parameter alignment (16 bytes of the 16-bit buffer: the
  // same elements in the target's dtype).
  const DType weights = o.weights_dtype.value_or(try_parse_dtype(ck.dtype).value_or(DType::kBF16));
  LayoutOptions base;
  base.dp = o.world;
  base.dtype = DType::kFP32;
  auto flat_options = [&](DType dtype) {
    LayoutOptions l = base;
    l.dtype = dtype;
    l.alignment_factor = o.alignment_factor;
    l.round_robin = o.round_robin.value_or(ck.round_robin);
    if (o.parameter_alignment.value_or(ck.parameter_alignment)) {
      l.param_align_bytes = 16 / element_size(weights) * element_size(dtype);
    }
    return l;
  };
  for (const std::string& target : plan.targets) {
    const DType dtype = target == "module" ? weights : DType::kFP32;
    if (zero3) {
      // Every group's partitions back to back in one buffer, or one buffer per group.
      const std::size_t count = o.buffer_per_group ? names.size() : 1;
      for (std::size_t k = 0; k < count; ++k) {
        const std::size_t first = o.buffer_per_group ? k : 0;
        const std::size_t last = o.buffer_per_group ? k + 1 : names.size();
        ResumeBuffer b;
        b.target = target;
        if (o.buffer_per_group) b.group = k;
        b.placement = LoadPlacement::partitions();
        b.layout = base;
        std::vector<std::string> n;
        for (std::size_t g = first; g < last; ++g) {
          n.insert(n.end(), names[g].begin(), names[g].end());
          b.numels.insert(b.numels.end(), numels[g].begin(), numels[g].end());
        }
        if (n.empty()) continue;  // nothing of the group is trained
        b.source = deepspeed_source(ck, target, n, b.numels);
        plan.buffers.push_back(std::move(b));
      }
      continue;
    }
    for (std::size_t g = 0; g < names.size(); ++g) {
      if (names[g].empty()) continue;  // nothing of the group is trained
      ResumeBuffer b;
      b.target = target;
      b.group = g;
      b.placement = LoadPlacement::slice();
      b.layout = flat_options(dtype);
      b.numels = numels[g];
      b.source = deepspeed_source(ck, target, names[g], numels[g]);
      plan.buffers.push_back(std::move(b));
    }
  }
  if (o.frozen_numels.size() != o.frozen.size()) {
    throw InvalidArgument("plan_resume: " + std::to_string(o.frozen.size()) + " frozen names, " +
                          std::to_string(o.frozen_numels.size()) + " element counts");
  }
  if (zero3 && !o.frozen.empty()) {
    ResumeBuffer b;
    b.target = "frozen";
    b.placement = LoadPlacement::partitions();
    b.layout = base;
    b.layout.dtype = o.frozen_dtype.value_or(weights);
    b.numels = o.frozen_numels;
    b.source = deepspeed_source(ck, "frozen", o.frozen, o.frozen_numels);
    plan.buffers.push_back(std::move(b));
  }

  // What is read whole: each saved sub-group's states that are not partitioned (step), from the
  // first saving rank (every rank saves the same); the module file's frozen parameters and
  // buffers (ZeRO-1/2 keep them whole; ZeRO-3 its buffers, its frozen parameters partitioned).
  const bool with_states = plan.targets.size() > 1;
  for (std::size_t s = 0; with_states && s < ck.sub_groups.size(); ++s) {
    const DeepSpeedSubGroup& sg = ck.sub_groups[s];
    if (sg.ranks.empty()) continue;
    const DeepSpeedPartition& part = sg.ranks.front();
    for (const DeepSpeedState& st : part.states) {
      if (!deepspeed_state_partitioned(st, part, sg)) {
        plan.small.push_back({st.name, s, "", st.tensor});
      }
    }
  }
  // The module file's tensors by name (its state_dict's keys): one pass, not one per name.
  std::unordered_map<std::string_view, const DeepSpeedTensor*> by_path;
  for (const DeepSpeedTensor& t : ck.module) by_path.emplace(t.path, &t);
  auto module_tensor = [&](const std::string& name) -> const DeepSpeedTensor* {
    TorchValue key;
    key.kind = TorchKind::kString;
    key.text = name;
    const auto it = by_path.find("module/" + torch_path_segment(key));
    return it == by_path.end() ? nullptr : it->second;
  };
  if (!zero3 && !o.frozen.empty()) {
    // The running engine's frozen parameters, whole, from the module file's state_dict (as
    // DeepSpeed's load_module_state_dict takes them, whichever parameters the saving run froze);
    // one the file does not hold is left out (the caller's strictness decides).
    for (std::size_t i = 0; i < o.frozen.size(); ++i) {
      const DeepSpeedTensor* t = module_tensor(o.frozen[i]);
      if (t == nullptr) continue;
      if (t->numel != o.frozen_numels[i]) {
        throw InvalidArgument(shown(ck) + ": frozen parameter '" + o.frozen[i] + "' holds " +
                              std::to_string(t->numel) + " elements in the module file, the " +
                              "model's " + std::to_string(o.frozen_numels[i]));
      }
      plan.small.push_back({"module", std::nullopt, o.frozen[i], *t});
    }
  }
  for (const DeepSpeedFrozen& fz : ck.frozen) {
    if (zero3 || !o.frozen.empty() || fz.fragments.empty()) continue;
    plan.small.push_back({"module", std::nullopt, fz.name, fz.fragments.front()});
  }
  for (const std::string& b : o.buffers ? *o.buffers : ck.buffer_names) {
    if (const DeepSpeedTensor* t = module_tensor(b)) {
      plan.small.push_back({"module", std::nullopt, b, *t});
    }
  }
  return plan;
}

std::uint64_t resume_kept_bytes(const ResumeBuffer& b) {
  return b.placement.kind == LoadPlacement::Kind::kPartitions
             ? zero3_buffer_layout(b.numels, b.layout).flat_bytes()
             : Layout::compute(b.numels, b.layout).partition_bytes();
}

ResumeRankBuffer resume_rank_buffer(const ResumeBuffer& b, std::uint64_t rank) {
  ResumeRankBuffer out;
  out.reads = planned_reads(b.source.index, b.source.params, b.placement, b.layout, rank);
  for (const PlannedRead& r : out.reads) {
    out.read_bytes += r.bytes;
    out.data_numel += r.numel;
  }
  // The saved element size of each parameter's values (its first run's).
  auto saved_size = [&](const LoadParam& p) -> std::uint64_t {
    for (const std::string& name : p.sources) {
      const CheckpointTensor* t = b.source.index.find(name);
      if (t != nullptr && t->type) return element_size(*t->type);
    }
    return 4;
  };
  if (b.placement.kind == LoadPlacement::Kind::kPartitions) {
    const Layout l = zero3_buffer_layout(b.numels, b.layout);
    out.kept_bytes = l.flat_bytes();
    out.partition_numel = l.flat_numel();
    for (std::size_t i = 0; i < b.numels.size(); ++i) {
      out.share_bytes += zero3_data_numel(b.numels[i], b.layout.dp, rank) *
                         saved_size(b.source.params[i]);
    }
  } else {
    const Layout l = Layout::compute(b.numels, b.layout);
    out.kept_bytes = l.partition_bytes();
    out.partition_numel = l.partition_numel();
    for (const Fragment& f : l.rank(rank, false).fragments) {
      out.share_bytes += f.numel * saved_size(b.source.params[f.param]);
    }
  }
  return out;
}

ResumeRank resume_rank(const ResumePlan& plan, std::uint64_t rank) {
  if (rank >= plan.world) {
    throw InvalidArgument("resume_rank: rank " + std::to_string(rank) + " outside a world of " +
                          std::to_string(plan.world));
  }
  ResumeRank out;
  out.rank = rank;
  for (const ResumeBuffer& b : plan.buffers) {
    out.buffers.push_back(resume_rank_buffer(b, rank));
    out.kept_bytes += out.buffers.back().kept_bytes;
    out.share_bytes += out.buffers.back().share_bytes;
    out.read_bytes += out.buffers.back().read_bytes;
  }
  for (const ResumeSmall& s : plan.small) out.small_bytes += s.tensor.bytes;
  return out;
}

std::uint64_t resume_read_ahead(const ResumePlan& plan, const ResumeRank& rank) {
  // Every buffer's reads together, by file path: the buffers' indexes name the same files.
  std::vector<detail::PathRange> ranges;
  for (std::size_t i = 0; i < plan.buffers.size() && i < rank.buffers.size(); ++i) {
    const CheckpointIndex& ck = plan.buffers[i].source.index;
    for (const PlannedRead& r : rank.buffers[i].reads) {
      if (r.file < ck.files.size()) ranges.push_back({ck.files[r.file], r.offset, r.bytes});
    }
  }
  return detail::read_ahead(std::move(ranges));
}

FlattenResult load_resume_buffer(const ResumeBuffer& b, Device& device, Communicator* comm,
                                 FlattenOptions options) {
  options.layout = b.layout;
  return load(b.source.index, b.source.params, b.placement, device, comm, options);
}

}  // namespace zeroflat
