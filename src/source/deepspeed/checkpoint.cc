// DeepSpeed checkpoint folders (deepspeed_checkpoint.h): which files a tag holds, their saved
// states read safely, and everything the files say checked against each other.
#include <algorithm>
#include <charconv>
#include <filesystem>
#include <map>
#include <set>

#include "model/files.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/error.h"
#include "zeroflat/layout.h"
#include "zeroflat/size.h"
#include "zeroflat/zero3.h"

namespace zeroflat {
namespace {

namespace fs = std::filesystem;

// The most files a checkpoint folder may hold (universal ones: four per parameter).
constexpr std::uint64_t kMaxFolderEntries = 4'000'000;
constexpr std::uint64_t kMaxRanks = kMaxDp;

std::string shown(const std::string& path) { return printable(path, 200); }

// "123" -> 123; anything else (empty, a sign, more than 9 digits) -> nullopt.
std::optional<std::uint64_t> digits(std::string_view s) {
  if (s.empty() || s.size() > 9) return std::nullopt;
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

bool starts(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Rank 0's file name (zero_pp_rank_0_...) as rank r's, for messages naming a missing file.
std::string rank_file_name(const std::string& rank0, std::uint64_t r) {
  constexpr std::string_view kRank0 = "zero_pp_rank_0_";
  const std::size_t at = rank0.find(kRank0);
  if (at == std::string::npos) return "rank " + std::to_string(r) + "'s file";
  return printable(rank0.substr(0, at)) + "zero_pp_rank_" + std::to_string(r) + "_" +
         printable(rank0.substr(at + kRank0.size()));
}

// What a file name of a tag folder is.
struct Named {
  enum Kind { kOther, kModel, kZero3Model, kOptim, kExpert, kLayer } kind = kOther;
  std::uint64_t rank = 0;
  std::uint64_t mp = 0;
  bool bf16 = false;
  bool old_name = false;  // "..._mp_rank_00optim_states.pt"
};

Named classify(std::string_view name) {
  Named out;
  if (!ends(name, ".pt")) return out;
  if (starts(name, "expp_rank_") || name.find("expert_") != std::string_view::npos) {
    out.kind = Named::kExpert;
    return out;
  }
  if (starts(name, "layer_")) {
    out.kind = Named::kLayer;
    return out;
  }
  // mp_rank_XX_model_states.pt
  if (starts(name, "mp_rank_") && ends(name, "_model_states.pt")) {
    const auto mp = digits(name.substr(8, name.size() - 8 - 16));
    if (mp) {
      out.kind = Named::kModel;
      out.mp = *mp;
    }
    return out;
  }
  std::string_view rest = name;
  if (starts(rest, "bf16_")) {
    out.bf16 = true;
    rest.remove_prefix(5);
  }
  if (!starts(rest, "zero_pp_rank_")) return out;
  rest.remove_prefix(13);
  const std::size_t cut = rest.find("_mp_rank_");
  if (cut == std::string_view::npos) return out;
  const auto rank = digits(rest.substr(0, cut));
  rest.remove_prefix(cut + 9);
  Named::Kind kind = Named::kOther;
  std::string_view mp_text;
  if (!out.bf16 && ends(rest, "_model_states.pt")) {
    kind = Named::kZero3Model;
    mp_text = rest.substr(0, rest.size() - 16);
  } else if (ends(rest, "_optim_states.pt")) {
    kind = Named::kOptim;
    mp_text = rest.substr(0, rest.size() - 16);
  } else if (ends(rest, "optim_states.pt")) {
    kind = Named::kOptim;
    out.old_name = true;
    mp_text = rest.substr(0, rest.size() - 15);
  }
  const auto mp = digits(mp_text);
  if (kind == Named::kOther || !rank || !mp) return out;
  out.kind = kind;
  out.rank = *rank;
  out.mp = *mp;
  return out;
}

bool same_value(const TorchValue& a, const TorchValue& b) {
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

  const TorchFile& torch(std::uint32_t f) const { return ck_.files[f].torch; }
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

  void zero12(std::uint32_t model, const std::vector<std::uint32_t>& optims) {
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

  void zero3(const std::vector<std::uint32_t>& models, const std::vector<std::uint32_t>& optims) {
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

  void universal(std::uint32_t model, const std::string& zero_dir) {
    // Trained parameters in group order from the model file; every parameter's files.
    const TorchValue& ps = torch(model).at("param_shapes");
    if (!ps.is_sequence()) {
      throw fail(model, "param_shapes", "expected a list of groups, found " +
                                            std::string(torch_kind_name(ps.kind)));
    }
    const bool zero3 = ck_.zero_stage == 3;
    ck_.round_robin = !zero3 && config_flag("zero_optimization/round_robin_gradients");
    for (std::uint64_t g = 0; g < ps.items.size(); ++g) {
      std::vector<DeepSpeedParam> flat = shapes(model, "param_shapes/" + std::to_string(g));
      DeepSpeedGroup group;
      std::vector<std::uint64_t> order;
      const std::uint64_t n = flat.size();
      if (ck_.round_robin) {
        for (std::uint64_t b = 0; b < ck_.world; ++b) {
          for (std::uint64_t i = b; i < n; i += ck_.world) order.push_back(i);
        }
      } else {
        for (std::uint64_t i = 0; i < n; ++i) order.push_back(i);
      }
      group.params.resize(n);
      for (std::uint64_t k = 0; k < n; ++k) {
        group.numel += flat[k].numel;
        flat[k].sub_group = g;
        group.params[order[k]] = std::move(flat[k]);
      }
      group.flat_numel = group.numel;
      // Stage 3's param_shapes lists sub-groups: several may belong to one optimizer group,
      // which the universal files do not say; each is taken as a group of its own.
      ck_.groups.push_back(std::move(group));
    }
    std::map<std::string, std::uint64_t> index;
    for (std::uint64_t i = 0; i < ck_.universal.size(); ++i) index[ck_.universal[i].name] = i;
    for (const DeepSpeedGroup& g : ck_.groups) {
      for (const DeepSpeedParam& p : g.params) {
        auto it = index.find(p.name);
        if (it == index.end()) {
          throw InvalidArgument(shown(zero_dir) + ": no folder of parameter '" +
                                printable(p.name) + "' (" + name(model) +
                                "'s param_shapes lists it)");
        }
        const DeepSpeedUniversalParam& u = ck_.universal[it->second];
        bool has_fp32 = false;
        for (const DeepSpeedState& s : u.tensors) has_fp32 = has_fp32 || s.name == "fp32";
        if (!has_fp32) {
          throw InvalidArgument(shown(zero_dir) + "/" + printable(p.name) +
                                "/fp32.pt: missing (every trained parameter's folder holds its "
                                "fp32 master weights)");
        }
        for (const DeepSpeedState& s : u.tensors) {
          if (s.name == "step") continue;
          if (s.tensor.numel != p.numel) {
            throw fail(s.tensor.file, s.tensor.path,
                       std::to_string(s.tensor.numel) + " elements, but parameter '" +
                           printable(p.name) + "' has shape " + shape_to_string(p.shape));
          }
        }
      }
    }
  }

 private:
  DeepSpeedCheckpoint& ck_;
  std::optional<std::uint32_t> config_;
};

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' ||
                        s.back() == '\t')) {
    s.pop_back();
  }
  std::size_t b = 0;
  while (b < s.size() && (s[b] == ' ' || s[b] == '\t')) ++b;
  return s.substr(b);
}

void check_tag(const std::string& tag, const std::string& where) {
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos ||
      tag.find('\0') != std::string::npos || tag.size() > 255) {
    throw InvalidArgument(where + ": tag '" + printable(tag, 200) +
                          "' is not a folder name (expected the name of a folder beside it)");
  }
}

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}
bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

std::vector<std::string> list_folder(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) {
    throw InvalidArgument(shown(dir.string()) + ": cannot list the folder (" + ec.message() + ")");
  }
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) throw InvalidArgument(shown(dir.string()) + ": listing failed (" + ec.message() + ")");
    if (out.size() >= kMaxFolderEntries) {
      throw InvalidArgument(shown(dir.string()) + ": more than " + format_count(kMaxFolderEntries) +
                            " entries");
    }
    out.push_back(it->path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::uint32_t add_file(DeepSpeedCheckpoint& ck, const fs::path& path, const std::string& role,
                       std::int64_t rank) {
  DeepSpeedFile f;
  f.path = path.string();
  f.role = role;
  f.rank = rank;
  f.torch = read_torch_file(f.path);
  ck.files.push_back(std::move(f));
  return static_cast<std::uint32_t>(ck.files.size() - 1);
}

}  // namespace

std::string_view deepspeed_format_name(DeepSpeedFormat format) noexcept {
  switch (format) {
    case DeepSpeedFormat::kZero12: return "zero-1/2";
    case DeepSpeedFormat::kZero3: return "zero-3";
    case DeepSpeedFormat::kUniversal: return "universal";
  }
  return "?";
}

const DeepSpeedTensor* DeepSpeedCheckpoint::find_module(std::string_view name) const {
  for (const DeepSpeedTensor& t : module) {
    if (std::string_view(t.path).substr(0, 7) == "module/") {
      TorchValue k;
      k.kind = TorchKind::kString;
      k.text = std::string(name);
      if (t.path.compare(7, std::string::npos, torch_path_segment(k)) == 0) return &t;
    }
  }
  return nullptr;
}

bool is_deepspeed_checkpoint(const std::string& dir) noexcept {
  try {
    if (dir.find('\0') != std::string::npos) return false;
    const fs::path root(dir);
    if (!is_dir(root)) return false;
    if (is_file(root / "latest") || is_file(root / "latest_universal")) return true;
    if (is_dir(root / "zero") && is_file(root / "mp_rank_00_model_states.pt")) return true;
    std::error_code ec;
    std::uint64_t seen = 0;
    for (fs::directory_iterator it(root, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      if (++seen > 100'000) break;
      const Named n = classify(it->path().filename().string());
      if (n.kind != Named::kOther) return true;
    }
    return false;
  } catch (...) {
    return false;
  }
}

DeepSpeedCheckpoint open_deepspeed_checkpoint(const std::string& dir,
                                              const std::optional<std::string>& tag) {
  detail::check_path(dir);
  const fs::path root(dir);
  if (!is_dir(root)) {
    throw InvalidArgument(shown(dir) + ": not a folder (expected a DeepSpeed checkpoint folder: "
                          "the one holding 'latest', or a tag folder)");
  }
  DeepSpeedCheckpoint ck;
  fs::path folder = root;
  if (tag) {
    check_tag(*tag, shown(dir));
    folder = root / *tag;
    if (!is_dir(folder)) {
      throw InvalidArgument(shown(dir) + ": no folder for tag '" + printable(*tag, 200) + "'");
    }
    ck.tag = *tag;
  } else {
    for (const char* latest : {"latest", "latest_universal"}) {
      const fs::path file = root / latest;
      if (!is_file(file)) continue;
      const std::string t = trim(detail::read_small_file(file.string(), 4096, "a 'latest' file"));
      check_tag(t, shown(file.string()));
      folder = root / t;
      if (!is_dir(folder)) {
        throw InvalidArgument(shown(file.string()) + " names tag '" + printable(t, 200) +
                              "', but there is no folder " + shown((root / t).string()));
      }
      ck.tag = t;
      break;
    }
    if (ck.tag.empty()) ck.tag = fs::absolute(root).lexically_normal().filename().string();
    if (ck.tag.empty()) ck.tag = fs::absolute(root).lexically_normal().parent_path().filename().string();
  }
  ck.dir = folder.string();

  // The files of the tag.
  std::vector<std::pair<std::uint64_t, std::string>> optim_names, zero3_model_names;
  std::string model_name;
  bool bf16_names = false;
  for (const std::string& entry : list_folder(folder)) {
    const Named n = classify(entry);
    const std::string here = shown((folder / entry).string());
    switch (n.kind) {
      case Named::kOther: continue;
      case Named::kExpert:
        throw Unsupported(here + ": an MoE expert checkpoint file; zeroflat reads checkpoints "
                          "without expert parallelism only");
      case Named::kLayer:
        throw Unsupported(here + ": a pipeline-parallel layer file; zeroflat reads checkpoints "
                          "without pipeline parallelism only");
      default: break;
    }
    if (n.mp != 0) {
      throw Unsupported(here + ": model parallel rank " + std::to_string(n.mp) +
                        "; model (tensor) parallel checkpoints are not supported (expected "
                        "mp_rank_00 only)");
    }
    if (n.kind == Named::kModel) model_name = entry;
    if (n.kind == Named::kZero3Model) zero3_model_names.emplace_back(n.rank, entry);
    if (n.kind == Named::kOptim) {
      optim_names.emplace_back(n.rank, entry);
      bf16_names = bf16_names || n.bf16;
    }
  }
  const bool universal = is_dir(folder / "zero");
  auto by_rank = [&](std::vector<std::pair<std::uint64_t, std::string>>& names,
                     const char* what) {
    std::sort(names.begin(), names.end());
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (i > 0 && names[i].first == names[i - 1].first) {
        throw InvalidArgument(shown(ck.dir) + ": two " + what + " files of rank " +
                              std::to_string(names[i].first) + ": " + names[i - 1].second +
                              " and " + names[i].second +
                              " (files of two runs in one folder? DeepSpeed would read one)");
      }
      if (names[i].first != i) {
        throw InvalidArgument(shown(ck.dir) + ": no " + what + " file of rank " +
                              std::to_string(i) + " (found " + names[i].second +
                              "): every rank's file must be there");
      }
      if (i >= kMaxRanks) throw InvalidArgument(shown(ck.dir) + ": more than 2^20 ranks");
    }
  };
  by_rank(optim_names, "optimizer");
  by_rank(zero3_model_names, "model-states");

  Builder b(ck);
  if (universal) {
    ck.format = DeepSpeedFormat::kUniversal;
    std::string model = model_name;
    if (model.empty() && !zero3_model_names.empty()) model = zero3_model_names.front().second;
    if (model.empty()) {
      throw InvalidArgument(shown(ck.dir) + ": a universal checkpoint (it has zero/) without "
                            "mp_rank_00_model_states.pt beside it");
    }
    // Converted from ZeRO-3, it keeps every saving rank's model-states file (their frozen
    // parameters' fragments).
    std::vector<std::uint32_t> per_rank;
    std::uint32_t m = 0;
    if (model_name.empty()) {
      for (const auto& [r, name] : zero3_model_names) {
        per_rank.push_back(add_file(ck, folder / name, "model", static_cast<std::int64_t>(r)));
      }
      m = per_rank.front();
    } else {
      m = add_file(ck, folder / model, "model", -1);
    }
    const fs::path zero = folder / "zero";
    for (const std::string& pname : list_folder(zero)) {
      const fs::path pdir = zero / pname;
      if (!is_dir(pdir)) {
        if (pname == "optimizer_state.pt") add_file(ck, pdir, "universal-common", -1);
        continue;
      }
      DeepSpeedUniversalParam u;
      u.name = pname;
      for (const std::string& fname : list_folder(pdir)) {
        if (!ends(fname, ".pt") || !is_file(pdir / fname)) continue;
        const std::uint32_t f = add_file(ck, pdir / fname, "universal", -1);
        ck.files[f].param = pname;
        ck.files[f].state = fname.substr(0, fname.size() - 3);
        const TorchFile& t = ck.files[f].torch;
        const TorchTensor* tensor = t.find_tensor("param");
        if (tensor == nullptr) tensor = t.find_tensor("");
        if (tensor == nullptr && ck.files[f].state == "step") {
          // ds_to_universal saves the step as the optimizer kept it: a tensor, or a number
          // (BF16_Optimizer and ZeRO-1 keep a Python int), as itself or under 'param'.
          const TorchValue* v = t.find("param");
          if (v == nullptr) v = t.find("");
          if (v != nullptr && (v->kind == TorchKind::kInt || v->kind == TorchKind::kFloat)) {
            continue;  // a value the resume reads whole, not a tensor of the parameter
          }
        }
        if (tensor == nullptr) {
          throw InvalidArgument(shown(ck.files[f].path) +
                                ": expected a tensor, or a dict with the tensor under 'param'" +
                                (ck.files[f].state == "step" ? " (or, for step.pt, a number)" : ""));
        }
        u.tensors.push_back({ck.files[f].state, b.from(f, *tensor)});
        if (ck.files[f].state == "fp32") {
          u.shape = tensor->shape;
          u.numel = tensor->numel;
        }
      }
      if (u.tensors.empty()) continue;
      ck.universal.push_back(std::move(u));
    }
    b.agree({m});
    const TorchValue* stage = b.config("zero_optimization/stage");
    ck.zero_stage = stage && stage->kind == TorchKind::kInt ? static_cast<int>(stage->integer) : 2;
    ck.world = ck.files[m].torch.find("dp_world_size") ? b.count(m, "dp_world_size") : 1;
    if (ck.world == 0 || ck.world > kMaxRanks) {
      throw b.fail(m, "dp_world_size", std::to_string(ck.world) + " ranks (expected 1 to " +
                                           std::to_string(kMaxRanks) + ")");
    }
    b.worlds(m, ck.world);
    b.module_of(m);
    b.universal(m, zero.string());
    b.frozen_of(m, per_rank);
    b.dtype_of(false);
    b.bookkeeping(m, m);
    return ck;
  }

  if (optim_names.empty()) {
    if (model_name.empty() && zero3_model_names.empty()) {
      throw InvalidArgument(
          shown(ck.dir) + ": no DeepSpeed checkpoint here: expected mp_rank_00_model_states.pt "
          "(ZeRO-1/2) or zero_pp_rank_R_mp_rank_00_model_states.pt (ZeRO-3) with "
          "{bf16_}zero_pp_rank_R_mp_rank_00_optim_states.pt per rank, a 'latest' file naming "
          "the tag folder, or a universal checkpoint's zero/ folder");
    }
    throw InvalidArgument(shown(ck.dir) + ": model states but no ZeRO optimizer files "
                          "({bf16_}zero_pp_rank_R_mp_rank_00_optim_states.pt): saved without "
                          "ZeRO, or without the optimizer");
  }
  const bool zero3 = !zero3_model_names.empty();
  if (zero3 && !model_name.empty()) {
    throw InvalidArgument(shown(ck.dir) + ": both " + model_name +
                          " (ZeRO-1/2) and zero_pp_rank_*_model_states.pt files (ZeRO-3): "
                          "files of two runs in one folder");
  }
  if (!zero3 && model_name.empty()) {
    throw InvalidArgument(shown(ck.dir) + ": optimizer files but no mp_rank_00_model_states.pt "
                          "(ZeRO-1/2) or zero_pp_rank_R_mp_rank_00_model_states.pt (ZeRO-3)");
  }
  if (zero3 && zero3_model_names.size() != optim_names.size()) {
    // Both lists hold ranks 0, 1, ...: the shorter one lacks the next rank's file.
    const auto& fewer = zero3_model_names.size() < optim_names.size() ? zero3_model_names
                                                                      : optim_names;
    throw InvalidArgument(shown(ck.dir) + ": model-states files of " +
                          std::to_string(zero3_model_names.size()) + " ranks, optimizer files of " +
                          std::to_string(optim_names.size()) +
                          " (expected one of each per rank): " +
                          rank_file_name(fewer.front().second, fewer.size()) + " is missing");
  }
  ck.format = zero3 ? DeepSpeedFormat::kZero3 : DeepSpeedFormat::kZero12;
  ck.world = optim_names.size();
  std::vector<std::uint32_t> models, optims, all;
  if (zero3) {
    for (const auto& [r, n] : zero3_model_names) {
      models.push_back(add_file(ck, folder / n, "model", static_cast<std::int64_t>(r)));
    }
  } else {
    models.push_back(add_file(ck, folder / model_name, "model", -1));
  }
  for (const auto& [r, n] : optim_names) {
    optims.push_back(add_file(ck, folder / n, "optim", static_cast<std::int64_t>(r)));
  }
  all = models;
  all.insert(all.end(), optims.begin(), optims.end());
  b.agree(all);
  b.stages(optims, zero3 ? 3 : 2);
  b.module_of(models.front());
  if (zero3) {
    b.zero3(models, optims);
  } else {
    b.zero12(models.front(), optims);
  }
  for (std::uint32_t m : models) b.worlds(m, ck.world);
  b.frozen_of(models.front(), models);
  b.dtype_of(bf16_names);
  b.bookkeeping(models.front(), optims.front());
  return ck;
}

}  // namespace zeroflat
