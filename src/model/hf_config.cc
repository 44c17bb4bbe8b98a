// Hugging Face config.json for the decoder-only architectures zeroflat knows.
#include <string>

#include "model/strict_json.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

struct Reader {
  const nlohmann::json& doc;
  const std::string& source;

  InvalidArgument fail(const std::string& field, const std::string& why) const {
    return InvalidArgument(source + ": field '" + field + "' " + why);
  }
  bool has(const char* field) const { return doc.contains(field) && !doc[field].is_null(); }
  std::uint64_t count(const char* field, std::uint64_t fallback, bool required) const {
    if (!has(field)) {
      if (required) throw fail(field, "is missing");
      return fallback;
    }
    const nlohmann::json& v = doc[field];
    std::uint64_t out = 0;
    if (v.is_number_unsigned()) {
      out = v.get<std::uint64_t>();
    } else if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
      out = static_cast<std::uint64_t>(v.get<std::int64_t>());
    } else {
      throw fail(field, "is " + v.dump().substr(0, 40) + ", expected a non-negative integer");
    }
    if (out > (std::uint64_t{1} << 32)) {
      throw fail(field, "= " + std::to_string(out) + " is implausibly large");
    }
    return out;
  }
  bool flag(const char* field, bool fallback) const {
    if (!has(field)) return fallback;
    if (!doc[field].is_boolean()) throw fail(field, "is not true or false");
    return doc[field].get<bool>();
  }
};

}  // namespace

TransformerConfig parse_hf_config(std::string_view text, const std::string& source) {
  if (text.size() > kMaxHeaderBytes) throw InvalidArgument(source + ": too large for a config");
  nlohmann::json doc = detail::parse_strict_json(text, source);
  if (!doc.is_object()) throw InvalidArgument(source + ": not a JSON object");
  Reader r{doc, source};
  std::string arch;
  if (r.has("architectures")) {
    const nlohmann::json& a = doc["architectures"];
    if (!a.is_array() || a.empty() || !a[0].is_string()) {
      throw r.fail("architectures", "is not a non-empty list of names");
    }
    arch = a[0].get<std::string>();
  } else if (r.has("model_type") && doc["model_type"].is_string()) {
    const std::string t = doc["model_type"].get<std::string>();
    arch = t == "qwen3_moe" ? "Qwen3MoeForCausalLM"
           : t == "qwen3"   ? "Qwen3ForCausalLM"
           : t == "qwen2"   ? "Qwen2ForCausalLM"
           : t == "llama"   ? "LlamaForCausalLM"
           : t == "mistral" ? "MistralForCausalLM"
                            : t;
  } else {
    throw InvalidArgument(source + ": neither 'architectures' nor 'model_type' names the model");
  }
  const bool qwen3_moe = arch == "Qwen3MoeForCausalLM";
  const bool qwen3 = arch == "Qwen3ForCausalLM";
  const bool qwen2 = arch == "Qwen2ForCausalLM";
  const bool llama = arch == "LlamaForCausalLM";
  const bool mistral = arch == "MistralForCausalLM";
  if (!(qwen3_moe || qwen3 || qwen2 || llama || mistral)) {
    throw InvalidArgument(source + ": architecture '" + arch.substr(0, 80) +
                          "' is not supported (Qwen3MoeForCausalLM, Qwen3ForCausalLM, "
                          "Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM)");
  }
  TransformerConfig c;
  c.architecture = arch;
  c.hidden_size = r.count("hidden_size", 0, true);
  c.num_layers = r.count("num_hidden_layers", 0, true);
  c.num_heads = r.count("num_attention_heads", 0, true);
  c.num_kv_heads = r.count("num_key_value_heads", c.num_heads, false);
  c.vocab_size = r.count("vocab_size", 0, true);
  if (c.num_heads == 0) throw r.fail("num_attention_heads", "must be at least 1");
  // Without a head_dim: Qwen3Config's default is 128; Qwen3-MoE's config has none and its
  // attention takes hidden_size / num_attention_heads, as the other architectures do.
  const std::uint64_t default_head = qwen3 ? 128 : c.hidden_size / c.num_heads;
  c.head_dim = r.count("head_dim", default_head, false);
  c.tie_word_embeddings = r.flag("tie_word_embeddings", false);
  c.qk_norm = qwen3 || qwen3_moe;
  const bool attention_bias = r.flag("attention_bias", false);
  c.qkv_bias = qwen2 || attention_bias;
  c.o_bias = !qwen2 && attention_bias;
  c.mlp_bias = llama && r.flag("mlp_bias", false);
  if (qwen3_moe) {
    // Transformers 5 writes Qwen3-MoE's expert count as 'num_local_experts' (Mixtral's name);
    // earlier releases and the published checkpoints write 'num_experts'.
    if (!r.has("num_experts") && r.has("num_local_experts")) {
      c.num_experts = r.count("num_local_experts", 0, true);
    } else if (!r.has("num_experts")) {
      throw r.fail("num_experts", "is missing (nor is 'num_local_experts', Transformers 5's name)");
    } else {
      c.num_experts = r.count("num_experts", 0, true);
    }
    c.moe_intermediate_size = r.count("moe_intermediate_size", 0, true);
    c.intermediate_size = r.count("intermediate_size", 0, false);
    c.decoder_sparse_step = r.count("decoder_sparse_step", 1, false);
    if (r.has("mlp_only_layers")) {
      const nlohmann::json& v = doc["mlp_only_layers"];
      if (!v.is_array()) throw r.fail("mlp_only_layers", "is not a list of layer indices");
      for (const nlohmann::json& x : v) {
        if (!x.is_number_integer() || x.get<std::int64_t>() < 0) {
          throw r.fail("mlp_only_layers", "holds something other than a layer index");
        }
        c.mlp_only_layers.push_back(x.get<std::uint64_t>());
      }
    }
  } else {
    c.intermediate_size = r.count("intermediate_size", 0, true);
  }
  if (c.num_experts > 0 && c.decoder_sparse_step == 0) {
    throw r.fail("decoder_sparse_step", "must be at least 1");
  }
  return c;
}

}  // namespace zeroflat
