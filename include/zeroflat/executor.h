// The executor: runs a step list (the very list the planner simulated) on a device and a
// communicator, and keeps the parameters' data safe when anything fails.
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
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/flatten.h"
#include "zeroflat/plan.h"

namespace zeroflat {

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

// Where a step list's values come from: the group's bytes wherever they are now. The executor
// owns the buffers and the order of the steps; a source only fills bytes it is pointed at, and
// may be asked again for the same range when a step is re-run. Two kinds: the parameters' own
// storage on the device (Originals, below), and a checkpoint's files (loader.h).
class StepSource {
 public:
  virtual ~StepSource() = default;
  // Bytes of the group already on the device before the first step (the originals), which the
  // kReleaseOriginals step frees; 0 for values that are not on the device.
  virtual std::uint64_t resident_bytes() const = 0;
  // Before any step: the views the steps re-point fit this source (their data pointers are the
  // originals, or null when nothing of the group is on the device yet). Throws InvalidArgument.
  virtual void check(std::span<const TensorRef> views, const Layout& layout,
                     const Device& device) const = 0;
  // kGather and kRead: layout bytes [flat_offset, flat_offset + bytes) of the group into dst,
  // device memory of the executor's device, padding as zeros. stage: the step list's live host
  // staging buffer (stage_bytes of pinned host memory), or null; a source the host cannot copy
  // to the device directly goes through it. Throws Error naming what failed (a file, tensor and
  // byte range), OutOfMemory when it cannot allocate its own scratch.
  virtual void read(void* dst, std::uint64_t flat_offset, std::uint64_t bytes, void* stage,
                    std::uint64_t stage_bytes) = 0;
  // kReleaseOriginals: the originals' storage is freed. Must not throw.
  virtual void release() noexcept = 0;
};

// The parameters' own storage on the device as a step source: kGather copies their bytes in
// layout order (zeros in the padding), kReleaseOriginals calls release_originals. params (data
// = the originals) is copied; the storage it points at must stay valid until released.
class Originals final : public StepSource {
 public:
  Originals(const Layout& layout, std::span<const TensorRef> params, Device& device,
            ReleaseOriginals release_originals = {});
  std::uint64_t resident_bytes() const override { return bytes_; }
  // validate_group (flatten.h): dtype, device, shapes, no overlaps.
  void check(std::span<const TensorRef> views, const Layout& layout,
             const Device& device) const override;
  void read(void* dst, std::uint64_t flat_offset, std::uint64_t bytes, void* stage,
            std::uint64_t stage_bytes) override;
  void release() noexcept override;

 private:
  const Layout& layout_;
  std::vector<TensorRef> params_;
  Device& device_;
  ReleaseOriginals release_;
  std::uint64_t bytes_ = 0;
};

// Runs `steps` (a candidate's list from the plan: tier_steps or load_steps) that fill `layout`
// from `source` on `device`, and re-point `views` into the buffer they build.
// - slot: which slice [slot * S, (slot + 1) * S) of the layout is this rank's (its all-gather
//   contribution and the partition the list names); < the layout's dp.
// - views: one per parameter of the layout, with its numel; on entry their data is where the
//   values are now (source.check says what it accepts), on return the parameter's data
//   (original storage, or its view in the buffer, per the outcome); after a release a pointer is
//   null only if the outcome is kLost.
// - comm: the ranks that agree at every point of no return (null, or of size 1: this rank
//   alone); a kAllGather step needs it to be the layout's dp ranks with this rank at `slot`.
// - Throws InvalidArgument for views, a source or a step list that do not fit the layout, before
//   any step runs; every other failure is reported in the result, never thrown.
// Whether execute() with options.master builds the master partition as it reads (the list has
// one read of this rank's slot of the layout into partition master_slot of the flat buffer, on
// a device whose memory is the host's and keeps data): the master's bytes are then held from
// that step to the end, which the caller's prediction of the peak must add.
bool builds_master(const std::vector<Step>& steps, const Layout& layout, std::uint64_t slot,
                   std::uint64_t master_slot, const Device& device);

Execution execute(const std::vector<Step>& steps, const Layout& layout, std::uint64_t slot,
                  std::span<TensorRef> views, Device& device, Communicator* comm,
                  StepSource& source, const ExecuteOptions& options = {});

// The same for a group whose values are its parameters' own storage on the device: `params` are
// both the source (Originals) and the views.
Execution execute(const std::vector<Step>& steps, const Layout& layout, std::uint64_t slot,
                  std::span<TensorRef> params, Device& device, Communicator* comm,
                  const ReleaseOriginals& release_originals, const ExecuteOptions& options = {});

}  // namespace zeroflat
