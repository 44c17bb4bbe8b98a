// Model specifications: ordered lists of named parameter tensors with shapes, and the built-in
// catalog (qwen3-30b-a3b, llama-3.1-8b, tiny-moe) that needs no download.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/common.h"

namespace zeroflat {

// The most elements a model may have: its bytes in any dtype zeroflat handles (at most 4 bytes
// an element) then fit in 64 bits, so sizes computed from a model never wrap.
// build_transformer and load_model refuse larger models.
inline constexpr std::uint64_t kMaxModelNumel = UINT64_MAX / 4;

struct TensorSpec {
  std::string name;
  Shape shape;
  std::uint64_t numel = 0;
};

struct ModelSpec {
  std::string name;                 // "qwen3-30b-a3b", or where it was read from
  std::string architecture;         // "Qwen3MoeForCausalLM"
  std::vector<TensorSpec> tensors;  // in the order the framework registers parameters
  // The element type the source declares (a config's torch_dtype, a checkpoint's dominant
  // floating-point dtype), when it is one zeroflat flattens; commands use it unless --dtype says
  // otherwise.
  std::optional<DType> dtype;

  // The number of elements; UINT64_MAX when the sum does not fit in 64 bits (never for a model
  // from build_transformer or load_model).
  std::uint64_t numel() const noexcept;
  std::vector<std::uint64_t> numels() const;
  // numel() * element_size(type): the model's bytes in that type. Throws InvalidArgument naming
  // the model when they do not fit in 64 bits (never for a model from build_transformer or
  // load_model).
  std::uint64_t num_bytes(DType type) const;
};

// The fields of a Hugging Face config.json that decide parameter shapes. experts == 0 means a
// dense MLP of intermediate_size; otherwise every layer is a sparse MoE block with a router.
struct TransformerConfig {
  std::string architecture;
  std::uint64_t hidden_size = 0;
  std::uint64_t num_layers = 0;
  std::uint64_t num_heads = 0;
  std::uint64_t num_kv_heads = 0;
  std::uint64_t head_dim = 0;
  std::uint64_t intermediate_size = 0;      // dense MLP
  std::uint64_t moe_intermediate_size = 0;  // per expert
  std::uint64_t num_experts = 0;
  std::uint64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool qk_norm = false;   // per-head q_norm / k_norm (Qwen3)
  bool qkv_bias = false;  // q/k/v projection biases (Qwen2; attention_bias elsewhere)
  bool o_bias = false;    // o_proj bias (attention_bias in Llama and Qwen3)
  bool mlp_bias = false;  // gate/up/down biases (Llama's mlp_bias)
  // MoE only: layer l is sparse when (l + 1) % decoder_sparse_step == 0 and l is not listed in
  // mlp_only_layers; other layers have a dense MLP of intermediate_size.
  std::uint64_t decoder_sparse_step = 1;
  std::vector<std::uint64_t> mlp_only_layers;
};

// Scales a model down for a small machine: fewer layers, fewer experts (MoE only).
struct ModelOverrides {
  std::optional<std::uint64_t> layers;
  std::optional<std::uint64_t> experts;
};

// The tensors of a decoder-only transformer with this config, in registration order:
// embed_tokens, then per layer self_attn (q, k, v, o, q_norm, k_norm), mlp (router and experts,
// or gate/up/down), input_layernorm, post_attention_layernorm; then norm and, unless tied,
// lm_head. Throws InvalidArgument for a zero dimension, a dimension or product over 2^40, or a
// model of more than kMaxModelNumel elements.
ModelSpec build_transformer(std::string name, const TransformerConfig& config);

// Applies overrides to a config. Throws InvalidArgument for layers == 0, experts == 0, or
// experts on a dense model.
TransformerConfig apply_overrides(TransformerConfig config, const ModelOverrides& overrides);

// Built-in catalog.
std::vector<std::string> catalog_names();
std::optional<TransformerConfig> catalog_config(std::string_view name);
// Throws InvalidArgument naming the model and listing the catalog when name is unknown.
ModelSpec catalog_model(std::string_view name, const ModelOverrides& overrides = {});

}  // namespace zeroflat
