// The JSON documents of one rank's flatten and load (report.h), written once for the CLI and the
// Python package.
#include <nlohmann/json.hpp>
#include <string>

#include "zeroflat/engine.h"
#include "zeroflat/report.h"

namespace zeroflat {
namespace {

using Json = nlohmann::ordered_json;

std::string dump(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Json parsed(const std::string& text) {
  return Json::parse(text);
}

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

// The fields both documents end with: the master partition, and what the probes saw.
void add_master_and_probes(Json& j, const DeviceBuffer& master, double master_seconds,
                           const std::string& master_error, const ProbeResult& probe,
                           const ProbeResult& host_probe) {
  j["master_bytes"] = master ? Json(master.num_bytes()) : Json();
  if (master) j["master_seconds"] = master_seconds;
  if (!master_error.empty()) j["master_error"] = master_error;
  j["probe"] = parsed(probe_json(probe));
  j["host_probe"] = parsed(probe_json(host_probe));
}

}  // namespace

std::string result_json(const FlattenResult& r) {
  const Candidate* chosen = r.plan.chosen_candidate();
  const Execution& ex = r.execution;
  Json j;
  j["rank"] = r.rank;
  j["tier"] = chosen != nullptr ? Json(std::string(tier_name(chosen->tier))) : Json();
  j["outcome"] = r.feasible() ? std::string(outcome_name(ex.outcome)) : std::string("infeasible");
  j["feasible"] = r.feasible();
  j["reason"] = r.plan.reason;
  j["flat_bytes"] = r.input.layout.flat_bytes();
  j["partition_bytes"] = r.input.layout.partition_bytes();
  j["seconds"] = ex.seconds;
  j["total_seconds"] = r.seconds;
  j["step_seconds"] = ex.step_seconds;
  double allgather = 0;
  if (chosen != nullptr) {
    for (std::size_t k = 0; k < chosen->steps.size() && k < ex.step_seconds.size(); ++k) {
      if (chosen->steps[k].op == Op::kAllGather) allgather += ex.step_seconds[k];
    }
  }
  // The all-gather's whole time: its step (the last part where the read was overlapped) and the
  // parts gathered while the read went on.
  j["allgather_seconds"] = allgather + ex.overlapped_gather_seconds;
  j["allgather_overlapped_seconds"] = ex.overlapped_gather_seconds;
  j["gather_parts"] = ex.gather_parts;
  j["predicted_peak_device_bytes"] = r.predicted_peak_device_bytes;
  j["measured_peak_device_bytes"] = ex.measured_peak_device_bytes;
  j["predicted_host_bytes"] = chosen != nullptr ? chosen->profile.peak_host_bytes : 0;
  j["host_bytes"] = ex.measured_peak_host_bytes;
  if (!ex.error.empty()) {
    j["error"] = ex.error;
    j["failed_step"] = ex.failed_step ? Json(*ex.failed_step) : Json();
    j["failed_rank"] = ex.failed_rank;
  }
  if (r.value_check.bytes_hashed > 0) {
    j["value_check_seconds"] = r.value_check.seconds;
    j["value_check_bytes"] = r.value_check.bytes_hashed;
  }
  if (r.read) {
    // Nothing was read into a device without data (or before a plan was chosen).
    const ReadReport& rd = *r.read;
    const bool read = !rd.page_cache.empty();
    j["bytes_read"] = rd.bytes;
    j["reads"] = rd.reads;
    j["read_seconds"] = rd.seconds;
    j["read_gbps"] = read ? Json(gbps(rd.bytes, rd.seconds)) : Json();
    j["page_cache"] = read ? Json(rd.page_cache) : Json();
    j["cached_fraction"] = read ? Json(rd.cached_fraction) : Json();
    j["copy_check_bytes"] = rd.copy_check_bytes;
    j["copy_check_read_bytes"] = rd.copy_check_read_bytes;
    j["copy_check_seconds"] = rd.copy_check_seconds;
  }
  add_master_and_probes(j, r.master, r.master_seconds, r.master_error, r.probe, r.host_probe);
  j["plan"] = parsed(plan_json(r.plan, r.input));
  return dump(j);
}

}  // namespace zeroflat
