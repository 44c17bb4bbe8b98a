// The executor: every tier on the cpu and sim devices with 1 to 4 ranks gives the same flat
// buffer, measured peaks equal the memory model's, and a fault at any step on any rank leaves
// every parameter's values intact, on every rank, without a hang.
#include "exec/executor.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/pattern.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/plan.h"

namespace zeroflat {
namespace {

const std::vector<std::uint64_t> kNumels = {1000, 3, 4097, 1, 250, 77, 12345, 8, 999, 64};

// One rank's originals on its own device, filled with the pattern.
struct RankState {
  std::unique_ptr<Device> device;
  std::vector<void*> storage;
  std::vector<TensorRef> params;
  std::uint64_t resident = 0;

  RankState(const std::string& spec, DType dtype) {
    device = make_device(spec, DeviceOptions{1});
    const std::uint64_t es = element_size(dtype);
    for (std::size_t i = 0; i < kNumels.size(); ++i) {
      storage.push_back(device->allocate(kNumels[i] * es));
      if (device->keeps_data()) fill_pattern(storage.back(), dtype, i, 0, kNumels[i]);
      params.push_back(TensorRef{storage.back(),
                                 kNumels[i],
                                 {static_cast<std::int64_t>(kNumels[i])},
                                 dtype,
                                 device.get()});
    }
    resident = device->memory_info().allocated_bytes;
  }
  ~RankState() { release(); }
  void release() {
    for (std::size_t i = 0; i < storage.size(); ++i) {
      device->release(storage[i], kNumels[i] * element_size(params[i].dtype));
      storage[i] = nullptr;
    }
  }
  bool intact() const {
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].data == nullptr) return false;
      if (match_pattern(params[i].data, params[i].dtype, i, 0, params[i].numel) !=
          params[i].numel) {
        return false;
      }
    }
    return true;
  }
};

struct RankOutcome {
  Execution ex;
  std::vector<Step> steps;
  std::uint64_t resident = 0;
  std::uint64_t checksum = 0;
  bool intact = false;
  std::string thrown;
};

// Runs `tier` on dp ranks as threads (one device each) and returns each rank's outcome.
std::vector<RankOutcome> run_ranks(Tier tier, const std::string& spec, std::uint64_t dp,
                                   const std::function<ExecuteOptions(std::uint64_t)>& opts = {},
                                   std::uint64_t staged_device_bytes = UINT64_MAX) {
  LayoutOptions lo;
  lo.dp = dp;
  const Layout layout = Layout::compute(kNumels, lo);
  LocalGroup group(static_cast<int>(dp), std::chrono::seconds(20));
  std::vector<RankOutcome> out(dp);
  auto body = [&](std::uint64_t r) {
    try {
      RankState st(spec, lo.dtype);
      std::unique_ptr<Communicator> comm = group.rank(static_cast<int>(r));
      const std::uint64_t x =
          staged_device_bytes == UINT64_MAX ? layout.partition_bytes() / 3 : staged_device_bytes;
      out[r].steps = tier_steps(tier, layout, r, x);
      out[r].resident = st.resident;
      out[r].ex = execute(
          out[r].steps, layout, r, st.params, *st.device, comm.get(), [&] { st.release(); },
          opts ? opts(r) : ExecuteOptions{});
      if (st.device->keeps_data()) {
        out[r].intact = st.intact();
        if (out[r].ex.group.flat) {
          out[r].checksum = st.device->checksum(out[r].ex.group.flat.data(), layout.flat_bytes());
        }
      }
      out[r].ex.group.flat.reset();
    } catch (const std::exception& e) {
      out[r].thrown = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (std::uint64_t r = 0; r < dp; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
  return out;
}

// The flat buffer built the simplest way, for the checksum every tier must reproduce.
std::uint64_t reference_checksum(std::uint64_t dp) {
  LayoutOptions lo;
  lo.dp = dp;
  RankState st("cpu", lo.dtype);
  FlatGroup g = flatten_group(*st.device, st.params, lo);
  return st.device->checksum(g.flat.data(), g.layout.flat_bytes());
}

class EveryTier : public ::testing::TestWithParam<std::tuple<Tier, std::string, std::uint64_t>> {};

TEST_P(EveryTier, SameFlatBufferAndPeakEqualsTheModel) {
  const auto [tier, spec, dp] = GetParam();
  const std::uint64_t want = reference_checksum(dp);
  std::vector<RankOutcome> ranks = run_ranks(tier, spec, dp);
  std::uint64_t original_bytes = 0;
  for (std::uint64_t n : kNumels) original_bytes += n * 2;
  for (std::uint64_t r = 0; r < dp; ++r) {
    const RankOutcome& o = ranks[r];
    ASSERT_EQ(o.thrown, "") << "rank " << r;
    EXPECT_EQ(o.ex.outcome, Outcome::kDone) << "rank " << r << ": " << o.ex.error;
    EXPECT_EQ(o.checksum, want) << "rank " << r;
    EXPECT_TRUE(o.intact) << "rank " << r << ": the views must hold the original values";
    const Profile p = simulate(o.steps, o.resident, original_bytes, dp);
    EXPECT_EQ(o.ex.measured_peak_device_bytes, p.peak_device_bytes) << "rank " << r;
    EXPECT_EQ(o.ex.measured_peak_host_bytes, p.peak_host_bytes) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Executor, EveryTier,
    ::testing::Combine(::testing::Values(Tier::kDevice, Tier::kSharded, Tier::kStaged, Tier::kHost),
                       ::testing::Values(std::string("cpu"), std::string("sim:64MiB")),
                       ::testing::Values(1u, 2u, 3u, 4u)),
    [](const auto& info) {
      std::string dev = std::get<1>(info.param) == "cpu" ? "cpu" : "sim";
      return std::string(tier_name(std::get<0>(info.param))) + "_" + dev + "_dp" +
             std::to_string(std::get<2>(info.param));
    });

TEST(Executor, StagedWithEverythingOnTheHostOrEverythingOnTheDevice) {
  const std::uint64_t want = reference_checksum(3);
  for (std::uint64_t x : {std::uint64_t{0}, UINT64_MAX - 1}) {
    std::vector<RankOutcome> ranks = run_ranks(Tier::kStaged, "sim:64MiB", 3, {}, x);
    for (const RankOutcome& o : ranks) {
      ASSERT_EQ(o.thrown, "");
      EXPECT_EQ(o.ex.outcome, Outcome::kDone) << o.ex.error;
      EXPECT_EQ(o.checksum, want);
    }
  }
}

// A fault at every step of every tier, on rank 0 and on the last rank: every rank reports the
// failure, names the step, and every parameter holds its original values.
TEST(Executor, FaultAtEveryStepLeavesEveryRankIntact) {
  for (Tier tier : kAllTiers) {
    for (std::uint64_t dp : {1u, 3u}) {
      LayoutOptions lo;
      lo.dp = dp;
      const std::size_t n = tier_steps(tier, Layout::compute(kNumels, lo), 0, 1000).size();
      for (std::size_t k = 0; k <= n; ++k) {
        for (std::uint64_t victim : {std::uint64_t{0}, dp - 1}) {
          SCOPED_TRACE(std::string(tier_name(tier)) + " dp " + std::to_string(dp) + " step " +
                       std::to_string(k) + " on rank " + std::to_string(victim));
          std::vector<RankOutcome> ranks = run_ranks(
              tier, "cpu", dp,
              [&](std::uint64_t r) {
                ExecuteOptions o;
                if (r == victim) o.fault_step = k;
                return o;
              },
              1000);
          for (std::uint64_t r = 0; r < dp; ++r) {
            const RankOutcome& o = ranks[r];
            ASSERT_EQ(o.thrown, "");
            EXPECT_TRUE(o.intact) << "rank " << r << ": " << o.ex.error;
            if (k == n) {  // past the last step: nothing happens
              EXPECT_EQ(o.ex.outcome, Outcome::kDone);
              continue;
            }
            EXPECT_TRUE(o.ex.outcome == Outcome::kRolledBack || o.ex.outcome == Outcome::kRecovered)
                << "rank " << r << ": " << outcome_name(o.ex.outcome);
            EXPECT_EQ(o.ex.failed_step, k) << "rank " << r;
            EXPECT_EQ(o.ex.failed_rank, static_cast<int>(victim)) << "rank " << r;
            EXPECT_NE(o.ex.error.find("step " + std::to_string(k)), std::string::npos)
                << o.ex.error;
          }
          // All ranks end the same way.
          for (std::uint64_t r = 1; r < dp; ++r) {
            EXPECT_EQ(ranks[r].ex.outcome, ranks[0].ex.outcome);
          }
        }
      }
    }
  }
}

TEST(Executor, RolledBackReleasesEverythingItAllocated) {
  RankState st("sim:64MiB", DType::kBF16);
  LayoutOptions lo;
  const Layout layout = Layout::compute(kNumels, lo);
  const std::vector<Step> steps = tier_steps(Tier::kDevice, layout, 0);
  ExecuteOptions o;
  o.fault_step = 3;  // the release of the originals, after the flat buffer exists
  Execution ex = execute(
      steps, layout, 0, st.params, *st.device, nullptr, [&] { st.release(); }, o);
  EXPECT_EQ(ex.outcome, Outcome::kRolledBack);
  EXPECT_EQ(st.device->memory_info().allocated_bytes, st.resident);
  for (std::size_t i = 0; i < st.params.size(); ++i) EXPECT_EQ(st.params[i].data, st.storage[i]);
  EXPECT_TRUE(st.intact());
}

// A real allocation failure (the device is smaller than the plan was told) before the
// originals go: rolled back, nothing leaked.
TEST(Executor, DeviceOutOfMemoryBeforeReleaseRollsBack) {
  LayoutOptions lo;
  const Layout layout = Layout::compute(kNumels, lo);
  RankState st("sim:" + std::to_string(layout.flat_bytes() + 1000), DType::kBF16);
  const std::vector<Step> steps = tier_steps(Tier::kDevice, layout, 0);
  Execution ex = execute(steps, layout, 0, st.params, *st.device, nullptr, [&] { st.release(); });
  EXPECT_EQ(ex.outcome, Outcome::kRolledBack);
  EXPECT_NE(ex.error.find("cannot allocate"), std::string::npos) << ex.error;
  EXPECT_EQ(ex.failed_step, 0u);
  EXPECT_TRUE(st.intact());
  EXPECT_EQ(st.device->memory_info().allocated_bytes, st.resident);
}

// After the originals are gone, a flat buffer that cannot be allocated even on the second try
// is data lost, and the result says which bytes this rank still had.
TEST(Executor, DeviceOutOfMemoryAfterReleaseIsReportedAsLost) {
  LayoutOptions lo;
  const Layout layout = Layout::compute(kNumels, lo);
  // Room for the originals and the host tier's nothing, not for a flat buffer beside the
  // originals' replacement: allocate filler after the originals go.
  RankState st("sim:" + std::to_string(layout.flat_bytes() + 64), DType::kBF16);
  const std::vector<Step> steps = tier_steps(Tier::kHost, layout, 0);
  void* filler = nullptr;
  Execution ex = execute(steps, layout, 0, st.params, *st.device, nullptr, [&] {
    st.release();
    filler = st.device->allocate(1000);  // somebody else takes memory meanwhile
  });
  EXPECT_EQ(ex.outcome, Outcome::kLost);
  EXPECT_NE(ex.error.find("lost"), std::string::npos) << ex.error;
  st.device->release(filler, 1000);
  EXPECT_EQ(st.device->memory_info().host_allocated_bytes, 0u);
}

// A rank that disappears (its communicator aborted) before the originals go: the others see a
// CommError at the next agreement, do not hang, and roll back.
TEST(Executor, VanishedRankBeforeReleaseRollsBackTheOthers) {
  LayoutOptions lo;
  lo.dp = 3;
  const Layout layout = Layout::compute(kNumels, lo);
  LocalGroup group(3, std::chrono::seconds(20));
  std::vector<Outcome> outcomes(3);
  std::vector<bool> intact(3);
  auto body = [&](int r) {
    RankState st("cpu", DType::kBF16);
    std::unique_ptr<Communicator> comm = group.rank(r);
    if (r == 2) {
      comm->abort("rank 2 crashed");
      return;
    }
    const std::vector<Step> steps = tier_steps(Tier::kSharded, layout, r);
    Execution ex =
        execute(steps, layout, r, st.params, *st.device, comm.get(), [&] { st.release(); });
    outcomes[r] = ex.outcome;
    intact[r] = st.intact();
  };
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(outcomes[r], Outcome::kRolledBack) << "rank " << r;
    EXPECT_TRUE(intact[r]) << "rank " << r;
  }
}

TEST(Executor, RefusesMismatchedInputsBeforeAnyStep) {
  RankState st("cpu", DType::kBF16);
  LayoutOptions lo;
  lo.dp = 2;
  const Layout layout = Layout::compute(kNumels, lo);
  const std::vector<Step> steps = tier_steps(Tier::kSharded, layout, 0);
  // dp 2 with no communicator.
  EXPECT_THROW(execute(steps, layout, 0, st.params, *st.device, nullptr, {}), InvalidArgument);
  // A rank outside the layout.
  EXPECT_THROW(execute(steps, layout, 2, st.params, *st.device, nullptr, {}), InvalidArgument);
  // A group that is not the layout's.
  std::vector<TensorRef> fewer(st.params.begin(), st.params.end() - 1);
  LayoutOptions one;
  const Layout l1 = Layout::compute(kNumels, one);
  EXPECT_THROW(execute(tier_steps(Tier::kDevice, l1, 0), l1, 0, fewer, *st.device, nullptr, {}),
               InvalidArgument);
  // A list with an all-gather needs as many ranks as the layout's dp; only a list without one
  // may run a layout of this rank's own (ZeRO-3's partitions) under more ranks. Refused before
  // any collective, so one rank alone can ask.
  {
    LocalGroup two(2, std::chrono::seconds(5));
    std::unique_ptr<Communicator> c = two.rank(0);
    EXPECT_THROW(
        execute(tier_steps(Tier::kSharded, l1, 0), l1, 0, st.params, *st.device, c.get(), {}),
        InvalidArgument);
    EXPECT_THROW(
        execute(tier_steps(Tier::kDevice, l1, 0), l1, 1, st.params, *st.device, c.get(), {}),
        InvalidArgument);  // the communicator says rank 0
  }
  // A malformed list (releases a buffer it never allocated).
  std::vector<Step> bad = tier_steps(Tier::kDevice, l1, 0);
  bad.insert(bad.begin(), Step{Op::kRelease, Buffer::kPartition});
  EXPECT_THROW(execute(bad, l1, 0, st.params, *st.device, nullptr, {}), InvalidArgument);
  EXPECT_EQ(st.device->memory_info().allocated_bytes, st.resident);
  EXPECT_TRUE(st.intact());
}

}  // namespace
}  // namespace zeroflat
