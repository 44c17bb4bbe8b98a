// Models from names and paths, and the inspection of checkpoints and configs.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "common/saturate.h"
#include "model/files.h"
#include "model/model_size.h"
#include "model/strict_json.h"
#include "model/torch_file.h"
#include "model/torch_state.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  return detail::read_small_file(path.string(), kMaxHeaderBytes, "a config or index file");
}

std::string zeroflat_dtype(const std::string& st) {
  if (st == "BF16") return "bf16";
  if (st == "F16") return "fp16";
  if (st == "F32") return "fp32";
  if (st == "F64") return "fp64";
  std::string out = st;
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

struct Checkpoint {
  std::vector<TensorInfo> tensors;
  std::uint64_t files = 0;
};

// Every tensor of a checkpoint (a directory, or one .safetensors file), headers only.
Checkpoint read_checkpoint(const fs::path& path) {
  const CheckpointIndex index = open_checkpoint(path.string());
  Checkpoint ck;
  ck.files = index.files.size();
  for (const CheckpointTensor& t : index.tensors) {
    if (t.alias) continue;  // a tied weight's other name in a torch.save'd state dict
    ck.tensors.push_back(TensorInfo{t.name, zeroflat_dtype(t.dtype), t.shape, t.numel, t.bytes});
  }
  return ck;
}

ModelSpec from_tensors(const std::string& name, const std::vector<TensorInfo>& tensors) {
  ModelSpec m;
  m.name = name;
  m.architecture = "checkpoint";
  std::map<std::string, std::uint64_t> bytes;
  for (const TensorInfo& t : tensors) {
    m.tensors.push_back(TensorSpec{t.name, t.shape, t.numel});
    // Saturating: shards are sparse files as far as sizes go, each may claim up to 2^64 bytes.
    bytes[t.dtype] = detail::sat_add(bytes[t.dtype], t.bytes);
  }
  try {
    detail::check_model_numel(m);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(printable(name, 200) + ": " + e.what());
  }
  // The floating-point dtype holding most bytes is the one training will flatten in.
  std::uint64_t best = 0;
  for (const auto& [name_of_dtype, b] : bytes) {
    if (auto d = try_parse_dtype(name_of_dtype); d && b > best) {
      best = b;
      m.dtype = d;
    }
  }
  return m;
}

bool has_checkpoint_files(const fs::path& dir) {
  std::error_code ec;
  for (const char* name : {"model.safetensors.index.json", "pytorch_model.bin.index.json",
                           "pytorch_model.bin"}) {
    const bool there = fs::exists(dir / name, ec);
    if (!ec && there) return true;
  }
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
       it.increment(ec)) {
    if (it->path().extension() == ".safetensors") return true;
  }
  if (ec) {
    throw InvalidArgument(printable(dir.string(), 200) + ": cannot list the folder (" +
                          ec.message() + ")");
  }
  return false;
}

// The config's dtype: "dtype", as Transformers 5 writes it, else the older "torch_dtype".
std::optional<DType> config_dtype(const std::string& text, const std::string& source) {
  nlohmann::json doc = detail::parse_strict_json(text, source);
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (!doc.is_object() || !doc.contains(key) || !doc[key].is_string()) continue;
    const std::string t = doc[key].get<std::string>();
    if (t == "float32") return DType::kFP32;
    if (t == "float16") return DType::kFP16;
    if (t == "bfloat16") return DType::kBF16;
  }
  return std::nullopt;
}

// A safetensors file by its name or, whatever its name (a .bin, none), by its first bytes.
bool safetensors_file(const fs::path& path) {
  return path.extension() == ".safetensors" || is_safetensors_file(path.string());
}

}  // namespace

ModelSpec load_model(const std::string& name_or_path, const ModelOverrides& overrides) {
  if (catalog_config(name_or_path)) return catalog_model(name_or_path, overrides);
  detail::check_path(name_or_path);
  const fs::path path(name_or_path);
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw InvalidArgument("unknown model '" + printable(name_or_path, 200) + "': neither a catalog name (" +
                          join(catalog_names()) +
                          ") nor an existing config.json, checkpoint directory or .safetensors "
                          "file");
  }
  auto config_model = [&](const fs::path& config) {
    const std::string text = read_text(config);
    TransformerConfig c = parse_hf_config(text, config.string());
    ModelSpec m;
    try {
      m = build_transformer(config.string(), apply_overrides(c, overrides));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(config.string() + ": " + e.what());
    }
    m.dtype = config_dtype(text, config.string());
    return m;
  };
  auto no_overrides = [&](const std::string& what) {
    if (overrides.layers || overrides.experts) {
      throw InvalidArgument(what +
                            ": --layers and --experts apply to catalog models and configs, "
                            "not to a checkpoint's tensors");
    }
  };
  if (fs::is_directory(path)) {
    // The checkpoint's own headers are the most faithful source; a config.json beside them is
    // used only when there are none.
    if (!has_checkpoint_files(path) && fs::exists(path / "config.json")) {
      return config_model(path / "config.json");
    }
    no_overrides(path.string());
    return from_tensors(path.string(), read_checkpoint(path).tensors);
  }
  if (safetensors_file(path)) {
    no_overrides(path.string());
    Inspection i = inspect_path(path.string());
    return from_tensors(path.string(), i.tensors);
  }
  if (detail::is_index_file(path.string()) || is_torch_file(path.string())) {
    no_overrides(path.string());
    return from_tensors(path.string(), read_checkpoint(path).tensors);
  }
  return config_model(path);
}

Inspection inspect_path(const std::string& p) {
  detail::check_path(p);
  const fs::path path(p);
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InvalidArgument(printable(p, 200) + ": no such file or directory");
  Inspection out;
  if (fs::is_directory(path) && !has_checkpoint_files(path) && fs::exists(path / "config.json")) {
    Inspection c = inspect_path((path / "config.json").string());
    return c;
  }
  if (fs::is_directory(path) || detail::is_index_file(path.string())) {
    Checkpoint ck = read_checkpoint(path);
    out.source = "checkpoint";
    out.files = ck.files;
    out.tensors = std::move(ck.tensors);
  } else if (const bool safetensors = safetensors_file(path); safetensors || is_torch_file(p)) {
    Checkpoint ck = read_checkpoint(path);
    out.source = safetensors ? "safetensors" : "torch.save";
    out.files = 1;
    out.tensors = std::move(ck.tensors);
  } else {
    const std::string text = read_text(path);
    TransformerConfig c = parse_hf_config(text, p);
    ModelSpec m;
    try {
      m = build_transformer(p, c);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(p + ": " + e.what());
    }
    // The dtype the config declares, bf16 when it says none.
    const DType declared = config_dtype(text, p).value_or(DType::kBF16);
    const std::string dtype(dtype_name(declared));
    const std::uint64_t es = element_size(declared);
    out.source = "config";
    out.files = 1;
    for (const TensorSpec& t : m.tensors) {
      // Fits: build_transformer bounds the model so that its bytes in fp32 fit in 64 bits.
      out.tensors.push_back(TensorInfo{t.name, dtype, t.shape, t.numel, t.numel * es});
    }
  }
  for (const TensorInfo& t : out.tensors) {
    if (__builtin_add_overflow(out.numel, t.numel, &out.numel) ||
        __builtin_add_overflow(out.bytes, t.bytes, &out.bytes)) {
      throw InvalidArgument(p + ": the tensors' sizes add up to more than 64 bits");
    }
    out.bytes_by_dtype[t.dtype] += t.bytes;
  }
  return out;
}

}  // namespace zeroflat
