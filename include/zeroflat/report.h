// The JSON documents zeroflat reports (docs/cli.md): what the probe saw, a plan and its
// candidates, and what one rank's flatten or load did. Each is written here, once: a caller that
// reports one of these builds it with the function below and only adds fields of its own (the
// CLI's `probe`, `plan`, and the entries of `run` and `load` with their repeats' timings,
// ceilings, checksums and verification; the Python package's reports, with what it knows of
// torch), so that the command line and Python say the same thing in the same shape. Each
// function returns one compact JSON document (UTF-8; bytes that are not valid UTF-8 are
// replaced).
#pragma once

#include <string>

#include "zeroflat/plan.h"
#include "zeroflat/probe.h"

namespace zeroflat {

struct FlattenResult;  // engine.h

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

// One rank's result of any front door (engine.h: flatten_param_group; loader.h: load, for any
// placement), the same keys for the same facts whatever the source and
// placement, and whether the group fits or not:
//   rank                         this rank (of comm)
//   tier                         the chosen tier or read plan, or null when none fits
//   outcome                      "done", "rolled back", "recovered", "lost" (engine.h), or
//                                "infeasible" when none fits (nothing moved)
//   feasible, reason             whether one fits, and why this one or why none (the plan's)
//   flat_bytes, partition_bytes  of the layout the steps filled (for ZeRO-3's partitions both
//                                are the rank's own buffer's)
//   seconds                      the chosen step list on this rank, agreements included
//   total_seconds                the whole call on this rank: checks, probe, agreement, plan,
//                                steps, the checks after them and the master partition
//   step_seconds                 each step's time
//   allgather_seconds            the all-gather's (0 without one): its step and the parts
//                                gathered while the read went on
//   allgather_overlapped_seconds  of those, the parts gathered during the read (0: none)
//   gather_parts                 the parts the read and the all-gather were split into (1: none)
//   predicted_peak_device_bytes  the memory model on the chosen steps, from what this rank's
//                                device held before them
//   measured_peak_device_bytes   the device's own high-water mark over the steps
//   predicted_host_bytes         the memory model's host stage for the chosen steps
//   host_bytes                   the host stage the steps held at most
//   error, failed_step,          only when a step failed: what failed and what the executor did,
//   failed_rank                  the step (null if none ran) and the rank the ranks agreed on
//   value_check_seconds,         only when the values check ran (sharded, staged): its time and
//   value_check_bytes            the bytes this rank hashed
//   master_bytes                 this rank's fp32 master partition, or null without one
//   master_seconds               only with a master: building it
//   master_error                 only when a master was asked and does not fit: why
//   probe, host_probe            probe_json of the device and of the host memory it stages through
//   plan                         plan_json of the plan and its input: every candidate, the
//                                chosen one's steps
//   bytes_read, reads            only for a group read from files (loader.h): the file bytes
//                                this rank read, and its reads after merging
//   read_seconds                 only from files: reading (conversion and staging included)
//   read_gbps                    only from files: bytes_read / read_seconds in GB/s (10^9
//                                bytes); null when nothing was read (a device without data)
//   page_cache, cached_fraction  only from files: where the bytes were before they were read
//                                ("cold", "warm", "partly"; 0 to 1); null when nothing was read
//   copy_check_bytes,            only from files: the check of the ranks' copies of the
//   copy_check_read_bytes,       checkpoint: bytes this rank hashed to compare, the file bytes
//   copy_check_seconds           among them it read (beside bytes_read: this rank read
//                                bytes_read + copy_check_read_bytes in all), and how long (0
//                                without one)
// All sizes are bytes and all times seconds.
std::string result_json(const FlattenResult& result);

}  // namespace zeroflat
