// The front door: one call probes, agrees, plans, executes and builds the master partition, on
// one rank and on ranks as threads; an error or a difference on any one rank is an error on
// every rank before anything moves, and nobody waits for it.
#include "zeroflat/engine.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/pattern.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/engine.h"

namespace zeroflat {
namespace {

const std::vector<std::uint64_t> kNumels = {1000, 3, 4097, 1, 250, 0, 77, 12345, 8, 999, 64};

// One rank's originals on its own device, filled with the pattern (or with `salt` added to the
// pattern's tensor index, to give a rank different values).
struct Rank {
  std::unique_ptr<Device> device;
  std::vector<void*> storage;
  std::vector<TensorRef> params;
  std::vector<std::uint64_t> numels;
  bool released = false;

  Rank(const std::string& spec, std::vector<std::uint64_t> sizes = kNumels, std::uint64_t salt = 0)
      : numels(std::move(sizes)) {
    device = make_device(spec, DeviceOptions{1});
    for (std::size_t i = 0; i < numels.size(); ++i) {
      storage.push_back(device->allocate(numels[i] * 2));
      if (device->keeps_data()) fill_pattern(storage.back(), DType::kBF16, i + salt, 0, numels[i]);
      params.push_back(TensorRef{storage.back(),
                                 numels[i],
                                 {static_cast<std::int64_t>(numels[i])},
                                 DType::kBF16,
                                 device.get()});
    }
  }
  ~Rank() { release(); }
  void release() {
    for (std::size_t i = 0; i < storage.size(); ++i) {
      device->release(storage[i], numels[i] * 2);
      storage[i] = nullptr;
    }
    released = true;
  }
  bool intact() const {
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].data == nullptr && numels[i] > 0) return false;
      if (match_pattern(params[i].data, DType::kBF16, i, 0, numels[i]) != numels[i]) return false;
    }
    return true;
  }
  bool untouched() const {
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].data != storage[i]) return false;
    }
    return !released && intact();
  }
};

// Runs fn(rank, comm) on `ranks` threads of one LocalGroup; returns each rank's exception text
// ("" when it returned).
std::vector<std::string> on_ranks(int ranks, const std::function<void(int, Communicator*)>& fn) {
  LocalGroup group(ranks, std::chrono::seconds(20));
  std::vector<std::string> errors(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> comm = group.rank(r);
      try {
        fn(r, comm.get());
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

TEST(Engine, OneRankProbesPlansFlattensAndBuildsTheMaster) {
  Rank rank("cpu");
  FlattenOptions o;
  FlattenResult r =
      flatten_param_group(rank.params, *rank.device, nullptr, o, [&] { rank.release(); });
  ASSERT_TRUE(r.feasible()) << r.plan.reason;
  ASSERT_TRUE(r.complete()) << r.execution.error;
  EXPECT_EQ(*r.plan.chosen, Tier::kDevice);  // the cpu's memory is the host's: never staged
  EXPECT_EQ(r.probe.device, "cpu");
  EXPECT_TRUE(r.probe.available);
  EXPECT_TRUE(r.probe.integrated);
  EXPECT_FALSE(r.probe.sources.empty());
  EXPECT_EQ(r.input.capacity_bytes, r.probe.total_bytes);
  EXPECT_TRUE(rank.released);
  EXPECT_TRUE(rank.intact());  // the parameters are views now, with their values
  const FlatGroup& g = r.execution.group;
  EXPECT_EQ(rank.params[2].data,
            static_cast<unsigned char*>(g.flat.data()) + g.layout.offsets()[2] * 2);
  EXPECT_EQ(r.master.num_bytes(), g.layout.partition_numel() * 4);
  EXPECT_EQ(r.predicted_peak_device_bytes, r.execution.measured_peak_device_bytes);
}

// Every tier on 1 to 3 ranks as threads, sim devices with data: the front door's buffer is the
// building block's (flatten_group), the peaks are the model's, and the sharded and staged tiers
// compare the ranks' values first.
TEST(Engine, EveryTierOnRanksAsThreadsBuildsTheSameBuffer) {
  for (int ranks = 1; ranks <= 3; ++ranks) {
    LayoutOptions lo;
    lo.dp = static_cast<std::uint64_t>(ranks);
    Rank reference("cpu");
    const FlatGroup want = flatten_group(*reference.device, reference.params, lo);
    for (Tier tier : kAllTiers) {
      std::vector<std::string> errors = on_ranks(ranks, [&](int r, Communicator* comm) {
        Rank rank("sim:64MiB");
        FlattenOptions o;
        o.layout = lo;
        o.tier = tier;
        FlattenResult res =
            flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
        if (!res.complete()) throw Error("not complete: " + res.execution.error);
        const FlatGroup& g = res.execution.group;
        if (std::memcmp(g.flat.data(), want.flat.data(), want.layout.flat_bytes()) != 0) {
          throw Error("rank " + std::to_string(r) + ": a different buffer");
        }
        if (!rank.intact()) throw Error("values changed");
        if (res.predicted_peak_device_bytes != res.execution.measured_peak_device_bytes) {
          throw Error("peaks differ");
        }
        const bool compared = ranks > 1 && (tier == Tier::kSharded || tier == Tier::kStaged);
        if (compared != (res.value_check.bytes_hashed > 0)) throw Error("value check");
      });
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(errors[r], "") << ranks << " ranks, " << tier_name(tier) << ", rank " << r;
      }
    }
  }
}

TEST(Engine, AnErrorOnOneRankIsAnErrorOnEveryRankBeforeAnythingMoves) {
  // A bad group on rank 1 (a null pointer), its own message there, "rank 1" on the others.
  std::vector<std::string> errors = on_ranks(3, [&](int r, Communicator* comm) {
    Rank rank("cpu");
    if (r == 1) rank.params[4].data = nullptr;
    FlattenOptions o;
    o.layout.dp = 3;
    try {
      (void)flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
    } catch (const InvalidArgument&) {
      if (r != 1 && !rank.untouched()) throw Error("moved");
      throw;
    }
  });
  EXPECT_NE(errors[1].find("parameter 4"), std::string::npos) << errors[1];
  EXPECT_NE(errors[0].find("rank 1 refused the group"), std::string::npos) << errors[0];
  EXPECT_NE(errors[2].find("rank 1 refused the group"), std::string::npos) << errors[2];
  // The others say why, in the failing rank's words (its message's start).
  const std::string why = errors[1].substr(0, 60);
  EXPECT_NE(errors[0].find(why), std::string::npos) << errors[0] << " / " << errors[1];
  EXPECT_NE(errors[2].find(why), std::string::npos) << errors[2] << " / " << errors[1];

  // The caller's own verdict (local_error) travels the same way.
  errors = on_ranks(2, [&](int r, Communicator* comm) {
    Rank rank("cpu");
    FlattenOptions o;
    o.layout.dp = 2;
    if (r == 0) o.local_error = "the caller's own check failed";
    (void)flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
  });
  EXPECT_EQ(errors[0], "the caller's own check failed");
  EXPECT_NE(errors[1].find("rank 0 refused"), std::string::npos) << errors[1];
}

TEST(Engine, RanksThatDifferAreRefusedNamingTheDifference) {
  // Options (round-robin on one rank only).
  std::vector<std::string> errors = on_ranks(2, [&](int r, Communicator* comm) {
    Rank rank("cpu");
    FlattenOptions o;
    o.layout.dp = 2;
    o.layout.round_robin = r == 1;
    (void)flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
  });
  // Each rank names the option and both values.
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("different options"), std::string::npos) << e;
    EXPECT_NE(e.find("'round-robin on'"), std::string::npos) << e;
    EXPECT_NE(e.find("'round-robin off'"), std::string::npos) << e;
  }
  // A shape (parameter 3 has 2 elements on rank 2), named by the caller's names.
  errors = on_ranks(3, [&](int r, Communicator* comm) {
    std::vector<std::uint64_t> sizes = kNumels;
    if (r == 2) sizes[3] = 2;
    Rank rank("cpu", sizes);
    FlattenOptions o;
    o.layout.dp = 3;
    for (std::size_t i = 0; i < sizes.size(); ++i) o.names.push_back("w" + std::to_string(i));
    (void)flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
  });
  // Every rank names the parameter, its shape here and the other shape with a rank holding it.
  for (int r = 0; r < 3; ++r) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    EXPECT_NE(e.find("position 3 of the group"), std::string::npos) << e;
    EXPECT_NE(e.find(r == 2 ? "'w3 [2] bf16' on this rank (2), 'w3 [1] bf16' on rank 0"
                            : "'w3 [1] bf16' on this rank (" + std::to_string(r) +
                                  "), 'w3 [2] bf16' on rank 2"),
              std::string::npos)
        << e;
  }
  // A different number of parameters.
  errors = on_ranks(2, [&](int r, Communicator* comm) {
    std::vector<std::uint64_t> sizes = kNumels;
    if (r == 0) sizes.pop_back();
    Rank rank("cpu", sizes);
    FlattenOptions o;
    o.layout.dp = 2;
    (void)flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
  });
  // The count, and the first parameter one rank has and the other has not.
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("different groups (from 10 to 11 parameters"), std::string::npos) << e;
    EXPECT_NE(e.find("'(none)'"), std::string::npos) << e;
  }
}

TEST(Engine, RanksWithDifferentValuesAreRefusedBeforeSlicesChangeHands) {
  for (Tier tier : {Tier::kSharded, Tier::kStaged}) {
    std::vector<std::string> errors = on_ranks(2, [&](int r, Communicator* comm) {
      Rank rank("cpu", kNumels, r == 1 ? 1 : 0);  // rank 1 holds other values
      FlattenOptions o;
      o.layout.dp = 2;
      o.tier = tier;
      try {
        (void)flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
      } catch (const InvalidArgument&) {
        for (std::size_t i = 0; i < rank.params.size(); ++i) {
          if (rank.params[i].data != rank.storage[i] || rank.released) throw Error("moved");
        }
        throw;
      }
    });
    for (const std::string& e : errors) {
      EXPECT_NE(e.find("different values"), std::string::npos) << tier_name(tier) << ": " << e;
    }
    // A caller that knows turns the check off: each rank then holds the owners' values.
    errors = on_ranks(2, [&](int r, Communicator* comm) {
      Rank rank("cpu", kNumels, r == 1 ? 1 : 0);
      FlattenOptions o;
      o.layout.dp = 2;
      o.tier = tier;
      o.check_values = false;
      FlattenResult res =
          flatten_param_group(rank.params, *rank.device, comm, o, [&] { rank.release(); });
      if (!res.complete() || res.value_check.bytes_hashed != 0) throw Error("not as asked");
    });
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "");
  }
}

TEST(Engine, NoFeasiblePlanMovesNothing) {
  Rank rank("sim:40KB");  // the group is 37 KB: no second copy, no room to stage it back
  FlattenOptions o;
  o.tier = Tier::kDevice;
  FlattenResult r =
      flatten_param_group(rank.params, *rank.device, nullptr, o, [&] { rank.release(); });
  EXPECT_FALSE(r.feasible());
  EXPECT_NE(r.plan.reason.find("forced tier device does not fit"), std::string::npos)
      << r.plan.reason;
  EXPECT_TRUE(rank.untouched());
  EXPECT_EQ(r.probe.used, "sim accounting");
}

TEST(Engine, DpMustBeTheNumberOfRanks) {
  Rank rank("cpu");
  FlattenOptions o;
  o.layout.dp = 4;
  EXPECT_THROW((void)flatten_param_group(rank.params, *rank.device, nullptr, o), InvalidArgument);
  EXPECT_TRUE(rank.untouched());
}

TEST(Engine, SimulatedDevicesStageThroughTheirSimulatedHost) {
  // The simulated node's host memory, shared by its ranks: not this machine's.
  auto sim = make_device("sim:h100-80gb", DeviceOptions{1, true});
  ProbeResult host = sim->probe_host_memory(ProbeContext{8, 0, 0});
  EXPECT_EQ(host.used, "simulated host");
  EXPECT_EQ(host.total_bytes, find_preset("h100-80gb")->host_bytes_per_node);
  EXPECT_EQ(host.free_bytes, host.total_bytes / 8);
  auto small = make_device("sim:80GiB", DeviceOptions{1, true, std::uint64_t{1} << 30});
  EXPECT_EQ(small->probe_host_memory(ProbeContext{2, 0, 0}).free_bytes, std::uint64_t{1} << 29);
  EXPECT_EQ(
      make_device("sim:80GiB", DeviceOptions{1, true})->probe_host_memory({1, 0, 0}).total_bytes,
      kGenericNodeHostBytes);
  EXPECT_TRUE(make_device("sim:gb10", DeviceOptions{1, true})->probe_memory({}).integrated);
}

}  // namespace
}  // namespace zeroflat
