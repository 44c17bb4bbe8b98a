// `zeroflat run`, cut by job: its options (run_options.cc), one rank's pipeline around the
// library's front door (run_rank.cc), launching the ranks as threads or MPI processes
// (run_launch.cc), and the report (run_report.cc). cmd_run.cc joins them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/progress.h"
#include "zeroflat/comm.h"
#include "zeroflat/layout.h"
#include "zeroflat/model.h"
#include "zeroflat/plan.h"

namespace zeroflat::cli {

using Json = nlohmann::ordered_json;

enum class DeviceKind { kCpu, kSim, kCuda };

// Where the ranks' buffers live and how the ranks talk: --device, --no-data, --host, --comm
// (shared by `run` and `load`).
struct Placement {
  std::string device_spec = "cpu";
  DeviceKind kind = DeviceKind::kCpu;
  bool no_data = false;
  std::optional<std::uint64_t> node_host_bytes;  // --host: the simulated node's host memory
  std::string comm = "local";
};
// what: what lives on the device ("the parameters live"); no_data_effect: what
// --no-data leaves out ("nothing is copied").
void add_placement_options(Parser& parser, const std::string& what,
                           const std::string& no_data_effect);
// Checked (InvalidArgument names the bad value; the device is made once, so a GPU that is not
// there is an error before any work). dp: the ranks as given, for the comm checks.
Placement placement_from_args(const Args& args, std::uint64_t dp);
// The --threads value: 0 when not given (settled from the ranks on this host later).
unsigned threads_from_args(const Args& args);

// Everything the ranks share, validated before anything is allocated.
struct RunConfig {
  ModelSpec model;
  LayoutOptions options;
  std::string device_spec;
  DeviceKind kind = DeviceKind::kCpu;
  bool no_data = false;
  std::optional<std::uint64_t> node_host_bytes;  // --host: the simulated node's host memory
  std::string comm = "local";
  std::optional<Tier> forced;
  std::optional<std::uint64_t> margin;
  unsigned threads = 1;  // per rank
  std::uint64_t repeat = 3;
  bool verify = false;
  bool check_values = true;
  std::optional<std::size_t> fault_step;
  std::uint64_t fault_rank = 0;
  std::optional<std::size_t> crash_step;  // --inject-crash: this rank dies (SIGKILL) there
  std::uint64_t crash_rank = 0;
  std::optional<std::uint64_t> corrupt;
  unsigned local_ranks = 1;  // ranks of this run on this host
  std::chrono::milliseconds timeout{60000};
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
// The most ranks one run or load takes.
inline constexpr std::uint64_t kMaxRanks = 256;
// dp: mpirun's world size (refused when --dp says otherwise), or --dp for ranks as threads; and
// this host's ranks. InvalidArgument beyond kMaxRanks.
void settle_world(LayoutOptions& options, unsigned& local_ranks, const Args& args,
                  Communicator* world);
// mpirun ends the whole job when one rank exits non-zero: every rank waits here (a barrier; a
// broken job skips it) until rank 0 has printed its report. Returns code.
int finish_job(Communicator* world, int code);

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
// This host's memory against `per_rank` bytes for each of the job's ranks that run here (every
// rank with --comm local, else the launcher's local count): nothing when they fit, when nothing
// is needed or when the host cannot be probed; else what the caller's message says.
struct HostShortfall {
  std::uint64_t ranks_here = 0;
  std::uint64_t need = 0;        // per_rank x ranks_here, saturating
  std::uint64_t usable = 0;      // free less the default margin
  std::uint64_t free_bytes = 0;  // as the probe read it, from `source`
  std::uint64_t margin = 0;
  std::string source;
};
std::optional<HostShortfall> host_shortfall(std::uint64_t per_rank, const std::string& comm,
                                            std::uint64_t dp, unsigned local_ranks);
// Bytes per second in GB/s (0 for no time).
double gbps(std::uint64_t bytes, double seconds);

// --- run_launch.cc ----------------------------------------------------------------------------
// body(rank, comm) for every rank: dp threads of this process joined by a local group (comm null
// for one rank), or once, for this MPI process's rank of world. Rethrows the first failure that
// is not another rank's abort (ResourceExhausted when a rank's thread cannot start).
void run_ranks(std::uint64_t dp, Communicator* world, std::chrono::milliseconds timeout,
               const std::function<void(std::uint64_t, Communicator*)>& body);
// Every rank's entry, in rank order, on every rank (one collective; {entry} alone without one).
std::vector<Json> exchange_entries(Communicator* control, const Json& entry);
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
