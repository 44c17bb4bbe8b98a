// `zeroflat run`, one rank: materialize the model from the pattern, hand it to the library's
// front door (probe, agreement, plan, execution, master partition), then time, verify and hash.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/agree.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/engine.h"
#include "zeroflat/rehearsal.h"
#include "zeroflat/report.h"

namespace zeroflat::cli {
namespace {

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

DeviceOptions device_options(const RunConfig& cfg) {
  return DeviceOptions{cfg.threads, cfg.setup.no_data, cfg.setup.node_host_bytes};
}

}  // namespace

std::string host_memory_shortfall(const RunConfig& cfg, Json& plan_doc) {
  const std::uint64_t es = element_size(cfg.library.layout.dtype);
  const std::uint64_t model_bytes = sat_mul(cfg.model.numel(), es);
  const Layout layout = Layout::compute(cfg.model.numels(), cfg.library.layout);
  std::unique_ptr<Device> device = make_device(cfg.setup.device_spec, device_options(cfg));
  // The plan the ranks will make once the originals are materialized on each device, as the
  // library's dry run makes it (the ranks' own agreement will take the minimum over them; here
  // one stands for all).
  const PlannedGroup planned = plan_param_group(layout, *device, cfg.library);
  const Plan& plan = planned.plan;
  plan_doc = Json::parse(plan_json(plan, planned.input));
  const Candidate* chosen = plan.chosen_candidate();
  if (chosen == nullptr) return "no feasible plan: " + plan.reason + ". Nothing was allocated.";

  // What this machine's memory holds per rank: the device's memory where it is the host's (the
  // memory model of the chosen steps, on this run's own account), the host stage where it is
  // real, and what the rehearsal keeps besides (the master partition; on cpu the timing rounds'
  // scratch buffer and the tier run again beside the finished buffer).
  const bool device_here = device->host_accessible() && device->keeps_data();
  const bool stage_here = device->keeps_data();
  const Profile own = simulate(chosen->steps, model_bytes, model_bytes, cfg.library.layout.dp);
  const std::uint64_t flat = layout.flat_bytes();
  const std::uint64_t master = sat_mul(4, layout.partition_numel());
  const std::uint64_t stage = stage_here ? own.peak_host_bytes : 0;
  std::uint64_t per_rank = 0;
  if (device_here) {
    per_rank = std::max(sat_add(own.peak_device_bytes, stage), sat_add(flat, master));
    if (cfg.setup.kind == DeviceKind::kCpu) {
      const std::uint64_t rerun =
          own.peak_device_bytes - std::min(own.peak_device_bytes, model_bytes);
      per_rank = std::max(per_rank, sat_add(sat_add(sat_mul(2, flat), rerun), stage));
    }
  } else if (cfg.verify) {
    per_rank = sat_add(flat, master);  // copied back to the host to be checked
  }
  per_rank = std::max(per_rank, stage);
  const std::optional<HostShortfall> s = host_shortfall(
      per_rank, cfg.setup.comm, cfg.library.layout.dp, cfg.library.probe.local_ranks);
  if (!s) return "";
  return "this run needs " + format_bytes(s->need) + " of this machine's memory (" +
         std::to_string(s->ranks_here) + " rank(s) here, each " + format_bytes(per_rank) +
         " for the " + std::string(tier_name(chosen->tier)) +
         " tier's peak, its host stage and the rehearsal's own buffers), and " +
         format_bytes(s->usable) + " is usable here (" + format_bytes(s->free_bytes) +
         " free from " + s->source + ", less a " + format_bytes(s->margin) +
         " margin). Nothing was allocated. Try --layers or --experts to scale the model down, "
         "or --device sim:SIZE --no-data to rehearse it.";
}

RankResult run_rank(const RunConfig& cfg, std::uint64_t rank, Communicator* control,
                    Progress& progress) {
  RankResult res;
  const DType dtype = cfg.library.layout.dtype;
  const std::uint64_t es = element_size(dtype);
  const std::uint64_t model_bytes = cfg.model.numel() * es;
  const std::uint64_t flat_bytes =
      Layout::compute(cfg.model.numels(), cfg.library.layout).flat_bytes();

  std::unique_ptr<Device> device = make_device(cfg.setup.device_spec, device_options(cfg));
  std::unique_ptr<Communicator> nccl;
  Communicator* comm = control;
  if (cfg.setup.comm == "nccl") {
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
  fill_pattern_tensors(*device, params, cfg.threads, [&](std::uint64_t n) { progress.advance(n); });
  progress.end();
  if (control != nullptr) control->barrier();  // every rank has materialized before the probe

  // --- the front door: probe, agree, plan, check, execute, master -----------------------------
  FlattenOptions fo = cfg.library;
  fo.must_match = {
      "model " + cfg.model.name + " (" + std::to_string(cfg.model.tensors.size()) + " tensors)",
      "device " + cfg.setup.device_spec, "comm " + cfg.setup.comm,
      "repeat " + std::to_string(cfg.repeat),
      std::string("data ") + (cfg.setup.no_data ? "no" : "yes")};
  if (rank == cfg.fault_rank) fo.execute.fault_step = cfg.fault_step;
  if (cfg.crash_step && rank == cfg.crash_rank) {
    fo.execute.on_step = [&](std::size_t k, const Step&) {
      if (k == *cfg.crash_step) {
        std::fflush(nullptr);
        std::raise(SIGKILL);
      }
    };
  }
  progress.begin("flatten " + format_bytes(flat_bytes), 0);
  FlattenResult fr = flatten_param_group(params, *device, comm, fo, [&] { originals.release(); });
  progress.end();
  // The library's account of this rank (report.h); the plan is the same on every rank and goes
  // to the top of the document once. The rehearsal's own fields follow.
  Json& e = res.entry;
  e = Json::parse(result_json(fr));
  res.plan = std::move(e["plan"]);
  e.erase("plan");
  if (!fr.feasible()) {
    res.exit = kExitInfeasible;
    res.message = "no feasible plan: " + fr.plan.reason + ". Nothing was moved.";
    return res;
  }
  const Candidate& chosen = *fr.plan.chosen_candidate();
  Execution& ex = fr.execution;
  if (ex.outcome != Outcome::kDone) res.exit = kExitExecFailed;
  e["threads"] = cfg.threads;
  e["end_to_end_gbps"] = gbps(flat_bytes, ex.seconds);
  e["flatten_gbps"] = Json();
  // Every parameter, wherever it points now, against the pattern it was filled with (checked
  // last, after anything that could have touched the data).
  auto originals_intact = [&] {
    e["originals_intact"] =
        device->keeps_data() ? Json(tensors_hold_pattern(*device, params, cfg.threads)) : Json();
  };
  if (!fr.complete()) {
    originals_intact();
    e["verified"] = false;
    e["checksum"] = Json();
    return res;
  }
  FlatGroup& group = ex.group;

  // --- timing rounds (cpu): the copy alone and the whole tier again, against memcpy ---------
  if (cfg.setup.kind == DeviceKind::kCpu && ex.outcome == Outcome::kDone) {
    if (control != nullptr) control->barrier();  // the ranks contend for the cores together
    progress.begin("time against memcpy (" + std::to_string(cfg.repeat) + " rounds)", 0);
    const Timing t = time_rounds(*device, group, chosen.steps, rank, comm, cfg.repeat, ex.seconds);
    progress.end();
    e["flatten_gbps"] = gbps(flat_bytes, t.copy_only);
    e["end_to_end_gbps"] = gbps(flat_bytes, t.end_to_end);
    e["memcpy_gbps"] = gbps(flat_bytes, t.memcpy);
    e["fresh_memcpy_gbps"] = gbps(flat_bytes, t.fresh_memcpy);
    res.memcpy_gbps = gbps(flat_bytes, t.memcpy);
    res.fresh_memcpy_gbps = gbps(flat_bytes, t.fresh_memcpy);
  }

  if (cfg.corrupt) corrupt_byte(*device, group.flat.data(), *cfg.corrupt);
  originals_intact();

  if (!device->keeps_data()) {
    e["verified"] = false;
    e["verify"] = "no data to verify (--no-data)";
    e["checksum"] = Json();
    return res;
  }
  if (cfg.verify) {
    progress.begin("verify " + format_bytes(flat_bytes), flat_bytes);
    const std::string failure = verify_flat_group(*device, group, fr.master, rank, cfg.threads,
                                                  [&](std::uint64_t n) { progress.advance(n); });
    progress.end();
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

}  // namespace zeroflat::cli
