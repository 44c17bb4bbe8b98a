// The built-in catalog (src/model/catalog.cc): tensor names, order, shapes and totals, as the
// models' published Hugging Face config.json files give them (Qwen/Qwen3-30B-A3B,
// meta-llama/Llama-3.1-8B); and the bound on a model's size.
#include "zeroflat/model.h"

#include <gtest/gtest.h>

#include "model/tiling.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

TEST(Catalog, Qwen3MoeTotalsMatchTheReference) {
  ModelSpec full = catalog_model("qwen3-30b-a3b");
  EXPECT_EQ(full.architecture, "Qwen3MoeForCausalLM");
  EXPECT_EQ(full.numel(), 30'532'122'624u);
  EXPECT_EQ(full.tensors.size(), 48u * 393 + 3);
  ModelSpec seed = catalog_model("qwen3-30b-a3b", {.layers = 32});
  EXPECT_EQ(seed.numel(), 20'562'192'384u);
  EXPECT_EQ(seed.tensors.size(), 12'579u);
  EXPECT_EQ(seed.numel() * 2, 41'124'384'768u);
  // One layer: 623,120,640 parameters in 393 tensors.
  ModelSpec one = catalog_model("qwen3-30b-a3b", {.layers = 1});
  ModelSpec two = catalog_model("qwen3-30b-a3b", {.layers = 2});
  EXPECT_EQ(two.numel() - one.numel(), 623'120'640u);
  EXPECT_EQ(two.tensors.size() - one.tensors.size(), 393u);
}

TEST(Catalog, Qwen3MoeNamesShapesAndOrder) {
  ModelSpec m = catalog_model("qwen3-30b-a3b", {.layers = 1, .experts = 2});
  std::vector<std::pair<std::string, Shape>> want = {
      {"model.embed_tokens.weight", {151936, 2048}},
      {"model.layers.0.self_attn.q_proj.weight", {4096, 2048}},
      {"model.layers.0.self_attn.k_proj.weight", {512, 2048}},
      {"model.layers.0.self_attn.v_proj.weight", {512, 2048}},
      {"model.layers.0.self_attn.o_proj.weight", {2048, 4096}},
      {"model.layers.0.self_attn.q_norm.weight", {128}},
      {"model.layers.0.self_attn.k_norm.weight", {128}},
      {"model.layers.0.mlp.gate.weight", {2, 2048}},
      {"model.layers.0.mlp.experts.0.gate_proj.weight", {768, 2048}},
      {"model.layers.0.mlp.experts.0.up_proj.weight", {768, 2048}},
      {"model.layers.0.mlp.experts.0.down_proj.weight", {2048, 768}},
      {"model.layers.0.mlp.experts.1.gate_proj.weight", {768, 2048}},
      {"model.layers.0.mlp.experts.1.up_proj.weight", {768, 2048}},
      {"model.layers.0.mlp.experts.1.down_proj.weight", {2048, 768}},
      {"model.layers.0.input_layernorm.weight", {2048}},
      {"model.layers.0.post_attention_layernorm.weight", {2048}},
      {"model.norm.weight", {2048}},
      {"lm_head.weight", {151936, 2048}},
  };
  ASSERT_EQ(m.tensors.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(m.tensors[i].name, want[i].first);
    EXPECT_EQ(m.tensors[i].shape, want[i].second) << want[i].first;
    EXPECT_EQ(m.tensors[i].numel, shape_numel(want[i].second));
  }
}

TEST(Catalog, Llama31Total) {
  ModelSpec m = catalog_model("llama-3.1-8b");
  EXPECT_EQ(m.numel(), 8'030'261'248u);
  EXPECT_EQ(m.tensors.size(), 32u * 9 + 3);
  EXPECT_EQ(m.tensors[1].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(m.tensors[5].name, "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(m.tensors[5].shape, (Shape{14336, 4096}));
}

TEST(Catalog, TinyMoeHasUnalignedSizes) {
  ModelSpec m = catalog_model("tiny-moe");
  EXPECT_EQ(m.tensors.front().shape, (Shape{1001, 264}));
  EXPECT_EQ(m.tensors.size(), 3u * (6 + 1 + 6 * 3 + 2) + 3);
  bool odd = false;
  for (const TensorSpec& t : m.tensors) odd |= t.numel % 8 != 0;
  EXPECT_TRUE(odd);
  EXPECT_EQ(m.tensors[1].shape, (Shape{4 * 66, 264}));  // q_proj: heads * head_dim
  EXPECT_EQ(m.tensors[2].shape, (Shape{2 * 66, 264}));  // k_proj
}

TEST(Catalog, OverridesAndErrors) {
  EXPECT_EQ(catalog_model("tiny-moe", {.layers = 1, .experts = 1}).tensors.size(),
            1u + (6 + 1 + 3 + 2) + 2);
  EXPECT_THROW((void)catalog_model("tiny-moe", {.layers = 0}), InvalidArgument);
  EXPECT_THROW((void)catalog_model("tiny-moe", {.experts = 0}), InvalidArgument);
  EXPECT_THROW((void)catalog_model("llama-3.1-8b", {.experts = 4}), InvalidArgument);
  try {
    (void)catalog_model("gpt-5");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'gpt-5'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("qwen3-30b-a3b"), std::string::npos);
  }
  // More layers than the reference model is allowed (a deeper variant), within reason.
  EXPECT_EQ(catalog_model("tiny-moe", {.layers = 5}).tensors.size(), 5u * 27 + 3);
}

TEST(Transformer, DenseWithBiasAndTiedEmbeddings) {
  TransformerConfig c;
  c.architecture = "Qwen2ForCausalLM";
  c.hidden_size = 8;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 4;
  c.intermediate_size = 16;
  c.vocab_size = 10;
  c.qkv_bias = true;
  c.tie_word_embeddings = true;
  ModelSpec m = build_transformer("toy", c);
  EXPECT_EQ(m.tensors.back().name, "model.norm.weight");  // no lm_head when tied
  EXPECT_EQ(m.tensors[2].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(m.tensors.size(), 1u + 2 * (7 + 3 + 2) + 1);
  c.hidden_size = 0;
  EXPECT_THROW((void)build_transformer("toy", c), InvalidArgument);
}

TEST(Transformer, MoeWithDenseLayersAndBiases) {
  TransformerConfig c = *catalog_config("tiny-moe");
  c.num_layers = 4;
  c.intermediate_size = 50;
  c.decoder_sparse_step = 2;  // layers 1 and 3 sparse
  c.mlp_only_layers = {3};    // ... but 3 is dense
  c.o_bias = true;
  ModelSpec m = build_transformer("mixed", c);
  int routers = 0, dense = 0, o_bias = 0;
  for (const TensorSpec& t : m.tensors) {
    routers += t.name.find("mlp.gate.weight") != std::string::npos;
    dense += t.name.find("mlp.gate_proj.weight") != std::string::npos &&
             t.name.find("experts") == std::string::npos;
    o_bias += t.name.find("o_proj.bias") != std::string::npos;
    if (t.name == "model.layers.0.mlp.gate_proj.weight") EXPECT_EQ(t.shape, (Shape{50, 264}));
  }
  EXPECT_EQ(routers, 1);
  EXPECT_EQ(dense, 3);
  EXPECT_EQ(o_bias, 4);
  c.intermediate_size = 0;  // dense layers need it
  EXPECT_THROW((void)build_transformer("mixed", c), InvalidArgument);
}

// The tensor limit speaks of tensors and says how many layers fit (it compared layers with
// tensors: "1000000 layers is over zeroflat's limit of 10000000 tensors").
TEST(Transformer, TooManyLayersAreRefusedInTensorsAndLayers) {
  TransformerConfig c = *catalog_config("tiny-moe");
  c.num_layers = 1'000'000;
  try {
    (void)build_transformer("deep", c);
    ADD_FAILURE() << "no error";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    const std::uint64_t per_layer = 16 + 1 + 3 * c.num_experts + 3;
    EXPECT_NE(what.find("up to " + std::to_string(per_layer) + " tensors each"),
              std::string::npos) << what;
    EXPECT_NE(what.find("at most " + std::to_string(10'000'000 / per_layer) + " such layers"),
              std::string::npos) << what;
  }
}

// A config within every per-field limit whose embedding has 2^63 elements: its bytes do not fit
// in 64 bits, so it is refused, naming the tensor, rather than built (inspect then printed its
// size wrapped to a few gigabytes).
TEST(Transformer, ModelsPastTheSizeLimitAreRefusedNamingTheTensor) {
  TransformerConfig c;
  c.architecture = "LlamaForCausalLM";
  c.hidden_size = std::uint64_t{1} << 32;
  c.num_layers = 1;
  c.num_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 1;
  c.intermediate_size = 1;
  c.vocab_size = std::uint64_t{1} << 31;
  auto error_of = [&] {
    try {
      (void)build_transformer("huge", c);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("built");
  };
  std::string e = error_of();
  EXPECT_NE(e.find("'model.embed_tokens.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("9,223,372,036,854,775,808 elements"), std::string::npos) << e;
  EXPECT_NE(e.find("limit"), std::string::npos) << e;
  // Each tensor alone within the limit, the two together past it: the second one is named.
  c.vocab_size = std::uint64_t{1} << 29;
  e = error_of();
  EXPECT_NE(e.find("'lm_head.weight'"), std::string::npos) << e;
  // Tied, the same model fits, and its bytes in every dtype are exact.
  c.tie_word_embeddings = true;
  const ModelSpec m = build_transformer("huge", c);
  EXPECT_LE(m.numel(), kMaxModelNumel);
  EXPECT_EQ(m.num_bytes(DType::kFP32), 4 * m.numel());
}

TEST(ModelSpecSizes, NumelSaturatesAndBytesThatDoNotFitAreRefused) {
  ModelSpec m;
  m.name = "handmade";
  m.tensors = {{"a", {}, std::uint64_t{1} << 62}};
  EXPECT_EQ(m.num_bytes(DType::kBF16), std::uint64_t{1} << 63);
  try {
    (void)m.num_bytes(DType::kFP32);
    ADD_FAILURE() << "2^64 bytes fit?";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("handmade"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("4,611,686,018,427,387,904 elements of fp32"),
              std::string::npos)
        << e.what();
  }
  m.tensors.push_back({"b", {}, UINT64_MAX - 5});
  EXPECT_EQ(m.numel(), UINT64_MAX);  // saturated, not wrapped to a small count
  EXPECT_THROW((void)m.num_bytes(DType::kBF16), InvalidArgument);
}

}  // namespace
}  // namespace zeroflat

// ---- tiling_problem: a tensor's chunks or pieces, no two sharing an element -------------------

namespace {

struct Boxes {
  std::vector<zeroflat::Shape> offsets, sizes;
  void add(zeroflat::Shape o, zeroflat::Shape s) {
    offsets.push_back(std::move(o));
    sizes.push_back(std::move(s));
  }
  std::vector<zeroflat::detail::Box> view() const {
    std::vector<zeroflat::detail::Box> out;
    for (std::size_t i = 0; i < offsets.size(); ++i) out.push_back({&offsets[i], &sizes[i]});
    return out;
  }
};

}  // namespace

TEST(Tiling, AGridOfChunksTilesAndAMovedChunkOverlapsOrLeavesAHole) {
  Boxes b;  // a 6 x 8 tensor cut 3 x 2, as Shard(0) and Shard(1) of a 3 x 2 mesh cut it
  for (std::int64_t r = 0; r < 3; ++r)
    for (std::int64_t c = 0; c < 2; ++c) b.add({2 * r, 4 * c}, {2, 4});
  auto p = zeroflat::detail::tiling_problem(b.view(), {6, 8}, true);
  EXPECT_TRUE(p.ok());
  EXPECT_EQ(p.covered, 48u);
  b.offsets[4] = {2, 4};  // moved onto chunk 3
  p = zeroflat::detail::tiling_problem(b.view(), {6, 8}, true);
  EXPECT_TRUE(p.overlap);
  EXPECT_EQ(p.a, 3u);
  EXPECT_EQ(p.b, 4u);
  b.offsets[4] = {4, 0};
  b.offsets[5] = {0, 4};  // chunk 5 onto chunk 1 as well: overlap at once
  EXPECT_TRUE(zeroflat::detail::tiling_problem(b.view(), {6, 8}, true).overlap);
  Boxes hole;  // one chunk left out: no overlap, 40 of 48 elements
  for (std::int64_t r = 0; r < 3; ++r)
    for (std::int64_t c = 0; c < 2; ++c)
      if (r != 1 || c != 1) hole.add({2 * r, 4 * c}, {2, 4});
  hole.add({2, 4}, {0, 4});  // an empty chunk shares nothing
  p = zeroflat::detail::tiling_problem(hole.view(), {6, 8}, true);
  EXPECT_FALSE(p.overlap);
  EXPECT_EQ(p.covered, 40u);
  EXPECT_FALSE(p.ok());
}

TEST(Tiling, OverlapsFoundOffTheGridInTwoAndThreeDimensions) {
  Boxes b;  // uneven boxes whose cut points make a large grid: the sweep decides
  b.add({0, 0}, {5, 1});
  b.add({1, 1}, {1, 7});
  b.add({3, 2}, {4, 1});
  b.add({4, 0}, {1, 2});  // shares (4, 0) with box 0
  auto p = zeroflat::detail::tiling_problem(b.view(), {8, 8}, false);
  EXPECT_TRUE(p.overlap);
  EXPECT_EQ(p.a, 0u);
  EXPECT_EQ(p.b, 3u);
  b.offsets[3] = {5, 0};
  EXPECT_FALSE(zeroflat::detail::tiling_problem(b.view(), {8, 8}, false).overlap);
  Boxes c;
  c.add({0, 0, 0}, {2, 2, 2});
  c.add({1, 1, 1}, {1, 1, 1});
  p = zeroflat::detail::tiling_problem(c.view(), {3, 3, 3}, false);
  EXPECT_TRUE(p.overlap);
  Boxes z;  // a 0-d tensor: two chunks of its one element
  z.add({}, {});
  z.add({}, {});
  EXPECT_TRUE(zeroflat::detail::tiling_problem(z.view(), {}, true).overlap);
}

TEST(Tiling, AStaircaseOfAMillionChunksIsCheckedInNLogN) {
  // Chunk i holds [i, n) x [i, i + 1): apart from every other, yet each spans all the later ones
  // along the first dimension and none lines up (a grid of n^2 cells): a pairwise check is
  // quadratic (10^12 comparisons); the sweep takes a logarithm per chunk.
  constexpr std::int64_t n = 1000000;
  Boxes b;
  b.offsets.reserve(n);
  b.sizes.reserve(n);
  for (std::int64_t i = 0; i < n; ++i) b.add({i, i}, {n - i, 1});
  const auto p = zeroflat::detail::tiling_problem(b.view(), {n, n}, false);
  EXPECT_FALSE(p.overlap);
  EXPECT_FALSE(p.too_many);
  b.offsets[n - 1] = {n - 2, n - 2};  // now inside chunk n - 2
  b.sizes[n - 1] = {1, 1};
  const auto q = zeroflat::detail::tiling_problem(b.view(), {n, n}, false);
  EXPECT_TRUE(q.overlap);
  EXPECT_EQ(q.b, static_cast<std::size_t>(n - 1));
}
