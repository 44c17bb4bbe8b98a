// The front door for a group whose values are on the device, and the one options and result
// type of every front door. One call takes a group from its original storage to its flat buffer
// on every rank of the group, the way every caller should (C++ programs, the CLI's run, the
// Python package and the DeepSpeed drop-in all go through it). A group read from a checkpoint
// enters through load (loader.h), for any placement: every door leads to the one
// pipeline, which asks the group's source (where its values are now) and its placement (what
// each rank must hold at the end) and never branches on either:
//
//   probe    the device's free-memory sources (Device::probe_memory) and the host memory this
//            rank may stage through (Device::probe_host_memory), with what the caller knows
//            (the framework's cached-but-free bytes) given as a source, not a finished number;
//   agree    one all-reduce over the ranks: the options and the group's shapes and dtypes must
//            match, every rank's own checks must have passed (an error names the first option
//            or parameter that differs), and the planner's facts become the minimum over ranks;
//            then the sources compare what they say (a checkpoint's headers);
//   plan     the source's candidate step lists for the placement (tiers from the originals,
//            read plans from files) on the memory model; the fastest that fits, or none;
//   check    for the sharded and staged tiers, that the ranks hold the same values (one more
//            all-reduce; each rank hashes the group once);
//   execute  the chosen step list, with agreement, rollback and recovery (Outcome, below);
//   after    a source's check of what the ranks read (their copies of a checkpoint);
//   master   this rank's fp32 master partition, if asked.
//
// Rules of flatten_param_group, as for a collective:
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
//
// Here too: what a flatten leaves (FlatGroup) and what running its step list reports (Execution,
// Outcome), and the `device` tier alone as building blocks (flatten_group, make_master_partition).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/layout.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"

namespace zeroflat {

// --- The flattened group, and its execution ------------------------------------------------------
// What running a step list reports. The executor (the `execute` step of the pipeline) runs the
// very list the planner simulated, on a device and a communicator, and keeps the parameters'
// data safe when anything fails:
// - Agreement: ranks that share a group end in the same state. Before every step that cannot be
//   taken back or that needs all of them (releasing the originals, each all-gather) and once
//   more at the end, they agree in one small all-reduce on whether every rank's steps so far
//   succeeded. A rank whose step failed skips ahead to that point, so nobody waits for it in an
//   all-gather.
// - Rollback: a failure agreed before the originals are released rolls every rank back: the
//   buffers the steps allocated are released and every view points where it pointed before
//   (its original storage, untouched; or nothing, for values read from files).
// - Recovery: after the release, the only complete copy of the group is spread over the ranks'
//   slices (or, in the host tier, the host stage). Putting it back within the memory the plan
//   proved is exactly what the rest of the list does, so every rank re-runs the steps from the
//   one that failed (without the injected fault), and the parameters end up holding their
//   values as views into the completed buffer (kRecovered). Only when that fails too (the
//   device refuses memory again, the communicator is gone) is data lost (kLost), and the result
//   says which layout bytes this rank still held.

// A flattened group: the flat buffer that owns every parameter's data, and the views.
struct FlatGroup {
  Layout layout;
  DeviceBuffer flat;
  // views[i] is input parameter i re-pointed into flat: data = flat + offsets[i] * esize,
  // same numel, shape, dtype and device.
  std::vector<TensorRef> views;

  // Rank r's partition [r * S, (r + 1) * S) of flat, as a 1-D tensor.
  TensorRef partition(std::uint64_t rank) const;
};

struct ExecuteOptions {
  // Testing aid: step N of the list fails on this rank, as if it had thrown, the first time it
  // runs (the recovery pass runs it normally). Past the last step it changes nothing.
  std::optional<std::size_t> fault_step;
  // Called before each step runs (for progress); index into the step list.
  std::function<void(std::size_t, const Step&)> on_step;
  // A read of this rank's slice followed by the all-gather of the buffer (the `load` plan) is
  // split into parts, each gathered while the next is read, where the communicator gathers parts
  // on this device (Communicator::gathers_parts): at most this many parts (0: ZEROFLAT_GATHER_PARTS
  // where set, else the executor's choice, one per 8 MiB up to 8; 1: read, then gather). The
  // ranks take the smallest count any of them asks for. A read up-cast into the master partition
  // as it arrives (master, below) without such a gather is read in as many parts.
  std::uint32_t gather_parts = 0;
  // This rank's fp32 master partition (partition master_slot of the flat buffer up-cast) is built
  // as the step list reads it: each part up-cast on a thread of its own while the next is read,
  // in memory the device allocates at the read step (Execution::master). Only on a device whose
  // memory is the host's and keeps data, for a list that reads this rank's slot of the layout
  // into that partition in one step (builds_master); otherwise nothing.
  bool master = false;
  std::uint64_t master_slot = 0;
};

enum class Outcome : std::uint8_t {
  kDone,        // the flat buffer is complete; parameters are views into it
  kRolledBack,  // nothing was released: parameters hold their original storage, unchanged
  kRecovered,   // a step failed after the originals were released; the rest of the list was
                // run again and the parameters hold their original values as views into flat
  kLost,        // recovery failed as well: some parameter data is gone (the error says why)
};
std::string_view outcome_name(Outcome outcome) noexcept;

struct Execution {
  Outcome outcome = Outcome::kDone;
  // Empty when done; otherwise "step 4 (all-gather ...) failed on rank 1: ..." and what the
  // executor did about it.
  std::string error;
  std::optional<std::size_t> failed_step;  // the first failure the ranks agreed on
  int failed_rank = -1;
  // When done or recovered: the flat buffer, the views and the layout. Empty otherwise.
  FlatGroup group;
  // Device usage over the run (the device's high-water mark; resident bytes included) and the
  // host staging memory it held at most.
  std::uint64_t measured_peak_device_bytes = 0;
  std::uint64_t measured_peak_host_bytes = 0;
  double seconds = 0;                // the whole step list on this rank, agreement included
  std::vector<double> step_seconds;  // per step of the list (the last run of each)
  // The parts of an overlapped read and all-gather (1 where there was none), and the seconds the
  // all-gather of all but the last part took while the read went on (inside the read step's
  // time; the all-gather step's time is the last part's).
  std::uint32_t gather_parts = 1;
  double overlapped_gather_seconds = 0;
  // When done or recovered and ExecuteOptions::master was met: this rank's fp32 master partition
  // (the partition's elements, padding included), and the seconds its up-casts took (on their
  // own thread, inside the read step's time). Empty otherwise.
  DeviceBuffer master;
  double master_seconds = 0;
};

// How the caller frees the originals' storage (the parameters as they are before flattening):
// called at most once, at the step that releases them; must not throw.
using ReleaseOriginals = std::function<void()>;

// --- The front door ------------------------------------------------------------------------------
// How the ranks check, after reading a checkpoint, that their copies hold the same bytes (their
// headers are always compared).
enum class CopyCheck : std::uint8_t {
  kOff,      // no check of the bytes
  kSampled,  // each rank re-reads 16 windows of 64 KiB of every other rank's slice from its own
             // copy and compares them with what that rank read: at most 1 MiB per other rank
  kFull,     // each rank re-reads every other rank's slice: (N - 1) / N of the checkpoint more
};
std::string_view copy_check_name(CopyCheck check) noexcept;  // "off", "sampled", "full"
// "off", "sampled" or "full"; throws InvalidArgument naming `what` otherwise.
CopyCheck parse_copy_check(std::string_view text, std::string_view what);

// How a group read from files is read (loader.h); a group on the device ignores it.
struct ReadOptions {
  // Drop the files this rank reads from the page cache before reading (posix_fadvise), so that
  // a cold load is measured without root. May differ.
  bool cold = false;
  // The staging ring, for devices the host cannot write: depth chunks of chunk_bytes of pinned
  // host memory (64 MiB by default). The reader's team fills several chunks at once, each
  // thread the next part of whatever chunk is in flight, while a copier thread moves each full
  // chunk to the device: a depth of several times the threads of one rank keeps them all
  // reading while the copies run (files.h, fill_through_ring). Must match.
  std::uint64_t ring_chunk_bytes = std::uint64_t{4} << 20;
  unsigned ring_depth = 16;
  // Testing aid: go through the ring on a host device too. Must match.
  bool through_ring = false;
  // Reader threads; 0: the device's team (default_num_threads of the local ranks). May differ.
  unsigned threads = 0;
  // The check of the ranks' copies after reading (see CopyCheck). Must match.
  CopyCheck copies = CopyCheck::kSampled;
  // Testing aid: this rank's reads fail once this many bytes have been read, as an I/O error.
  std::optional<std::uint64_t> fail_after_bytes;
  // Testing aid: each reader thread reads at most this many bytes per second (a slow disk,
  // simulated: the thread waits out the rest of each piece's time); 0: as fast as it can. May
  // differ.
  double simulated_read_bytes_per_second = 0;
  // Counts this rank's planned and read bytes as the load runs, for a display on another
  // thread (common.h); none: not counted. May differ.
  std::shared_ptr<ReadProgress> progress;
};

// The options of every front door: flatten_param_group here, load (loader.h).
struct FlattenOptions {
  // The layout (dp = the ranks of comm). Must match on every rank.
  LayoutOptions layout;
  // Force a tier (for a group read from files, a read plan: plan.h); none: the planner's
  // choice. Must match.
  std::optional<Tier> tier;
  // A group read from files: the bandwidth of the storage all nodes share (bytes/s); 0: each
  // node's own, not a shared bottleneck (Bandwidths::storage). Must match.
  double storage_bytes_per_second = 0;
  // Device bytes never planned into; none: default_margin(capacity). Must match.
  std::optional<std::uint64_t> margin_bytes;
  // Build this rank's fp32 master partition once the buffer is complete. Must match.
  bool master = true;
  // Before the sharded and staged tiers release the originals, check that the ranks hold the
  // same values (they would otherwise each end up with the owners' values). Off for callers
  // that know, such as a framework that has just broadcast the model. Must match.
  bool check_values = true;
  // Bandwidths of the cost model; none: the device's preset (Device::hardware()), else a
  // generic device of its capacity. Must match.
  std::optional<Bandwidths> bandwidths;
  // The DeepSpeed release whose layout the group follows (layout.h), when the caller builds
  // one: the layout options are checked against its rules (InvalidArgument naming the option),
  // and the release is part of what the ranks compare and of the report. The caller passes the
  // group as that release forms it (layout_for_release says which parameters it keeps). Must
  // match.
  std::optional<ReleaseRules> release;
  // A group read from files: how (loader.h).
  ReadOptions read;
  // The caller's own account of the layout, when it laid the group out itself (a framework's
  // bookkeeping): each parameter's first element and the buffer's elements. Empty / none: not
  // checked. A layout that differs is refused (InvalidArgument naming the first parameter that
  // differs, and both offsets) before anything moves.
  std::vector<std::uint64_t> expected_offsets;
  std::optional<std::uint64_t> expected_flat_numel;
  // More that every rank must pass identically, as items (the caller's own options, "key
  // value"; a description of each tensor it holds outside the group): compared, and the first
  // item that differs is named in the error with what each side passed.
  std::vector<std::string> must_match;

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

// What a rank read from files (a group read from a checkpoint).
struct ReadReport {
  std::uint64_t bytes = 0;  // file bytes this rank read (its slice's, or the whole buffer's)
  std::uint64_t reads = 0;  // pread ranges after merging neighbours
  // How much of what this rank read was in the page cache before it read it (0 to 1), and the
  // word for it: "cold" (under 10%), "warm" (over 90%), "partly"; "" when nothing was read (a
  // device without data).
  double cached_fraction = 0;
  std::string page_cache;
  double seconds = 0;  // reading (conversion and staging included)
  // The copies check (ReadOptions::copies): bytes this rank hashed to compare (of its own buffer
  // or read again), the file bytes among them it read again (other ranks' windows, as its own
  // copy holds them; beside `bytes`: all this rank read is bytes + copy_check_read_bytes), and
  // how long.
  std::uint64_t copy_check_bytes = 0;
  std::uint64_t copy_check_read_bytes = 0;
  double copy_check_seconds = 0;
};

// The result of every front door.
struct FlattenResult {
  std::uint64_t rank = 0;  // this rank of comm (0 alone)
  ProbeResult probe;       // this rank's device: every source, which decided (before agreement)
  ProbeResult host_probe;  // the host memory this rank may stage through
  PlanInput input;         // what the planner was given, after agreement
  Plan plan;               // every candidate; nothing chosen when none fits
  ValueCheck value_check;  // when the chosen tier needed it (seconds, bytes hashed)
  Execution execution;     // outcome, error, and the group (buffer and views) when complete
  // The memory model's peak for the chosen steps on this rank's own account (what its device
  // held before the first step), to set beside execution.measured_peak_device_bytes.
  std::uint64_t predicted_peak_device_bytes = 0;
  DeviceBuffer master;        // this rank's fp32 master partition, when asked and complete
  double master_seconds = 0;  // building it (allocation and first touch included)
  std::string master_error;   // why there is no master although one was asked
  double seconds = 0;         // the whole call on this rank, agreement included
  // A group read from files: what this rank read; none for a group on the device.
  std::optional<ReadReport> read;

  // False: no tier or read plan fits (plan.reason says why with the numbers); nothing moved.
  bool feasible() const noexcept { return plan.chosen.has_value(); }
  // The buffer is complete and every parameter is a view into it.
  bool complete() const noexcept {
    return feasible() &&
           (execution.outcome == Outcome::kDone || execution.outcome == Outcome::kRecovered);
  }
  const FlatGroup& group() const noexcept { return execution.group; }
  // The chosen candidate (feasible()), else the first (the reason it does not fit).
  const Candidate& chosen() const;
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
FlattenResult flatten_param_group(std::span<TensorRef> params, Device& device, Communicator* comm,
                                  const FlattenOptions& options,
                                  const ReleaseOriginals& release_originals = {});

// --- The device tier alone -----------------------------------------------------------------------
// Flattening one parameter group on one device, without probe, plan or agreement: the building
// blocks of the `device` tier.

// Checks that params can form one group under options: same dtype as options.dtype, on
// device, numel equal to the shape's product, data non-null when numel > 0, no two parameters
// overlapping in memory. Throws InvalidArgument naming the parameter's index and shape.
void validate_group(std::span<const TensorRef> params, const Device& device,
                    const LayoutOptions& options);

// The segments that gather the flat buffer's byte range [lo_bytes, hi_bytes) from the
// parameters (dst offsets relative to lo_bytes). Gaps between them are padding.
std::vector<Segment> gather_segments(const Layout& layout, std::span<const TensorRef> params,
                                     std::uint64_t lo_bytes, std::uint64_t hi_bytes);

// The `device` tier alone, as a building block: no probe, no plan, no agreement. Most callers
// want flatten_param_group (above), which proves a way of flattening fits first. Builds the
// flat buffer of params on device (one allocation of layout.flat_bytes(), one gather with every
// padding gap zeroed) and returns it with the views.
// The originals are not modified and may be released by the caller afterwards. Throws
// InvalidArgument (bad group, checked before anything is allocated) or OutOfMemory.
FlatGroup flatten_group(Device& device, std::span<const TensorRef> params,
                        const LayoutOptions& options);

// The fp32 master copy of rank's partition of group.flat, padding included (zeros): the
// up-cast of every element. Returns a buffer of partition_numel * 4 bytes on the same device.
DeviceBuffer make_master_partition(Device& device, const FlatGroup& group, std::uint64_t rank);

}  // namespace zeroflat
