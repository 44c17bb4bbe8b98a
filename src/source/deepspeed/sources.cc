// A DeepSpeed checkpoint's saved runs as the loader's sources (deepspeed_source: the one mapping
// of each parameter's elements onto the saved partitions and files), and which optimizer states
// it saves per element (deepspeed_partitioned_states). What a rank of a new world reads is the
// loader's own read plan over these sources (resume.h).
#include <algorithm>
#include <cstdio>
#include <map>

#include "zeroflat/common.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/layout.h"

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

// A saved tensor a resume reads must be of a dtype the loader converts.
void check_readable(const DeepSpeedCheckpoint& ck, const DeepSpeedTensor& t) {
  if (!t.type) {
    throw InvalidArgument(printable(ck.files[t.file].path, 200) + ": entry '" +
                          printable(t.path) + "' is " + printable(t.dtype) +
                          ": a resume reads bf16, fp16 and fp32 tensors");
  }
}


}  // namespace

bool deepspeed_state_partitioned(const DeepSpeedState& s, const DeepSpeedPartition& part,
                                 const DeepSpeedSubGroup& sg) noexcept {
  return s.name != "step" &&
         (s.tensor.numel == part.fp32.numel || s.tensor.numel == sg.partition_numel);
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
          found = found || (s.name == name && deepspeed_state_partitioned(s, part, sg));
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
      out_.index.file_bytes.push_back(f.file_bytes);
      out_.index.stamps.push_back(f.stamp);
    }
  }

  // One run: elements [element, element + numel) of saved tensor t.
  std::string add(const DeepSpeedTensor& t, std::uint64_t element, std::uint64_t numel) {
    check_readable(ck_, t);
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
    if (x.name == target && deepspeed_state_partitioned(x, part, sg) &&
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
