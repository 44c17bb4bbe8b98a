// Options shared by subcommands: model selection, layout options, element-count lists.
#include "zeroflat/model_source.h"

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "zeroflat/common.h"
#include "zeroflat/error.h"
#include "zeroflat/size.h"

namespace zeroflat::cli {

void add_model_options(Parser& parser, const std::string& default_model) {
  std::string names;
  for (const std::string& n : catalog_names()) names += (names.empty() ? "" : ", ") + n;
  parser.option("model", "NAME|PATH",
                "a catalog model (" + names +
                    "), a config.json, or a checkpoint directory or .safetensors file",
                default_model);
  parser.option("layers", "L", "keep only the first L decoder layers");
  parser.option("experts", "E", "keep only E experts per MoE layer");
}

ModelSpec model_from_args(const Args& args, const std::string& default_model) {
  ModelOverrides overrides;
  if (auto v = args.get("layers")) overrides.layers = parse_u64(*v, "--layers");
  if (auto v = args.get("experts")) overrides.experts = parse_u64(*v, "--experts");
  return load_model(args.get("model").value_or(default_model), overrides);
}

void add_layout_options(Parser& parser) {
  parser.option("dp", "P", "data-parallel size: ranks sharing the group", "1");
  parser.flag("round-robin", "DeepSpeed's round_robin_gradients order (bucket i mod P)");
  parser.option("alignment-factor", "A",
                "pad the buffer to a multiple of A * P elements (nccl_start_alignment_factor)",
                "2");
  parser.option("dtype", "T", "element type: bf16, fp16 or fp32", "bf16");
  parser.option("param-align-bytes", "B",
                "start every parameter after the first at a multiple of B bytes (0: packed)", "0");
}

LayoutOptions layout_options_from_args(const Args& args) {
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
  if (auto v = args.get("dtype")) o.dtype = parse_dtype(*v);
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

namespace {

std::vector<std::uint64_t> parse_list(const std::string& text, const std::string& source) {
  std::vector<std::uint64_t> out;
  std::string item;
  std::size_t line = 1;
  std::size_t item_line = 1;
  auto flush = [&] {
    if (item.empty()) return;
    std::string what = "element count #" + std::to_string(out.size() + 1) + " of " + source +
                       (source == "--numels" ? "" : " (line " + std::to_string(item_line) + ")");
    out.push_back(parse_u64(item, what));
    item.clear();
  };
  for (char c : text) {
    if (c == ',' || std::isspace(static_cast<unsigned char>(c)) != 0) {
      flush();
      if (c == '\n') ++line;
      continue;
    }
    if (item.empty()) item_line = line;
    item += c;
  }
  flush();
  return out;
}

}  // namespace

std::vector<std::uint64_t> parse_numels(const std::string& text) {
  if (text.empty() || text.find_first_not_of(" \t\n,") == std::string::npos) {
    throw InvalidArgument("--numels is empty: expected element counts such as 5,7,3 or @FILE");
  }
  if (text[0] != '@') return parse_list(text, "--numels");
  const std::string path = text.substr(1);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument("--numels " + text + ": cannot read '" + path + "'");
  std::ostringstream buf;
  buf << in.rdbuf();
  const std::string content = buf.str();
  const std::size_t first = content.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) {
    throw InvalidArgument("'" + path + "' holds no element counts");
  }
  if (content[first] != '[') return parse_list(content, "'" + path + "'");
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(content);
  } catch (const nlohmann::json::parse_error& e) {
    throw InvalidArgument("'" + path + "' is not valid JSON: " + e.what());
  }
  std::vector<std::uint64_t> out;
  for (std::size_t i = 0; i < doc.size(); ++i) {
    const nlohmann::json& v = doc[i];
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0)) {
      throw InvalidArgument("'" + path + "': item " + std::to_string(i) + " (" + v.dump() +
                            ") is not a non-negative integer");
    }
    out.push_back(v.get<std::uint64_t>());
  }
  if (out.empty()) throw InvalidArgument("'" + path + "' holds an empty list");
  return out;
}

}  // namespace zeroflat::cli
