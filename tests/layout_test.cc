// The layout engine against DeepSpeed's layout: the spec's vectors, worked examples, properties
// on thousands of random inputs, and bad input.
#include "zeroflat/layout.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "zeroflat/common.h"

namespace zeroflat {
namespace {

using nlohmann::json;

json load_vectors() {
  std::ifstream in(std::string(ZEROFLAT_TEST_DATA_DIR) + "/layout-vectors.json");
  EXPECT_TRUE(in.good()) << "missing tests/data/layout-vectors.json";
  return json::parse(in);
}

LayoutOptions options_of(const json& c) {
  LayoutOptions o;
  o.dp = c.at("dp").get<std::uint64_t>();
  o.alignment_factor = c.at("alignment_factor").get<std::uint64_t>();
  o.round_robin = c.at("round_robin").get<bool>();
  o.dtype = parse_dtype(c.at("dtype").get<std::string>());
  o.param_align_bytes = c.at("param_align_bytes").get<std::uint64_t>();
  return o;
}

TEST(LayoutVectors, EveryCaseMatchesExactly) {
  json vectors = load_vectors();
  ASSERT_GE(vectors.size(), 35u);
  for (std::size_t k = 0; k < vectors.size(); ++k) {
    const json& c = vectors[k].at("case");
    Layout l = Layout::compute(c.at("numels").get<std::vector<std::uint64_t>>(), options_of(c));
    json got = json::parse(l.to_json());
    EXPECT_EQ(got, vectors[k].at("expect")) << "case " << k << ": " << c.dump();
  }
}

TEST(LayoutVectors, JsonKeysInContractOrder) {
  Layout l = Layout::compute(std::vector<std::uint64_t>{5, 7, 3}, LayoutOptions{4});
  std::string doc = l.to_json();
  EXPECT_EQ(doc.rfind("{\"dp\":4,\"alignment\":8,\"dtype\":\"bf16\",\"numel\":15,\"padding\":1,"
                      "\"flat_numel\":16,\"flat_bytes\":32,\"partition_numel\":4,",
                      0),
            0u)
      << doc;
}

TEST(LayoutExamples, LastWorkedExampleHasTrailingAllPaddingRanks) {
  Layout l = Layout::compute(std::vector<std::uint64_t>{266240}, LayoutOptions{768});
  EXPECT_EQ(l.flat_numel(), 267264u);
  EXPECT_EQ(l.partition_numel(), 348u);
  EXPECT_EQ(l.rank(767).padding, 348u);
  EXPECT_EQ(l.rank(766).padding, 348u);
  EXPECT_EQ(l.rank(765).padding, 328u);
  EXPECT_TRUE(l.rank(767).params_in_partition.empty());
  EXPECT_TRUE(l.rank(767).fragments.empty());
}

TEST(LayoutExamples, RoundRobinOrder) {
  LayoutOptions o;
  o.dp = 2;
  o.round_robin = true;
  Layout l = Layout::compute(std::vector<std::uint64_t>{5, 7, 3, 4, 6}, o);
  EXPECT_EQ(l.order(), (std::vector<std::uint64_t>{0, 2, 4, 1, 3}));
  EXPECT_EQ(l.offsets(), (std::vector<std::uint64_t>{0, 14, 5, 21, 8}));
  // More buckets than parameters.
  o.dp = 8;
  l = Layout::compute(std::vector<std::uint64_t>{1, 2, 3}, o);
  EXPECT_EQ(l.order(), (std::vector<std::uint64_t>{0, 1, 2}));
}

TEST(LayoutExamples, ZeroSizedParameterInsideAPartitionCounts) {
  Layout l = Layout::compute(std::vector<std::uint64_t>{16, 0, 16}, LayoutOptions{2});
  EXPECT_EQ(l.rank(1).params_in_partition, (std::vector<std::uint64_t>{1, 2}));
  EXPECT_EQ(l.rank(1).fragments.size(), 1u);  // the empty overlap is skipped
}

TEST(LayoutExamples, EmptyGroup) {
  Layout l = Layout::compute(std::vector<std::uint64_t>{}, LayoutOptions{4});
  EXPECT_EQ(l.flat_numel(), 0u);
  EXPECT_EQ(l.partition_numel(), 0u);
  EXPECT_TRUE(l.rank(3).params_in_partition.empty());
}

TEST(LayoutBadInput, RejectedWithTheValueNamed) {
  auto msg = [](std::vector<std::uint64_t> numels, LayoutOptions o) {
    try {
      (void)Layout::compute(numels, o);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  LayoutOptions dp0;
  dp0.dp = 0;
  EXPECT_NE(msg({1}, dp0).find("dp = 0"), std::string::npos);
  LayoutOptions af0;
  af0.alignment_factor = 0;
  EXPECT_NE(msg({1}, af0).find("alignment factor = 0"), std::string::npos);
  for (std::uint64_t bad : {1, 3, 6, 24}) {
    LayoutOptions o;
    o.param_align_bytes = bad;
    EXPECT_NE(msg({1}, o).find("param_align_bytes = " + std::to_string(bad)), std::string::npos);
  }
  LayoutOptions fp32_align2;
  fp32_align2.dtype = DType::kFP32;
  fp32_align2.param_align_bytes = 2;  // a power of two, but smaller than the element
  EXPECT_NE(msg({1}, fp32_align2).find("at least the element size"), std::string::npos);
  EXPECT_NE(msg({UINT64_MAX, 1}, {}).find("overflows"), std::string::npos);
  // The sum fits, the padded size does not.
  EXPECT_NE(msg({UINT64_MAX}, {}).find("padded flat size overflows"), std::string::npos);
  // Elements fit, bytes do not.
  EXPECT_NE(msg({UINT64_MAX / 2 + 10}, {}).find("bytes overflows"), std::string::npos);
  LayoutOptions huge;
  huge.dp = kMaxDp;
  huge.alignment_factor = UINT64_MAX / 4;
  EXPECT_NE(msg({1}, huge).find("overflows"), std::string::npos);
  huge.alignment_factor = 2;
  huge.dp = kMaxDp + 1;  // more ranks than any group has: refused, not laid out
  EXPECT_NE(msg({1}, huge).find("1 to 1048576"), std::string::npos);
  EXPECT_THROW((void)Layout::compute(std::vector<std::uint64_t>{1}, {}).rank(1), InvalidArgument);
}

// Sizes at the edge of 64 bits are exact or refused, never wrapped: a buffer of 2^64 - 2 bytes
// is a layout (the planner then finds it fits nowhere); one byte more in any size is refused
// with the value named.
TEST(LayoutBadInput, SizesAtTheEdgeOf64BitsAreExactOrRefused) {
  auto msg = [](std::vector<std::uint64_t> numels, LayoutOptions o) {
    try {
      (void)Layout::compute(numels, o);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  const std::uint64_t top = (std::uint64_t{1} << 63) - 1;  // the largest bf16 element count
  LayoutOptions o;
  o.alignment_factor = top;
  const Layout l = Layout::compute(std::vector<std::uint64_t>{1, 2}, o);
  EXPECT_EQ(l.flat_numel(), top);
  EXPECT_EQ(l.flat_bytes(), UINT64_MAX - 1);
  EXPECT_EQ(l.partition_bytes(), UINT64_MAX - 1);
  EXPECT_EQ(l.padding(), top - 3);
  EXPECT_EQ(l.rank(0).padding, top - 3);
  // One element more is 2^64 bytes.
  o.alignment_factor = top + 1;
  EXPECT_NE(
      msg({1}, o).find("flat buffer size in bytes overflows 64 bits (9223372036854775808 * 2)"),
      std::string::npos)
      << msg({1}, o);
  // The factor times dp.
  o.alignment_factor = top;
  o.dp = 3;
  EXPECT_NE(msg({1}, o).find("alignment factor * dp overflows 64 bits (9223372036854775807 * 3)"),
            std::string::npos)
      << msg({1}, o);
  // The same through the element counts, and through parameter alignment.
  EXPECT_NE(msg({top, 1}, {}).find("flat buffer size in bytes overflows"), std::string::npos);
  EXPECT_EQ(Layout::compute(std::vector<std::uint64_t>{top - 1}, {}).flat_bytes(),
            UINT64_MAX - 3);
  LayoutOptions aligned;
  aligned.param_align_bytes = std::uint64_t{1} << 63;  // every parameter at 2^62 elements
  EXPECT_EQ(Layout::compute(std::vector<std::uint64_t>{1, 1}, aligned).offsets()[1],
            std::uint64_t{1} << 62);
  EXPECT_NE(msg({1, 1, 1}, aligned).find("bytes overflows"), std::string::npos)
      << msg({1, 1, 1}, aligned);
  EXPECT_NE(msg({1, 1, 1, 1, 1}, aligned).find("parameter offset overflows"), std::string::npos)
      << msg({1, 1, 1, 1, 1}, aligned);
}

// A brute-force model of the rules: per element, who owns it.
void check_properties(const std::vector<std::uint64_t>& numels, const LayoutOptions& o) {
  SCOPED_TRACE(::testing::Message()
               << "dp " << o.dp << " af " << o.alignment_factor << " rr " << o.round_robin << " B "
               << o.param_align_bytes << " n " << numels.size());
  Layout l = Layout::compute(numels, o);
  const std::uint64_t n = numels.size();
  const std::uint64_t es = l.element_size();
  ASSERT_EQ(l.flat_numel() % l.alignment(), 0u);
  ASSERT_EQ(l.flat_numel() % o.dp, 0u);
  ASSERT_GE(l.flat_numel(), l.numel());
  ASSERT_LT(l.flat_numel() - l.data_end(), l.alignment());
  // Parameters occupy disjoint ranges in flat order; alignment holds; the first starts at 0.
  std::vector<std::int64_t> owner(l.flat_numel(), -1);  // -1: padding
  for (std::uint64_t k = 0; k < n; ++k) {
    const std::uint64_t i = l.order()[k];
    const std::uint64_t off = l.offsets()[i];
    if (k == 0) ASSERT_EQ(off, 0u);
    if (o.param_align_bytes > 0) ASSERT_EQ(off * es % o.param_align_bytes, 0u);
    if (k > 0) {
      const std::uint64_t prev = l.order()[k - 1];
      ASSERT_GE(off, l.offsets()[prev] + numels[prev]);
      if (o.param_align_bytes == 0) ASSERT_EQ(off, l.offsets()[prev] + numels[prev]);
    }
    for (std::uint64_t e = 0; e < numels[i]; ++e) {
      ASSERT_EQ(owner[off + e], -1);
      owner[off + e] = static_cast<std::int64_t>(i);
    }
  }
  if (o.round_robin) {
    // Bucket-major: bucket (i mod dp) never decreases along the flat order.
    for (std::uint64_t k = 1; k < n; ++k) {
      ASSERT_LE(l.order()[k - 1] % o.dp, l.order()[k] % o.dp);
    }
  }
  // Partitions tile the buffer; every parameter element is in exactly one fragment of one rank.
  std::vector<int> covered(l.flat_numel(), 0);
  std::uint64_t padding_total = 0;
  for (std::uint64_t r = 0; r < o.dp; ++r) {
    RankLayout rl = l.rank(r);
    RankLayout quick = l.rank(r, false);
    ASSERT_EQ(quick.params_in_partition, rl.params_in_partition);
    ASSERT_EQ(quick.first_offset, rl.first_offset);
    ASSERT_TRUE(quick.params_not_in_partition.empty());
    // Brute force: in the partition iff it starts inside [start, end), or straddles start.
    std::uint64_t want_first_offset = 0;
    std::vector<std::uint64_t> want_in;
    for (std::uint64_t i : l.order()) {
      const std::uint64_t o = l.offsets()[i], m = numels[i];
      if (o >= rl.start && o < rl.end) {
        want_in.push_back(i);
      } else if (o < rl.start && o + m > rl.start) {
        want_in.push_back(i);
        want_first_offset = rl.start - o;
      }
    }
    ASSERT_EQ(rl.params_in_partition, want_in);
    ASSERT_EQ(rl.first_offset, want_first_offset);
    ASSERT_EQ(rl.start, r * l.partition_numel());
    ASSERT_EQ(rl.end - rl.start, l.partition_numel());
    std::uint64_t pad = 0;
    for (std::uint64_t x = rl.start; x < rl.end; ++x) pad += x >= l.data_end();
    ASSERT_EQ(rl.padding, pad);
    padding_total += pad;
    ASSERT_EQ(rl.params_in_partition.size() + rl.params_not_in_partition.size(), n);
    for (const Fragment& f : rl.fragments) {
      ASSERT_GT(f.numel, 0u);
      for (std::uint64_t e = 0; e < f.numel; ++e) {
        const std::uint64_t x = rl.start + f.partition_offset + e;
        ASSERT_LT(x, rl.end);
        ASSERT_EQ(owner[x], static_cast<std::int64_t>(f.param));
        ASSERT_EQ(l.offsets()[f.param] + f.param_offset + e, x);
        ++covered[x];
      }
      // Every fragment's parameter is listed as in the partition.
      bool listed = std::find(rl.params_in_partition.begin(), rl.params_in_partition.end(),
                              f.param) != rl.params_in_partition.end();
      ASSERT_TRUE(listed);
    }
  }
  for (std::uint64_t x = 0; x < l.flat_numel(); ++x) {
    ASSERT_EQ(covered[x], owner[x] >= 0 ? 1 : 0) << "element " << x;
  }
  ASSERT_EQ(padding_total, l.flat_numel() - l.data_end());
}

TEST(LayoutProperties, ThousandsOfRandomGroups) {
  std::mt19937_64 rng(20261129);
  const DType dtypes[] = {DType::kBF16, DType::kFP16, DType::kFP32};
  int cases = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    LayoutOptions o;
    o.dp = 1 + rng() % (iter % 10 == 0 ? 70 : 9);
    o.alignment_factor = 1 + rng() % 8;
    o.round_robin = rng() % 2 == 0;
    o.dtype = dtypes[rng() % 3];
    const std::uint64_t es = element_size(o.dtype);
    o.param_align_bytes = rng() % 3 == 0 ? 0 : es << (rng() % 6);
    const std::size_t n = rng() % 12;
    std::vector<std::uint64_t> numels(n);
    for (auto& m : numels) {
      const int kind = static_cast<int>(rng() % 6);
      m = kind == 0 ? 0 : kind == 1 ? 1 : rng() % (kind == 5 ? 300 : 40);
    }
    check_properties(numels, o);
    if (::testing::Test::HasFatalFailure()) return;
    ++cases;
  }
  EXPECT_EQ(cases, 3000);
}

TEST(LayoutFragments, RangeQueryMatchesRankFragments) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 200; ++iter) {
    LayoutOptions o;
    o.dp = 1 + rng() % 6;
    std::vector<std::uint64_t> numels(1 + rng() % 20);
    for (auto& m : numels) m = rng() % 50;
    Layout l = Layout::compute(numels, o);
    for (std::uint64_t r = 0; r < o.dp; ++r) {
      RankLayout rl = l.rank(r);
      EXPECT_EQ(l.fragments_in(rl.start, rl.end), rl.fragments);
    }
    EXPECT_TRUE(l.fragments_in(5, 5).empty());
  }
}

TEST(LayoutScale, MillionParametersIsLinear) {
  std::vector<std::uint64_t> numels(1'000'000);
  for (std::size_t i = 0; i < numels.size(); ++i) numels[i] = i % 4099;
  LayoutOptions o;
  o.dp = 64;
  o.round_robin = true;
  Layout l = Layout::compute(numels, o);
  EXPECT_EQ(l.order().size(), numels.size());
  EXPECT_EQ(l.flat_numel() % 128, 0u);
  std::uint64_t sum = 0;
  for (std::uint64_t r = 0; r < o.dp; ++r) {
    for (const Fragment& f :
         l.fragments_in(r * l.partition_numel(), (r + 1) * l.partition_numel())) {
      sum += f.numel;
    }
  }
  EXPECT_EQ(sum, l.numel());
}

}  // namespace
}  // namespace zeroflat

namespace zeroflat {
namespace {

TEST(Release, RulesByVersion) {
  const ReleaseRules r198 = deepspeed_rules("0.19.8");
  EXPECT_TRUE(r198.tested && r198.skips_zero_element && r198.has_parameter_alignment);
  EXPECT_FALSE(r198.padding_on_last_rank);
  const ReleaseRules r197 = deepspeed_rules("0.19.7+cu121");
  EXPECT_FALSE(r197.tested || r197.skips_zero_element);
  EXPECT_TRUE(r197.has_parameter_alignment);
  EXPECT_EQ(r197.rules, "0.18.9");
  EXPECT_TRUE(deepspeed_rules("0.15.4").padding_on_last_rank);
  EXPECT_FALSE(deepspeed_rules("0.16.0").padding_on_last_rank);
  EXPECT_EQ(deepspeed_rules("latest").release, tested_deepspeed_releases().back());
  EXPECT_EQ(deepspeed_rules("0.21.3").rules, "0.19.8");
  EXPECT_FALSE(deepspeed_rules("0.21.3").tested);
  for (const char* bad : {"0.13.9", "1", "0.x.1", "", "0.19", "0.19.8junk"}) {
    EXPECT_THROW((void)deepspeed_rules(bad), InvalidArgument) << bad;
  }
}

// The example: one zero-element parameter with round-robin and 16-byte alignment changes
// every later offset and the flat size between zeroflat's layout and DeepSpeed 0.19.8's.
TEST(Release, ZeroElementParametersAreLeftOutFrom0198) {
  const std::vector<std::uint64_t> sizes = {6, 40299, 4, 4, 0, 5, 29911, 3};
  LayoutOptions o;
  o.dp = 2;
  o.round_robin = true;
  o.param_align_bytes = 16;
  EXPECT_EQ(Layout::compute(sizes, o).flat_numel(), 70252u);
  const ReleaseLayout r = layout_for_release(sizes, {}, o, deepspeed_rules("0.19.8"));
  EXPECT_EQ(r.layout.flat_numel(), 70256u);
  ASSERT_EQ(r.left_out.size(), 1u);
  EXPECT_EQ(r.left_out[0].first, 4u);
  EXPECT_EQ(r.left_out[0].second, LeftOut::kZeroElements);
  EXPECT_EQ(r.kept, (std::vector<std::uint64_t>{0, 1, 2, 3, 5, 6, 7}));
  // Older releases keep it: zeroflat's layout, frozen parameters aside.
  o.param_align_bytes = 0;
  const std::vector<bool> frozen = {false, false, true, false, false, false, false, false};
  const ReleaseLayout old = layout_for_release(sizes, frozen, o, deepspeed_rules("0.18.6"));
  EXPECT_EQ(old.left_out.size(), 1u);
  EXPECT_EQ(old.left_out[0].second, LeftOut::kFrozen);
  std::vector<std::uint64_t> without_frozen = sizes;
  without_frozen.erase(without_frozen.begin() + 2);
  EXPECT_EQ(old.layout.offsets(), Layout::compute(without_frozen, o).offsets());
}

TEST(Release, PaddingBookkeepingAndOptionsFollowTheRelease) {
  LayoutOptions o;
  o.dp = 4;
  const std::vector<std::uint64_t> one = {1};  // 7 elements of padding over 4 partitions of 2
  const ReleaseLayout before = layout_for_release(one, {}, o, deepspeed_rules("0.14.5"));
  const ReleaseLayout after = layout_for_release(one, {}, o, deepspeed_rules("0.16.9"));
  EXPECT_EQ(before.rank_padding(0), 0u);
  EXPECT_EQ(before.rank_padding(3), 7u);  // all of it on the last rank, more than a partition
  EXPECT_EQ(after.rank_padding(0), 1u);
  EXPECT_EQ(after.rank_padding(3), 2u);
  o.alignment_factor = 4;
  EXPECT_THROW((void)layout_for_release(one, {}, o, deepspeed_rules("0.19.8")), InvalidArgument);
  o.alignment_factor = 2;
  o.param_align_bytes = 16;
  EXPECT_THROW((void)layout_for_release(one, {}, o, deepspeed_rules("0.18.9")), InvalidArgument);
  o.param_align_bytes = 32;
  EXPECT_THROW((void)layout_for_release(one, {}, o, deepspeed_rules("0.19.8")), InvalidArgument);
  EXPECT_THROW((void)layout_for_release(one, {true, false}, {}, deepspeed_rules("0.19.8")),
               InvalidArgument);
}

}  // namespace
}  // namespace zeroflat
