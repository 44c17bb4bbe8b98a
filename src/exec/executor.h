// The executor: runs a step list (the very list the planner simulated) on a device and a
// communicator, and keeps the parameters' data safe when anything fails: its rules (agreement,
// rollback, recovery) are written in zeroflat/engine.h, with Outcome and Execution. Private:
// callers reach it through the front doors (engine.h, loader.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/engine.h"
#include "zeroflat/layout.h"
#include "zeroflat/plan.h"

namespace zeroflat {

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
  // validate_group (engine.h): dtype, device, shapes, no overlaps.
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
