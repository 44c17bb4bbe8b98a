// `zeroflat run`: its options, checked before anything is allocated.
#include <cstdio>
#include <string>

#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/device.h"
#include "zeroflat/error.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"

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

void add_placement_options(Parser& p, const std::string& what, const std::string& no_data_effect) {
  p.option("device", "DEV",
           "where " + what +
               ": cpu, cuda:N, or sim:SIZE / sim:PRESET (a device of that "
               "capacity with exact accounting, backed by host memory)",
           "cpu");
  p.flag("no-data",
         "sim devices: keep no data at all (memory is accounted, " + no_data_effect + ")");
  p.option("host", "SIZE",
           "sim devices: the host memory of the simulated node, shared by its ranks (staging is "
           "planned against it, not against this machine)",
           "the preset's node; 2 TiB for sim:SIZE");
  p.option("comm", "NAME",
           "how the ranks talk: local (ranks as threads of this process), mpi (rank and size "
           "from mpirun), nccl (cuda devices; bootstrapped over mpi)",
           "local");
}

Placement placement_from_args(const Args& args, std::uint64_t dp) {
  Placement pl;
  pl.device_spec = args.get("device").value_or("cpu");
  pl.no_data = args.has("no-data");
  pl.comm = args.get("comm").value_or("local");
  const bool sim = pl.device_spec.rfind("sim:", 0) == 0;
  // The spec is checked by making the device once (an unknown name, a bad size, a GPU that is
  // not there): before any work.
  (void)make_device(pl.device_spec, DeviceOptions{1, pl.no_data && sim, std::nullopt});
  if (sim) {
    pl.kind = DeviceKind::kSim;
  } else if (pl.device_spec == "cpu") {
    pl.kind = DeviceKind::kCpu;
  } else if (pl.device_spec.rfind("cuda", 0) == 0) {
    pl.kind = DeviceKind::kCuda;
  } else {
    throw InvalidArgument("--device '" + printable(pl.device_spec) +
                          "': expected cpu, sim:SIZE or cuda:N");
  }
  if (auto v = args.get("host")) {
    if (pl.kind != DeviceKind::kSim) {
      throw InvalidArgument("--host is the host memory of a simulated node (--device sim:...); " +
                            pl.device_spec + " uses this machine's");
    }
    pl.node_host_bytes = parse_size(*v);
  }
  if (pl.no_data && pl.kind != DeviceKind::kSim) {
    throw InvalidArgument("--no-data is for sim devices (--device sim:SIZE); " + pl.device_spec +
                          " keeps its data");
  }
  if (pl.comm != "local" && pl.comm != "mpi" && pl.comm != "nccl") {
    throw InvalidArgument("--comm '" + printable(pl.comm) + "': expected local, mpi or nccl");
  }
  if (pl.comm == "nccl" && pl.kind != DeviceKind::kCuda) {
    throw InvalidArgument(
        "--comm nccl moves device memory of cuda devices; use --comm local or "
        "mpi with " +
        pl.device_spec);
  }
  if (pl.comm == "local" && pl.kind == DeviceKind::kCuda && dp > 1) {
    throw InvalidArgument(
        "--comm local copies host memory; with cuda devices and --dp > 1 use "
        "--comm nccl under mpirun");
  }
  return pl;
}

unsigned threads_from_args(const Args& args) {
  auto v = args.get("threads");
  if (!v) return 0;
  const std::uint64_t n = parse_u64(*v, "--threads");
  if (n == 0 || n > kMaxThreads) {
    throw InvalidArgument("--threads " + printable(*v) + ": expected 1 to " +
                          std::to_string(kMaxThreads));
  }
  return static_cast<unsigned>(n);
}

void add_run_options(Parser& p) {
  add_model_options(p, "tiny-moe");
  add_placement_options(p, "the parameters live", "nothing is copied");
  add_layout_options(p);
  p.option("tier", "TIER", "auto, device, sharded, staged or host", "auto");
  p.option("margin", "SIZE", "device bytes the plan never uses", "min(3% of capacity, 1 GiB)");
  p.option("threads", "N", "host threads per rank (overrides ZEROFLAT_NUM_THREADS)",
           "cores / ranks on this host");
  p.option("repeat", "N", "cpu: timed rounds of the copy, the tier and each ceiling (best kept)",
           "3");
  p.option("timeout", "SECONDS", "how long a collective waits for the other ranks", "60");
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
  cfg.options = layout_options_from_args(args, &cfg.model);
  if (const std::string note = apply_release(args, cfg.model, cfg.options); !note.empty()) {
    std::fprintf(stderr, "zeroflat run: %s\n", note.c_str());
  }
  const Placement pl = placement_from_args(args, cfg.options.dp);
  cfg.device_spec = pl.device_spec;
  cfg.kind = pl.kind;
  cfg.no_data = pl.no_data;
  cfg.node_host_bytes = pl.node_host_bytes;
  cfg.comm = pl.comm;
  cfg.verify = args.has("verify");
  cfg.check_values = !args.has("no-value-check");
  cfg.json = args.has("json");
  cfg.quiet = args.has("quiet");
  if (cfg.no_data && cfg.verify) {
    throw InvalidArgument("--verify needs data; drop --no-data to verify on a sim device");
  }
  if (auto v = args.get("tier")) cfg.forced = parse_tier_choice(*v, "--tier");
  if (auto v = args.get("margin")) cfg.margin = parse_size(*v);
  if (auto v = args.get("repeat")) {
    cfg.repeat = parse_u64(*v, "--repeat");
    if (cfg.repeat == 0 || cfg.repeat > 1000) {
      throw InvalidArgument("--repeat " + printable(*v) + ": expected 1 to 1000");
    }
  }
  if (auto v = args.get("timeout")) {
    const std::uint64_t s = parse_u64(*v, "--timeout");
    if (s == 0 || s > 86400) {
      throw InvalidArgument("--timeout " + printable(*v) + ": expected 1 to 86400");
    }
    cfg.timeout = std::chrono::milliseconds(s * 1000);
  }
  if (auto v = args.get("inject-fault")) {
    parse_step_at_rank(*v, "--inject-fault", cfg.fault_step, cfg.fault_rank);
  }
  if (auto v = args.get("inject-crash")) {
    parse_step_at_rank(*v, "--inject-crash", cfg.crash_step, cfg.crash_rank);
    if (cfg.comm != "mpi") {
      throw InvalidArgument(
          "--inject-crash kills a process: it is for --comm mpi (ranks as "
          "threads would all die)");
    }
  }
  cfg.threads = threads_from_args(args);  // 0: settle_ranks picks the default
  if (cfg.options.dp > kMaxRanks) {
    throw InvalidArgument("--dp " + std::to_string(cfg.options.dp) + ": at most " +
                          std::to_string(kMaxRanks) + " ranks");
  }
  return cfg;
}

void settle_world(LayoutOptions& options, unsigned& local_ranks, const Args& args,
                  Communicator* world) {
  if (world != nullptr) {
    const auto size = static_cast<std::uint64_t>(world->size());
    if (args.get("dp") && options.dp != size) {
      throw InvalidArgument("--dp " + std::to_string(options.dp) + " but mpirun started " +
                            std::to_string(size) + " ranks; leave --dp out or make them equal");
    }
    options.dp = size;
    local_ranks = runtime_env().local_ranks.value_or(static_cast<unsigned>(size));
  } else {
    local_ranks = static_cast<unsigned>(options.dp);
  }
  if (options.dp > kMaxRanks) {
    throw InvalidArgument("--dp " + std::to_string(options.dp) + ": at most " +
                          std::to_string(kMaxRanks) + " ranks");
  }
}

int finish_job(Communicator* world, int code) {
  if (world != nullptr) {
    std::fflush(stdout);
    try {
      world->barrier();
    } catch (const CommError&) {  // rank 0's report stands on its own
    }
  }
  return code;
}

void settle_ranks(RunConfig& cfg, const Args& args, Communicator* world) {
  settle_world(cfg.options, cfg.local_ranks, args, world);
  const std::uint64_t dp = cfg.options.dp;
  if (cfg.fault_step && cfg.fault_rank >= dp) {
    throw InvalidArgument("--inject-fault " + printable(*args.get("inject-fault")) + ": rank " +
                          std::to_string(cfg.fault_rank) + " is outside dp " + std::to_string(dp));
  }
  if (cfg.crash_step && cfg.crash_rank >= dp) {
    throw InvalidArgument("--inject-crash " + printable(*args.get("inject-crash")) + ": rank " +
                          std::to_string(cfg.crash_rank) + " is outside dp " + std::to_string(dp));
  }
  if (cfg.threads == 0) cfg.threads = default_num_threads(cfg.local_ranks);
  const Layout layout = Layout::compute(cfg.model.numels(), cfg.options);
  if (auto v = args.get("inject-corruption")) {
    cfg.corrupt = parse_u64(*v, "--inject-corruption");
    if (*cfg.corrupt >= layout.flat_bytes()) {
      throw InvalidArgument("--inject-corruption " + printable(*v) + ": the flat buffer has " +
                            std::to_string(layout.flat_bytes()) + " bytes");
    }
  }
}

}  // namespace zeroflat::cli
