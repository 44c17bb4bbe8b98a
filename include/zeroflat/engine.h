// The front door for a group whose values are on the device: one call takes it from its
// original storage to its flat buffer on every rank of the group, the way every caller should
// (C++ programs, the CLI's run, the Python package and the DeepSpeed drop-in all go through it).
// A group read from a checkpoint enters through load_flat_group (loader.h); both doors lead to
// the same pipeline, with only the source of the values differing:
//
//   probe    the device's free-memory sources (Device::probe_memory) and the host memory this
//            rank may stage through (Device::probe_host_memory), with what the caller knows
//            (the framework's cached-but-free bytes) given as a source, not a finished number;
//   agree    one all-reduce over the ranks (agree.h): the options and the group's shapes and
//            dtypes must match, every rank's own checks must have passed, and the planner's
//            facts become the minimum over ranks;
//   plan     every tier as a step list on the memory model; the fastest that fits, or none;
//   check    for the sharded and staged tiers, that the ranks hold the same values (one more
//            all-reduce; each rank hashes the group once);
//   execute  the chosen step list (executor.h), with agreement, rollback and recovery;
//   master   this rank's fp32 master partition, if asked.
//
// Rules, as for a collective:
// - Every rank of `comm` calls it once per group, with a group of the same shapes and dtypes in
//   the same order and the same options (FlattenOptions says which fields may differ). This is
//   checked before anything moves: a mismatch, or an error found on any one rank, throws
//   InvalidArgument on every rank at the same point, and no rank is left waiting.
// - comm null (or of size 1) means one rank; options.layout.dp must equal the group's size.
// - params[i].data must point at parameter i's original storage on `device`, which the caller
//   owns; release_originals is called at most once, at the step where the plan frees it (it
//   must not throw). On return params[i].data points at the parameter's data (original storage,
//   or its view in the flat buffer), null only when the outcome is kLost.
// - The device is used by this call alone while it runs (see device.h for its threads), and must
//   outlive the result: the flat buffer, the views and the master partition are its memory.
// - comm is used by this call alone while it runs (a Communicator is not for concurrent use by
//   several threads; see comm.h).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/agree.h"
#include "zeroflat/comm.h"
#include "zeroflat/device.h"
#include "zeroflat/executor.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"
#include "zeroflat/release.h"
#include "zeroflat/tensor.h"

namespace zeroflat {

struct FlattenOptions {
  // The layout (dp = the ranks of comm). Must match on every rank.
  LayoutOptions layout;
  // Force a tier (for a group read from a source, a read plan); none: the planner's choice.
  // Must match.
  std::optional<Tier> tier;
  // A group read from a source: the bandwidth of the storage all nodes share (bytes/s); 0: each
  // node's own, not a shared bottleneck (Bandwidths::storage). Must match.
  double storage_bytes_per_second = 0;
  // Device bytes never planned into; none: default_margin(capacity). Must match.
  std::optional<std::uint64_t> margin_bytes;
  // Build this rank's fp32 master partition once the flat buffer is complete. Must match.
  bool master = true;
  // Before the sharded and staged tiers release the originals, check that the ranks hold the
  // same values (they would otherwise each end up with the owners' values). Off for callers
  // that know, such as a framework that has just broadcast the model. Must match.
  bool check_values = true;
  // Bandwidths of the cost model; none: the device's preset (Device::hardware()), else a
  // generic device of its capacity. Must match.
  std::optional<Bandwidths> bandwidths;
  // The DeepSpeed release whose layout the group follows (release.h), when the caller builds
  // one: the layout options are checked against its rules (InvalidArgument naming the option),
  // and the release is part of what the ranks compare and of the report. The caller passes the
  // group as that release forms it (layout_for_release says which parameters it keeps). Must
  // match.
  std::optional<ReleaseRules> release;
  // More that every rank must pass identically, as text (the caller's own options): compared,
  // shown in the error when the ranks differ.
  std::string must_match;

  // May differ between ranks:
  // What the caller knows that the probe cannot see (the framework's cache); local_ranks 0:
  // runtime_env()'s count, else the group's size (one host).
  ProbeContext probe;
  // How errors name parameter i (the caller's own indices or names); empty: "parameter i".
  std::vector<std::string> names;
  // Non-empty: the caller's own checks of this rank's group failed, and this is why. The ranks
  // still agree, so that the error is raised on every rank at once (InvalidArgument), here with
  // this message.
  std::string local_error;
  // Fault injection and progress of the steps, on this rank.
  ExecuteOptions execute;
};

struct FlattenResult {
  ProbeResult probe;       // this rank's device: every source, which decided (before agreement)
  ProbeResult host_probe;  // the host memory this rank may stage through
  PlanInput input;         // what the planner was given, after agreement
  Plan plan;               // every candidate; nothing chosen when no tier fits
  ValueCheck value_check;  // when the chosen tier needed it (seconds, bytes hashed)
  Execution execution;     // outcome, error, and the group (flat buffer and views) when complete
  // The memory model's peak for the chosen steps on this rank's own account (what its device
  // held before the first step), to set beside execution.measured_peak_device_bytes.
  std::uint64_t predicted_peak_device_bytes = 0;
  DeviceBuffer master;       // this rank's fp32 master partition, when asked and complete
  double master_seconds = 0;  // building it (allocation and first touch included)
  std::string master_error;  // why there is no master although one was asked

  // False: no tier fits (plan.reason says why with the numbers); nothing was moved.
  bool feasible() const noexcept { return plan.chosen.has_value(); }
  // The flat buffer is complete and every parameter is a view into it.
  bool complete() const noexcept {
    return feasible() &&
           (execution.outcome == Outcome::kDone || execution.outcome == Outcome::kRecovered);
  }
};

// What flatten_param_group would plan for a group laid out as `layout` whose originals are about
// to be placed on `device` (its elements at the layout's element size, not there yet), on this
// rank alone:
// the same probe, facts and policy (options' tier, margin, bandwidths, probe context), without
// agreement (the ranks' minimum may be lower) and without moving anything. For dry runs: the
// CLI's check that a rehearsal fits this machine, `zeroflat plan`. Throws InvalidArgument for
// a bad layout or options.
struct PlannedGroup {
  ProbeResult probe;       // this rank's device
  ProbeResult host_probe;  // the host memory it may stage through
  PlanInput input;
  Plan plan;
};
PlannedGroup plan_param_group(const Layout& layout, Device& device, const FlattenOptions& options,
                              std::uint64_t rank = 0);

// Collective (see above). Throws InvalidArgument (a bad group or options on any rank, or ranks
// that differ), CommError (the ranks cannot talk while agreeing) or Error (the ranks hold
// different values; see check_values), each before anything moves. Every other failure is in
// the result: no feasible plan (feasible() false, nothing moved), a failed step (the execution's
// outcome says what the parameters hold), a master partition that does not fit (master_error).
FlattenResult flatten_param_group(std::span<TensorRef> params, Device& device,
                                  Communicator* comm, const FlattenOptions& options,
                                  const ReleaseOriginals& release_originals = {});

}  // namespace zeroflat
