// `zeroflat load`, cut by job as `run` is: its options and the group read from the checkpoint's
// headers (load_options.cc), one rank's load through the library's loader with the ceiling and
// verification around it (load_rank.cc), and the report (load_report.cc). cmd_load.cc joins
// them; what load shares with run is in cli/ranks.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "cli/ranks.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/comm.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"
#include "zeroflat/release.h"

namespace zeroflat::cli {

// Everything the ranks share, validated before anything is read.
struct LoadConfig {
  std::string source;  // the checkpoint as named (a path or hub id), or the model rehearsed
  bool rehearsal = false;
  CheckpointIndex ck;
  std::vector<LoadParam> params;
  std::vector<std::string> left_out;   // tensors the loader does not read, and why
  std::uint64_t checkpoint_bytes = 0;  // of the tensors loaded, as stored
  // What every rank passes to the loader: the layout (dp, dtype, rules), margin, the read plan
  // (tier; none: the cost model's choice), the shared storage's bytes/s, the read options (cold,
  // ring, copies), this host's ranks (probe.local_ranks). Only rank-specific fields (the names,
  // the fault injection, must_match) are set per rank.
  FlattenOptions library;
  StageChoice stage;  // --stage 3: ZeRO-3's partitions (load_partitions), else the flat buffer
  DeviceSetup setup;
  unsigned threads = 0;
  bool verify = false;
  bool ceiling = true;
  std::chrono::milliseconds timeout{60000};
  // --start-timeout: how long the MPI job may take to start (--timeout bounds a collective)
  std::chrono::milliseconds start_timeout{120000};
  std::optional<std::uint64_t> fail_after;
  std::uint64_t fail_rank = 0;
  bool json = false;
  bool quiet = false;
};

// --- load_options.cc --------------------------------------------------------------------------
void add_load_options(Parser& parser);
// The options as given and the group from the checkpoint's headers (or the rehearsed model),
// checked (InvalidArgument names the bad value, file or tensor). dp, local ranks and threads are
// settled by settle_load_ranks() once the ranks are known.
LoadConfig load_config_from_args(const Args& args);
// After MPI has started (world, or null for ranks as threads): dp, local ranks, threads.
void settle_load_ranks(LoadConfig& cfg, const Args& args, Communicator* world);
// Why the ranks of this process cannot hold their buffers in this machine's memory, or "".
std::string load_memory_shortfall(const LoadConfig& cfg);

// --- load_rank.cc -----------------------------------------------------------------------------
// What one rank brings back.
struct LoadOutcome {
  int exit = 0;         // kExit* (common.h)
  std::string message;  // infeasible: why
  Json entry;           // its element of "ranks"
  Json plan;            // the load's candidate (identical on every rank)
  std::uint64_t flat_bytes = 0;
  std::uint64_t partition_bytes = 0;
};
// One rank: its device, the ceiling before and after, the library's loader, verification and
// checksum. `control` joins the ranks (null for one).
LoadOutcome load_rank(const LoadConfig& cfg, std::uint64_t rank, Communicator* control,
                      Progress& progress);

// --- load_report.cc ---------------------------------------------------------------------------
// The exit code of the whole load from every rank's entry, and the first error.
int load_exit_code(const std::vector<Json>& entries, std::string& first_error);
// The JSON document (docs/cli.md) or the human report, on stdout.
void print_load_report(const LoadConfig& cfg, const std::vector<Json>& entries,
                       const LoadOutcome& first, int exit, const std::string& first_error);

}  // namespace zeroflat::cli
