// The JSON shapes of plans.
#include "zeroflat/plan_json.h"

#include <string>

namespace zeroflat::cli {

nlohmann::ordered_json step_json(const Step& st, const StepAccount& acc) {
  return {{"op", std::string(op_name(st.op))},
          {"buffer", std::string(buffer_name(st.buffer))},
          {"bytes", st.bytes},
          {"description", st.describe()},
          {"device_bytes_after", acc.device_bytes},
          {"host_bytes_after", acc.host_bytes}};
}

nlohmann::ordered_json candidate_json(const Candidate& c, bool with_steps) {
  nlohmann::ordered_json j;
  j["tier"] = std::string(tier_name(c.tier));
  j["feasible"] = c.feasible;
  j["peak_device_bytes"] = c.profile.peak_device_bytes;
  j["host_bytes"] = c.profile.peak_host_bytes;
  j["pcie_bytes"] = c.profile.pcie_bytes;
  j["comm_bytes"] = c.profile.comm_bytes;
  j["device_copy_bytes"] = c.profile.device_copy_bytes;
  j["predicted_seconds"] = c.predicted_seconds;
  j["why_not"] = c.feasible ? nlohmann::ordered_json() : nlohmann::ordered_json(c.why_not);
  if (with_steps) {
    nlohmann::ordered_json steps = nlohmann::ordered_json::array();
    for (std::size_t k = 0; k < c.steps.size(); ++k) {
      steps.push_back(step_json(c.steps[k], c.profile.after_step[k]));
    }
    j["steps"] = std::move(steps);
  }
  return j;
}

nlohmann::ordered_json plan_json(const Plan& plan, const PlanInput& in) {
  using Json = nlohmann::ordered_json;
  Json j;
  j["tier"] = plan.chosen ? Json(std::string(tier_name(*plan.chosen))) : Json();
  j["feasible"] = plan.chosen.has_value();
  j["reason"] = plan.reason;
  j["capacity_bytes"] = in.capacity_bytes;
  j["free_bytes"] = in.free_bytes;
  j["margin_bytes"] = in.margin_bytes;
  j["host_free_bytes"] = in.host_free_bytes;
  Json cands = Json::array();
  for (const Candidate& c : plan.candidates) cands.push_back(candidate_json(c, false));
  j["candidates"] = std::move(cands);
  if (const Candidate* c = plan.chosen_candidate()) {
    Json steps = Json::array();
    for (std::size_t k = 0; k < c->steps.size(); ++k) {
      steps.push_back(std::to_string(k) + ": " + c->steps[k].describe());
    }
    j["steps"] = std::move(steps);
  }
  return j;
}

}  // namespace zeroflat::cli
