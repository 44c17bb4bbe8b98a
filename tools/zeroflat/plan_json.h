// The JSON shapes of plans, shared by `plan` and `run` (docs/cli.md).
#pragma once

#include <nlohmann/json.hpp>

#include "zeroflat/plan.h"

namespace zeroflat::cli {

// One step with the memory model's account after it.
nlohmann::ordered_json step_json(const Step& step, const StepAccount& account);
// One candidate tier: feasibility, peak, traffic, predicted time, why not; its steps if asked.
nlohmann::ordered_json candidate_json(const Candidate& candidate, bool with_steps);

}  // namespace zeroflat::cli
