// The JSON documents of the probe and the planner (report.h).
#include <nlohmann/json.hpp>
#include <string>

#include "zeroflat/report.h"

namespace zeroflat {
namespace {

using Json = nlohmann::ordered_json;

std::string dump(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

Json step_doc(const Step& st, const StepAccount& acc) {
  return {{"op", std::string(op_name(st.op))},
          {"buffer", std::string(buffer_name(st.buffer))},
          {"bytes", st.bytes},
          {"description", st.describe()},
          {"device_bytes_after", acc.device_bytes},
          {"host_bytes_after", acc.host_bytes}};
}

Json candidate_doc(const Candidate& c, bool with_steps) {
  Json j;
  j["tier"] = std::string(tier_name(c.tier));
  j["feasible"] = c.feasible;
  j["peak_device_bytes"] = c.profile.peak_device_bytes;
  j["host_bytes"] = c.profile.peak_host_bytes;
  j["pcie_bytes"] = c.profile.pcie_bytes;
  j["comm_bytes"] = c.profile.comm_bytes;
  if (c.profile.read_bytes > 0) j["read_bytes"] = c.profile.read_bytes;
  j["device_copy_bytes"] = c.profile.device_copy_bytes;
  j["predicted_seconds"] = c.predicted_seconds;
  j["why_not"] = c.feasible ? Json() : Json(c.why_not);
  if (with_steps) {
    Json steps = Json::array();
    for (std::size_t k = 0; k < c.steps.size(); ++k) {
      steps.push_back(step_doc(c.steps[k], c.profile.after_step[k]));
    }
    j["steps"] = std::move(steps);
  }
  return j;
}

}  // namespace

std::string probe_json(const ProbeResult& r) {
  Json doc;
  doc["device"] = r.device;
  doc["available"] = r.available;
  doc["total_bytes"] = r.total_bytes;
  doc["free_bytes"] = r.free_bytes;
  doc["used"] = r.used;
  doc["integrated"] = r.integrated;
  doc["sources"] = Json::array();
  for (const SourceReport& s : r.sources) {
    doc["sources"].push_back({{"source", s.source},
                              {"ok", s.ok},
                              {"total_bytes", s.total_bytes},
                              {"free_bytes", s.free_bytes},
                              {"detail", s.detail}});
  }
  doc["notes"] = r.notes;
  return dump(doc);
}

std::string candidate_json(const Candidate& c, bool with_steps) {
  return dump(candidate_doc(c, with_steps));
}

std::string plan_json(const Plan& plan, const PlanInput& in) {
  Json j;
  j["tier"] = plan.chosen ? Json(std::string(tier_name(*plan.chosen))) : Json();
  j["feasible"] = plan.chosen.has_value();
  j["reason"] = plan.reason;
  j["capacity_bytes"] = in.capacity_bytes;
  j["free_bytes"] = in.free_bytes;
  j["margin_bytes"] = in.margin_bytes;
  j["host_free_bytes"] = in.host_free_bytes;
  Json cands = Json::array();
  for (const Candidate& c : plan.candidates) cands.push_back(candidate_doc(c, false));
  j["candidates"] = std::move(cands);
  if (const Candidate* c = plan.chosen_candidate()) {
    Json steps = Json::array();
    for (std::size_t k = 0; k < c->steps.size(); ++k) {
      steps.push_back(std::to_string(k) + ": " + c->steps[k].describe());
    }
    j["steps"] = std::move(steps);
  }
  return dump(j);
}

}  // namespace zeroflat
