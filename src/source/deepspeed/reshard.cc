// Which bytes of a DeepSpeed checkpoint a rank of a new world reads (deepspeed_rank_reads):
// the new layout's fragments of each partition, mapped onto the saved ranks' files.
#include <algorithm>
#include <cstdio>
#include <map>

#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/error.h"
#include "zeroflat/layout.h"
#include "zeroflat/release.h"
#include "zeroflat/size.h"
#include "zeroflat/zero3.h"

namespace zeroflat {
namespace {

// A run of elements of one saved tensor.
struct Piece {
  const DeepSpeedTensor* tensor = nullptr;
  std::uint64_t element = 0;  // first element in the tensor
  std::uint64_t numel = 0;
};

// Where elements [a, a + n) of parameter p of saved group g lie: the pieces of the saved
// fp32 partitions (target "fp32") or of a state, in order.
std::vector<std::pair<Piece, const DeepSpeedPartition*>> locate(const DeepSpeedCheckpoint& ck_,
                                                                 const DeepSpeedParam& p,
                                                                 std::uint64_t a, std::uint64_t n) {
  std::vector<std::pair<Piece, const DeepSpeedPartition*>> out;
  const DeepSpeedSubGroup& sg = ck_.sub_groups[p.sub_group];
  const std::uint64_t W = ck_.world;
  while (n > 0) {
    std::uint64_t q = 0, pos = 0, run = 0;
    if (ck_.zero_stage == 3) {
      const std::uint64_t part = zero3_partition_numel(p.numel, W);
      q = a / part;
      pos = p.offset + a % part;
      run = std::min(n, part - a % part);
    } else {
      const std::uint64_t P = sg.partition_numel;
      const std::uint64_t flat = p.offset + a;
      q = flat / P;
      pos = flat % P;
      run = std::min(n, P - pos);
    }
    const DeepSpeedPartition& part = sg.ranks.at(q);
    if (pos + run > part.fp32.numel) {
      throw InvalidArgument(printable(ck_.files[part.fp32.file].path, 200) + ": entry '" +
                            printable(part.fp32.path) + "': parameter '" + printable(p.name) +
                            "' needs elements up to " + std::to_string(pos + run) +
                            ", but the saved partition holds " +
                            std::to_string(part.fp32.numel));
    }
    out.push_back({Piece{&part.fp32, pos, run}, &part});
    a += run;
    n -= run;
  }
  return out;
}


class Planner {
 public:
  Planner(const DeepSpeedCheckpoint& ck, std::uint64_t world, std::uint64_t rank,
          const DeepSpeedReshardOptions& options)
      : ck_(ck), world_(world), rank_(rank), options_(options) {
    out_.world = world;
    out_.rank = rank;
  }

  DeepSpeedRankReads run() {
    rules_ = options_.rules ? *options_.rules : saving_rules();
    const bool zero3 = ck_.zero_stage == 3;
    if (ck_.format != DeepSpeedFormat::kUniversal && ck_.sub_groups.empty() && !ck_.groups.empty()) {
      throw InvalidArgument(printable(ck_.dir, 200) + ": no optimizer partitions to read");
    }
    if (zero3) {
      plan_zero3();
    } else {
      plan_zero12();
    }
    if (options_.module) plan_module(zero3);
    for (const DeepSpeedRead& r : out_.reads) out_.bytes += r.bytes;
    return std::move(out_);
  }

 private:
  ReleaseRules saving_rules() const {
    try {
      return deepspeed_rules(ck_.ds_version.empty() ? "latest" : ck_.ds_version);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(printable(ck_.dir, 200) + ": the saving release '" +
                            printable(ck_.ds_version) + "' has no layout rules here (" +
                            e.what() + "); name the new run's release");
    }
  }

  // Emits one read, merged into the previous one when it continues it in the file and in the
  // destination.
  void emit(const Piece& p, const std::string& target, std::uint64_t sub_group,
            const std::string& param, std::uint64_t dest) {
    if (p.numel == 0) return;
    DeepSpeedRead r;
    r.file = p.tensor->file;
    r.offset = p.tensor->offset + p.element * p.tensor->element_size;
    r.bytes = p.numel * p.tensor->element_size;
    r.target = target;
    r.sub_group = sub_group;
    r.param = param;
    r.dest = dest;
    r.numel = p.numel;
    if (!out_.reads.empty()) {
      DeepSpeedRead& last = out_.reads.back();
      if (last.file == r.file && last.target == r.target && last.sub_group == r.sub_group &&
          last.param == r.param && last.offset + last.bytes == r.offset &&
          last.dest + last.numel == r.dest) {
        last.bytes += r.bytes;
        last.numel += r.numel;
        return;
      }
    }
    out_.reads.push_back(std::move(r));
  }

  // A saved partition's state tensors: those as long as the fp32 partition (saved with or
  // without its padding) are partitioned; the rest (step) are read whole.
  static bool partitioned(const DeepSpeedState& s, const DeepSpeedPartition& part,
                          std::uint64_t partition_numel) {
    return s.name != "step" &&
           (s.tensor.numel == partition_numel || s.tensor.numel == part.fp32.numel);
  }

  // Elements [a, a + n) of parameter p, for dest of the new sub-group being planned.
  struct Want {
    const DeepSpeedParam* param;
    std::uint64_t a, n, dest;
  };

  // Emits the reads of one new sub-group's wants: the fp32 master, then each partitioned
  // state, each in destination order (so that runs adjacent in a file merge).
  void read_wants(const std::vector<Want>& wants, std::uint64_t new_sub_group) {
    if (ck_.format == DeepSpeedFormat::kUniversal) {
      std::vector<std::string> names;
      for (const Want& w : wants) {
        for (const DeepSpeedState& s : universal(w.param->name).tensors) {
          if (s.name == "step" || (!options_.states && s.name != "fp32")) continue;
          if (std::find(names.begin(), names.end(), s.name) == names.end()) names.push_back(s.name);
        }
      }
      std::sort(names.begin(), names.end(), [](const std::string& x, const std::string& y) {
        return (x == "fp32") != (y == "fp32") ? x == "fp32" : x < y;
      });
      for (const std::string& name : names) {
        for (const Want& w : wants) {
          const DeepSpeedState* s = nullptr;
          for (const DeepSpeedState& x : universal(w.param->name).tensors) {
            if (x.name == name) s = &x;
          }
          if (s == nullptr) {
            throw InvalidArgument(printable(ck_.dir, 200) + ": parameter '" +
                                  printable(w.param->name) + "' has no " + printable(name) +
                                  ".pt (others have)");
          }
          emit(Piece{&s->tensor, w.a, w.n}, name, new_sub_group, "", w.dest);
        }
      }
      return;
    }
    // Every want's pieces in the saved partitions.
    std::vector<std::vector<std::pair<Piece, const DeepSpeedPartition*>>> pieces;
    std::vector<std::string> names;
    for (const Want& w : wants) {
      pieces.push_back(locate(ck_, *w.param, w.a, w.n));
      const DeepSpeedSubGroup& sg = ck_.sub_groups[w.param->sub_group];
      for (const auto& [piece, part] : pieces.back()) {
        for (const DeepSpeedState& s : part->states) {
          if (options_.states && partitioned(s, *part, sg.partition_numel) &&
              std::find(names.begin(), names.end(), s.name) == names.end()) {
            names.push_back(s.name);
          }
        }
      }
    }
    std::sort(names.begin(), names.end());
    names.insert(names.begin(), "fp32");
    for (const std::string& name : names) {
      for (std::size_t i = 0; i < wants.size(); ++i) {
        const DeepSpeedSubGroup& sg = ck_.sub_groups[wants[i].param->sub_group];
        std::uint64_t d = wants[i].dest;
        for (const auto& [piece, part] : pieces[i]) {
          const DeepSpeedTensor* t = &part->fp32;
          if (name != "fp32") {
            t = nullptr;
            for (const DeepSpeedState& x : part->states) {
              if (x.name == name && partitioned(x, *part, sg.partition_numel) &&
                  piece.element + piece.numel <= x.tensor.numel) {
                t = &x.tensor;
              }
            }
            if (t == nullptr) {
              throw InvalidArgument(printable(ck_.files[part->fp32.file].path, 200) +
                                    ": no optimizer state '" + printable(name) +
                                    "' covering the elements of parameter '" +
                                    printable(wants[i].param->name) +
                                    "' (other ranks' files have it)");
            }
          }
          emit(Piece{t, piece.element, piece.numel}, name, new_sub_group, "", d);
          d += piece.numel;
        }
      }
    }
  }

  // The whole states (step) of a new sub-group, from the saved partition that holds element
  // `element` of parameter p (a file the rank reads anyway).
  void read_whole_states(const DeepSpeedParam& p, std::uint64_t element,
                         std::uint64_t new_sub_group) {
    if (!options_.states) return;
    if (ck_.format == DeepSpeedFormat::kUniversal) {
      for (const DeepSpeedState& s : universal(p.name).tensors) {
        if (s.name == "step") emit(Piece{&s.tensor, 0, s.tensor.numel}, s.name, new_sub_group, "", 0);
      }
      return;
    }
    const DeepSpeedSubGroup& sg = ck_.sub_groups[p.sub_group];
    const DeepSpeedPartition* part = &sg.ranks.front();
    if (element < p.numel) part = locate(ck_, p, element, 1).front().second;
    for (const DeepSpeedState& s : part->states) {
      if (!partitioned(s, *part, sg.partition_numel)) {
        emit(Piece{&s.tensor, 0, s.tensor.numel}, s.name, new_sub_group, "", 0);
      }
    }
  }

  const DeepSpeedUniversalParam& universal(const std::string& name) const {
    for (const DeepSpeedUniversalParam& u : ck_.universal) {
      if (u.name == name) return u;
    }
    throw InvalidArgument(printable(ck_.dir, 200) + ": no universal files of parameter '" +
                          printable(name) + "'");
  }

  std::vector<std::uint64_t> numels_of(const DeepSpeedGroup& g) const {
    std::vector<std::uint64_t> out;
    for (const DeepSpeedParam& p : g.params) out.push_back(p.numel);
    return out;
  }

  void plan_zero12() {
    LayoutOptions lo;
    lo.dp = world_;
    lo.alignment_factor = 2;
    lo.round_robin = ck_.round_robin;
    lo.dtype = try_parse_dtype(ck_.dtype).value_or(DType::kBF16);
    lo.param_align_bytes = ck_.parameter_alignment ? 16 : 0;
    for (std::uint64_t g = 0; g < ck_.groups.size(); ++g) {
      const DeepSpeedGroup& group = ck_.groups[g];
      const std::vector<std::uint64_t> numels = numels_of(group);
      const ReleaseLayout rl = layout_for_release(numels, {}, lo, rules_);
      const RankLayout mine = rl.layout.rank(rank_, false);
      out_.partition_numel.push_back(rl.layout.partition_numel());
      out_.data_numel.push_back(rl.layout.partition_numel() - mine.padding);
      std::vector<Want> wants;
      for (const Fragment& f : mine.fragments) {
        wants.push_back({&group.params[rl.kept[f.param]], f.param_offset, f.numel,
                         f.partition_offset});
      }
      read_wants(wants, g);
      if (!mine.fragments.empty()) {
        // The group's step: every saved rank holds the same; the one holding the first element.
        const Fragment& f = mine.fragments.front();
        read_whole_states(group.params[rl.kept[f.param]], f.param_offset, g);
      } else if (!group.params.empty()) {
        read_whole_states(group.params.front(), 0, g);
      }
    }
  }

  void plan_zero3() {
    // The new groups: the saved ones' parameters, as the new release selects them.
    std::vector<std::vector<std::uint64_t>> groups;
    std::vector<std::vector<const DeepSpeedParam*>> params;
    for (const DeepSpeedGroup& g : ck_.groups) {
      const std::vector<std::uint64_t> numels = numels_of(g);
      const ReleaseSelection sel = select_for_release(numels, {}, rules_);
      groups.emplace_back();
      params.emplace_back();
      for (std::uint64_t k : sel.kept) {
        groups.back().push_back(numels[k]);
        params.back().push_back(&g.params[k]);
      }
    }
    Zero3Options zo;
    zo.world = world_;
    zo.sub_group_size = options_.sub_group_size.value_or(
        ck_.sub_group_size ? ck_.sub_group_size : kDefaultSubGroupSize);
    zo.dtype = try_parse_dtype(ck_.dtype).value_or(DType::kBF16);
    const Zero3Layout z = Zero3Layout::compute(groups, zo);
    std::vector<const DeepSpeedParam*> flat;
    for (const auto& g : params) flat.insert(flat.end(), g.begin(), g.end());
    for (std::uint64_t s = 0; s < z.sub_groups().size(); ++s) {
      const Zero3SubGroup& sg = z.sub_groups()[s];
      out_.partition_numel.push_back(sg.numel);
      std::uint64_t data = 0;
      std::vector<Want> wants;
      for (std::uint64_t k = sg.first_param; k < sg.first_param + sg.num_params; ++k) {
        const std::uint64_t n = z.numels()[k];
        const std::uint64_t part = z.partition_numels()[k];
        const std::uint64_t have = zero3_data_numel(n, world_, rank_);
        data += have;
        if (have > 0) wants.push_back({flat[k], rank_ * part, have, z.offsets()[k] - sg.offset});
      }
      read_wants(wants, s);
      out_.data_numel.push_back(data);
      if (!wants.empty()) {
        read_whole_states(*wants.front().param, wants.front().a, s);
      } else if (sg.num_params > 0) {
        read_whole_states(*flat[sg.first_param], 0, s);
      }
    }
  }

  void plan_module(bool zero3) {
    for (const DeepSpeedFrozen& fz : ck_.frozen) {
      if (fz.fragments.empty()) continue;  // the release saved none
      if (!zero3) {
        const DeepSpeedTensor& t = fz.fragments.front();
        emit(Piece{&t, 0, t.numel}, "module", 0, fz.name, 0);
        continue;
      }
      // The new rank's partition of the frozen parameter, from the saved ranks' partitions.
      const std::uint64_t part_new = zero3_partition_numel(fz.numel, world_);
      const std::uint64_t part_old = zero3_partition_numel(fz.numel, ck_.world);
      std::uint64_t a = rank_ * part_new;
      std::uint64_t n = zero3_data_numel(fz.numel, world_, rank_);
      std::uint64_t dest = 0;
      while (n > 0) {
        const std::uint64_t q = a / part_old, pos = a % part_old;
        const std::uint64_t run = std::min(n, part_old - pos);
        const DeepSpeedTensor& t = fz.fragments.at(q);
        if (pos + run > t.numel) {
          throw InvalidArgument(printable(ck_.files[t.file].path, 200) + ": entry '" +
                                printable(t.path) + "': holds " + std::to_string(t.numel) +
                                " elements of the frozen parameter, " +
                                std::to_string(pos + run) + " are needed");
        }
        emit(Piece{&t, pos, run}, "module", 0, fz.name, dest);
        a += run;
        n -= run;
        dest += run;
      }
    }
    for (const std::string& b : ck_.buffer_names) {
      if (const DeepSpeedTensor* t = ck_.find_module(b)) {
        emit(Piece{t, 0, t->numel}, "module", 0, b, 0);
      }
    }
  }

  const DeepSpeedCheckpoint& ck_;
  std::uint64_t world_;
  std::uint64_t rank_;
  const DeepSpeedReshardOptions& options_;
  ReleaseRules rules_;
  DeepSpeedRankReads out_;
};

}  // namespace

DeepSpeedRankReads deepspeed_rank_reads(const DeepSpeedCheckpoint& checkpoint,
                                        std::uint64_t world, std::uint64_t rank,
                                        const DeepSpeedReshardOptions& options) {
  if (world == 0 || world > kMaxDp) {
    throw InvalidArgument("deepspeed_rank_reads: world " + std::to_string(world) +
                          " (expected 1 to " + std::to_string(kMaxDp) + ")");
  }
  if (rank >= world) {
    throw InvalidArgument("deepspeed_rank_reads: rank " + std::to_string(rank) +
                          " outside a world of " + std::to_string(world));
  }
  return Planner(checkpoint, world, rank, options).run();
}

std::vector<std::string> deepspeed_partitioned_states(const DeepSpeedCheckpoint& ck) {
  // Universal: the trained parameters' files (a frozen parameter or a buffer has fp32.pt alone).
  std::vector<const DeepSpeedUniversalParam*> trained;
  for (const DeepSpeedUniversalParam& u : ck.universal) {
    bool in_group = ck.groups.empty();
    for (const DeepSpeedGroup& g : ck.groups) {
      for (const DeepSpeedParam& p : g.params) in_group = in_group || p.name == u.name;
    }
    if (in_group) trained.push_back(&u);
  }
  // Every state name any partition (universal: any trained parameter) saves, first seen first.
  std::vector<std::string> names;
  auto note = [&](const std::string& name) {
    if (name != "fp32" && std::find(names.begin(), names.end(), name) == names.end()) {
      names.push_back(name);
    }
  };
  for (const DeepSpeedSubGroup& sg : ck.sub_groups) {
    for (const DeepSpeedPartition& part : sg.ranks) {
      for (const DeepSpeedState& s : part.states) note(s.name);
    }
  }
  for (const DeepSpeedUniversalParam* u : trained) {
    for (const DeepSpeedState& s : u->tensors) note(s.name);
  }
  // A name is partitioned where a partition holds it with the partition's elements. Held so by
  // some partitions and missing from (or of another size in) others, the checkpoint is
  // incomplete: refused, naming where it is missing (a resume that skipped the state would
  // leave it unrestored everywhere).
  std::vector<std::string> out;
  for (const std::string& name : names) {
    if (name == "step") continue;  // one element per partition, whatever the partition's size
    std::uint64_t held = 0;
    std::string missing;
    for (const DeepSpeedSubGroup& sg : ck.sub_groups) {
      for (std::size_t r = 0; r < sg.ranks.size(); ++r) {
        const DeepSpeedPartition& part = sg.ranks[r];
        bool found = false;
        for (const DeepSpeedState& s : part.states) {
          found = found || (s.name == name && (s.tensor.numel == part.fp32.numel ||
                                               s.tensor.numel == sg.partition_numel));
        }
        held += found ? 1 : 0;
        if (!found && missing.empty()) {
          missing = printable(ck.files.at(part.fp32.file).path, 200) + ": no '" + printable(name) + "' of " +
                    std::to_string(part.fp32.numel) + " elements for the partition of " +
                    "sub-group " + std::to_string(&sg - ck.sub_groups.data());
        }
      }
    }
    for (const DeepSpeedUniversalParam* u : trained) {
      bool found = false;
      for (const DeepSpeedState& s : u->tensors) {
        found = found || (s.name == name && s.tensor.numel == u->numel);
      }
      held += found ? 1 : 0;
      if (!found && missing.empty()) {
        missing = printable(ck.dir) + "/zero/" + printable(u->name) + "/" + printable(name) +
                  ".pt: missing or not of the parameter's " + std::to_string(u->numel) +
                  " elements";
      }
    }
    if (held == 0) continue;  // saved whole (a scalar state)
    if (!missing.empty()) {
      throw InvalidArgument(missing + ", while other " +
                            (trained.empty() ? "partitions" : "parameters") +
                            " hold it: an incomplete checkpoint");
    }
    out.push_back(name);
  }
  return out;
}

namespace {

// The index being built: one tensor per run, named so that runs sort in the order they are made
// (natural order: "T/#0000000012" before "T/#0000000100").
class SourceBuilder {
 public:
  SourceBuilder(const DeepSpeedCheckpoint& ck, std::string_view target) : ck_(ck), target_(target) {
    out_.index.path = ck.dir;
    for (const DeepSpeedFile& f : ck.files) {
      out_.index.files.push_back(f.path);
      out_.index.file_bytes.push_back(f.torch.file_bytes);
    }
  }

  // One run: elements [element, element + numel) of saved tensor t.
  std::string add(const DeepSpeedTensor& t, std::uint64_t element, std::uint64_t numel) {
    if (!t.type) {
      throw InvalidArgument(printable(ck_.files[t.file].path, 200) + ": entry '" +
                            printable(t.path) + "' is " + printable(t.dtype) +
                            ": a resume reads bf16, fp16 and fp32 tensors");
    }
    char name[32];
    std::snprintf(name, sizeof name, "#%012llu", static_cast<unsigned long long>(count_++));
    CheckpointTensor c;
    c.name = std::string(target_) + "/" + name;
    c.dtype = t.dtype;
    c.type = t.type;
    c.shape = {static_cast<std::int64_t>(numel)};
    c.numel = numel;
    c.file = t.file;
    c.offset = t.offset + element * t.element_size;
    c.bytes = numel * t.element_size;
    out_.index.tensors.push_back(std::move(c));
    return out_.index.tensors.back().name;
  }

  DeepSpeedSource done() { return std::move(out_); }
  DeepSpeedSource& out() { return out_; }

 private:
  const DeepSpeedCheckpoint& ck_;
  std::string_view target_;
  std::uint64_t count_ = 0;
  DeepSpeedSource out_;
};

const DeepSpeedParam* saved_param(const DeepSpeedCheckpoint& ck, const std::string& name) {
  for (const DeepSpeedGroup& g : ck.groups) {
    for (const DeepSpeedParam& p : g.params) {
      if (p.name == name) return &p;
    }
  }
  return nullptr;
}

// The saved tensor of `target` that covers the same elements as the fp32 run `piece` of
// partition `part` (a state as long as the partition, saved with or without its padding).
const DeepSpeedTensor& state_of(const DeepSpeedCheckpoint& ck, const DeepSpeedPartition& part,
                                const DeepSpeedSubGroup& sg, const Piece& piece,
                                std::string_view target) {
  if (target == "fp32") return part.fp32;
  for (const DeepSpeedState& x : part.states) {
    if (x.name == target && (x.tensor.numel == part.fp32.numel ||
                             x.tensor.numel == sg.partition_numel) &&
        piece.element + piece.numel <= x.tensor.numel) {
      return x.tensor;
    }
  }
  throw InvalidArgument(printable(ck.files[part.fp32.file].path, 200) +
                        ": no partitioned optimizer state '" + printable(std::string(target)) +
                        "' beside entry '" + printable(part.fp32.path) + "'");
}

}  // namespace

DeepSpeedSource deepspeed_source(const DeepSpeedCheckpoint& ck, std::string_view target,
                                 std::span<const std::string> params,
                                 std::span<const std::uint64_t> numels) {
  if (params.size() != numels.size()) {
    throw InvalidArgument("deepspeed_source: " + std::to_string(params.size()) + " names for " +
                          std::to_string(numels.size()) + " element counts");
  }
  SourceBuilder b(ck, target);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i];
    const std::uint64_t n = numels[i];
    std::vector<std::string> runs;
    auto has = [&](std::uint64_t saved) {
      if (saved != n) {
        throw InvalidArgument(printable(ck.dir, 200) + ": parameter '" + printable(name) +
                              "' has " + std::to_string(saved) + " elements in the checkpoint, " +
                              std::to_string(n) + " in the model");
      }
    };
    if (target == "frozen" || target == "module") {
      // The module file's tensor (ZeRO-1/2, universal; buffers), or the saved ranks' partitions
      // of a frozen parameter (ZeRO-3).
      const DeepSpeedFrozen* fz = nullptr;
      for (const DeepSpeedFrozen& f : ck.frozen) {
        if (f.name == name) fz = &f;
      }
      const DeepSpeedTensor* whole = ck.find_module(name);
      const DeepSpeedUniversalParam* u = nullptr;
      for (const DeepSpeedUniversalParam& x : ck.universal) {
        if (x.name == name) u = &x;
      }
      const DeepSpeedState* u32 = nullptr;
      for (std::size_t k = 0; u != nullptr && k < u->tensors.size(); ++k) {
        if (u->tensors[k].name == "fp32") u32 = &u->tensors[k];
      }
      if (target == "frozen" && (whole == nullptr || whole->numel == 0) && u32 != nullptr) {
        // A universal checkpoint converted from ZeRO-3: the parameter's own fp32.pt.
        has(u->numel);
        runs.push_back(b.add(u32->tensor, 0, u32->tensor.numel));
      } else if (target == "frozen" && fz != nullptr && ck.zero_stage == 3 &&
                 !fz->fragments.empty()) {
        has(fz->numel);
        // Each saved rank's partition holds ceil(numel / world) elements, the last one padded:
        // the parameter is their first numel elements.
        std::uint64_t left = fz->numel;
        for (const DeepSpeedTensor& t : fz->fragments) {
          const std::uint64_t take = std::min(left, t.numel);
          if (take > 0 || runs.empty()) runs.push_back(b.add(t, 0, take));
          left -= take;
        }
      } else if (whole != nullptr && whole->numel > 0) {
        has(whole->numel);
        runs.push_back(b.add(*whole, 0, whole->numel));
      } else {
        throw InvalidArgument(printable(ck.dir, 200) + ": the checkpoint holds no " +
                              (target == "module" ? "16-bit weights" : "values") + " of '" +
                              printable(name) + "' in its module file");
      }
    } else if (ck.format == DeepSpeedFormat::kUniversal) {
      const DeepSpeedUniversalParam* u = nullptr;
      for (const DeepSpeedUniversalParam& x : ck.universal) {
        if (x.name == name) u = &x;
      }
      if (u == nullptr) {
        throw InvalidArgument(printable(ck.dir, 200) + ": no universal files of parameter '" +
                              printable(name) + "'");
      }
      has(u->numel);
      const DeepSpeedState* s = nullptr;
      for (const DeepSpeedState& x : u->tensors) {
        if (x.name == target) s = &x;
      }
      if (s == nullptr) {
        throw InvalidArgument(printable(ck.dir, 200) + ": parameter '" + printable(name) +
                              "' has no " + printable(std::string(target)) + ".pt");
      }
      runs.push_back(b.add(s->tensor, 0, s->tensor.numel));
    } else {
      const DeepSpeedParam* p = saved_param(ck, name);
      if (p == nullptr) {
        throw InvalidArgument(printable(ck.dir, 200) + ": the checkpoint's optimizer holds no "
                              "parameter '" + printable(name) + "'");
      }
      has(p->numel);
      const DeepSpeedSubGroup& sg = ck.sub_groups[p->sub_group];
      for (const auto& [piece, part] : locate(ck, *p, 0, p->numel)) {
        runs.push_back(b.add(state_of(ck, *part, sg, piece, target), piece.element, piece.numel));
      }
      if (runs.empty() && !sg.ranks.empty()) {
        // A parameter of no element: one empty run keeps its place (its name alone would be
        // looked up as a tensor of its own).
        const DeepSpeedPartition& part = sg.ranks.front();
        runs.push_back(b.add(state_of(ck, part, sg, Piece{&part.fp32, 0, 0}, target), 0, 0));
      }
    }
    LoadParam lp(name, Shape{static_cast<std::int64_t>(n)}, std::move(runs));
    b.out().params.push_back(std::move(lp));
  }
  return b.done();
}

}  // namespace zeroflat
