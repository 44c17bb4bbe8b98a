// `zeroflat run --comm mpi` under mpirun: the same verified checksum as ranks as threads, for
// every tier, device and rank count; faults at every step roll back on every process; the seed's
// 48-layer rehearsal with 8 processes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_run.h"
#include "sanitizers.h"

namespace {

using nlohmann::json;

// OpenMPI refuses root unless told, and needs --oversubscribe for more ranks than cores. Its
// libraries and plugins keep allocations until exit, which LeakSanitizer (in the sanitizer build)
// would report as ours: leak checking is off for these processes only (the same code runs
// leak-checked as threads in the CLI tests). Each launch keeps its session files in a folder of
// its own under the tests' scratch: two mpiruns started at once (ctest -j) may otherwise race to
// create the shared /tmp/ompi.<host>.<uid> and one fail to start ("mkdir ... File exists").
const std::string kRoot =
    "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
    "OMPI_MCA_orte_tmpdir_base=\"$(mktemp -d \"${TEST_TMPDIR:-/tmp}/ompi.XXXXXX\")\" "
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

// Processes launched with different options (MPMD: one command line per rank) agree before
// anything moves: every rank refuses (exit 2), none reports done.
TEST(MpiRun, RanksLaunchedWithDifferentOptionsAllRefuse) {
  const std::string cli = ZEROFLAT_CLI_PATH;
  const std::string base = " run --model tiny-moe --comm mpi --tier sharded --quiet";
  for (const std::string& other :
       {std::string(" --round-robin"), std::string(" --dtype fp32"), std::string(" --layers 2")}) {
    // mpirun -np 1 zeroflat run ... OTHER : -np 1 zeroflat run ...
    Result r = run(base.substr(1) + other + " : -np 1 " + cli + base, kRoot,
                   std::string(ZEROFLAT_MPIEXEC) + " --oversubscribe -np 1");
    EXPECT_EQ(r.code, 2) << other;
    EXPECT_EQ(r.out.find("done"), std::string::npos) << other << "\n" << r.out;
    EXPECT_NE(r.err.find("differ"), std::string::npos) << other << "\n" << r.err;
  }
}

// A rank killed (SIGKILL) as any step of any tier starts: the others end within --timeout, each
// with exit 4 and a report of what it holds (rolled back, recovered, or the layout bytes it kept).
// OpenMPI ends the whole job when a process dies unless told otherwise; a job that wants its
// survivors to report says so (orte_abort_on_non_zero_status 0, orte_enable_recovery 1).
#if !ZEROFLAT_TEST_ASAN
// (Twenty-seven MPI jobs: the Release suite runs it; the sanitizers check the same code paths in
// FaultsAtEveryStepRollBackOnEveryProcess.)
TEST(MpiRun, ARankKilledAtAnyStepLeavesTheOthersReportingWithinTheTimeout) {
  const std::string launcher = std::string(ZEROFLAT_MPIEXEC) +
                               " -n 3 --oversubscribe --mca orte_abort_on_non_zero_status 0"
                               " --mca orte_enable_recovery 1 sh -c '";
  for (const char* tier : {"device", "sharded", "staged", "host"}) {
    // The steps counted under the default --timeout: a loaded machine may hold a rank back a
    // second between two collectives. The crash jobs wait 2 s for the dead rank (1 s was as
    // tight for the live ones on a busy machine).
    const std::string plain =
        std::string("run --model tiny-moe --comm mpi --device sim:64MB --tier ") + tier;
    const std::string base = plain + " --timeout 2";
    const std::size_t steps = run_json(plain, 0, mpirun(3))["plan"]["steps"].size();
    ASSERT_GT(steps, 0u) << tier;
    for (std::size_t k = 0; k < steps; ++k) {
      SCOPED_TRACE(std::string(tier) + " step " + std::to_string(k));
      const auto t0 = std::chrono::steady_clock::now();
      // Each process writes its own document (stdout of several processes interleaves).
      const std::string out = ::testing::TempDir() + "crash." + std::to_string(getpid()) + ".";
      Result r = run(base + " --quiet --json --inject-crash " + std::to_string(k) + "@1 > " + out +
                         "$OMPI_COMM_WORLD_RANK.json; echo exit=$? >&2'",
                     kRoot, launcher);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_LT(seconds, 30.0);
      for (int rank : {0, 2}) {
        std::ifstream in(out + std::to_string(rank) + ".json");
        const std::string text((std::istreambuf_iterator<char>(in)),
                               std::istreambuf_iterator<char>());
        std::remove((out + std::to_string(rank) + ".json").c_str());
        ASSERT_FALSE(text.empty()) << "rank " << rank << " said nothing\n" << r.err;
        const json doc = json::parse(text);
        ASSERT_EQ(doc["ranks"].size(), 1u);
        const json& e = doc["ranks"][0];
        EXPECT_EQ(e["rank"], rank);
        EXPECT_FALSE(e.value("error", std::string()).empty()) << e.dump();
        if (e["outcome"] == "rolled back") EXPECT_EQ(e["originals_intact"], true);
        if (e["outcome"] == "lost") {
          EXPECT_NE(e["error"].get<std::string>().find("this rank held layout bytes"),
                    std::string::npos);
        }
      }
      std::size_t exits = 0;
      for (std::size_t at = 0; (at = r.err.find("exit=4", at)) != std::string::npos; at += 6) {
        ++exits;
      }
      EXPECT_EQ(exits, 2u) << r.err;
    }
  }
}
#endif

// `zeroflat load --comm mpi`: each process reads its partition; the same bytes as ranks as
// threads, for bf16 and fp32 files into bf16 and fp16 buffers; a failed read ends every process
// with exit 4.
TEST(MpiLoad, ProcessesHoldWhatThreadsHoldAndReadOnlyTheirPartition) {
  const std::string base = ::testing::TempDir() + "zeroflat_mpi_load_" + std::to_string(getpid());
  std::system(("rm -rf " + base + "*").c_str());
  for (const char* stored : {"bf16", "fp32"}) {
    const std::string dir = base + stored;
    Result w = run(std::string("write-checkpoint ") + dir + " --model tiny-moe --shard-size 2MB " +
                   "--quiet --dtype " + stored);
    ASSERT_EQ(w.code, 0) << w.err;
    for (const char* dtype : {"bf16", "fp16"}) {
      for (int dp = 2; dp <= 3; ++dp) {
        for (const char* rr : {"", " --round-robin"}) {
          // Each rank its slice (load-whole, every rank everything, is the loader test's).
          const std::string opts = std::string(" --dtype ") + dtype + rr + " --read-plan load";
          SCOPED_TRACE(dir + opts + " dp " + std::to_string(dp));
          json local = run_json("load " + dir + opts + " --dp " + std::to_string(dp), 0);
          json mpi = run_json("load " + dir + opts + " --comm mpi --verify", 0, mpirun(dp));
          ASSERT_EQ(mpi["ranks"].size(), static_cast<std::size_t>(dp)) << mpi.dump();
          std::uint64_t read = 0;
          for (int r = 0; r < dp; ++r) {
            const json& e = mpi["ranks"][r];
            EXPECT_EQ(e["checksum"], local["ranks"][0]["checksum"]);
            EXPECT_EQ(e["verified"], true);
            EXPECT_EQ(e["bytes_read"], local["ranks"][r]["bytes_read"]);
            read += e["bytes_read"].get<std::uint64_t>();
          }
          EXPECT_EQ(read, mpi["checkpoint_bytes"].get<std::uint64_t>());
        }
      }
    }
    // The slices read in parts, each all-gathered while the next is read: the same buffer.
    {
      json local = run_json("load " + dir + " --read-plan load --dp 3", 0);
      Result r = run("load " + dir + " --read-plan load --comm mpi --verify --json --quiet",
                     kRoot + " ZEROFLAT_GATHER_PARTS=4", mpirun(3));
      ASSERT_EQ(r.code, 0) << r.err;
      const json mpi = json::parse(r.out);
      ASSERT_EQ(mpi["ranks"].size(), 3u) << mpi.dump();
      for (const json& e : mpi["ranks"]) {
        EXPECT_EQ(e["gather_parts"], 4) << e.dump();
        EXPECT_EQ(e["checksum"], local["ranks"][0]["checksum"]);
        EXPECT_EQ(e["verified"], true);
      }
    }
    for (const char* parts : {"1", "4"}) {
      Result r = run("load " + dir +
                         " --comm mpi --read-plan load --inject-read-error 5000@2 "
                         "--json --quiet",
                     kRoot + " ZEROFLAT_GATHER_PARTS=" + parts, mpirun(3));
      EXPECT_EQ(r.code, 4) << parts << " parts\n" << r.err;
      const json fail = json::parse(r.out);
      ASSERT_EQ(fail["ranks"].size(), 3u);
      for (const json& e : fail["ranks"]) EXPECT_FALSE(e["error"].get<std::string>().empty());
      EXPECT_NE(fail["ranks"][2]["error"].get<std::string>().find("bytes ["), std::string::npos);
    }
    std::system(("rm -rf " + dir).c_str());
  }
}

// A rank that never joins the MPI job (it refused an argument only it was given, and lingers)
// leaves the others in MPI's start-up, which has no timeout of its own; --start-timeout covers
// it: they end, exit 1, saying why. The rank lingers because one that exits before the others
// join lets mpirun end the job itself, at once and not always with a message, which would leave
// the watchdog untested. (OpenMPI would also end the job on a non-zero exit, unless told not to,
// as here.)
TEST(MpiRun, ARankThatNeverJoinsEndsTheOthersWithinTheStartTimeout) {
  const std::string cli = ZEROFLAT_CLI_PATH;
  for (const char* command :
       {"run --model tiny-moe", "load --model tiny-moe --device sim:1GiB --no-data"}) {
    SCOPED_TRACE(command);
    // Without the watchdog the job would wait for ever: `timeout` ends it, and the test fails.
    const std::string launcher =
        "timeout 60 " + std::string(ZEROFLAT_MPIEXEC) +
        " -n 3 --oversubscribe --mca orte_abort_on_non_zero_status 0 sh -c 'if [ "
        "\"$OMPI_COMM_WORLD_RANK\" = 1 ]; then " +
        cli + " run --frobnicate; echo exit1=$? >&2; sleep 20; else";
    const auto t0 = std::chrono::steady_clock::now();
    Result r =
        run(std::string(command) +
                " --comm mpi --start-timeout 3 --quiet; echo exit$OMPI_COMM_WORLD_RANK=$? >&2; "
                "fi'",
            kRoot, launcher);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // mpirun ends the lingering rank once another has left; were it not to, the job ends with
    // the lingering rank's 20 s.
    EXPECT_LT(seconds, 30.0);
    EXPECT_NE(r.err.find("exit1=2"), std::string::npos) << r.err;
    // Nothing ends the job before a watchdog does, so at least one of the others reports its
    // own end; the other may be ended by mpirun first when it started later (a loaded machine,
    // the sanitizers): either way, nobody waits past the start-up's limit.
    EXPECT_NE(r.err.find("did not start within --start-timeout 3 s"), std::string::npos) << r.err;
    int reported = 0;
    for (const char* other : {"exit0=", "exit2="}) {
      const std::size_t at = r.err.find(other);
      if (at == std::string::npos) continue;
      ++reported;
      EXPECT_EQ(r.err.substr(at, 7), std::string(other) + "1") << r.err;
    }
    EXPECT_GE(reported, 1) << r.err;
  }
}

// MPI's start-up is not a collective: it has its own limit, --start-timeout, and a start slower
// than the collectives' --timeout (a loaded machine, a real cluster) still starts. One rank is
// held back 5 s before it execs; its MPI_Init, and so the other's, waits for it. (Devices
// without data: few collectives, each a short wait, so that a loaded machine does not make one
// of them outlast the 2 s.)
TEST(MpiRun, AStartSlowerThanTheTimeoutStillStarts) {
  for (const char* command : {"run --model tiny-moe --device sim:64MB --no-data",
                              "load --model tiny-moe --device sim:1GiB --no-data"}) {
    SCOPED_TRACE(command);
    const std::string launcher =
        "timeout 120 " + std::string(ZEROFLAT_MPIEXEC) +
        " -n 2 --oversubscribe sh -c 'if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then sleep 5; fi; exec";
    const auto t0 = std::chrono::steady_clock::now();
    Result r =
        run(std::string(command) + " --comm mpi --timeout 2 --json --quiet'", kRoot, launcher);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(seconds, 5.0);
    ASSERT_EQ(r.code, 0) << r.err;
    const json doc = json::parse(r.out);
    ASSERT_EQ(doc["ranks"].size(), 2u) << r.out;
    for (int rank = 0; rank < 2; ++rank) EXPECT_EQ(doc["ranks"][rank]["rank"], rank) << r.out;

    // The same start with a start-up limit under the delay: the limit that expired is named.
    Result late =
        run(std::string(command) + " --comm mpi --start-timeout 1 --quiet'", kRoot, launcher);
    EXPECT_EQ(late.code, 1) << late.err;
    EXPECT_NE(late.err.find("did not start within --start-timeout 1 s"), std::string::npos)
        << late.err;
  }
}

// --start-timeout takes what --timeout takes (whole seconds, 1 to 86400): anything else is a
// usage error before any work, naming the option.
TEST(MpiRun, StartTimeoutIsCheckedLikeTheTimeout) {
  for (const char* command :
       {"run --model tiny-moe", "load --model tiny-moe --device sim:1GiB --no-data"}) {
    for (const char* value : {"0", "-1", "86401", "1.5", "soon", "nan", "inf"}) {
      const std::string args = std::string(command) + " --start-timeout " + value;
      Result r = run(args);
      EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
      EXPECT_NE(r.err.find("--start-timeout"), std::string::npos) << args << "\n" << r.err;
      EXPECT_EQ(r.err.find("materialize"), std::string::npos) << args << " started work";
    }
    for (const char* value : {"1", "86400"}) {  // taken (ranks as threads do not start MPI)
      const std::string args = std::string(command) + " --quiet --start-timeout " + value;
      Result r = run(args);
      EXPECT_EQ(r.code, 0) << args << "\n" << r.err;
    }
  }
}

}  // namespace
