// `zeroflat run`: its options, checked before anything is allocated.
#include <cstdio>
#include <string>

#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat::cli {
namespace {

// Parses "N" or "N@R" of `option` into step and rank.
void parse_step_at_rank(const std::string& text, const std::string& option,
                        std::optional<std::size_t>& step, std::uint64_t& rank) {
  const auto at = text.find('@');
  step = static_cast<std::size_t>(parse_u64(text.substr(0, at), option));
  if (at != std::string::npos) rank = parse_u64(text.substr(at + 1), option + " rank");
}

}  // namespace

void add_run_options(Parser& p) {
  add_model_options(p, "tiny-moe");
  add_device_setup_options(p, "the parameters live", "nothing is copied");
  add_layout_options(p);
  p.option("tier", "TIER", "auto, device, sharded, staged or host", "auto");
  p.option("margin", "SIZE", "device bytes the plan never uses", "min(3% of capacity, 1 GiB)");
  p.option("threads", "N", "host threads per rank (overrides ZEROFLAT_NUM_THREADS)",
           "cores / ranks on this host");
  p.option("repeat", "N", "cpu: timed rounds of the copy, the tier and each ceiling (best kept)",
           "3");
  p.option("timeout", "SECONDS", "how long a rank waits for the others in a collective", "60");
  p.option("start-timeout", "SECONDS",
           "--comm mpi and nccl: how long the MPI job may take to start (every rank joining it)",
           "the larger of 120 and --timeout");
  p.flag("verify", "check every byte of the flat buffer, every view and the master partition");
  p.flag("no-value-check",
         "skip the check that the ranks hold equal values before the sharded and staged tiers "
         "hand slices between them");
  p.option("inject-fault", "N[@R]",
           "testing aid: step N of the plan fails on rank R (default 0), to prove rollback; "
           "exit 4, with originals_intact per rank");
  p.option("inject-crash", "N[@R]",
           "testing aid, --comm mpi: rank R (default 0) is killed (SIGKILL) as step N starts, to "
           "prove that the others end within --timeout and say what they hold");
  p.option("inject-corruption", "BYTE",
           "testing aid: flip one byte of the flat buffer after the flatten, for --verify");
  p.flag("json", "print one JSON document on stdout (docs/cli.md)");
  p.flag("quiet", "no progress on stderr");
}

RunConfig run_config_from_args(const Args& args) {
  RunConfig cfg;
  cfg.model = model_from_args(args, "tiny-moe");
  cfg.library.layout = layout_options_from_args(args, &cfg.model);
  cfg.library.release = release_from_args(args, cfg.library.layout);
  if (const std::string note = apply_release(cfg.library.release, cfg.model, cfg.library.layout);
      !note.empty()) {
    std::fprintf(stderr, "zeroflat run: %s\n", note.c_str());
  }
  cfg.setup = device_setup_from_args(args, cfg.library.layout.dp);
  cfg.verify = args.has("verify");
  cfg.library.check_values = !args.has("no-value-check");
  cfg.json = args.has("json");
  cfg.quiet = args.has("quiet");
  if (cfg.setup.no_data && cfg.verify) {
    throw InvalidArgument("--verify needs data; drop --no-data to verify on a sim device");
  }
  if (auto v = args.get("tier")) cfg.library.tier = parse_tier_choice(*v, "--tier");
  if (auto v = args.get("margin")) cfg.library.margin_bytes = parse_size(*v, "--margin");
  if (auto v = args.get("repeat")) {
    cfg.repeat = parse_u64(*v, "--repeat");
    if (cfg.repeat == 0 || cfg.repeat > 1000) {
      throw InvalidArgument("--repeat " + printable(*v) + ": expected 1 to 1000");
    }
  }
  cfg.timeout = timeout_from_args(args);
  cfg.start_timeout = start_timeout_from_args(args, cfg.timeout);
  if (auto v = args.get("inject-fault")) {
    parse_step_at_rank(*v, "--inject-fault", cfg.fault_step, cfg.fault_rank);
  }
  if (auto v = args.get("inject-crash")) {
    parse_step_at_rank(*v, "--inject-crash", cfg.crash_step, cfg.crash_rank);
    if (cfg.setup.comm != "mpi") {
      throw InvalidArgument(
          "--inject-crash kills a process: it is for --comm mpi (ranks as "
          "threads would all die)");
    }
  }
  cfg.threads = threads_from_args(args);  // 0: settle_ranks picks the default
  if (cfg.library.layout.dp > kMaxRanks) {
    throw InvalidArgument("--dp " + std::to_string(cfg.library.layout.dp) + ": at most " +
                          std::to_string(kMaxRanks) + " ranks");
  }
  return cfg;
}

void settle_ranks(RunConfig& cfg, const Args& args, Communicator* world) {
  settle_world(cfg.library.layout, cfg.library.probe.local_ranks, args, world);
  const std::uint64_t dp = cfg.library.layout.dp;
  if (cfg.fault_step && cfg.fault_rank >= dp) {
    throw InvalidArgument("--inject-fault " + printable(*args.get("inject-fault")) + ": rank " +
                          std::to_string(cfg.fault_rank) + " is outside dp " + std::to_string(dp));
  }
  if (cfg.crash_step && cfg.crash_rank >= dp) {
    throw InvalidArgument("--inject-crash " + printable(*args.get("inject-crash")) + ": rank " +
                          std::to_string(cfg.crash_rank) + " is outside dp " + std::to_string(dp));
  }
  if (cfg.threads == 0) cfg.threads = default_num_threads(cfg.library.probe.local_ranks);
  const Layout layout = Layout::compute(cfg.model.numels(), cfg.library.layout);
  if (auto v = args.get("inject-corruption")) {
    cfg.corrupt = parse_u64(*v, "--inject-corruption");
    if (*cfg.corrupt >= layout.flat_bytes()) {
      throw InvalidArgument("--inject-corruption " + printable(*v) + ": the flat buffer has " +
                            std::to_string(layout.flat_bytes()) + " bytes");
    }
  }
}

}  // namespace zeroflat::cli
