// The one pipeline behind both front doors (flatten_param_group in engine.h, load_flat_group in
// loader.h): check -> probe -> agree -> plan -> check values -> execute -> master, for a group
// whatever its values come from (its source) and wherever they must end (its placement).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "zeroflat/comm.h"
#include "zeroflat/device.h"
#include "zeroflat/engine.h"
#include "zeroflat/executor.h"

namespace zeroflat::detail {

// What each rank must hold when the pipeline returns. A new placement is a new step list for the
// same pipeline (the planner simulates it, the executor runs it), never a second pipeline.
enum class Placement : std::uint8_t {
  // ZeRO-1/2: every rank holds the whole flat buffer, the parameters are views into it, and the
  // optimizer keeps rank r's partition [r * S, (r + 1) * S) (the tiers, and the loader's read of
  // its own slice plus an all-gather).
  kFlatPartitioned,
  // ZeRO-3: each rank holds only its own partition of every parameter (zero3.h), the partitions
  // back to back in the group's order as the Stage 3 optimizer's buffer; the layout the steps run
  // on is that buffer's (Zero3Layout::buffer_layout, dp 1 on every rank) while the ranks still
  // agree over comm; the step list is the source's kLoadPartitions (no all-gather). Only from a
  // source: a group's own storage is whole parameters, not partitions.
  kPartitions,
};

// A source other than the parameters' own storage on the device (the checkpoint loader's files).
// The pipeline calls, on every rank, in this order: must_match() before agreeing; agree() once
// the ranks have agreed on the options and the group (collective: the ranks compare what their
// sources say, and every rank throws at once when they differ); read() through the executor's
// kRead steps; after() once the group is complete on every rank (collective: a check of the
// bytes the ranks read, throwing on every rank when they differ).
class GroupSource : public StepReader {
 public:
  // What every rank's source must say identically, as text (compared with the options).
  virtual std::string must_match() const = 0;
  // The staging ring a device the host cannot write reads through, in bytes (0: none).
  virtual std::uint64_t ring_bytes() const = 0;
  virtual void agree(Communicator* comm) = 0;
  virtual void after(const FlatGroup& group, Communicator* comm) = 0;
};

// Runs the pipeline for `params` on every rank of comm, with the rules of flatten_param_group
// (engine.h). With a source, params' data pointers are null (nothing of the group is on the
// device), the options' tier, check_values and release_originals do not apply, and the plan is
// the source's step list; options.local_error carries the caller's own checks of the source.
// With kPartitions, params are the whole parameters (compared over the ranks as such) and stay
// untouched; the result's group holds the partitions' views (1-D, partition numel each), and the
// master is the fp32 copy of the whole rank buffer.
FlattenResult run_pipeline(std::span<TensorRef> params, Device& device, Communicator* comm,
                           const FlattenOptions& options, const ReleaseOriginals& release_originals,
                           GroupSource* source, Placement placement = Placement::kFlatPartitioned);

}  // namespace zeroflat::detail
