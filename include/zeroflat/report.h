// The JSON documents zeroflat reports (docs/cli.md): what the probe saw, a plan and its
// candidates. The CLI prints them and the Python package returns them parsed, so both say the
// same thing in the same shape. Each function returns one compact JSON document (UTF-8; bytes
// that are not valid UTF-8 are replaced).
#pragma once

#include <string>

#include "zeroflat/plan.h"
#include "zeroflat/probe.h"

namespace zeroflat {

// `zeroflat probe --json`: the device, whether it is available, total and free bytes, which
// source decided, every source with its answer or error, and the notes.
std::string probe_json(const ProbeResult& probe);

// One candidate tier: feasibility, peak device and host bytes, traffic, predicted seconds, why
// not; with its steps (each with the memory model's account after it) if asked.
std::string candidate_json(const Candidate& candidate, bool with_steps);

// The plan as `zeroflat run` and the Python package report it: the chosen tier and why, the
// memory it was planned in, every candidate (without steps), and the chosen tier's steps as
// numbered lines.
std::string plan_json(const Plan& plan, const PlanInput& input);

}  // namespace zeroflat
