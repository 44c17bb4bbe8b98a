// `zeroflat run`: the main job. Materializes a model on every rank's device, agrees on free
// memory, plans, runs the chosen tier's step list with the executor, builds the fp32 master
// partition, verifies, and reports each rank next to the memcpy ceiling of the same run.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "device/cpu_device.h"
#include "zeroflat/checksum.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/error.h"
#include "zeroflat/executor.h"
#include "zeroflat/flatten.h"
#include "zeroflat/plan.h"
#include "zeroflat/plan_json.h"
#include "zeroflat/probe.h"
#include "zeroflat/progress.h"
#include "zeroflat/run_checks.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"

namespace zeroflat::cli {
namespace {

using Json = nlohmann::ordered_json;

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

double ratio(double a, double b) {
  return b > 0 ? a / b : 0.0;
}

enum class DeviceKind { kCpu, kSim, kCuda };

// Everything the ranks share, validated before anything is allocated.
struct Config {
  ModelSpec model;
  LayoutOptions options;
  std::string device_spec;
  DeviceKind kind = DeviceKind::kCpu;
  std::optional<DevicePreset> preset;  // sim:PRESET
  bool no_data = false;
  std::string comm = "local";
  std::optional<Tier> forced;
  std::optional<std::uint64_t> margin;
  unsigned threads = 1;  // per rank
  std::uint64_t repeat = 3;
  bool verify = false;
  std::optional<std::size_t> fault_step;
  std::uint64_t fault_rank = 0;
  std::optional<std::uint64_t> corrupt;
  std::uint64_t local_ranks = 1;  // ranks of this run on this host
  std::chrono::milliseconds timeout{60000};
};

// What one rank brings back.
struct RankResult {
  int exit = kExitOk;
  std::string message;  // why, when exit != 0 before any step ran (no feasible plan)
  Json entry;           // its element of "ranks"
  Json plan;            // the plan (identical on every rank)
  double memcpy_gbps = 0;
  double fresh_memcpy_gbps = 0;
};

// The original parameters of one rank: one allocation per tensor, as a framework holds them.
class Originals {
 public:
  explicit Originals(Device& device) : device_(device) {}
  ~Originals() { release(); }
  Originals(const Originals&) = delete;
  Originals& operator=(const Originals&) = delete;

  void add(std::uint64_t bytes) {
    ptrs_.push_back(device_.allocate(bytes));
    bytes_.push_back(bytes);
  }
  void* data(std::size_t i) const { return ptrs_[i]; }
  void release() noexcept {
    for (std::size_t i = 0; i < ptrs_.size(); ++i) {
      device_.release(ptrs_[i], bytes_[i]);
      ptrs_[i] = nullptr;
    }
  }

 private:
  Device& device_;
  std::vector<void*> ptrs_;
  std::vector<std::uint64_t> bytes_;
};

// Every rank's entry, in rank order, on every rank: lengths agreed by an all-reduce, then one
// all-gather of fixed-size slices over host memory.
std::vector<Json> exchange_entries(Communicator* control, detail::CpuDevice& host,
                                   const Json& entry) {
  const std::string mine = entry.dump();
  if (control == nullptr || control->size() == 1) return {entry};
  std::array<std::uint64_t, 1> len{mine.size()};
  control->all_reduce_max(len);
  const auto n = static_cast<std::uint64_t>(control->size());
  std::vector<char> buf(len[0] * n, ' ');
  std::memcpy(buf.data() + static_cast<std::uint64_t>(control->rank()) * len[0], mine.data(),
              mine.size());
  control->all_gather_inplace(buf.data(), len[0], host);
  std::vector<Json> out;
  for (std::uint64_t r = 0; r < n; ++r) {
    out.push_back(Json::parse(buf.begin() + static_cast<std::ptrdiff_t>(r * len[0]),
                              buf.begin() + static_cast<std::ptrdiff_t>((r + 1) * len[0])));
  }
  return out;
}

// One rank: its device, its originals, the agreement, the plan, the execution, the checks.
RankResult run_rank(const Config& cfg, std::uint64_t rank, Communicator* control,
                    Progress& progress) {
  RankResult res;
  const DType dtype = cfg.options.dtype;
  const std::uint64_t es = element_size(dtype);
  const Layout layout = Layout::compute(cfg.model.numels(), cfg.options);
  const std::uint64_t model_bytes = cfg.model.numel() * es;
  const std::uint64_t flat_bytes = layout.flat_bytes();

  std::unique_ptr<Device> device =
      make_device(cfg.device_spec, DeviceOptions{cfg.threads, cfg.no_data});
  // Host-side work (filling, checking) runs on a team of this rank's threads.
  std::unique_ptr<detail::CpuDevice> own_team;
  auto* team = dynamic_cast<detail::CpuDevice*>(device.get());
  if (team == nullptr) {
    own_team = std::make_unique<detail::CpuDevice>(DeviceOptions{cfg.threads});
    team = own_team.get();
  }
  std::unique_ptr<Communicator> nccl;
  Communicator* comm = control;
  if (cfg.comm == "nccl") {
    nccl = make_nccl_communicator(*control, *device, cfg.timeout);
    comm = nccl.get();
  }

  // --- the originals, filled with the pattern --------------------------------------------------
  progress.begin("materialize " + format_bytes(model_bytes) + " on " + device->name(), model_bytes);
  Originals originals(*device);
  std::vector<TensorRef> params;
  params.reserve(cfg.model.tensors.size());
  for (std::size_t i = 0; i < cfg.model.tensors.size(); ++i) {
    const TensorSpec& t = cfg.model.tensors[i];
    originals.add(t.numel * es);
    params.push_back(TensorRef{originals.data(i), t.numel, t.shape, dtype, device.get()});
  }
  fill_tensors(*device, *team, params, progress);
  progress.end();
  const MemoryInfo before = device->memory_info();
  const std::uint64_t resident = before.allocated_bytes;

  // --- free memory, agreed over the ranks -------------------------------------------------------
  PlanInput in;
  in.layout = layout;
  in.original_bytes = model_bytes;
  in.rank = rank;
  in.local_ranks = cfg.local_ranks;
  in.forced = cfg.forced;
  if (control != nullptr) control->barrier();  // every rank has materialized before the probe
  const ProbeResult host = probe_host(system_host_sources());
  const std::uint64_t host_share = host.free_bytes / cfg.local_ranks;
  switch (cfg.kind) {
    case DeviceKind::kCpu:
      in.capacity_bytes = host.total_bytes / cfg.local_ranks;
      in.free_bytes =
          std::min(host_share, in.capacity_bytes - std::min(in.capacity_bytes, resident));
      // Device memory is host memory: staging frees nothing, so the planner never picks the
      // staged or host tier here; forced, their step lists run as they would on a GPU.
      in.integrated = !cfg.forced;
      in.bandwidths = generic_preset(in.capacity_bytes).bandwidths;
      in.host_free_bytes = host_share;
      break;
    case DeviceKind::kSim:
    case DeviceKind::kCuda:
      in.capacity_bytes = before.total_bytes;
      in.free_bytes = before.free_bytes;
      in.bandwidths = (cfg.preset ? *cfg.preset : generic_preset(in.capacity_bytes)).bandwidths;
      // A rehearsal of a node stages through that node's host memory, not this machine's.
      in.host_free_bytes = cfg.preset && cfg.no_data
                               ? cfg.preset->host_bytes_per_node / cfg.local_ranks
                               : host_share;
      break;
  }
  if (control != nullptr) {
    std::array<std::uint64_t, 2> agreed{in.free_bytes, in.host_free_bytes};
    control->all_reduce_min(agreed);
    in.free_bytes = agreed[0];
    in.host_free_bytes = agreed[1];
  }
  in.margin_bytes = cfg.margin.value_or(default_margin(in.capacity_bytes));
  const Plan plan = plan_group(in);
  res.plan = plan_json(plan, in);
  const Candidate* chosen = plan.chosen_candidate();
  if (chosen == nullptr) {
    res.exit = kExitInfeasible;
    res.message = "no feasible plan: " + plan.reason + ". Nothing was moved.";
    return res;
  }

  // --- the tier's steps ---------------------------------------------------------------------
  ExecuteOptions opts;
  if (rank == cfg.fault_rank) opts.fault_step = cfg.fault_step;
  progress.begin("flatten " + format_bytes(flat_bytes) + ": " +
                     std::string(tier_name(chosen->tier)) + " tier, " +
                     std::to_string(chosen->steps.size()) + " steps",
                 0);
  Execution ex = execute(
      chosen->steps, layout, rank, params, *device, comm, [&] { originals.release(); }, opts);
  progress.end();
  if (ex.outcome != Outcome::kDone) res.exit = kExitExecFailed;

  Json& e = res.entry;
  e["rank"] = rank;
  e["tier"] = std::string(tier_name(chosen->tier));
  e["outcome"] = std::string(outcome_name(ex.outcome));
  e["threads"] = cfg.threads;
  e["seconds"] = ex.seconds;
  e["end_to_end_gbps"] = gbps(flat_bytes, ex.seconds);
  e["flatten_gbps"] = Json();
  // The memory model on this rank's own account: what its device held before the steps.
  e["predicted_peak_device_bytes"] =
      simulate(chosen->steps, resident, model_bytes, cfg.options.dp).peak_device_bytes;
  e["measured_peak_device_bytes"] = ex.measured_peak_device_bytes;
  e["predicted_host_bytes"] = chosen->profile.peak_host_bytes;
  e["host_bytes"] = ex.measured_peak_host_bytes;
  Json step_seconds = Json::array();
  for (double s : ex.step_seconds) step_seconds.push_back(s);
  e["step_seconds"] = std::move(step_seconds);
  if (!ex.error.empty()) {
    e["error"] = ex.error;
    e["failed_step"] = ex.failed_step ? Json(*ex.failed_step) : Json();
    e["failed_rank"] = ex.failed_rank;
  }
  // Every parameter, wherever it points now, against the pattern it was filled with.
  e["originals_intact"] =
      device->keeps_data() ? Json(params_intact(*device, *team, params)) : Json();

  const bool have_group = ex.outcome == Outcome::kDone || ex.outcome == Outcome::kRecovered;
  if (!have_group) {
    e["verified"] = false;
    e["checksum"] = Json();
    return res;
  }
  FlatGroup& group = ex.group;

  // --- timing rounds (cpu): the copy alone and the whole tier again, against memcpy ---------
  if (cfg.kind == DeviceKind::kCpu && ex.outcome == Outcome::kDone) {
    if (control != nullptr) control->barrier();  // the ranks contend for the cores together
    progress.begin("time against memcpy (" + std::to_string(cfg.repeat) + " rounds)", 0);
    Timing t = time_rounds(*team, group, chosen->steps, rank, comm, cfg.repeat, ex.seconds);
    progress.end();
    e["flatten_gbps"] = gbps(flat_bytes, t.copy_only);
    e["end_to_end_gbps"] = gbps(flat_bytes, t.end_to_end);
    e["memcpy_gbps"] = gbps(flat_bytes, t.memcpy);
    e["fresh_memcpy_gbps"] = gbps(flat_bytes, t.fresh_memcpy);
    res.memcpy_gbps = gbps(flat_bytes, t.memcpy);
    res.fresh_memcpy_gbps = gbps(flat_bytes, t.fresh_memcpy);
  }

  if (cfg.corrupt) corrupt_byte(*device, group.flat.data(), *cfg.corrupt);

  // The fp32 master partition comes after the flatten and may not fit where the flatten just
  // did (the plan's after_init says so): then the flat buffer is still reported and checked.
  progress.begin("fp32 master partition", 0);
  DeviceBuffer master;
  try {
    master = make_master_partition(*device, group, rank);
    e["master_bytes"] = master.num_bytes();
  } catch (const OutOfMemory& oom) {
    e["master_bytes"] = Json();
    e["master_error"] = std::string("the fp32 master partition does not fit: ") + oom.what();
  }
  progress.end();

  if (!device->keeps_data()) {
    e["verified"] = false;
    e["verify"] = "no data to verify (--no-data)";
    e["checksum"] = Json();
    return res;
  }
  if (cfg.verify) {
    const std::string failure = verify_group(*device, *team, group, master, rank, progress);
    e["verified"] = failure.empty();
    if (!failure.empty()) {
      e["verify_error"] = failure;
      if (res.exit == kExitOk) res.exit = kExitOther;
    }
  } else {
    e["verified"] = false;
    e["verify"] = "not requested";
  }
  progress.begin("checksum", 0);
  e["checksum"] = checksum_hex(device->checksum(group.flat.data(), flat_bytes));
  progress.end();
  return res;
}

// Why this run cannot fit in this host's memory, or "" when it can. Host memory holds the
// ranks' originals and flat buffers on the cpu and backed sim devices (plus the host stage, the
// timing rounds' buffers and the master partition); on a GPU only what --verify copies back.
std::string host_memory_shortfall(const Config& cfg, const Layout& layout) {
  auto sat_add = [](std::uint64_t a, std::uint64_t b) {
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
  };
  auto sat_mul = [](std::uint64_t a, std::uint64_t b) {
    return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
  };
  const std::uint64_t model_bytes = sat_mul(cfg.model.numel(), element_size(cfg.options.dtype));
  const std::uint64_t flat = layout.flat_bytes();
  const std::uint64_t master = sat_mul(4, layout.partition_numel());
  std::uint64_t per_rank = 0;
  std::string what;
  if (cfg.no_data) return "";
  if (cfg.kind == DeviceKind::kCuda) {
    per_rank = cfg.verify ? sat_add(flat, master) : 0;
    what = "the flat buffer and master partition copied back to verify them";
  } else {
    per_rank = sat_add(sat_add(model_bytes, sat_mul(3, flat)), master);
    what = "the originals (" + format_bytes(model_bytes) +
           "), the flat buffer, a host stage or "
           "the timing rounds' buffers (" +
           format_bytes(flat) + " each) and the master partition";
  }
  const std::uint64_t ranks_here = cfg.comm == "local" ? cfg.options.dp : cfg.local_ranks;
  const std::uint64_t need = sat_mul(per_rank, ranks_here);
  const ProbeResult host = probe_host(system_host_sources());
  const std::uint64_t margin = default_margin(host.total_bytes);
  const std::uint64_t usable = host.free_bytes > margin ? host.free_bytes - margin : 0;
  if (!host.available || need <= usable) return "";
  return "this run needs " + format_bytes(need) + " of host memory (" + std::to_string(ranks_here) +
         " rank(s) here, each with " + what + "), and " + format_bytes(usable) +
         " is usable here (" + format_bytes(host.free_bytes) + " free from " + host.used +
         ", less a " + format_bytes(margin) +
         " margin). Nothing was allocated. Try --layers or "
         "--experts to scale the model down, or --device sim:SIZE --no-data to rehearse it.";
}

// Parses "N" or "N@R".
void parse_fault(const std::string& text, Config& cfg) {
  const auto at = text.find('@');
  cfg.fault_step = static_cast<std::size_t>(parse_u64(text.substr(0, at), "--inject-fault"));
  if (at != std::string::npos) {
    cfg.fault_rank = parse_u64(text.substr(at + 1), "--inject-fault rank");
  }
}

void print_human(const Config& cfg, const Json& plan, const std::vector<Json>& entries,
                 const RankResult& first) {
  const std::uint64_t es = element_size(cfg.options.dtype);
  std::printf("zeroflat run: %s, %s tensors, %s parameters, %s %s\n", cfg.model.name.c_str(),
              format_count(cfg.model.tensors.size()).c_str(),
              format_count(cfg.model.numel()).c_str(), format_bytes(cfg.model.numel() * es).c_str(),
              std::string(dtype_name(cfg.options.dtype)).c_str());
  std::printf("  device %s%s, dp %llu over %s, threads per rank %u\n", cfg.device_spec.c_str(),
              cfg.no_data ? " (no data: memory accounted, nothing copied)" : "",
              static_cast<unsigned long long>(cfg.options.dp), cfg.comm.c_str(), cfg.threads);
  std::printf("  plan: %s (free %s per rank, margin %s)\n",
              plan["reason"].get<std::string>().c_str(),
              format_bytes(plan["free_bytes"].get<std::uint64_t>()).c_str(),
              format_bytes(plan["margin_bytes"].get<std::uint64_t>()).c_str());
  std::printf("  %-4s %-8s %-11s %9s %12s %12s %10s  %-16s %s\n", "rank", "tier", "outcome", "time",
              "peak model", "peak real", "host", "checksum", "verified");
  for (const Json& e : entries) {
    const std::string sum = e["checksum"].is_string() ? e["checksum"].get<std::string>() : "-";
    std::printf("  %-4llu %-8s %-11s %7.1fms %12s %12s %10s  %-16s %s\n",
                static_cast<unsigned long long>(e["rank"].get<std::uint64_t>()),
                e["tier"].get<std::string>().c_str(), e["outcome"].get<std::string>().c_str(),
                e["seconds"].get<double>() * 1e3,
                format_bytes(e["predicted_peak_device_bytes"].get<std::uint64_t>()).c_str(),
                format_bytes(e["measured_peak_device_bytes"].get<std::uint64_t>()).c_str(),
                format_bytes(e["host_bytes"].get<std::uint64_t>()).c_str(), sum.c_str(),
                e["verified"].get<bool>() ? "yes" : (e.contains("verify_error") ? "NO" : "-"));
  }
  const Json& e0 = entries.front();
  if (e0.contains("memcpy_gbps")) {
    const double f = e0["flatten_gbps"].get<double>();
    const double e2e = e0["end_to_end_gbps"].get<double>();
    std::printf("  rank 0 copy       %6.2f GB/s   %.2f x memcpy (%.2f GB/s)\n", f,
                ratio(f, first.memcpy_gbps), first.memcpy_gbps);
    std::printf("  rank 0 tier e2e   %6.2f GB/s   %.2f x memcpy into fresh memory (%.2f GB/s)\n",
                e2e, ratio(e2e, first.fresh_memcpy_gbps), first.fresh_memcpy_gbps);
    std::printf("  (time: the run that built the buffer; the GB/s: best of %llu rounds of each)\n",
                static_cast<unsigned long long>(cfg.repeat));
  }
  for (const Json& e : entries) {
    if (e.contains("error")) {
      std::printf("  rank %llu: %s; originals intact: %s\n",
                  static_cast<unsigned long long>(e["rank"].get<std::uint64_t>()),
                  e["error"].get<std::string>().c_str(),
                  e["originals_intact"].is_boolean()
                      ? (e["originals_intact"].get<bool>() ? "yes" : "NO")
                      : "unknown (no data)");
    }
    if (e.contains("master_error")) {
      std::printf("  rank %llu: %s\n",
                  static_cast<unsigned long long>(e["rank"].get<std::uint64_t>()),
                  e["master_error"].get<std::string>().c_str());
    }
    if (e.contains("verify_error")) {
      std::printf("  rank %llu: verification failed: %s\n",
                  static_cast<unsigned long long>(e["rank"].get<std::uint64_t>()),
                  e["verify_error"].get<std::string>().c_str());
    }
  }
}

}  // namespace

int subcommand_run(const std::vector<std::string>& argv) {
  Parser p("run", "[--model NAME] [--device DEV] [--comm local|mpi|nccl] [--dp P] [options]",
           "The main job, rehearsed on this machine: materializes the model's tensors on every\n"
           "rank's device (filled with a deterministic pattern), agrees on free memory over the\n"
           "ranks, plans, runs the chosen tier's steps (allocate, gather, release the originals,\n"
           "all-gather, re-point), builds each rank's fp32 master partition, optionally verifies\n"
           "every byte, and reports the predicted and measured peak memory of every rank and the\n"
           "bandwidth next to a memcpy of the same bytes, measured in the same run.");
  add_model_options(p, "tiny-moe");
  p.option("device", "DEV",
           "where the parameters live: cpu, cuda:N, or sim:SIZE / sim:PRESET (a device of that "
           "capacity with exact accounting, backed by host memory)",
           "cpu");
  p.flag("no-data", "sim devices: keep no data at all (memory is accounted, nothing is copied)");
  p.option("comm", "NAME",
           "how the ranks talk: local (ranks as threads of this process), mpi (rank and size "
           "from mpirun), nccl (cuda devices; bootstrapped over mpi)",
           "local");
  add_layout_options(p);
  p.option("tier", "TIER", "auto, device, sharded, staged or host", "auto");
  p.option("margin", "SIZE", "device bytes the plan never uses", "min(3% of capacity, 1 GiB)");
  p.option("threads", "N", "host threads per rank (overrides ZEROFLAT_NUM_THREADS)",
           "cores / ranks on this host");
  p.option("repeat", "N", "cpu: timed rounds of the copy, the tier and each ceiling (best kept)",
           "3");
  p.option("timeout", "SECONDS", "how long a collective waits for the other ranks", "60");
  p.flag("verify", "check every byte of the flat buffer, every view and the master partition");
  p.option("inject-fault", "N[@R]",
           "testing aid: step N of the plan fails on rank R (default 0), to prove rollback; "
           "exit 4, with originals_intact per rank");
  p.option("inject-corruption", "BYTE",
           "testing aid: flip one byte of the flat buffer after the flatten, for --verify");
  p.flag("json", "print one JSON document on stdout (docs/cli.md)");
  p.flag("quiet", "no progress on stderr");
  p.epilog(
      "examples:\n"
      "  zeroflat run --model tiny-moe --dp 3 --verify            3 ranks as threads\n"
      "  zeroflat run --model tiny-moe --dp 3 --tier staged --verify\n"
      "  mpirun -n 3 zeroflat run --model tiny-moe --comm mpi --verify\n"
      "  zeroflat run --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data --dp 8\n"
      "  zeroflat run --model tiny-moe --dp 2 --tier sharded --inject-fault 4@1\n\n"
      "Exit codes: 0 done; 1 verification failed; 2 bad arguments; 3 no feasible plan (nothing\n"
      "moved); 4 a step failed (after rollback; see originals_intact). Bandwidths are bytes of\n"
      "the flat buffer per second (GB = 1e9 bytes): the copy figure writes into a buffer\n"
      "already faulted in, against memcpy into such a buffer; the tier figure includes\n"
      "allocation and first touch, against memcpy into fresh memory.");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;

  // --- everything is validated before anything is allocated ---------------------------------
  Config cfg;
  cfg.model = model_from_args(args, "tiny-moe");
  cfg.options = layout_options_from_args(args, &cfg.model);
  cfg.device_spec = args.get("device").value_or("cpu");
  cfg.no_data = args.has("no-data");
  cfg.comm = args.get("comm").value_or("local");
  cfg.verify = args.has("verify");
  const bool json = args.has("json");
  // The spec is checked by making the device once (an unknown name, a bad size, a GPU that is
  // not there): before any work.
  (void)make_device(cfg.device_spec, DeviceOptions{1, cfg.no_data && cfg.device_spec != "cpu"});
  if (cfg.device_spec == "cpu") {
    cfg.kind = DeviceKind::kCpu;
  } else if (cfg.device_spec.rfind("sim:", 0) == 0) {
    cfg.kind = DeviceKind::kSim;
    cfg.preset = find_preset(cfg.device_spec.substr(4));
  } else if (cfg.device_spec.rfind("cuda", 0) == 0) {
    cfg.kind = DeviceKind::kCuda;
  } else {
    throw InvalidArgument("--device " + cfg.device_spec + ": expected cpu, sim:SIZE or cuda:N");
  }
  if (cfg.no_data && cfg.kind != DeviceKind::kSim) {
    throw InvalidArgument("--no-data is for sim devices (--device sim:SIZE); " + cfg.device_spec +
                          " keeps its data");
  }
  if (cfg.no_data && cfg.verify) {
    throw InvalidArgument("--verify needs data; drop --no-data to verify on a sim device");
  }
  if (cfg.comm != "local" && cfg.comm != "mpi" && cfg.comm != "nccl") {
    throw InvalidArgument("--comm '" + cfg.comm + "': expected local, mpi or nccl");
  }
  if (cfg.comm == "nccl" && cfg.kind != DeviceKind::kCuda) {
    throw InvalidArgument(
        "--comm nccl moves device memory of cuda devices; use --comm local or "
        "mpi with " +
        cfg.device_spec);
  }
  if (cfg.comm == "local" && cfg.kind == DeviceKind::kCuda && cfg.options.dp > 1) {
    throw InvalidArgument(
        "--comm local copies host memory; with cuda devices and --dp > 1 use "
        "--comm nccl under mpirun");
  }
  if (auto v = args.get("tier"); v && *v != "auto") {
    cfg.forced = try_parse_tier(*v);
    if (!cfg.forced) {
      throw InvalidArgument("--tier '" + *v + "': expected auto, device, sharded, staged or host");
    }
  }
  if (auto v = args.get("margin")) cfg.margin = parse_size(*v);
  if (auto v = args.get("repeat")) {
    cfg.repeat = parse_u64(*v, "--repeat");
    if (cfg.repeat == 0 || cfg.repeat > 1000) {
      throw InvalidArgument("--repeat " + *v + ": expected 1 to 1000");
    }
  }
  if (auto v = args.get("timeout")) {
    const std::uint64_t s = parse_u64(*v, "--timeout");
    if (s == 0 || s > 86400) throw InvalidArgument("--timeout " + *v + ": expected 1 to 86400");
    cfg.timeout = std::chrono::milliseconds(s * 1000);
  }
  if (auto v = args.get("inject-fault")) parse_fault(*v, cfg);
  std::optional<std::uint64_t> threads;
  if (auto v = args.get("threads")) {
    const std::uint64_t n = parse_u64(*v, "--threads");
    if (n == 0 || n > kMaxThreads) {
      throw InvalidArgument("--threads " + *v + ": expected 1 to " + std::to_string(kMaxThreads));
    }
    threads = n;
  }

  // The ranks: threads of this process, or the MPI job's processes.
  std::unique_ptr<Communicator> world;
  if (cfg.comm != "local") {
    world = make_mpi_communicator(cfg.timeout);
    const auto size = static_cast<std::uint64_t>(world->size());
    if (args.get("dp") && cfg.options.dp != size) {
      throw InvalidArgument("--dp " + std::to_string(cfg.options.dp) + " but mpirun started " +
                            std::to_string(size) + " ranks; leave --dp out or make them equal");
    }
    cfg.options.dp = size;
    cfg.local_ranks = runtime_env().local_ranks.value_or(static_cast<unsigned>(size));
  } else {
    cfg.local_ranks = cfg.options.dp;
  }
  const std::uint64_t dp = cfg.options.dp;
  if (dp > 256) throw InvalidArgument("--dp " + std::to_string(dp) + ": at most 256 ranks");
  if (cfg.fault_step && cfg.fault_rank >= dp) {
    throw InvalidArgument("--inject-fault " + *args.get("inject-fault") + ": rank " +
                          std::to_string(cfg.fault_rank) + " is outside dp " + std::to_string(dp));
  }
  cfg.threads = threads ? static_cast<unsigned>(*threads)
                        : default_num_threads(static_cast<unsigned>(cfg.local_ranks));
  const Layout layout = Layout::compute(cfg.model.numels(), cfg.options);
  if (cfg.corrupt = std::nullopt; auto v = args.get("inject-corruption")) {
    cfg.corrupt = parse_u64(*v, "--inject-corruption");
    if (*cfg.corrupt >= layout.flat_bytes()) {
      throw InvalidArgument("--inject-corruption " + *v + ": the flat buffer has " +
                            std::to_string(layout.flat_bytes()) + " bytes");
    }
  }

  // --- does it fit in this host's memory? Nothing is allocated before this answer ----------
  const int me = world ? world->rank() : 0;
  if (std::string why = host_memory_shortfall(cfg, layout); !why.empty()) {
    if (me == 0) std::fprintf(stderr, "zeroflat run: no feasible plan: %s\n", why.c_str());
    return kExitInfeasible;
  }

  Progress progress(!args.has("quiet") && me == 0);
  if (me == 0) {
    progress.note(cfg.model.name + ": " + format_count(cfg.model.tensors.size()) + " tensors, " +
                  format_bytes(cfg.model.numel() * element_size(cfg.options.dtype)) + "; dp " +
                  std::to_string(dp) + " over " + cfg.comm + " on " + cfg.device_spec +
                  ", threads per rank " + std::to_string(cfg.threads));
  }

  // --- run the ranks -------------------------------------------------------------------------
  std::vector<RankResult> results;
  std::vector<Json> entries;
  if (world) {
    detail::CpuDevice host(DeviceOptions{1});
    RankResult r = run_rank(cfg, static_cast<std::uint64_t>(me), world.get(), progress);
    if (r.exit == kExitInfeasible) {
      if (me == 0) std::fprintf(stderr, "zeroflat run: %s\n", r.message.c_str());
      return kExitInfeasible;
    }
    entries = exchange_entries(world.get(), host, r.entry);
    results.push_back(std::move(r));
  } else {
    results.resize(dp);
    std::vector<std::exception_ptr> errors(dp);
    std::unique_ptr<LocalGroup> group;
    if (dp > 1) group = std::make_unique<LocalGroup>(static_cast<int>(dp), cfg.timeout);
    auto body = [&](std::uint64_t r) {
      try {
        std::unique_ptr<Communicator> c = group ? group->rank(static_cast<int>(r)) : nullptr;
        Progress silent(false);  // one per rank: a Progress is not shared between threads
        results[r] = run_rank(cfg, r, c.get(), r == 0 ? progress : silent);
      } catch (...) {
        errors[r] = std::current_exception();
        if (group) group->rank(static_cast<int>(r))->abort("rank " + std::to_string(r) + " failed");
      }
    };
    std::vector<std::thread> ranks;
    for (std::uint64_t r = 1; r < dp; ++r) ranks.emplace_back(body, r);
    body(0);
    for (std::thread& t : ranks) t.join();
    // The first failure that is not another rank's abort is the one worth reporting.
    std::exception_ptr first;
    for (const std::exception_ptr& e : errors) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const CommError&) {
        if (!first) first = e;
      } catch (...) {
        first = e;
        break;
      }
    }
    if (first) std::rethrow_exception(first);
    if (results[0].exit == kExitInfeasible) {
      std::fprintf(stderr, "zeroflat run: %s\n", results[0].message.c_str());
      return kExitInfeasible;
    }
    for (const RankResult& r : results) entries.push_back(r.entry);
  }

  // --- report ---------------------------------------------------------------------------------
  int exit = kExitOk;
  std::string first_error;
  for (const Json& e : entries) {
    if (e["outcome"] != "done") {
      exit = kExitExecFailed;
      if (first_error.empty()) first_error = e.value("error", std::string("a step failed"));
    } else if (e.contains("verify_error") && exit == kExitOk) {
      exit = kExitOther;
    }
  }
  // mpirun ends the whole job when one rank exits non-zero: the others wait here until rank 0
  // has printed the report.
  auto finish = [&](int code) {
    if (world) {
      std::fflush(stdout);
      try {
        world->barrier();
      } catch (const CommError&) {  // rank 0's report stands on its own
      }
    }
    return code;
  };
  if (me != 0) return finish(exit);
  const RankResult& r0 = results.front();
  if (json) {
    Json doc;
    const std::uint64_t es = element_size(cfg.options.dtype);
    doc["model"] = {{"name", cfg.model.name},
                    {"architecture", cfg.model.architecture},
                    {"tensors", cfg.model.tensors.size()},
                    {"numel", cfg.model.numel()},
                    {"bytes", cfg.model.numel() * es}};
    doc["dp"] = dp;
    doc["device"] = cfg.device_spec;
    doc["no_data"] = cfg.no_data;
    doc["comm"] = cfg.comm;
    doc["dtype"] = std::string(dtype_name(cfg.options.dtype));
    doc["flat_bytes"] = layout.flat_bytes();
    doc["partition_bytes"] = layout.partition_bytes();
    doc["tier"] = r0.plan["tier"];
    doc["plan"] = r0.plan;
    if (exit == kExitExecFailed) doc["error"] = first_error;
    doc["ranks"] = entries;
    doc["ceiling"] = {{"memcpy_gbps", r0.memcpy_gbps}, {"fresh_memcpy_gbps", r0.fresh_memcpy_gbps}};
    if (entries.front().contains("memcpy_gbps")) {
      doc["ceiling"]["flatten_over_memcpy"] =
          ratio(entries.front()["flatten_gbps"].get<double>(), r0.memcpy_gbps);
      doc["ceiling"]["end_to_end_over_fresh_memcpy"] =
          ratio(entries.front()["end_to_end_gbps"].get<double>(), r0.fresh_memcpy_gbps);
    }
    std::printf("%s\n", doc.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
  } else {
    print_human(cfg, r0.plan, entries, r0);
  }
  if (exit == kExitExecFailed) {
    std::fprintf(stderr, "zeroflat run: execution failed: %s\n", first_error.c_str());
  } else if (exit == kExitOther) {
    std::fprintf(stderr, "zeroflat run: verification failed (see the report)\n");
  }
  return finish(exit);
}

}  // namespace zeroflat::cli
