// The command line's model and layout options: which model (a catalog name, a file, or a
// Hugging Face hub id in the local cache), which layout options, and which DeepSpeed release's
// rules (cli/common.h).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "cli/common.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat::cli {
namespace {

namespace fs = std::filesystem;

// "org/name": one slash between two non-empty parts of the characters hub ids are made of.
bool looks_like_hub_id(const std::string& s) {
  const auto slash = s.find('/');
  if (slash == std::string::npos || slash == 0 || slash + 1 == s.size() ||
      s.find('/', slash + 1) != std::string::npos || s.size() > 200) {
    return false;
  }
  const std::string org = s.substr(0, slash), name = s.substr(slash + 1);
  if (org == "." || org == ".." || name == "." || name == "..") return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '/' || c == '-' || c == '_' ||
           c == '.';
  });
}

}  // namespace

std::string terminal_text(std::string_view text) {
  std::string out(text);
  for (char& c : out) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t') || u == 0x7f) c = '?';
  }
  return out;
}

std::string resolve_model_path(const std::string& name_or_path) {
  std::error_code ec;
  if (catalog_config(name_or_path) || fs::exists(fs::symlink_status(name_or_path, ec)) ||
      !looks_like_hub_id(name_or_path)) {
    return name_or_path;
  }
  const std::string cache = hf_hub_cache();
  const std::string id = name_or_path;
  if (cache.empty()) {
    throw InvalidArgument(
        "'" + printable(id) +
        "' is not a path here, and no Hugging Face hub cache is set (HF_HUB_CACHE, "
        "HF_HOME or HOME) to look for it as a hub id; zeroflat downloads nothing");
  }
  // huggingface_hub's layout: models--ORG--NAME/refs/main holds the revision of
  // snapshots/REVISION/, whose files are links into blobs/.
  const fs::path repo = fs::path(cache) / ("models--" + id.substr(0, id.find('/')) + "--" +
                                           id.substr(id.find('/') + 1));
  if (!fs::is_directory(repo, ec)) {
    throw InvalidArgument("'" + printable(id) +
                          "' is not a path here, nor in the Hugging Face hub cache (" +
                          printable(repo.string(), 200) +
                          " does not exist); zeroflat downloads nothing: fetch it first (for "
                          "example `huggingface-cli download " +
                          printable(id) + "`)");
  }
  std::string revision;
  if (std::ifstream ref(repo / "refs" / "main"); ref) {
    std::getline(ref, revision);
    while (!revision.empty() && std::isspace(static_cast<unsigned char>(revision.back()))) {
      revision.pop_back();
    }
    if (revision.empty() || revision.find('/') != std::string::npos || revision == "." ||
        revision == "..") {
      throw InvalidArgument(printable((repo / "refs" / "main").string(), 200) +
                            ": expected a revision, found '" + printable(revision) + "'");
    }
  } else {
    // No main ref (a revision fetched by hash): the only snapshot, if there is one.
    std::vector<std::string> snapshots;
    for (const auto& e : fs::directory_iterator(repo / "snapshots", ec)) {
      if (e.is_directory(ec)) snapshots.push_back(e.path().filename().string());
    }
    if (snapshots.size() != 1) {
      throw InvalidArgument(printable(repo.string(), 200) + " has no refs/main and " +
                            std::to_string(snapshots.size()) +
                            " snapshots: name the one to use by its path (" +
                            printable((repo / "snapshots").string(), 200) + "/REVISION)");
    }
    revision = snapshots.front();
  }
  const fs::path snapshot = repo / "snapshots" / revision;
  if (!fs::is_directory(snapshot, ec)) {
    throw InvalidArgument("'" + printable(id) + "': the hub cache's refs/main names revision " +
                          printable(revision) + ", which has no snapshot (" +
                          printable(snapshot.string(), 200) + ")");
  }
  return snapshot.string();
}

void add_model_options(Parser& parser, const std::string& default_model) {
  const std::string names = join(catalog_names());
  parser.option("model", "NAME|PATH",
                "a catalog model (" + names +
                    "), a config.json, a checkpoint directory or .safetensors file, or a Hugging "
                    "Face hub id (org/name) already in the local hub cache",
                default_model);
  parser.option("layers", "L", "decoder layers (fewer than the model's scales it down)");
  parser.option("experts", "E", "experts per MoE layer (fewer scales it down)");
}

ModelSpec model_from_args(const Args& args, const std::string& default_model) {
  ModelOverrides overrides;
  if (auto v = args.get("layers")) overrides.layers = parse_u64(*v, "--layers");
  if (auto v = args.get("experts")) overrides.experts = parse_u64(*v, "--experts");
  const std::string given = args.get("model").value_or(default_model);
  const std::string path = resolve_model_path(given);
  ModelSpec m = load_model(path, overrides);
  if (path != given) m.name = given;  // a hub id: named as the user named it
  return m;
}

void add_layout_options(Parser& parser) {
  parser.option("dp", "P", "data-parallel size: ranks sharing the group", "1");
  parser.flag("round-robin", "DeepSpeed's round_robin_gradients order (bucket i mod P)");
  parser.option("alignment-factor", "A",
                "pad the buffer to a multiple of A * P elements (nccl_start_alignment_factor)",
                "2");
  parser.option("dtype", "T", "element type: bf16, fp16 or fp32",
                "the model's own (a config's dtype or torch_dtype, a checkpoint's), else bf16");
  parser.option("param-align-bytes", "B",
                "start every parameter after the first at a multiple of B bytes (0: packed)", "0");
  parser.option("deepspeed", "V",
                "lay the group out as DeepSpeed release V does (0.14.0 and later, or latest): "
                "the parameters it leaves out (frozen; zero-element from 0.19.8) are reported, "
                "not laid out; none: zeroflat's own layout (docs/layout.md), every parameter in "
                "place",
                "latest, or none where --alignment-factor or --param-align-bytes ask for a "
                "layout no release builds");
}

void add_stage_options(Parser& parser) {
  parser.option("stage", "S",
                "the ZeRO stage: 1 or 2 (DeepSpeedZeroOptimizer's flat buffer, the same layout "
                "for both) or 3 (each parameter partitioned on its own over the --dp ranks, "
                "p = ceil(n / dp) elements each, every rank's partitions back to back as "
                "DeepSpeedZeroOptimizer_Stage3's buffer, cut into sub-groups)",
                "2");
  parser.option("sub-group-size", "N",
                "with --stage 3: zero_optimization.sub_group_size, the partition elements at "
                "which Stage 3 closes a sub-group",
                "1000000000, DeepSpeed's");
}

StageChoice stage_from_args(const Args& args) {
  StageChoice out;
  if (auto v = args.get("stage")) {
    const std::uint64_t stage = parse_u64(*v, "--stage");
    if (stage < 1 || stage > 3) {
      throw InvalidArgument("--stage " + printable(*v) + ": expected 1, 2 or 3");
    }
    out.zero3 = stage == 3;
  }
  if (auto v = args.get("sub-group-size")) {
    if (!out.zero3) {
      throw InvalidArgument("--sub-group-size cuts ZeRO-3's sub-groups: it needs --stage 3");
    }
    out.sub_group_size = parse_u64(*v, "--sub-group-size");
  }
  if (out.zero3) {
    for (const char* o : {"round-robin", "alignment-factor", "param-align-bytes"}) {
      if (args.has(o)) {
        throw InvalidArgument(std::string("--") + o +
                              " shapes ZeRO-1/2's flat buffer; --stage 3 pads each parameter "
                              "to the ranks and packs the partitions back to back");
      }
    }
  }
  return out;
}

std::optional<ReleaseRules> release_from_args(const Args& args, const LayoutOptions& options) {
  if (auto v = args.get("deepspeed")) {
    if (*v == "none") return std::nullopt;
    ReleaseRules rules = deepspeed_rules(*v);
    try {
      check_release_options(options, rules);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("--deepspeed " + printable(*v) + ": " + e.what() +
                            " (--deepspeed none lays it out as zeroflat's own layout)");
    }
    return rules;
  }
  // The default (no DeepSpeed here to ask: the newest release's), unless the options ask for
  // what no release builds.
  ReleaseRules rules = default_deepspeed_rules();
  try {
    check_release_options(options, rules);
  } catch (const InvalidArgument&) {
    return std::nullopt;
  }
  return rules;
}

std::string rules_text(const std::optional<ReleaseRules>& rules) {
  if (!rules) return "zeroflat's own layout (--deepspeed none)";
  std::string text = "DeepSpeed " + printable(rules->release) + "'s rules";
  if (rules->rules != rules->release) text += " (those of " + rules->rules + ")";
  return text + (rules->tested ? "" : ", untested");
}

nlohmann::ordered_json rules_doc(const std::optional<ReleaseRules>& rules) {
  if (!rules) return nullptr;
  return {{"release", rules->release}, {"rules", rules->rules}, {"tested", rules->tested}};
}

std::string apply_release(const std::optional<ReleaseRules>& rules, ModelSpec& model,
                          const LayoutOptions& options) {
  if (!rules) return "";
  const ReleaseLayout rl = layout_for_release(model.numels(), {}, options, *rules);
  if (rl.left_out.empty()) return "";
  std::vector<TensorSpec> kept;
  for (std::uint64_t i : rl.kept) kept.push_back(model.tensors[i]);
  model.tensors = std::move(kept);
  return "DeepSpeed " + rules->release + " leaves " + std::to_string(rl.left_out.size()) +
         " zero-element tensor(s) out of the group (--deepspeed none keeps them)";
}

LayoutOptions layout_options_from_args(const Args& args, const ModelSpec* model) {
  LayoutOptions o;
  if (auto v = args.get("dp")) {
    o.dp = parse_u64(*v, "--dp");
    if (o.dp == 0) throw InvalidArgument("--dp 0: the data-parallel size must be at least 1");
  }
  o.round_robin = args.has("round-robin");
  if (auto v = args.get("alignment-factor")) {
    o.alignment_factor = parse_u64(*v, "--alignment-factor");
    if (o.alignment_factor == 0) {
      throw InvalidArgument("--alignment-factor 0: it must be at least 1");
    }
  }
  if (auto v = args.get("dtype")) {
    o.dtype = parse_dtype(*v);
  } else if (model != nullptr && model->dtype) {
    o.dtype = *model->dtype;
  }
  if (auto v = args.get("param-align-bytes")) {
    o.param_align_bytes = parse_u64(*v, "--param-align-bytes");
  }
  try {
    validate(o);
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    if (msg.rfind("param_align_bytes", 0) == 0) msg = "--param-align-bytes" + msg.substr(17);
    throw InvalidArgument(msg);
  }
  return o;
}

}  // namespace zeroflat::cli
