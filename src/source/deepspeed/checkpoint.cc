// DeepSpeed checkpoint folders (deepspeed_checkpoint.h): which files a tag holds, their saved
// states read safely, and everything the files say checked against each other. The builder's
// checks common to every format are in builder.h; each format's own in checkpoint_zero12.cc,
// checkpoint_zero3.cc and checkpoint_universal.cc.
#include <algorithm>
#include <charconv>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "model/files.h"
#include "model/torch_file.h"
#include "source/deepspeed/builder.h"
#include "source/saved_state.h"
#include "zeroflat/common.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/layout.h"

namespace zeroflat {
namespace {

using detail::Builder;
using detail::kMaxRanks;
using detail::rank_file_name;
using detail::shown;
namespace fs = std::filesystem;


// The most files a checkpoint folder may hold (universal ones: four per parameter).
constexpr std::uint64_t kMaxFolderEntries = 4'000'000;


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
// A 'latest' to read: a regular file, or anything else under that name but a folder or a
// dangling link (a FIFO, a device: read, and refused by name). A folder named so (as a
// 'latest -> checkpoint-1000' link beside a model's safetensors) and a dangling link are not a
// DeepSpeed 'latest', as DeepSpeed's own os.path.isfile says.
bool present(const fs::path& p) {
  std::error_code ec;
  const fs::file_status st = fs::status(p, ec);
  return fs::exists(st) && !fs::is_directory(st);
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
  auto saved = std::make_shared<detail::SavedFile>();
  saved->torch = read_torch_file(f.path);
  f.file_bytes = saved->torch.file_bytes;
  f.stamp = saved->torch.stamp;
  f.tensors = saved->torch.tensors.size();
  f.globals = saved->torch.globals;
  f.saved = std::move(saved);
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

const TorchFile& deepspeed_file_state(const DeepSpeedCheckpoint& ck, std::size_t file) {
  const DeepSpeedFile& f = ck.files.at(file);
  if (f.saved == nullptr) {
    throw InvalidArgument(shown(f.path) +
                          ": a file the checkpoint describes without having read it");
  }
  return f.saved->torch;
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
    if (present(root / "latest") || present(root / "latest_universal")) return true;
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
      if (!present(file)) continue;
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
        const TorchFile& t = b.torch(f);
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
    ck.world = b.torch(m).find("dp_world_size") ? b.count(m, "dp_world_size") : 1;
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
