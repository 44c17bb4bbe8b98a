// The planner: step lists on the memory model, the seed's scenarios, and its invariants.
#include "zeroflat/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "zeroflat/common.h"
#include "zeroflat/layout.h"
#include "zeroflat/model.h"

namespace zeroflat {
namespace {

constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

PlanInput qwen_on(const char* preset_name, std::uint64_t layers, std::uint64_t dp,
                  std::optional<std::uint64_t> free = std::nullopt) {
  ModelSpec m = catalog_model("qwen3-30b-a3b", {.layers = layers});
  LayoutOptions o;
  o.dp = dp;
  DevicePreset preset = *find_preset(preset_name);
  PlanInput in{Layout::compute(m.numels(), o)};
  in.original_bytes = m.numel() * 2;
  in.capacity_bytes = preset.capacity_bytes;
  in.free_bytes = free.value_or(
      preset.capacity_bytes > in.original_bytes ? preset.capacity_bytes - in.original_bytes : 0);
  in.margin_bytes = default_margin(preset.capacity_bytes);
  in.host_free_bytes = preset.host_bytes_per_node / std::min<std::uint64_t>(dp, 8);
  in.bandwidths = preset.bandwidths;
  in.integrated = preset.integrated;
  return in;
}

const Candidate& candidate(const Plan& p, Tier t) {
  for (const Candidate& c : p.candidates) {
    if (c.tier == t) return c;
  }
  throw std::runtime_error("tier missing");
}

TEST(Steps, PeaksFollowTheTierFormulas) {
  // 5 params, dp 4: flat 32 elements of bf16 -> Fb = 64 bytes, Sb = 16.
  Layout l = Layout::compute(std::vector<std::uint64_t>{5, 7, 3, 10, 4}, LayoutOptions{4});
  const std::uint64_t fb = l.flat_bytes(), sb = l.partition_bytes(), m = 29 * 2;
  ASSERT_EQ(fb, 64u);
  const std::uint64_t resident = 1000;
  Profile dev = simulate(tier_steps(Tier::kDevice, l, 1), resident, m, 4);
  EXPECT_EQ(dev.peak_device_bytes, resident + fb);
  EXPECT_EQ(dev.device_copy_bytes, fb);
  EXPECT_EQ(dev.after_step.back().device_bytes, resident - m + fb);
  Profile sh = simulate(tier_steps(Tier::kSharded, l, 1), resident, m, 4);
  EXPECT_EQ(sh.peak_device_bytes, resident + sb + (fb - m));
  EXPECT_EQ(sh.comm_bytes, fb / 4 * 3);
  EXPECT_EQ(sh.after_step.back().device_bytes, resident - m + fb);
  Profile st = simulate(tier_steps(Tier::kStaged, l, 1, 6), resident, m, 4);
  EXPECT_EQ(st.peak_device_bytes, resident - m + fb + 6);
  EXPECT_EQ(st.peak_host_bytes, sb - 6);
  EXPECT_EQ(st.pcie_bytes, 2 * (sb - 6));
  EXPECT_EQ(st.after_step.back().device_bytes, resident - m + fb);
  EXPECT_EQ(st.after_step.back().host_bytes, 0u);
  Profile host = simulate(tier_steps(Tier::kHost, l, 1), resident, m, 4);
  EXPECT_EQ(host.peak_device_bytes, resident - m + fb);  // only the padding on top
  EXPECT_EQ(host.peak_host_bytes, fb);
  EXPECT_EQ(host.pcie_bytes, 2 * fb);
  // Every tier ends with the same memory: the flat buffer instead of the originals.
  for (Tier t : kAllTiers) {
    Profile p = simulate(tier_steps(t, l, 3, 3), resident, m, 4);
    EXPECT_EQ(p.after_step.back().device_bytes, resident - m + fb) << tier_name(t);
    EXPECT_EQ(p.after_step.back().host_bytes, 0u) << tier_name(t);
  }
}

TEST(Steps, TheSliceIsTheRanks) {
  Layout l = Layout::compute(std::vector<std::uint64_t>{100}, LayoutOptions{4});
  for (std::uint64_t r = 0; r < 4; ++r) {
    std::vector<Step> s = tier_steps(Tier::kSharded, l, r);
    EXPECT_EQ(s[1].op, Op::kGather);
    EXPECT_EQ(s[1].flat_offset, r * l.partition_bytes());
    EXPECT_EQ(s[1].bytes, l.partition_bytes());
  }
  EXPECT_THROW((void)tier_steps(Tier::kDevice, l, 4), InvalidArgument);
}

TEST(Steps, BrokenStepListsAreCaught) {
  EXPECT_THROW((void)simulate({Step{Op::kRelease, Buffer::kFlat}}, 10, 5, 1), InternalError);
  EXPECT_THROW((void)simulate({Step{Op::kReleaseOriginals}, Step{Op::kReleaseOriginals}}, 10, 5, 1),
               InternalError);
  EXPECT_THROW((void)simulate({Step{Op::kAllocate, Buffer::kFlat, Buffer::kNone, 4},
                               Step{Op::kReleaseOriginals},
                               Step{Op::kGather, Buffer::kFlat, Buffer::kOriginals, 4}},
                              10, 5, 1),
               InternalError);
}

TEST(Scenarios, Seed32LayersOn8H100IsDevice) {
  Plan p = plan_group(qwen_on("h100-80gb", 32, 8));
  ASSERT_TRUE(p.chosen);
  EXPECT_EQ(*p.chosen, Tier::kDevice);
  EXPECT_NEAR(p.chosen_candidate()->predicted_seconds, 0.0296, 0.005);
}

TEST(Scenarios, Full48LayersOn8H100IsSharded) {
  Plan p = plan_group(qwen_on("h100-80gb", 48, 8));
  ASSERT_TRUE(p.chosen);
  EXPECT_EQ(*p.chosen, Tier::kSharded);
  EXPECT_FALSE(candidate(p, Tier::kDevice).feasible);
  EXPECT_NE(candidate(p, Tier::kDevice).why_not.find("second copy"), std::string::npos);
}

TEST(Scenarios, Full48LayersOn8H100With4GiBFreeIsStaged) {
  Plan p = plan_group(qwen_on("h100-80gb", 48, 8, 4 * kGiB));
  ASSERT_TRUE(p.chosen);
  EXPECT_EQ(*p.chosen, Tier::kStaged);
  // Only part of this rank's 1/8 goes through the host.
  const Candidate& s = candidate(p, Tier::kStaged);
  EXPECT_GT(s.profile.peak_host_bytes, 0u);
  EXPECT_LT(s.profile.peak_host_bytes, p.candidates[0].steps[0].bytes / 8 + 1);
}

TEST(Scenarios, Full48LayersOnOneH200IsDeviceAndOnOneH100With2GiBIsStagedDeficitOnly) {
  Plan h200 = plan_group(qwen_on("h200", 48, 1));
  ASSERT_TRUE(h200.chosen);
  EXPECT_EQ(*h200.chosen, Tier::kDevice);
  PlanInput in = qwen_on("h100-80gb", 48, 1, 2 * kGiB);
  Plan h100 = plan_group(in);
  ASSERT_TRUE(h100.chosen);
  EXPECT_EQ(*h100.chosen, Tier::kStaged);
  const Candidate& s = candidate(h100, Tier::kStaged);
  // Exactly the deficit: what does not fit beside the flat buffer goes through the host.
  const std::uint64_t limit = in.capacity_bytes - in.margin_bytes;
  const std::uint64_t resident = in.capacity_bytes - in.free_bytes;
  const std::uint64_t on_device = limit - (resident - in.original_bytes + in.layout.flat_bytes());
  EXPECT_EQ(s.profile.peak_host_bytes, in.layout.flat_bytes() - on_device);
  EXPECT_LT(s.profile.peak_host_bytes, candidate(h100, Tier::kHost).profile.peak_host_bytes);
  EXPECT_EQ(s.profile.peak_device_bytes, limit);
}

TEST(Scenarios, ModelLargerThanTheDeviceHasNoPlan) {
  Plan p = plan_group(qwen_on("a100-40gb", 48, 8));
  EXPECT_FALSE(p.chosen);
  EXPECT_NE(p.reason.find("61.1 GB"), std::string::npos) << p.reason;
  EXPECT_NE(p.reason.find("42.9 GB"), std::string::npos) << p.reason;
  for (const Candidate& c : p.candidates) EXPECT_FALSE(c.feasible);
}

TEST(Scenarios, ForcedTierThatDoesNotFitHasNoPlan) {
  PlanInput in = qwen_on("h100-80gb", 48, 8);
  in.forced = Tier::kDevice;
  Plan p = plan_group(in);
  EXPECT_FALSE(p.chosen);
  EXPECT_NE(p.reason.find("forced tier device"), std::string::npos);
  in.forced = Tier::kHost;  // feasible but slow: honoured
  p = plan_group(in);
  ASSERT_TRUE(p.chosen);
  EXPECT_EQ(*p.chosen, Tier::kHost);
}

TEST(Invariants, MoreFreeMemoryNeverYieldsASlowerPlanAndPeaksStayUnderTheLimit) {
  for (const char* preset : {"h100-80gb", "h200", "a100-80gb"}) {
    for (std::uint64_t dp : {1, 2, 8}) {
      for (std::uint64_t layers : {8, 24, 48}) {
        PlanInput base = qwen_on(preset, layers, dp);
        if (base.original_bytes >= base.capacity_bytes) continue;
        double prev = INFINITY;
        const std::uint64_t max_free = base.capacity_bytes - base.original_bytes;
        // An even sweep, plus the points where the staged tier starts keeping bytes on the
        // device (free = margin + Fb - M, and one byte more).
        std::vector<std::uint64_t> frees;
        for (std::uint64_t f = 0; f <= max_free; f += max_free / 97 + 1) frees.push_back(f);
        const std::uint64_t edge =
            base.margin_bytes + (base.layout.flat_bytes() - base.original_bytes);
        for (std::uint64_t f : {edge - 1, edge, edge + 1, edge + 4096}) {
          if (f <= max_free) frees.push_back(f);
        }
        std::sort(frees.begin(), frees.end());
        for (std::uint64_t free : frees) {
          PlanInput in = base;
          in.free_bytes = free;
          Plan p = plan_group(in);
          ASSERT_EQ(p.candidates.size(), 4u);
          for (const Candidate& c : p.candidates) {
            EXPECT_EQ(c.feasible, c.why_not.empty());
          }
          if (!p.chosen) {
            EXPECT_EQ(prev, INFINITY) << "a plan existed with less free memory";
            continue;
          }
          const Candidate* c = p.chosen_candidate();
          EXPECT_LE(c->profile.peak_device_bytes, in.capacity_bytes - in.margin_bytes);
          EXPECT_LE(c->predicted_seconds, prev + 1e-12)
              << preset << " dp " << dp << " layers " << layers << " free " << free;
          prev = c->predicted_seconds;
        }
      }
    }
  }
}

TEST(Invariants, IntegratedDevicesDoNotStage) {
  PlanInput in = qwen_on("gb10", 24, 1);
  Plan p = plan_group(in);
  EXPECT_FALSE(candidate(p, Tier::kHost).feasible);
  EXPECT_NE(candidate(p, Tier::kHost).why_not.find("integrated"), std::string::npos);
}

TEST(Groups, FreedOriginalsMakeRoomForTheNextGroup) {
  // Two groups of 40 GiB each on an 85 GiB device with 6 GiB free: group 0 can only shard;
  // once it is done (padding aside) the next group sees the same free memory.
  PlanInput a = qwen_on("h100-80gb", 16, 8);
  PlanInput b = a;
  a.free_bytes = b.free_bytes = 6 * kGiB;
  std::vector<Plan> plans = plan_groups({a, b});
  ASSERT_EQ(plans.size(), 2u);
  ASSERT_TRUE(plans[0].chosen && plans[1].chosen);
  EXPECT_EQ(*plans[0].chosen, *plans[1].chosen);
  // With a group that grows memory (padding), the second one sees less.
  Layout padded = Layout::compute(std::vector<std::uint64_t>{kGiB + 1}, LayoutOptions{8, 1024});
  PlanInput c = a;
  c.layout = padded;
  c.original_bytes = (kGiB + 1) * 2;
  c.free_bytes = 10 * kGiB;
  std::vector<Plan> two = plan_groups({c, c});
  const std::uint64_t grown = padded.flat_bytes() - c.original_bytes;
  const Candidate* first = two[0].chosen_candidate();
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->profile.after_step.back().device_bytes, c.capacity_bytes - c.free_bytes + grown);
}

TEST(AfterInit, WarnsWhenInitFitsButTrainingDoesNot) {
  AfterInit seed = estimate_after_init(qwen_on("h100-80gb", 32, 8));
  EXPECT_TRUE(seed.fits);
  const std::uint64_t s = qwen_on("h100-80gb", 32, 8).layout.partition_numel();
  EXPECT_EQ(seed.master_bytes, 4 * s);
  EXPECT_EQ(seed.optimizer_bytes, 8 * s);
  AfterInit full = estimate_after_init(qwen_on("h100-80gb", 48, 8));
  EXPECT_FALSE(full.fits);
  AfterInit offload = estimate_after_init(qwen_on("h100-80gb", 48, 8), true, true);
  EXPECT_LT(offload.device_bytes_after, full.device_bytes_after);
}

TEST(Load, TheFlatBufferAloneOnTheDeviceTheRingOnTheHostTheReadsAPartition) {
  // The seed's 48 layers, nothing of the model on the device yet.
  PlanInput in = qwen_on("h100-80gb", 48, 8);
  in.free_bytes = in.capacity_bytes;
  in.original_bytes = 0;
  const Candidate c = plan_load(in, kDefaultRingBytes);
  EXPECT_TRUE(c.feasible) << c.why_not;
  EXPECT_EQ(c.tier, Tier::kLoad);
  EXPECT_EQ(c.profile.peak_device_bytes, in.layout.flat_bytes());
  EXPECT_EQ(c.profile.peak_host_bytes, kDefaultRingBytes);
  EXPECT_EQ(c.profile.read_bytes, in.layout.partition_bytes());
  EXPECT_EQ(c.profile.comm_bytes, in.layout.flat_bytes() - in.layout.partition_bytes());
  EXPECT_EQ(c.profile.after_step.back().host_bytes, 0u);  // the ring is released
  // Reading dominates the time, at the read bandwidth.
  EXPECT_GE(c.predicted_seconds,
            static_cast<double>(in.layout.partition_bytes()) / in.bandwidths.read);
  // What is resident counts: with half the device taken, the buffer does not fit.
  in.free_bytes = in.capacity_bytes / 2;
  const Candidate tight = plan_load(in, kDefaultRingBytes);
  EXPECT_FALSE(tight.feasible);
  EXPECT_NE(tight.why_not.find("exceeds"), std::string::npos) << tight.why_not;
  // No pinned host memory to stage through.
  in.free_bytes = in.capacity_bytes;
  in.host_free_bytes = 1 << 20;
  EXPECT_NE(plan_load(in, kDefaultRingBytes).why_not.find("ring"), std::string::npos);
  // A host device reads straight into the buffer: no ring.
  EXPECT_TRUE(plan_load(in, 0).feasible);
  EXPECT_THROW(tier_steps(Tier::kLoad, in.layout, 0), InvalidArgument);
}

TEST(Load, ZeRO3PartitionsAreReadIntoTheRanksOwnBufferWithNoAllGather) {
  // The seed's 48 layers on 8 ranks of one node: each rank's buffer is its partitions (layout.h).
  const PlanInput flat = qwen_on("h100-80gb", 48, 8);
  PlanInput in = flat;
  in.layout = zero3_buffer_layout(flat.layout.numels(), flat.layout.options());
  in.ranks = 8;
  in.local_ranks = 8;
  in.free_bytes = in.capacity_bytes;
  in.original_bytes = 0;
  const Plan p = plan_reads(in, kDefaultRingBytes, std::nullopt, kPartitionReadPlans);
  ASSERT_EQ(p.candidates.size(), 1u);
  ASSERT_EQ(p.chosen, Tier::kLoadPartitions);
  EXPECT_NE(p.reason.find("1 node x 8 ranks"), std::string::npos) << p.reason;
  const Candidate& c = p.candidates[0];
  EXPECT_EQ(c.profile.peak_device_bytes, in.layout.flat_bytes());
  EXPECT_EQ(c.profile.read_bytes, in.layout.flat_bytes());
  EXPECT_EQ(c.profile.comm_bytes, 0u);
  // About 1/8 of the flat buffer, never more than a rank's own rounding up per parameter.
  EXPECT_LE(in.layout.flat_bytes(), flat.layout.flat_bytes() / 8 + 2 * in.layout.num_params());
  // The node reads its 8 ranks' buffers from its storage: at least that over the read rate;
  // from a shared storage, all 8 ranks' buffers over its bandwidth.
  const double node = 8.0 * static_cast<double>(in.layout.flat_bytes());
  EXPECT_GE(c.predicted_seconds, node / in.bandwidths.read);
  in.bandwidths.storage = 1e9;
  EXPECT_GE(plan_load(in, kDefaultRingBytes, Tier::kLoadPartitions).predicted_seconds, node / 1e9);
  // The flat placement's read plans are not this placement's.
  EXPECT_THROW(plan_reads(in, kDefaultRingBytes, Tier::kLoad, kPartitionReadPlans),
               InvalidArgument);
  EXPECT_EQ(load_steps(in.layout, 5, 0, Tier::kLoadPartitions).size(), 3u);  // any rank
  // A slice is the rank's: one past the last rank is an error, the last one is not.
  EXPECT_EQ(load_steps(flat.layout, 7, 0, Tier::kLoadSlice).size(), 2u);
  EXPECT_THROW(load_steps(flat.layout, 8, 0, Tier::kLoadSlice), InvalidArgument);
}

// Sizes past 64 bits: a flat buffer of 2^64 - 2 bytes (alignment factor 2^63 - 1, bf16) is a
// valid layout, but beside anything resident it needs more than 64 bits can count. Every
// account saturates, so no tier fits; a wrapped peak would read as a gigabyte and be chosen.
Layout huge_layout() {
  LayoutOptions o;
  o.alignment_factor = (std::uint64_t{1} << 63) - 1;
  return Layout::compute(std::vector<std::uint64_t>{1}, o);
}

PlanInput huge_input(std::uint64_t capacity, std::uint64_t margin) {
  PlanInput in{huge_layout()};
  in.original_bytes = 2;
  in.capacity_bytes = capacity;
  in.free_bytes = capacity - kGiB;  // a gigabyte resident, the group's 2 bytes among it
  in.margin_bytes = margin;
  in.host_free_bytes = UINT64_MAX;
  in.bandwidths = find_preset("h100-80gb")->bandwidths;
  return in;
}

TEST(Saturation, HugeBuffersSaturateTheMemoryModelInsteadOfWrapping) {
  const Layout l = huge_layout();
  ASSERT_EQ(l.flat_bytes(), UINT64_MAX - 1);
  Profile dev = simulate(tier_steps(Tier::kDevice, l, 0), kGiB, 2, 1);
  EXPECT_EQ(dev.peak_device_bytes, UINT64_MAX);
  // The account stays saturated after the releases: what it held is unknown.
  EXPECT_EQ(dev.after_step.back().device_bytes, UINT64_MAX);
  Profile host = simulate(tier_steps(Tier::kHost, l, 0), kGiB, 2, 1);
  EXPECT_EQ(host.peak_host_bytes, UINT64_MAX - 1);
  EXPECT_EQ(host.pcie_bytes, UINT64_MAX);  // two passes over the buffer
  EXPECT_EQ(host.peak_device_bytes, UINT64_MAX);
  // Small lists keep exact accounts.
  Layout small = Layout::compute(std::vector<std::uint64_t>{5}, LayoutOptions{});
  ASSERT_EQ(small.flat_bytes(), 12u);
  EXPECT_EQ(simulate(tier_steps(Tier::kDevice, small, 0), 100, 10, 1).peak_device_bytes, 112u);
}

TEST(Saturation, NoTierFitsABufferPast64Bits) {
  for (std::uint64_t capacity : {std::uint64_t{81559} << 20, std::uint64_t{UINT64_MAX}}) {
    for (std::uint64_t margin : {std::uint64_t{0}, kGiB}) {
      const PlanInput in = huge_input(capacity, margin);
      const Plan p = plan_group(in);
      EXPECT_FALSE(p.chosen) << capacity << " " << margin << ": " << p.reason;
      for (const Candidate& c : p.candidates) {
        EXPECT_FALSE(c.feasible) << tier_name(c.tier);
        EXPECT_NE(c.why_not.find("exceeds"), std::string::npos) << c.why_not;
      }
      EXPECT_NE(p.reason.find("no tier fits"), std::string::npos) << p.reason;
      EXPECT_NE(p.reason.find("short by more than 64 bits"), std::string::npos) << p.reason;
      const Candidate load = plan_load(in, kDefaultRingBytes);
      EXPECT_FALSE(load.feasible);
      EXPECT_NE(load.why_not.find("exceeds"), std::string::npos) << load.why_not;
      const AfterInit after = estimate_after_init(in);
      EXPECT_FALSE(after.fits);
      EXPECT_EQ(after.device_bytes_after, UINT64_MAX);
    }
  }
}

TEST(Saturation, AdamStateOfAHugePartitionSaturates) {
  // 2^61 fp32 elements: 4 * S is 2^63, 8 * S is 2^64.
  LayoutOptions o;
  o.dtype = DType::kFP32;
  PlanInput in{Layout::compute(std::vector<std::uint64_t>{std::uint64_t{1} << 61}, o)};
  in.capacity_bytes = UINT64_MAX;
  in.free_bytes = UINT64_MAX;
  const AfterInit a = estimate_after_init(in);
  EXPECT_EQ(a.master_bytes, std::uint64_t{1} << 63);
  EXPECT_EQ(a.optimizer_bytes, UINT64_MAX);
  EXPECT_EQ(a.device_bytes_after, UINT64_MAX);
  EXPECT_FALSE(a.fits);
}

TEST(Presets, CapacitiesAsTheDriverReportsThem) {
  EXPECT_EQ(find_preset("h100-80gb")->capacity_bytes, 81559ull << 20);
  EXPECT_EQ(find_preset("h200")->capacity_bytes, 143771ull << 20);
  EXPECT_EQ(find_preset("a100-40gb")->capacity_bytes, 40960ull << 20);
  EXPECT_FALSE(find_preset("h300"));
  EXPECT_EQ(default_margin(81559ull << 20), kGiB);
  EXPECT_EQ(default_margin(10 * kGiB), 10 * kGiB / 100 * 3);
  EXPECT_EQ(*try_parse_tier("staged"), Tier::kStaged);
  EXPECT_FALSE(try_parse_tier("auto"));
}

}  // namespace
}  // namespace zeroflat
