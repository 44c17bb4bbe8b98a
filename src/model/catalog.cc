// Transformer parameter lists from a config, and the built-in catalog of model shapes.
#include <algorithm>
#include <string>

#include "common/saturate.h"
#include "model/model_size.h"
#include "zeroflat/common.h"
#include "zeroflat/model.h"

namespace zeroflat {
namespace {

std::int64_t dim(std::uint64_t v, const char* what) {
  if (v == 0) throw InvalidArgument(std::string(what) + " must be at least 1");
  if (v > (std::uint64_t{1} << 40)) {
    throw InvalidArgument(std::string(what) + " = " + std::to_string(v) + " is implausibly large");
  }
  return static_cast<std::int64_t>(v);
}

struct Builder {
  ModelSpec spec;
  void add(std::string name, Shape shape) {
    std::uint64_t numel = shape_numel(shape);
    spec.tensors.push_back(TensorSpec{std::move(name), std::move(shape), numel});
  }
};

}  // namespace

std::uint64_t ModelSpec::numel() const noexcept {
  std::uint64_t n = 0;
  for (const TensorSpec& t : tensors) n = detail::sat_add(n, t.numel);
  return n;
}

std::uint64_t ModelSpec::num_bytes(DType type) const {
  const std::uint64_t n = numel();
  std::uint64_t bytes = 0;
  if (n == detail::kSaturated || __builtin_mul_overflow(n, element_size(type), &bytes)) {
    throw InvalidArgument(printable(name, 200) + ": " +
                          (n == detail::kSaturated ? std::string("more than 2^64")
                                                   : format_count(n)) +
                          " elements of " + std::string(dtype_name(type)) +
                          " are more bytes than fit in 64 bits");
  }
  return bytes;
}

void detail::check_model_numel(const ModelSpec& model) {
  std::uint64_t n = 0;
  for (const TensorSpec& t : model.tensors) {
    if (__builtin_add_overflow(n, t.numel, &n) || n > kMaxModelNumel) {
      throw InvalidArgument(
          "tensor '" + printable(t.name) + "' " +
          shape_to_string(t.shape) + " of " + format_count(t.numel) +
          " elements brings the model past zeroflat's limit of " + format_count(kMaxModelNumel) +
          " elements (2^62 - 1: beyond it the bytes in fp32 do not fit in 64 bits)");
    }
  }
}

std::vector<std::uint64_t> ModelSpec::numels() const {
  std::vector<std::uint64_t> out;
  out.reserve(tensors.size());
  for (const TensorSpec& t : tensors) out.push_back(t.numel);
  return out;
}

ModelSpec build_transformer(std::string name, const TransformerConfig& c) {
  const std::int64_t hidden = dim(c.hidden_size, "hidden_size");
  const std::int64_t layers = dim(c.num_layers, "num_hidden_layers");
  const std::int64_t heads = dim(c.num_heads, "num_attention_heads");
  const std::int64_t kv_heads = dim(c.num_kv_heads, "num_key_value_heads");
  const std::int64_t head_dim = dim(c.head_dim, "head_dim");
  const std::int64_t vocab = dim(c.vocab_size, "vocab_size");
  const bool moe = c.num_experts > 0;
  const std::int64_t experts = moe ? dim(c.num_experts, "num_experts") : 0;
  const std::int64_t expert_ffn = moe ? dim(c.moe_intermediate_size, "moe_intermediate_size") : 0;
  if (moe && c.decoder_sparse_step == 0) {
    throw InvalidArgument("decoder_sparse_step must be at least 1");
  }
  // Count before building, so that a hostile config or a typo in --layers cannot make zeroflat
  // build a list of billions of names.
  {
    const std::uint64_t experts_u = moe ? c.num_experts : 0;
    const std::uint64_t per_layer = 16 + 1 + 3 * experts_u + 3;
    const std::uint64_t kMaxTensors = 10'000'000;
    if (c.num_layers > kMaxTensors / per_layer) {
      throw InvalidArgument(std::to_string(c.num_layers) + " layers" +
                            (moe ? " of " + std::to_string(c.num_experts) + " experts" : "") +
                            " make up to " + std::to_string(per_layer) +
                            " tensors each, over zeroflat's limit of " +
                            std::to_string(kMaxTensors) + " tensors per model (at most " +
                            std::to_string(kMaxTensors / per_layer) + " such layers)");
    }
  }
  // The dense layers by index, once: asking the list for every layer would take layers x list
  // length (a hostile config lists millions).
  std::vector<bool> mlp_only(c.num_layers, false);
  for (std::uint64_t l : c.mlp_only_layers) {
    if (l < c.num_layers) mlp_only[l] = true;
  }
  auto sparse = [&](std::int64_t l) {
    const auto ul = static_cast<std::uint64_t>(l);
    return moe && (ul + 1) % c.decoder_sparse_step == 0 && !mlp_only[ul];
  };
  bool any_dense = !moe;
  for (std::int64_t l = 0; l < layers && !any_dense; ++l) any_dense = !sparse(l);
  const std::int64_t ffn = any_dense ? dim(c.intermediate_size, "intermediate_size") : 0;
  auto product = [](std::int64_t a, std::int64_t b, const char* what) {
    std::int64_t out = 0;
    if (__builtin_mul_overflow(a, b, &out) || out > (std::int64_t{1} << 40)) {
      throw InvalidArgument(std::string(what) + " = " + std::to_string(a) + " * " +
                            std::to_string(b) + " is implausibly large");
    }
    return out;
  };
  const std::int64_t q_out = product(heads, head_dim, "num_attention_heads * head_dim");
  const std::int64_t kv_out = product(kv_heads, head_dim, "num_key_value_heads * head_dim");
  if (heads % kv_heads != 0) {
    throw InvalidArgument("num_attention_heads (" + std::to_string(heads) +
                          ") is not a multiple of num_key_value_heads (" +
                          std::to_string(kv_heads) + ")");
  }

  Builder b;
  b.spec.name = std::move(name);
  b.spec.architecture = c.architecture;
  b.add("model.embed_tokens.weight", {vocab, hidden});
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    b.add(p + "self_attn.q_proj.weight", {q_out, hidden});
    if (c.qkv_bias) b.add(p + "self_attn.q_proj.bias", {q_out});
    b.add(p + "self_attn.k_proj.weight", {kv_out, hidden});
    if (c.qkv_bias) b.add(p + "self_attn.k_proj.bias", {kv_out});
    b.add(p + "self_attn.v_proj.weight", {kv_out, hidden});
    if (c.qkv_bias) b.add(p + "self_attn.v_proj.bias", {kv_out});
    b.add(p + "self_attn.o_proj.weight", {hidden, q_out});
    if (c.o_bias) b.add(p + "self_attn.o_proj.bias", {hidden});
    if (c.qk_norm) {
      b.add(p + "self_attn.q_norm.weight", {head_dim});
      b.add(p + "self_attn.k_norm.weight", {head_dim});
    }
    if (sparse(l)) {
      b.add(p + "mlp.gate.weight", {experts, hidden});
      for (std::int64_t e = 0; e < experts; ++e) {
        const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
        b.add(ep + "gate_proj.weight", {expert_ffn, hidden});
        b.add(ep + "up_proj.weight", {expert_ffn, hidden});
        b.add(ep + "down_proj.weight", {hidden, expert_ffn});
      }
    } else {
      b.add(p + "mlp.gate_proj.weight", {ffn, hidden});
      if (c.mlp_bias) b.add(p + "mlp.gate_proj.bias", {ffn});
      b.add(p + "mlp.up_proj.weight", {ffn, hidden});
      if (c.mlp_bias) b.add(p + "mlp.up_proj.bias", {ffn});
      b.add(p + "mlp.down_proj.weight", {hidden, ffn});
      if (c.mlp_bias) b.add(p + "mlp.down_proj.bias", {hidden});
    }
    b.add(p + "input_layernorm.weight", {hidden});
    b.add(p + "post_attention_layernorm.weight", {hidden});
  }
  b.add("model.norm.weight", {hidden});
  if (!c.tie_word_embeddings) b.add("lm_head.weight", {vocab, hidden});
  detail::check_model_numel(b.spec);
  return std::move(b.spec);
}

TransformerConfig apply_overrides(TransformerConfig config, const ModelOverrides& overrides) {
  if (overrides.layers) {
    if (*overrides.layers == 0) throw InvalidArgument("--layers 0: a model needs at least 1 layer");
    config.num_layers = *overrides.layers;
  }
  if (overrides.experts) {
    if (config.num_experts == 0) {
      throw InvalidArgument("--experts " + std::to_string(*overrides.experts) + ": " +
                            config.architecture + " is a dense model without experts");
    }
    if (*overrides.experts == 0) {
      throw InvalidArgument("--experts 0: a MoE layer needs at least 1 expert");
    }
    config.num_experts = *overrides.experts;
  }
  return config;
}

std::vector<std::string> catalog_names() {
  return {"llama-3.1-8b", "qwen3-30b-a3b", "tiny-moe"};
}

std::optional<TransformerConfig> catalog_config(std::string_view name) {
  TransformerConfig c;
  if (name == "qwen3-30b-a3b") {
    c.architecture = "Qwen3MoeForCausalLM";
    c.hidden_size = 2048;
    c.num_layers = 48;
    c.num_heads = 32;
    c.num_kv_heads = 4;
    c.head_dim = 128;
    c.moe_intermediate_size = 768;
    c.num_experts = 128;
    c.vocab_size = 151936;
    c.qk_norm = true;
    return c;
  }
  if (name == "llama-3.1-8b") {
    c.architecture = "LlamaForCausalLM";
    c.hidden_size = 4096;
    c.num_layers = 32;
    c.num_heads = 32;
    c.num_kv_heads = 8;
    c.head_dim = 128;
    c.intermediate_size = 14336;
    c.vocab_size = 128256;
    return c;
  }
  if (name == "tiny-moe") {
    c.architecture = "Qwen3MoeForCausalLM";
    c.hidden_size = 264;
    c.num_layers = 3;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    c.head_dim = 66;
    c.moe_intermediate_size = 98;
    c.num_experts = 6;
    c.vocab_size = 1001;
    c.qk_norm = true;
    return c;
  }
  return std::nullopt;
}

ModelSpec catalog_model(std::string_view name, const ModelOverrides& overrides) {
  std::optional<TransformerConfig> config = catalog_config(name);
  if (!config) {
    throw InvalidArgument("unknown model '" + printable(name) + "': the catalog has " +
                          join(catalog_names()));
  }
  return build_transformer(std::string(name), apply_overrides(*config, overrides));
}

}  // namespace zeroflat
