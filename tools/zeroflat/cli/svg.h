// An SVG picture of a plan: device memory over the steps of each tier against the capacity.
#pragma once

#include <string>

#include "zeroflat/plan.h"

namespace zeroflat::cli {

// One panel per candidate (2 x 2): a step line of device bytes after each step, the capacity
// and capacity - margin lines, and each step's description as a tooltip.
std::string plan_svg(const Plan& plan, const PlanInput& input, const std::string& title);

}  // namespace zeroflat::cli
