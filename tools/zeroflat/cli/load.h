// `zeroflat load`, cut by job as `run` is: its options and the group read from the checkpoint's
// headers (load_options.cc), one rank's load through the library's loader with the ceiling and
// verification around it (load_rank.cc), and the report (load_report.cc); `--from deepspeed`,
// a DeepSpeed checkpoint's resume, has its group and rank (load_deepspeed.cc) and its report
// (load_deepspeed_report.cc). cmd_load.cc joins them; what load shares with run is in
// cli/ranks.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "cli/ranks.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/device.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"
#include "zeroflat/resume.h"

namespace zeroflat::cli {

// `--from deepspeed`: what a resuming rank keeps, one buffer per load call (resume.h). Each
// buffer's layout.dp is the world, settled with the ranks (settle_load_ranks).
using DeepSpeedBuffer = ResumeBuffer;
struct DeepSpeedLoad {
  DeepSpeedCheckpoint ck;
  // The library's plan: the new run's stage (--stage), its targets (--states), the buffers in
  // the order every rank loads them, the rules that chose the parameters, their counts.
  ResumePlan plan;
};

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
  StageChoice stage;  // --stage 3: ZeRO-3's partitions, else the flat buffer
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
  // --from deepspeed (load_deepspeed.cc): ck is then its first buffer's (every file of the
  // checkpoint), params empty, checkpoint_bytes what all ranks read together.
  std::optional<DeepSpeedLoad> deepspeed;
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
// One rank's device and communicator, and the options each of its load calls starts from.
struct RankContext {
  std::unique_ptr<Device> device;
  std::unique_ptr<Communicator> nccl;  // --comm nccl: over control
  Communicator* comm = nullptr;        // what the loader's collectives use
  FlattenOptions options;              // cfg.library, threads, must_match, fault injection
};
RankContext rank_context(const LoadConfig& cfg, std::uint64_t rank, Communicator* control);
// The ceiling: `bytes` of cfg.ck's files read sequentially (from rank * bytes on), after the
// ranks meet; keeps the faster of `best` and this one.
void measure_ceiling(const LoadConfig& cfg, std::uint64_t rank, std::uint64_t bytes,
                     Device& device, Communicator* control, Progress& progress,
                     std::optional<ReadCeiling>& best);
Json ceiling_json(const ReadCeiling& ceiling);
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
// The entry's verified and verify_error (exit 1 when `failure` is not ""), or with --verify not
// given, why nothing was verified.
void record_verification(const LoadConfig& cfg, const std::string& failure, LoadOutcome& out);
// The entry of a rank whose load failed midway (exit 4): nothing kept.
LoadOutcome failed_load(std::uint64_t rank, const Error& err);

// --- load_report.cc ---------------------------------------------------------------------------
// The exit code of the whole load from every rank's entry, and the first error.
int load_exit_code(const std::vector<Json>& entries, std::string& first_error);
// The node's figures from every rank's entry: all bytes read over the slowest rank's read time,
// the page cache, and the same for the ceilings.
struct NodeFigures {
  bool no_data = false;
  std::uint64_t bytes = 0;
  double seconds = 0;
  double read_gbps = 0;
  std::string cache;  // "" when nothing was read
  bool have_ceiling = false;
  std::uint64_t ceiling_bytes = 0;
  double ceiling_gbps = 0;
  std::string ceiling_cache;
  // read_gbps, page_cache, ceiling, vs_ceiling.
  void add_json(Json& doc) const;
  // The "node: ..." line, when something was read.
  void print() const;
};
NodeFigures node_figures(const std::vector<Json>& entries, bool no_data);
// The JSON document (docs/cli.md) or the human report, on stdout.
void print_load_report(const LoadConfig& cfg, const std::vector<Json>& entries,
                       const LoadOutcome& first, int exit, const std::string& first_error);
// The end of either JSON document, printed: plan, the node's figures, ranks, exit, error.
void print_document(Json& doc, const Json& plan, const NodeFigures& node,
                    const std::vector<Json>& entries, int exit, const std::string& first_error);
// "12.35" (fixed digits), for tables.
std::string fixed(double v, int digits);

// --- load_deepspeed.cc ------------------------------------------------------------------------
void add_deepspeed_load_options(Parser& parser);
// Whether --from names a DeepSpeed checkpoint (UsageError for another value).
bool from_deepspeed(const Args& args);
// --from deepspeed: the checkpoint (DIR, --tag), the new run's stage (--stage, checked against
// the saved one), the states (--states), the buffers and their sources, into cfg (deepspeed,
// ck, source, library.layout's dp and dtype, stage, checkpoint_bytes). Options of the
// safetensors load the checkpoint decides (--dtype, --round-robin, ...) are InvalidArgument.
void deepspeed_config(LoadConfig& cfg, const Args& args);
// The bytes each rank keeps (every buffer; the ranks' are equal), for the host's room.
std::uint64_t deepspeed_kept_bytes(const LoadConfig& cfg);
// One rank's resume: every buffer loaded in turn (each a collective load() of its placement),
// kept, then the ceiling and verification; one entry for the rank.
LoadOutcome load_deepspeed_rank(const LoadConfig& cfg, std::uint64_t rank, Communicator* control,
                                Progress& progress);
// A line for stderr before the ranks start.
std::string deepspeed_note(const LoadConfig& cfg);

// --- load_deepspeed_report.cc -----------------------------------------------------------------
void print_deepspeed_report(const LoadConfig& cfg, const std::vector<Json>& entries,
                            const LoadOutcome& first, int exit, const std::string& first_error);

}  // namespace zeroflat::cli
