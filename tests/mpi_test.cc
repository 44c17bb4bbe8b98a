// `zeroflat run --comm mpi` under mpirun: the same verified checksum as ranks as threads, for
// every tier, device and rank count; faults at every step roll back on every process; the seed's
// 48-layer rehearsal with 8 processes.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "cli_run.h"

namespace {

using nlohmann::json;

// OpenMPI refuses root unless told, and needs --oversubscribe for more ranks than cores. Its
// libraries and plugins keep allocations until exit, which LeakSanitizer (in the sanitizer build)
// would report as ours: leak checking is off for these processes only (the same code runs
// leak-checked as threads in the CLI tests).
const std::string kRoot =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
    "ASAN_OPTIONS=\"${ASAN_OPTIONS:-}:detect_leaks=0\"";

std::string mpirun(int n) {
  return std::string(ZEROFLAT_MPIEXEC) + " -n " + std::to_string(n) + " --oversubscribe";
}

json run_json(const std::string& args, int want, const std::string& prefix = "") {
  Result r = run(args + " --json --quiet", kRoot, prefix);
  EXPECT_EQ(r.code, want) << prefix << " " << args << "\n" << r.err;
  if (r.out.empty()) return json();
  return json::parse(r.out);
}

// Every tier x cpu and sim devices x 1 to 4 processes.
TEST(MpiRun, EveryTierMatchesThreadsOnOneToFourProcesses) {
  for (int dp = 1; dp <= 4; ++dp) {
    for (const char* device : {"cpu", "sim:64MB"}) {
      for (const char* tier : {"device", "sharded", "staged", "host"}) {
        SCOPED_TRACE(std::string(device) + " " + tier + " dp " + std::to_string(dp));
        const std::string args = std::string("run --model tiny-moe --verify --repeat 1 --device ") +
                                 device + " --tier " + tier;
        json local = run_json(args + " --dp " + std::to_string(dp), 0);
        json mpi = run_json(args + " --comm mpi", 0, mpirun(dp));
        ASSERT_EQ(mpi["ranks"].size(), static_cast<std::size_t>(dp)) << mpi.dump();
        EXPECT_EQ(mpi["comm"], "mpi");
        EXPECT_EQ(mpi["dp"], dp);
        const json want = local["ranks"][0]["checksum"];
        ASSERT_TRUE(want.is_string());
        for (int r = 0; r < dp; ++r) {
          const json& e = mpi["ranks"][r];
          EXPECT_EQ(e["rank"], r);
          EXPECT_EQ(e["tier"], tier);
          EXPECT_EQ(e["verified"], true) << e.dump();
          EXPECT_EQ(e["checksum"], want) << "rank " << r;
          EXPECT_EQ(e["predicted_peak_device_bytes"], e["measured_peak_device_bytes"]);
          EXPECT_EQ(e["predicted_host_bytes"], e["host_bytes"]);
        }
      }
    }
  }
}

TEST(MpiRun, FaultsAtEveryStepRollBackOnEveryProcess) {
  for (const char* tier : {"sharded", "staged"}) {
    const std::string base =
        std::string("run --model tiny-moe --comm mpi --tier ") + tier + " --device sim:64MB";
    json plain = run_json(base, 0, mpirun(3));
    const std::size_t steps = plain["plan"]["steps"].size();
    ASSERT_GT(steps, 4u);
    for (std::size_t k = 0; k < steps; ++k) {
      json doc = run_json(base + " --inject-fault " + std::to_string(k) + "@2", 4, mpirun(3));
      ASSERT_EQ(doc["ranks"].size(), 3u);
      EXPECT_NE(doc["error"].get<std::string>().find("step " + std::to_string(k)),
                std::string::npos);
      for (const json& e : doc["ranks"]) {
        EXPECT_EQ(e["originals_intact"], true) << tier << " step " << k << ": " << e.dump();
        EXPECT_EQ(e["failed_rank"], 2);
      }
    }
  }
}

TEST(MpiRun, SeedModelOnEightProcessesPicksShardedWithPeakAsPredicted) {
  json doc = run_json(
      "run --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data "
      "--comm mpi",
      0, mpirun(8));
  EXPECT_EQ(doc["tier"], "sharded");
  ASSERT_EQ(doc["ranks"].size(), 8u);
  for (const json& e : doc["ranks"]) {
    EXPECT_EQ(e["predicted_peak_device_bytes"], e["measured_peak_device_bytes"]);
  }
}

TEST(MpiRun, DpMustMatchTheLauncher) {
  Result r = run("run --model tiny-moe --comm mpi --dp 4", kRoot, mpirun(2));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("mpirun started 2 ranks"), std::string::npos) << r.err;
}

}  // namespace
