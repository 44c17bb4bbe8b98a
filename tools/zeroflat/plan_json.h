// The JSON shapes of plans, shared by `plan` and `run` (docs/cli.md).
#pragma once

#include <nlohmann/json.hpp>

#include "zeroflat/plan.h"

namespace zeroflat::cli {

// One step with the memory model's account after it.
nlohmann::ordered_json step_json(const Step& step, const StepAccount& account);
// One candidate tier: feasibility, peak, traffic, predicted time, why not; its steps if asked.
nlohmann::ordered_json candidate_json(const Candidate& candidate, bool with_steps);
// A plan for `run` and the Python binding: the chosen tier and why, the memory it was planned
// in, every candidate (without steps), and the chosen tier's steps as numbered lines.
nlohmann::ordered_json plan_json(const Plan& plan, const PlanInput& input);

}  // namespace zeroflat::cli
