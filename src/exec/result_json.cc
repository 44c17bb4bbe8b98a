// The JSON documents of one rank's flatten and load (report.h), written once for the CLI and the
// Python package.
#include <nlohmann/json.hpp>
#include <string>

#include "zeroflat/engine.h"
#include "zeroflat/loader.h"
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

std::string flatten_result_json(const FlattenResult& r) {
  const Candidate* chosen = r.plan.chosen_candidate();
  const Execution& ex = r.execution;
  Json j;
  j["rank"] = r.input.rank;
  j["tier"] = chosen != nullptr ? Json(std::string(tier_name(chosen->tier))) : Json();
  j["outcome"] = r.feasible() ? std::string(outcome_name(ex.outcome)) : std::string("infeasible");
  j["feasible"] = r.feasible();
  j["reason"] = r.plan.reason;
  j["flat_bytes"] = r.input.layout.flat_bytes();
  j["partition_bytes"] = r.input.layout.partition_bytes();
  j["seconds"] = ex.seconds;
  j["step_seconds"] = ex.step_seconds;
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
  add_master_and_probes(j, r.master, r.master_seconds, r.master_error, r.probe, r.host_probe);
  j["plan"] = parsed(plan_json(r.plan, r.input));
  return dump(j);
}

std::string load_result_json(const LoadResult& r) {
  // The loader leaves page_cache empty when it read nothing (no data to read into, or no plan).
  const bool read = !r.page_cache.empty();
  Json j;
  j["rank"] = r.input.rank;
  j["tier"] = std::string(tier_name(r.plan.tier));
  j["outcome"] = r.feasible() ? "done" : "infeasible";
  j["feasible"] = r.feasible();
  j["reason"] = r.plan.why_not;
  j["flat_bytes"] = r.input.layout.flat_bytes();
  j["partition_bytes"] = r.input.layout.partition_bytes();
  j["bytes_read"] = r.bytes_read;
  j["reads"] = r.reads;
  j["read_seconds"] = r.read_seconds;
  j["read_gbps"] = read ? Json(gbps(r.bytes_read, r.read_seconds)) : Json();
  j["page_cache"] = read ? Json(r.page_cache) : Json();
  j["cached_fraction"] = read ? Json(r.cached_fraction) : Json();
  j["allgather_seconds"] = r.allgather_seconds;
  j["seconds"] = r.seconds;
  j["predicted_peak_device_bytes"] = r.predicted_peak_device_bytes;
  j["measured_peak_device_bytes"] = r.measured_peak_device_bytes;
  j["predicted_host_bytes"] = r.plan.profile.peak_host_bytes;
  j["host_bytes"] = r.measured_peak_host_bytes;
  j["copy_check_bytes"] = r.copy_check_bytes;
  j["copy_check_seconds"] = r.copy_check_seconds;
  add_master_and_probes(j, r.master, r.master_seconds, r.master_error, r.probe, r.host_probe);
  j["plan"] = parsed(candidate_json(r.plan, true));
  Json plans = Json::array();
  for (const Candidate& c : r.read_plans.candidates) {
    plans.push_back(parsed(candidate_json(c, false)));
  }
  j["read_plans"] = {{"reason", r.read_plans.reason}, {"candidates", std::move(plans)}};
  return dump(j);
}

}  // namespace zeroflat
