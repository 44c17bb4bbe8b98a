// `zeroflat inspect`: what a checkpoint, a .safetensors file or a config.json holds.
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/common.h"
#include "zeroflat/model_source.h"
#include "zeroflat/size.h"

namespace zeroflat::cli {

int subcommand_inspect(const std::vector<std::string>& argv) {
  Parser p("inspect", "PATH [--json] [--largest N]",
           "Reads a checkpoint directory (*.safetensors, optionally with\n"
           "model.safetensors.index.json), a single .safetensors file, or a Hugging Face\n"
           "config.json, headers only, and reports the tensor count, parameter count, bytes per\n"
           "dtype and the largest tensors. Every field of an untrusted file is checked: a\n"
           "malformed one is exit 2 with the file and the problem named.");
  p.option("largest", "N", "how many of the largest tensors to list", "5");
  p.flag("json", "print one JSON document");
  p.allow_positionals(1);
  p.epilog(
      "examples:\n  zeroflat inspect model.safetensors\n  zeroflat inspect ./Qwen3-30B-A3B/\n"
      "  zeroflat inspect config.json --json");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  if (args.positionals().empty()) throw UsageError("give the PATH to inspect");
  std::uint64_t largest = 5;
  if (auto v = args.get("largest")) largest = parse_u64(*v, "--largest");
  const std::string path = args.positionals()[0];
  Inspection in = inspect_path(path);
  std::vector<const TensorInfo*> order;
  for (const TensorInfo& t : in.tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(),
                   [](const TensorInfo* a, const TensorInfo* b) { return a->bytes > b->bytes; });
  if (order.size() > largest) order.resize(largest);
  if (args.has("json")) {
    nlohmann::ordered_json doc;
    doc["path"] = path;
    doc["source"] = in.source;
    doc["files"] = in.files;
    doc["tensors"] = in.tensors.size();
    doc["numel"] = in.numel;
    doc["bytes"] = in.bytes;
    doc["dtypes"] = nlohmann::ordered_json::object();
    for (const auto& [d, b] : in.bytes_by_dtype) doc["dtypes"][d] = b;
    doc["largest"] = nlohmann::ordered_json::array();
    for (const TensorInfo* t : order) {
      doc["largest"].push_back({{"name", t->name},
                                {"dtype", t->dtype},
                                {"shape", t->shape},
                                {"numel", t->numel},
                                {"bytes", t->bytes}});
    }
    std::printf("%s\n",
                doc.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    return kExitOk;
  }
  std::printf("%s (%s, %llu file%s): %s tensors, %s parameters, %s\n",
              printable(path, 200).c_str(),
              in.source.c_str(), static_cast<unsigned long long>(in.files),
              in.files == 1 ? "" : "s", format_count(in.tensors.size()).c_str(),
              format_count(in.numel).c_str(), format_bytes(in.bytes).c_str());
  for (const auto& [d, b] : in.bytes_by_dtype) {
    std::printf("  %-8s %s\n", printable(d).c_str(), format_bytes(b).c_str());
  }
  if (!order.empty()) std::printf("largest:\n");
  for (const TensorInfo* t : order) {
    // Names come from the file: printable characters only, whatever it holds.
    std::printf("  %-56s %-6s %-20s %s\n", printable(t->name, 53).c_str(),
                printable(t->dtype).c_str(),
                shape_to_string(t->shape).c_str(), format_bytes(t->bytes).c_str());
  }
  return kExitOk;
}

}  // namespace zeroflat::cli
