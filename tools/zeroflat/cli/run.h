// `zeroflat run`, cut by job: its options (run_options.cc), one rank's pipeline around the
// library's front door (run_rank.cc), launching the ranks as threads or MPI processes
// (run_launch.cc), and the report (run_report.cc). cmd_run.cc joins them. What run shares with
// load (the device setup, ranks, this host's memory) is in cli/ranks.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/progress.h"
#include "cli/ranks.h"
#include "zeroflat/comm.h"
#include "zeroflat/engine.h"
#include "zeroflat/layout.h"
#include "zeroflat/model.h"
#include "zeroflat/plan.h"

namespace zeroflat::cli {

// Everything the ranks share, validated before anything is allocated.
struct RunConfig {
  ModelSpec model;
  // What every rank passes to the front door: the layout (dp, dtype, rules), the forced tier,
  // margin, the value check, this host's ranks (probe.local_ranks). Only rank-specific fields
  // (fault injection, must_match) are set per rank.
  FlattenOptions library;
  DeviceSetup setup;
  unsigned threads = 1;  // per rank
  std::uint64_t repeat = 3;
  bool verify = false;
  std::optional<std::size_t> fault_step;
  std::uint64_t fault_rank = 0;
  std::optional<std::size_t> crash_step;  // --inject-crash: this rank dies (SIGKILL) there
  std::uint64_t crash_rank = 0;
  std::optional<std::uint64_t> corrupt;
  std::chrono::milliseconds timeout{60000};
  // --start-timeout: how long the MPI job may take to start (--timeout bounds a collective)
  std::chrono::milliseconds start_timeout{120000};
  bool json = false;
  bool quiet = false;
};

// --- run_options.cc ---------------------------------------------------------------------------
void add_run_options(Parser& parser);
// The options as given, checked (InvalidArgument names the bad one). dp, local_ranks and
// threads are settled by settle_ranks() once the ranks are known.
RunConfig run_config_from_args(const Args& args);
// After MPI has started (world, or null for ranks as threads): dp, local ranks, threads.
void settle_ranks(RunConfig& cfg, const Args& args, Communicator* world);

// --- run_rank.cc ------------------------------------------------------------------------------
// What one rank brings back.
struct RankResult {
  int exit = 0;         // kExit* (common.h)
  std::string message;  // why, when no step ran (no feasible plan)
  Json entry;           // its element of "ranks"
  Json plan;            // the plan (identical on every rank)
  double memcpy_gbps = 0;
  double fresh_memcpy_gbps = 0;
};
// One rank: its device, its originals, the front door (probe, agreement, plan, execution,
// master), the timing rounds, verification. `control` joins the ranks (null for one).
RankResult run_rank(const RunConfig& cfg, std::uint64_t rank, Communicator* control,
                    Progress& progress);
// Why this process's ranks cannot fit in this host's memory, or "": derived from the plan the
// ranks will make (the chosen tier's step list on the memory model) plus what the rehearsal
// itself holds. A run without data holds nothing here. `plan_doc` receives the predicted plan.
std::string host_memory_shortfall(const RunConfig& cfg, Json& plan_doc);

// --- run_launch.cc ----------------------------------------------------------------------------
struct Launched {
  std::vector<Json> entries;  // every rank's, in rank order (on rank 0)
  RankResult first;           // rank 0's result in this process (the plan, the ceilings)
  int me = 0;                 // this process's rank (0 for threads)
  // The MPI ranks could not meet after the steps (a peer died): entries holds this process's
  // own entry only, and every surviving process reports what it holds.
  bool alone = false;
};
// Runs the ranks: dp threads of this process, or this MPI process's one rank (world).
Launched launch_ranks(const RunConfig& cfg, Communicator* world, Progress& progress);

// --- run_report.cc ----------------------------------------------------------------------------
// The exit code of the whole run from every rank's entry.
int run_exit_code(const std::vector<Json>& entries, std::string& first_error);
// The JSON document (docs/cli.md) or the human report, on stdout.
void print_run_report(const RunConfig& cfg, const Launched& run, int exit,
                      const std::string& first_error);
// The document or message of a run that no plan fits (exit 3): nothing was allocated.
void print_infeasible(const RunConfig& cfg, const Json& plan, const std::string& why);

}  // namespace zeroflat::cli
