// Options shared by subcommands: model selection, layout options, element-count lists.
#include "zeroflat/model_source.h"

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/common.h"
#include "zeroflat/error.h"
#include "zeroflat/size.h"

namespace zeroflat::cli {

void add_model_options(Parser& parser, const std::string& default_model) {
  const std::string names = join(catalog_names());
  parser.option("model", "NAME|PATH",
                "a catalog model (" + names +
                    "), a config.json, or a checkpoint directory or .safetensors file",
                default_model);
  parser.option("layers", "L", "decoder layers (fewer than the model's scales it down)");
  parser.option("experts", "E", "experts per MoE layer (fewer scales it down)");
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
  parser.option("dtype", "T", "element type: bf16, fp16 or fp32",
                "the model's own (a config's torch_dtype, a checkpoint's), else bf16");
  parser.option("param-align-bytes", "B",
                "start every parameter after the first at a multiple of B bytes (0: packed)", "0");
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

namespace {

constexpr std::uint64_t kMaxNumelsFileBytes = std::uint64_t{256} << 20;

// "5,7,3", "5 7 3", one per line: commas and white space separate items; an empty item between
// commas is an error. Fast: a million items parse in a few milliseconds.
std::vector<std::uint64_t> parse_list(std::string_view text, const std::string& source) {
  std::vector<std::uint64_t> out;
  std::size_t line = 1, token_start = 0, token_line = 1;
  bool in_token = false, item_since_comma = false, saw_comma = false;
  auto where = [&](std::size_t index, std::size_t at_line) {
    return "element count #" + std::to_string(index) + " of " + source +
           (source == "--numels" ? "" : " (line " + std::to_string(at_line) + ")");
  };
  auto flush = [&](std::size_t end) {
    if (!in_token) return;
    in_token = false;
    item_since_comma = true;
    const std::string_view tok = text.substr(token_start, end - token_start);
    std::uint64_t v = 0;
    bool ok = !tok.empty();
    for (char c : tok) {
      if (c < '0' || c > '9' || __builtin_mul_overflow(v, std::uint64_t{10}, &v) ||
          __builtin_add_overflow(v, static_cast<std::uint64_t>(c - '0'), &v)) {
        ok = false;
        break;
      }
    }
    if (!ok) (void)parse_u64(tok, where(out.size() + 1, token_line));  // throws with the reason
    out.push_back(v);
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool sep = c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r';
    if (!sep) {
      if (!in_token) {
        in_token = true;
        token_start = i;
        token_line = line;
      }
      continue;
    }
    flush(i);
    if (c == ',') {
      if (!item_since_comma) {
        throw InvalidArgument(where(out.size() + 1, line) +
                              " is empty: two commas, or a comma first, with nothing between");
      }
      item_since_comma = false;
      saw_comma = true;
    }
    if (c == '\n') ++line;
  }
  flush(text.size());
  if (saw_comma && !item_since_comma) {
    throw InvalidArgument(where(out.size() + 1, line) + " is empty: the list ends with a comma");
  }
  return out;
}

std::string read_numels_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InvalidArgument("--numels @" + path + ": cannot read '" + path + "'");
  std::string content;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    content.append(buf, static_cast<std::size_t>(in.gcount()));
    if (content.size() > kMaxNumelsFileBytes) {
      throw InvalidArgument("'" + path + "' is larger than " + format_bytes(kMaxNumelsFileBytes) +
                            ": not a list of element counts");
    }
  }
  if (content.rfind("\xEF\xBB\xBF", 0) == 0) content.erase(0, 3);  // a UTF-8 byte order mark
  return content;
}

}  // namespace

std::vector<std::uint64_t> parse_numels(const std::string& text) {
  if (text.empty() || text.find_first_not_of(" \t\n") == std::string::npos) {
    throw InvalidArgument("--numels is empty: expected element counts such as 5,7,3 or @FILE");
  }
  if (text[0] != '@') {
    std::vector<std::uint64_t> out = parse_list(text, "--numels");
    if (out.empty()) {
      throw InvalidArgument("--numels is empty: expected element counts such as 5,7,3 or @FILE");
    }
    return out;
  }
  const std::string path = text.substr(1);
  const std::string content = read_numels_file(path);
  const std::size_t first = content.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) {
    throw InvalidArgument("'" + path + "' holds no element counts");
  }
  if (content[first] != '[') {
    std::vector<std::uint64_t> out = parse_list(content, "'" + path + "'");
    if (out.empty()) throw InvalidArgument("'" + path + "' holds no element counts");
    return out;
  }
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(content);
  } catch (const nlohmann::json::parse_error& e) {
    throw InvalidArgument("'" + path + "' is not valid JSON: " + e.what());
  }
  if (!doc.is_array()) throw InvalidArgument("'" + path + "' is not a JSON list");
  std::vector<std::uint64_t> out;
  out.reserve(doc.size());
  for (std::size_t i = 0; i < doc.size(); ++i) {
    const nlohmann::json& v = doc[i];
    if (v.is_number_unsigned()) {
      out.push_back(v.get<std::uint64_t>());
    } else if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
      out.push_back(static_cast<std::uint64_t>(v.get<std::int64_t>()));
    } else if (v.is_number_float() && v.get<double>() >= 18446744073709551615.0) {
      throw InvalidArgument("'" + path + "': item " + std::to_string(i) + " (" + v.dump() +
                            ") does not fit in 64 bits");
    } else {
      throw InvalidArgument("'" + path + "': item " + std::to_string(i) + " (" +
                            v.dump().substr(0, 40) + ") is not a non-negative integer");
    }
  }
  if (out.empty()) throw InvalidArgument("'" + path + "' holds an empty list");
  return out;
}

}  // namespace zeroflat::cli
