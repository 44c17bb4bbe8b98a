// The description of a DeepSpeed checkpoint built from its files (deepspeed_checkpoint.h), for
// the folder reader (checkpoint.cc) and each format's own checks (checkpoint_zero12.cc,
// checkpoint_zero3.cc, checkpoint_universal.cc): every value read from a file is checked
// before it is believed, and every file's against the others'.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "model/torch_file.h"
#include "source/saved_state.h"
#include "zeroflat/common.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/layout.h"

namespace zeroflat::detail {

namespace fs = std::filesystem;

// The most ranks a checkpoint may have been saved by.
inline constexpr std::uint64_t kMaxRanks = kMaxDp;

inline std::string shown(const std::string& path) { return printable(path, 200); }

// Rank 0's file name (zero_pp_rank_0_...) as rank r's, for messages naming a missing file.
inline std::string rank_file_name(const std::string& rank0, std::uint64_t r) {
  constexpr std::string_view kRank0 = "zero_pp_rank_0_";
  const std::size_t at = rank0.find(kRank0);
  if (at == std::string::npos) return "rank " + std::to_string(r) + "'s file";
  return printable(rank0.substr(0, at)) + "zero_pp_rank_" + std::to_string(r) + "_" +
         printable(rank0.substr(at + kRank0.size()));
}

inline bool same_value(const TorchValue& a, const TorchValue& b) {
  if (a.kind != b.kind || a.boolean != b.boolean || a.integer != b.integer || a.text != b.text ||
      a.items.size() != b.items.size() || a.entries.size() != b.entries.size()) {
    return false;
  }
  if (a.kind == TorchKind::kFloat && !(a.real == b.real || (a.real != a.real && b.real != b.real))) {
    return false;
  }
  for (std::size_t i = 0; i < a.items.size(); ++i) {
    if (!same_value(a.items[i], b.items[i])) return false;
  }
  for (std::size_t i = 0; i < a.entries.size(); ++i) {
    if (!same_value(a.entries[i].first, b.entries[i].first) ||
        !same_value(a.entries[i].second, b.entries[i].second)) {
      return false;
    }
  }
  return true;
}

// Builds a checkpoint's description from its files.
class Builder {
 public:
  explicit Builder(DeepSpeedCheckpoint& ck) : ck_(ck) {}

  const TorchFile& torch(std::uint32_t f) const { return ck_.files[f].saved->torch; }
  std::string name(std::uint32_t f) const { return shown(ck_.files[f].path); }

  InvalidArgument fail(std::uint32_t f, std::string_view entry, const std::string& why) const {
    return InvalidArgument(name(f) + ": entry '" + printable(entry, 200) + "': " + why);
  }
  // partition_count `c` in file f's entry against the folder's optimizer files (optims, of
  // ranks 0, 1, ... in order): the files that are missing named, or the surplus said.
  InvalidArgument world_mismatch(std::uint32_t f, std::string_view entry, std::uint64_t c,
                                 const std::vector<std::uint32_t>& optims) const {
    const std::uint64_t world = optims.size();
    std::string why = "partition_count " + std::to_string(c) + ", but the folder holds " +
                      std::to_string(world) + " ranks' optimizer files (";
    if (c < world) return fail(f, entry, why + "files of more ranks than the run had)");
    const std::string first = fs::path(ck_.files[optims.front()].path).filename().string();
    why += c - world == 1 ? "a rank's file is missing: " : "ranks' files are missing: ";
    for (std::uint64_t r = world; r < c && r < world + 3; ++r) {
      why += (r > world ? ", " : "") + rank_file_name(first, r);
    }
    return fail(f, entry, why + (c > world + 3 ? ", ...)" : ")"));
  }
  InvalidArgument differ(std::uint32_t a, std::uint32_t b, std::string_view entry,
                         const std::string& va, const std::string& vb) const {
    return InvalidArgument("files of one checkpoint disagree on '" + printable(entry, 200) +
                           "': " + name(a) + " says " + va + ", " + name(b) + " says " + vb +
                           " (files of different runs, tags or world sizes in one folder?)");
  }

  // A contiguous tensor of file f at path.
  DeepSpeedTensor tensor(std::uint32_t f, std::string_view path) const {
    const TorchTensor& t = torch(f).tensor_at(path);
    return from(f, t);
  }
  DeepSpeedTensor from(std::uint32_t f, const TorchTensor& t) const {
    if (!t.contiguous) {
      throw fail(f, t.path, "tensor " + shape_to_string(t.shape) + " with stride " +
                                shape_to_string(t.stride) +
                                " is not contiguous (expected a flat, contiguous tensor)");
    }
    DeepSpeedTensor out;
    out.file = f;
    out.path = t.path;
    out.dtype = t.dtype;
    out.type = t.type;
    out.element_size = t.element_size;
    out.shape = t.shape;
    out.numel = t.numel;
    out.offset = t.offset;
    out.bytes = t.bytes;
    return out;
  }

  std::uint64_t count(std::uint32_t f, std::string_view path) const {
    const std::int64_t v = torch(f).int_at(path);
    if (v < 0) throw fail(f, path, "expected a count (an int >= 0), found " + std::to_string(v));
    return static_cast<std::uint64_t>(v);
  }

  // param_shapes-like entries: an OrderedDict of name -> torch.Size.
  std::vector<DeepSpeedParam> shapes(std::uint32_t f, std::string_view path) const {
    const TorchValue& d = torch(f).at(path);
    if (d.kind != TorchKind::kDict) {
      throw fail(f, path, "expected a dict of parameter name -> shape, found " +
                              std::string(torch_kind_name(d.kind)));
    }
    std::vector<DeepSpeedParam> out;
    std::set<std::string> seen;
    for (const auto& [k, v] : d.entries) {
      if (k.kind != TorchKind::kString) {
        throw fail(f, path, "a parameter name that is a " + std::string(torch_kind_name(k.kind)) +
                                " (expected a string)");
      }
      DeepSpeedParam p;
      p.name = k.text;
      if (!seen.insert(p.name).second) {
        throw fail(f, path, "parameter '" + printable(p.name) + "' is listed twice");
      }
      const std::string entry = std::string(path) + "/" + torch_path_segment(k);
      p.shape = torch(f).shape_at(entry);
      try {
        p.numel = shape_numel(p.shape);
      } catch (const InvalidArgument&) {
        throw fail(f, entry, "shape " + shape_to_string(p.shape) + " overflows 64 bits");
      }
      out.push_back(std::move(p));
    }
    return out;
  }

  // A string at path in file f, or "" when absent.
  std::string text_or_empty(std::uint32_t f, std::string_view path) const {
    const TorchValue* v = torch(f).find(path);
    return v && v->kind == TorchKind::kString ? v->text : std::string();
  }

  // Everything the files say about the run, checked to agree.
  void agree(const std::vector<std::uint32_t>& all) {
    // ds_version: at the top of every file, and inside ZeRO-1/2's optimizer state.
    std::optional<std::uint32_t> first;
    for (std::uint32_t f : all) {
      for (const char* key : {"ds_version", "optimizer_state_dict/ds_version"}) {
        const TorchValue* v = torch(f).find(key);
        if (v == nullptr) continue;
        if (v->kind != TorchKind::kString) {
          throw fail(f, key, "expected the release as a string, found " +
                                 std::string(torch_kind_name(v->kind)));
        }
        if (!first) {
          first = f;
          ck_.ds_version = v->text;
        } else if (v->text != ck_.ds_version) {
          throw differ(*first, f, key, "'" + printable(ck_.ds_version) + "'",
                       "'" + printable(v->text) + "'");
        }
      }
    }
    // ds_config: the same run configured every file.
    std::optional<std::uint32_t> config_file;
    for (std::uint32_t f : all) {
      const TorchValue* c = torch(f).find("ds_config");
      if (c == nullptr) continue;
      if (!config_file) {
        config_file = f;
      } else if (!same_value(*c, torch(*config_file).at("ds_config"))) {
        throw differ(*config_file, f, "ds_config", "one configuration", "another");
      }
    }
    config_ = config_file;
  }

  const TorchValue* config(std::string_view path) const {
    if (!config_) return nullptr;
    return torch(*config_).find("ds_config/" + std::string(path));
  }
  bool config_flag(std::string_view path) const {
    const TorchValue* v = config(path);
    return v && ((v->kind == TorchKind::kBool && v->boolean) ||
                 (v->kind == TorchKind::kInt && v->integer != 0));
  }

  // The stage each optimizer file says, the same in all.
  void stages(const std::vector<std::uint32_t>& optims, int expected_family) {
    std::optional<std::uint32_t> first;
    for (std::uint32_t f : optims) {
      const TorchValue* v = torch(f).find("optimizer_state_dict/zero_stage");
      if (v == nullptr) continue;
      if (v->kind != TorchKind::kEnum && v->kind != TorchKind::kInt) {
        throw fail(f, "optimizer_state_dict/zero_stage",
                   "expected a ZeroStageEnum, found " + std::string(torch_kind_name(v->kind)));
      }
      const int stage = static_cast<int>(v->integer);
      if (!first) {
        first = f;
        ck_.zero_stage = stage;
      } else if (stage != ck_.zero_stage) {
        throw differ(*first, f, "optimizer_state_dict/zero_stage", std::to_string(ck_.zero_stage),
                     std::to_string(stage));
      }
    }
    if (!first) {
      // BF16_Optimizer (bf16 ZeRO-1 with fp32 gradient accumulation) saves no stage.
      const TorchValue* s = config("zero_optimization/stage");
      ck_.zero_stage = s && s->kind == TorchKind::kInt ? static_cast<int>(s->integer) : 1;
    }
    const bool zero3 = ck_.zero_stage == 3;
    if ((expected_family == 3) != zero3 || ck_.zero_stage < 1 || ck_.zero_stage > 3) {
      throw fail(first.value_or(optims.front()), "optimizer_state_dict/zero_stage",
                 "stage " + std::to_string(ck_.zero_stage) + ", but the folder's files are " +
                     (expected_family == 3 ? "ZeRO-3's (zero_pp_rank_*_model_states.pt)"
                                           : "ZeRO-1/2's (one mp_rank_00_model_states.pt)"));
    }
  }

  // dp_world_size and mp_world_size of a model file.
  void worlds(std::uint32_t f, std::uint64_t world) {
    if (const TorchValue* mp = torch(f).find("mp_world_size")) {
      if (mp->kind == TorchKind::kInt && mp->integer != 1) {
        throw Unsupported(name(f) + ": entry 'mp_world_size': " + std::to_string(mp->integer) +
                          ": model (tensor) parallel checkpoints are not supported (expected 1)");
      }
    }
    if (torch(f).find("dp_world_size") != nullptr) {
      const std::uint64_t dp = count(f, "dp_world_size");
      if (dp != world) {
        throw fail(f, "dp_world_size",
                   std::to_string(dp) + " ranks saved, but the folder holds optimizer files of " +
                       std::to_string(world) + " ranks");
      }
    }
  }

  void bookkeeping(std::uint32_t model, std::uint32_t optim) {
    const TorchFile& m = torch(model);
    auto int_or = [&](const char* key) -> std::int64_t {
      const TorchValue* v = m.find(key);
      return v && v->kind == TorchKind::kInt ? v->integer : -1;
    };
    ck_.global_steps = int_or("global_steps");
    ck_.global_samples = int_or("global_samples");
    ck_.skipped_steps = int_or("skipped_steps");
    const TorchValue* sched = m.find("lr_scheduler");
    ck_.has_lr_scheduler = sched != nullptr && sched->kind != TorchKind::kNone;
    const TorchFile& o = torch(optim);
    if (const TorchValue* v = o.find("optimizer_state_dict/loss_scaler/cur_scale")) {
      if (v->kind == TorchKind::kFloat) ck_.loss_scale = v->real;
      if (v->kind == TorchKind::kInt) ck_.loss_scale = static_cast<double>(v->integer);
    }
    if (const TorchValue* v = o.find("optimizer_state_dict/dynamic_loss_scale")) {
      ck_.dynamic_loss_scale = v->kind == TorchKind::kBool && v->boolean;
    }
    if (const TorchValue* v = o.find("optimizer_state_dict/clip_grad")) {
      if (v->kind == TorchKind::kFloat) ck_.clip_grad = v->real;
      if (v->kind == TorchKind::kInt) ck_.clip_grad = static_cast<double>(v->integer);
    }
  }

  // The module's tensors, buffer names and frozen parameters of a model file.
  void module_of(std::uint32_t model) {
    const TorchFile& m = torch(model);
    const TorchValue& mod = m.at("module");
    if (mod.kind != TorchKind::kDict) {
      throw fail(model, "module", "expected the module's state_dict, found " +
                                      std::string(torch_kind_name(mod.kind)));
    }
    for (const auto& [k, v] : mod.entries) {
      if (v.kind != TorchKind::kTensor) continue;
      ck_.module.push_back(from(model, m.tensors[static_cast<std::uint64_t>(v.integer)]));
    }
    if (const TorchValue* b = m.find("buffer_names"); b && b->is_sequence()) {
      for (const TorchValue& n : b->items) {
        if (n.kind != TorchKind::kString) {
          throw fail(model, "buffer_names", "a buffer name that is a " +
                                                std::string(torch_kind_name(n.kind)));
        }
        ck_.buffer_names.push_back(n.text);
      }
    }
  }

  // Frozen parameters: frozen_param_shapes where the release saves it, else the module's
  // tensors that are neither trained nor buffers.
  void frozen_of(std::uint32_t model, const std::vector<std::uint32_t>& per_rank_models) {
    const TorchFile& m = torch(model);
    const TorchValue* shapes_v = m.find("frozen_param_shapes");
    std::vector<DeepSpeedParam> frozen;
    if (shapes_v != nullptr && shapes_v->kind == TorchKind::kDict) {
      frozen = shapes(model, "frozen_param_shapes");
    } else {
      std::set<std::string> trained, buffers(ck_.buffer_names.begin(), ck_.buffer_names.end());
      for (const DeepSpeedGroup& g : ck_.groups) {
        for (const DeepSpeedParam& p : g.params) trained.insert(p.name);
      }
      for (const DeepSpeedTensor& t : ck_.module) {
        const std::string n = t.path.substr(7);  // "module/"
        if (trained.count(n) || buffers.count(n)) continue;
        DeepSpeedParam p;
        p.name = n;
        p.shape = t.shape;
        p.numel = t.numel;
        frozen.push_back(std::move(p));
      }
    }
    for (DeepSpeedParam& p : frozen) {
      DeepSpeedFrozen fz;
      fz.name = p.name;
      fz.shape = p.shape;
      fz.numel = p.numel;
      if (ck_.format == DeepSpeedFormat::kZero3 ||
          (ck_.format == DeepSpeedFormat::kUniversal && !per_rank_models.empty())) {
        const std::uint64_t part = zero3_partition_numel(p.numel, ck_.world);
        for (std::uint32_t f : per_rank_models) {
          const std::string entry = "frozen_param_fragments/" + torch_path_segment_of(p.name);
          const TorchTensor* t = torch(f).find_tensor(entry);
          if (t == nullptr) {
            fz.fragments.clear();
            break;
          }
          DeepSpeedTensor d = from(f, *t);
          if (d.numel > part) {
            throw fail(f, entry, std::to_string(d.numel) + " elements, more than a partition of " +
                                     shape_to_string(p.shape) + " over " +
                                     std::to_string(ck_.world) + " ranks holds (" +
                                     std::to_string(part) + ")");
          }
          fz.fragments.push_back(std::move(d));
        }
      } else if (const DeepSpeedTensor* t = ck_.find_module(p.name)) {
        if (ck_.format == DeepSpeedFormat::kUniversal && t->numel == 0 && p.numel > 0) {
          // Converted from ZeRO-3: the module file holds a placeholder; the values are the
          // parameter's own universal files (zero/NAME/fp32.pt).
          ck_.frozen.push_back(std::move(fz));
          continue;
        }
        if (t->numel != p.numel) {
          throw fail(t->file, t->path, "frozen parameter of shape " + shape_to_string(p.shape) +
                                           " is saved as " + shape_to_string(t->shape));
        }
        fz.fragments.push_back(*t);
      }
      ck_.frozen.push_back(std::move(fz));
    }
  }

  static std::string torch_path_segment_of(const std::string& key) {
    TorchValue k;
    k.kind = TorchKind::kString;
    k.text = key;
    return torch_path_segment(k);
  }

  // The dtype of the run's 16-bit weights.
  void dtype_of(bool bf16_names) {
    if (bf16_names || config_flag("bf16/enabled") || config_flag("bfloat16/enabled")) {
      ck_.dtype = "bf16";
    } else if (config_flag("fp16/enabled")) {
      ck_.dtype = "fp16";
    } else {
      ck_.dtype = "fp32";
      for (const DeepSpeedTensor& t : ck_.module) {
        if (t.type && *t.type != DType::kFP32) {
          ck_.dtype = std::string(dtype_name(*t.type));
          break;
        }
      }
    }
  }

  // The optimizer state tensors of one partition (a dict of name -> tensor; others skipped).
  std::vector<DeepSpeedState> states_at(std::uint32_t f, const std::string& path) const {
    std::vector<DeepSpeedState> out;
    const TorchValue* d = torch(f).find(path);
    if (d == nullptr) return out;
    if (d->kind != TorchKind::kDict) {
      throw fail(f, path, "expected the optimizer state of a partition (a dict), found " +
                              std::string(torch_kind_name(d->kind)));
    }
    for (const auto& [k, v] : d->entries) {
      if (k.kind != TorchKind::kString || v.kind != TorchKind::kTensor) continue;
      out.push_back({k.text, from(f, torch(f).tensors[static_cast<std::uint64_t>(v.integer)])});
    }
    return out;
  }

  void zero12(std::uint32_t model, const std::vector<std::uint32_t>& optims);

  void zero3(const std::vector<std::uint32_t>& models, const std::vector<std::uint32_t>& optims);

  void universal(std::uint32_t model, const std::string& zero_dir);

 private:
  DeepSpeedCheckpoint& ck_;
  std::optional<std::uint32_t> config_;
};

}  // namespace zeroflat::detail
