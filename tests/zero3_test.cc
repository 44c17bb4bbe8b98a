// The ZeRO-3 layout: partitions and padding per parameter, the rank buffer's offsets, the
// Stage 3 optimizer's sub-groups and groups_padding, on small cases checked by hand, and the
// sizes that would overflow.
#include "zeroflat/layout.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "zeroflat/common.h"

namespace zeroflat {
namespace {

using Groups = std::vector<std::vector<std::uint64_t>>;

Zero3Layout compute(const Groups& groups, std::uint64_t world, std::uint64_t sub_group_size,
                    DType dtype = DType::kBF16) {
  return Zero3Layout::compute(groups, Zero3Options{world, sub_group_size, dtype});
}

TEST(Zero3Partition, IsTheCeilingOfNOverWorldAndTheLastRanksSliceHoldsThePadding) {
  EXPECT_EQ(zero3_partition_numel(10, 4), 3u);  // 3 3 3 1, padding 2
  EXPECT_EQ(zero3_partition_numel(8, 4), 2u);   // n % W == 0: no padding
  EXPECT_EQ(zero3_partition_numel(3, 4), 1u);   // n < W: the last rank holds only padding
  EXPECT_EQ(zero3_partition_numel(0, 4), 0u);
  EXPECT_EQ(zero3_partition_numel(UINT64_MAX, 2), std::uint64_t{1} << 63);
  const std::vector<std::uint64_t> ten = {3, 3, 3, 1};
  for (std::uint64_t r = 0; r < 4; ++r) EXPECT_EQ(zero3_data_numel(10, 4, r), ten[r]) << r;
  const std::vector<std::uint64_t> three = {1, 1, 1, 0};
  for (std::uint64_t r = 0; r < 4; ++r) EXPECT_EQ(zero3_data_numel(3, 4, r), three[r]) << r;
  // 5 on 3 ranks: p 2, slices 2 2 1.
  EXPECT_EQ(zero3_data_numel(5, 3, 0), 2u);
  EXPECT_EQ(zero3_data_numel(5, 3, 1), 2u);
  EXPECT_EQ(zero3_data_numel(5, 3, 2), 1u);
  // 4 on 3 ranks: p 2, slices 2 2 0 (a rank past the data holds only padding).
  EXPECT_EQ(zero3_data_numel(4, 3, 2), 0u);
  EXPECT_EQ(zero3_data_numel(0, 3, 0), 0u);
  EXPECT_EQ(zero3_data_numel(UINT64_MAX, 2, 1), (std::uint64_t{1} << 63) - 1);
  EXPECT_EQ(zero3_data_numel(4, 2, UINT64_MAX), 0u);
}

TEST(Zero3Layout, PartitionsBackToBackOverGroupsWithTheirPadding) {
  // W = 4: 10 -> p 3 pad 2; 8 -> p 2 pad 0; 3 -> p 1 pad 1; 0 -> p 0 pad 0; 5 -> p 2 pad 3.
  const Zero3Layout l = compute({{10, 8}, {3, 0, 5}}, 4, kDefaultSubGroupSize);
  EXPECT_EQ(l.num_groups(), 2u);
  EXPECT_EQ(l.num_params(), 5u);
  EXPECT_EQ(l.numel(), 26u);
  EXPECT_EQ(l.partition_numels(), (std::vector<std::uint64_t>{3, 2, 1, 0, 2}));
  EXPECT_EQ(l.offsets(), (std::vector<std::uint64_t>{0, 3, 5, 6, 6}));
  EXPECT_EQ(l.groups(), (std::vector<std::uint64_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(l.buffer_numel(), 8u);
  EXPECT_EQ(l.buffer_bytes(), 16u);
  const std::vector<std::uint64_t> pad = {2, 0, 1, 0, 3};
  for (std::uint64_t i = 0; i < 5; ++i) EXPECT_EQ(l.padding(i), pad[i]) << i;
  // One sub-group per group (sub_group_size holds each).
  ASSERT_EQ(l.sub_groups().size(), 2u);
  EXPECT_EQ(l.sub_groups()[0], (Zero3SubGroup{0, 0, 2, 0, 5}));
  EXPECT_EQ(l.sub_groups()[1], (Zero3SubGroup{1, 2, 3, 5, 3}));
  // groups_padding: the padding on the last rank only.
  using Pad = std::vector<std::vector<std::uint64_t>>;
  EXPECT_EQ(l.groups_padding(3), (Pad{{2, 0}, {1, 0, 3}}));
  for (std::uint64_t r = 0; r < 3; ++r) EXPECT_EQ(l.groups_padding(r), (Pad{{0, 0}, {0, 0, 0}}));
  EXPECT_THROW(l.groups_padding(4), InvalidArgument);
  // Data per rank: 3+2+1+0+2, ..., the last 1+2+0+0+0.
  EXPECT_EQ(l.data_numel(0), 8u);
  EXPECT_EQ(l.data_numel(2), 3u + 2 + 1 + 0 + 1);
  EXPECT_EQ(l.data_numel(3), 1u + 2 + 0 + 0 + 0);
  // The buffer as a one-rank layout: the partitions back to back, nothing else.
  const Layout b = l.buffer_layout();
  EXPECT_EQ(b.options().dp, 1u);
  EXPECT_EQ(b.flat_numel(), 8u);
  EXPECT_EQ(b.offsets(), l.offsets());
  EXPECT_EQ(b.numels(), l.partition_numels());
}

TEST(Zero3Layout, SubGroupsAreCutWhenTheirPartitionsReachTheSize) {
  // W = 2, partitions 5 3 4 2 6 (numels 10 6 7 4 11), group total 20.
  const Groups g = {{10, 6, 7, 4, 11}};
  // >= cut: 5 -> 5+3=8 >= 8 cut; 4+2=6, +6=12 >= 8 cut at the end.
  Zero3Layout l = compute(g, 2, 8);
  ASSERT_EQ(l.sub_groups().size(), 2u);
  EXPECT_EQ(l.sub_groups()[0], (Zero3SubGroup{0, 0, 2, 0, 8}));
  EXPECT_EQ(l.sub_groups()[1], (Zero3SubGroup{0, 2, 3, 8, 12}));
  // Size 5: the first parameter alone reaches it; 3+4 = 7; 2+6 = 8.
  l = compute(g, 2, 5);
  ASSERT_EQ(l.sub_groups().size(), 3u);
  EXPECT_EQ(l.sub_groups()[0], (Zero3SubGroup{0, 0, 1, 0, 5}));
  EXPECT_EQ(l.sub_groups()[1], (Zero3SubGroup{0, 1, 2, 5, 7}));
  EXPECT_EQ(l.sub_groups()[2], (Zero3SubGroup{0, 3, 2, 12, 8}));
  // Exactly the group's total, or more: one sub-group; one less: cut, the last closes the rest.
  EXPECT_EQ(compute(g, 2, 20).sub_groups().size(), 1u);
  EXPECT_EQ(compute(g, 2, 1'000).sub_groups().size(), 1u);
  l = compute(g, 2, 19);
  ASSERT_EQ(l.sub_groups().size(), 1u);  // 5+3+4+2+6 reaches 19 only at the group's end
  EXPECT_EQ(l.sub_groups()[0], (Zero3SubGroup{0, 0, 5, 0, 20}));
  // 0: every parameter its own sub-group.
  l = compute(g, 2, 0);
  ASSERT_EQ(l.sub_groups().size(), 5u);
  for (std::uint64_t k = 0; k < 5; ++k) {
    EXPECT_EQ(l.sub_groups()[k].first_param, k);
    EXPECT_EQ(l.sub_groups()[k].num_params, 1u);
    EXPECT_EQ(l.sub_groups()[k].offset, l.offsets()[k]);
  }
  // groups_padding follows the cut: 10 6 7 4 11 on 2 ranks pad 0 0 1 0 1.
  l = compute(g, 2, 8);
  using Pad = std::vector<std::vector<std::uint64_t>>;
  EXPECT_EQ(l.groups_padding(1), (Pad{{0, 0}, {1, 0, 1}}));
  EXPECT_EQ(l.groups_padding(0), (Pad{{0, 0}, {0, 0, 0}}));
  // Each group is cut on its own: the count starts again at a group's first parameter, and a
  // group's last parameter closes its last sub-group.
  l = compute({{10, 6}, {7, 4, 11}}, 2, 5);
  ASSERT_EQ(l.sub_groups().size(), 4u);
  EXPECT_EQ(l.sub_groups()[0], (Zero3SubGroup{0, 0, 1, 0, 5}));
  EXPECT_EQ(l.sub_groups()[1], (Zero3SubGroup{0, 1, 1, 5, 3}));
  EXPECT_EQ(l.sub_groups()[2], (Zero3SubGroup{1, 2, 2, 8, 6}));
  EXPECT_EQ(l.sub_groups()[3], (Zero3SubGroup{1, 4, 1, 14, 6}));
}

TEST(Zero3Layout, EmptyGroupsAndZeroElementParameters) {
  // An empty group has no sub-group (DeepSpeed drops it before cutting); zero-element parameters
  // have partitions of 0 elements.
  const Zero3Layout l = compute({{}, {0, 0}, {4}}, 3, 0);
  EXPECT_EQ(l.num_params(), 3u);
  EXPECT_EQ(l.buffer_numel(), 2u);
  ASSERT_EQ(l.sub_groups().size(), 2u);
  // Zero partition elements and a size of 0: 0 >= 0 holds, so the group stays whole.
  EXPECT_EQ(l.sub_groups()[0], (Zero3SubGroup{1, 0, 2, 0, 0}));
  EXPECT_EQ(l.sub_groups()[1], (Zero3SubGroup{2, 2, 1, 0, 2}));
  EXPECT_EQ(l.padding(2), 2u);  // 4 on 3 ranks: p 2, 2 2 0
  EXPECT_EQ(l.data_numel(2), 0u);
  const Zero3Layout none = compute({}, 2, 5);
  EXPECT_EQ(none.buffer_numel(), 0u);
  EXPECT_TRUE(none.sub_groups().empty());
}

TEST(Zero3Layout, OneRankHoldsEveryParameterWhole) {
  const Zero3Layout l = compute({{5, 7, 3}}, 1, 100, DType::kFP32);
  EXPECT_EQ(l.partition_numels(), (std::vector<std::uint64_t>{5, 7, 3}));
  EXPECT_EQ(l.buffer_bytes(), 60u);
  for (std::uint64_t i = 0; i < 3; ++i) EXPECT_EQ(l.padding(i), 0u);
}

TEST(Zero3Layout, SizesThatOverflowAreRefusedAndPaddingNeverWraps) {
  EXPECT_THROW(compute({{1}}, 0, 1), InvalidArgument);
  EXPECT_THROW(compute({{1}}, kMaxDp + 1, 1), InvalidArgument);
  // The buffer's elements fit, its bytes do not.
  EXPECT_THROW(compute({{UINT64_MAX}}, 1, 1), InvalidArgument);
  EXPECT_THROW(compute({{UINT64_MAX / 2, UINT64_MAX / 2}}, 1, 1), InvalidArgument);
  // The parameters' elements overflow though the buffer is small.
  EXPECT_THROW(compute({{UINT64_MAX, UINT64_MAX}}, kMaxDp, 1), InvalidArgument);
  // Padding exact where p * W would not fit in 64 bits.
  const Zero3Layout l = compute({{UINT64_MAX}}, 3, 1);
  EXPECT_EQ(l.partition_numels()[0], UINT64_MAX / 3);  // divisible: no padding
  EXPECT_EQ(l.padding(0), 0u);
  const Zero3Layout m = compute({{UINT64_MAX - 1}}, kMaxDp, 1);
  const std::uint64_t p = m.partition_numels()[0];
  // p * W - n computed without the product: n + padding is a multiple of W, in 128 bits.
  const unsigned __int128 total = static_cast<unsigned __int128>(p) * kMaxDp;
  EXPECT_EQ(static_cast<unsigned __int128>(m.padding(0)), total - (UINT64_MAX - 1));
}

TEST(Zero3Layout, TheDocumentListsParamsSubGroupsAndEachRanksPadding) {
  const Zero3Layout l = compute({{10, 6, 7, 4, 11}}, 2, 8);
  std::ostringstream out;
  l.write_json(out);
  const nlohmann::json doc = nlohmann::json::parse(out.str());
  EXPECT_EQ(doc["stage"], 3);
  EXPECT_EQ(doc["world"], 2);
  EXPECT_EQ(doc["buffer_numel"], 20);
  EXPECT_EQ(doc["params"][2]["partition_numel"], 4);
  EXPECT_EQ(doc["params"][2]["padding"], 1);
  EXPECT_EQ(doc["params"][2]["offset"], 8);
  EXPECT_EQ(doc["sub_groups"][1]["params"], nlohmann::json::array({2, 3}));
  EXPECT_EQ(doc["sub_groups"][1]["offset"], 8);
  ASSERT_EQ(doc["ranks"].size(), 2u);
  EXPECT_EQ(doc["ranks"][1]["groups_padding"], nlohmann::json::parse("[[0,0],[1,0,1]]"));
  EXPECT_EQ(doc["ranks"][1]["padding"], 2);
  EXPECT_EQ(doc["ranks"][0]["data_numel"], 20);
  std::ostringstream one;
  l.write_json(one, 1);
  EXPECT_EQ(nlohmann::json::parse(one.str())["ranks"].size(), 1u);
  std::ostringstream bad;
  EXPECT_THROW(l.write_json(bad, 2), InvalidArgument);
  // Too many entries for one document of every rank: refused before anything is written.
  const Zero3Layout wide = compute({std::vector<std::uint64_t>(200, 1)}, kMaxDp, 1);
  std::ostringstream none;
  EXPECT_THROW(wide.write_json(none), InvalidArgument);
  EXPECT_TRUE(none.str().empty());
}

}  // namespace
}  // namespace zeroflat
