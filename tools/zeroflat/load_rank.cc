// `zeroflat load`, one rank: its device, the library's loader between two sequential reads of
// the same files (the ceiling), then verification against every tensor read whole, and the
// checksum.
#include <memory>
#include <string>

#include "cli/common.h"
#include "cli/load.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/report.h"

namespace zeroflat::cli {

RankContext rank_context(const LoadConfig& cfg, std::uint64_t rank, Communicator* control) {
  RankContext ctx;
  const DeviceSetup& pl = cfg.setup;
  ctx.device =
      make_device(pl.device_spec, DeviceOptions{cfg.threads, pl.no_data, pl.node_host_bytes});
  ctx.comm = control;
  if (pl.comm == "nccl") {
    ctx.nccl = make_nccl_communicator(*control, *ctx.device, cfg.timeout);
    ctx.comm = ctx.nccl.get();
  }
  FlattenOptions& lo = ctx.options;
  lo = cfg.library;
  lo.read.threads = cfg.threads;
  lo.must_match = {"source " + cfg.source,
                   "device " + pl.device_spec,
                   "comm " + pl.comm,
                   "threads " + std::to_string(cfg.threads),
                   std::string("verify ") + (cfg.verify ? "yes" : "no"),
                   std::string("ceiling ") + (cfg.ceiling ? "yes" : "no")};
  if (cfg.stage.zero3) {
    lo.must_match.push_back("sub-group size " + std::to_string(cfg.stage.sub_group_size));
  }
  if (cfg.fail_after && rank == cfg.fail_rank) lo.read.fail_after_bytes = cfg.fail_after;
  lo.read.progress = std::make_shared<ReadProgress>();
  return ctx;
}

void measure_ceiling(const LoadConfig& cfg, std::uint64_t rank, std::uint64_t bytes,
                     Device& device, Communicator* control, Progress& progress,
                     std::optional<ReadCeiling>& best) {
  if (control != nullptr) control->barrier();  // the ranks read together, as they load
  progress.begin("ceiling: read " + format_bytes(bytes) + " sequentially", 0);
  const ReadCeiling c =
      measure_read_ceiling(cfg.ck, rank * bytes, bytes, cfg.threads, cfg.library.read.cold, &device);
  progress.end();
  if (!best || c.seconds < best->seconds) best = c;
}

Json ceiling_json(const ReadCeiling& c) {
  return {{"bytes", c.bytes},
          {"seconds", c.seconds},
          {"read_gbps", gbps(c.bytes, c.seconds)},
          {"page_cache", c.page_cache},
          {"cached_fraction", c.cached_fraction}};
}

void record_verification(const LoadConfig& cfg, const std::string& failure, LoadOutcome& out) {
  Json& e = out.entry;
  if (!cfg.verify) {
    e["verified"] = false;
    e["verify"] = cfg.setup.no_data ? "no data to verify (--no-data)" : "not requested";
    return;
  }
  e["verified"] = failure.empty();
  if (!failure.empty()) {
    e["verify_error"] = failure;
    out.exit = kExitOther;
  }
}

LoadOutcome failed_load(std::uint64_t rank, const Error& err) {
  LoadOutcome out;
  out.exit = kExitExecFailed;
  out.entry["rank"] = rank;
  out.entry["error"] = err.what();
  out.entry["buffer_kept"] = false;
  return out;
}

LoadOutcome load_rank(const LoadConfig& cfg, std::uint64_t rank, Communicator* control,
                      Progress& progress) {
  LoadOutcome out;
  const DeviceSetup& pl = cfg.setup;
  RankContext ctx = rank_context(cfg, rank, control);
  std::unique_ptr<Device>& device = ctx.device;
  const LoadPlacement placement =
      cfg.stage.zero3 ? LoadPlacement::partitions() : LoadPlacement::flat();

  // The ceiling: as many bytes of the same files read sequentially, before the load and again
  // after it (memory and cache conditions shift between the two); the faster is kept.
  std::optional<ReadCeiling> ceiling;
  std::uint64_t ceiling_bytes = 0;
  const bool with_ceiling = cfg.ceiling && !pl.no_data;
  if (with_ceiling) {
    ceiling_bytes = load_read_bytes(cfg.ck, cfg.params, placement, cfg.library.layout, rank);
    measure_ceiling(cfg, rank, ceiling_bytes, *device, control, progress, ceiling);
  }
  FlattenResult res;
  progress.begin("rank " + std::to_string(rank) + ": " +
                     (pl.no_data ? "account for its reads" : "load"),
                 0, ctx.options.read.progress);
  try {
    res = load(cfg.ck, cfg.params, placement, *device, ctx.comm, ctx.options);
  } catch (const InvalidArgument&) {
    throw;  // bad input, the same verdict on every rank: exit 2
  } catch (const Error& err) {
    progress.end();
    return failed_load(rank, err);
  }
  progress.end();
  // The library's account of this rank (report.h); the plan is the same on every rank and goes
  // to the top of the document once. The command's own fields follow.
  Json& e = out.entry;
  e = Json::parse(result_json(res));
  out.plan = std::move(e["plan"]);
  e.erase("plan");
  if (!res.feasible()) {
    out.exit = kExitInfeasible;
    out.message = "the loader's plan does not fit: " + res.plan.reason + ". Nothing was read.";
    return out;
  }
  out.flat_bytes = res.group().layout.flat_bytes();
  out.partition_bytes = res.group().layout.partition_bytes();

  if (with_ceiling) {
    measure_ceiling(cfg, rank, ceiling_bytes, *device, control, progress, ceiling);
    e["ceiling"] = ceiling_json(*ceiling);
  }
  if (cfg.verify) {
    progress.begin("verify against every tensor read whole", 0);
    const std::string failure = verify_load(cfg.ck, cfg.params, placement, *device, res.group(),
                                            cfg.library.layout.dp, rank);
    progress.end();
    record_verification(cfg, failure, out);
  } else {
    record_verification(cfg, "", out);
  }
  e["checksum"] =
      device->keeps_data()
          ? Json(checksum_hex(device->checksum(res.group().flat.data(), out.flat_bytes)))
          : Json();
  return out;
}

}  // namespace zeroflat::cli
