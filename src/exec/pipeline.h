// The one pipeline behind every front door (flatten_param_group in engine.h, load in loader.h): check -> probe -> agree -> plan -> check -> execute -> after ->
// master, for a group whatever its values come from (its Source) and wherever they must end (its
// Placement). Both are values the pipeline asks; it never branches on which they are.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "exec/executor.h"
#include "zeroflat/comm.h"
#include "zeroflat/device.h"
#include "zeroflat/dtensor.h"
#include "zeroflat/engine.h"

namespace zeroflat::detail {

// What each rank must hold when the pipeline returns.
// - layout(): the layout this rank's steps fill (for ZeRO-1/2 the group's flat layout, the same
//   on every rank; for ZeRO-3 the rank's own buffer of partitions); slot(): which slice of it is
//   this rank's (its all-gather contribution, its master partition).
// - starts(): where each parameter's layout elements start within the parameter (0 for whole
//   parameters), for sources that read elements by position.
// - tiers() / read_plans(): the step lists that build it from the originals on the device, and
//   from files (plan.h).
// - views(): the tensors the steps re-point, one per parameter of the layout.
// Where a placement's layout entries take their elements: per parameter, runs of its source
// elements (the parameter's tensors concatenated, row-major) that fill its entry from the
// entry's first element on, in order; the entry's elements past them are padding, never read.
// Empty: every parameter whole, in order (an entry holds the parameter).
using SourceRuns = std::vector<std::vector<ElementRun>>;

class Placement {
 public:
  virtual ~Placement() = default;
  // What the ranks compare ("flat buffer", "ZeRO-3 partitions").
  virtual std::string name() const = 0;
  // Throws InvalidArgument for options this placement cannot take (naming the option).
  virtual Layout layout(std::span<const std::uint64_t> numels,
                        const FlattenOptions& options) const = 0;
  virtual std::uint64_t slot(std::uint64_t rank) const = 0;
  // Which partition of the buffer the steps leave is this rank's (its master partition): the
  // buffer holds the whole layout (ZeRO-1/2: slot), the rank's own buffer (ZeRO-3: 0), or only
  // its slice (0).
  virtual std::uint64_t buffer_slot(std::uint64_t rank) const = 0;
  // Where rank `rank` of `world`'s layout entries take their elements (see SourceRuns).
  virtual SourceRuns runs(std::span<const std::uint64_t> numels, std::uint64_t world,
                          std::uint64_t rank) const = 0;
  virtual std::span<const Tier> tiers() const = 0;
  virtual std::span<const Tier> read_plans() const = 0;
  // params: the group as the caller passed it (whole parameters, data as the source has it).
  // Returns params itself when the steps re-point the parameters, or tensors of its own (kept
  // by this object) when they re-point something else (ZeRO-3's partitions).
  virtual std::span<TensorRef> views(std::span<TensorRef> params, const Layout& layout,
                                     Device& device) = 0;
};

// ZeRO-1/2: every rank holds the whole flat buffer, the parameters are views into it, and the
// optimizer keeps rank r's partition [r * S, (r + 1) * S).
class FlatPlacement final : public Placement {
 public:
  std::string name() const override { return "flat buffer"; }
  Layout layout(std::span<const std::uint64_t> numels,
                const FlattenOptions& options) const override;
  std::uint64_t slot(std::uint64_t rank) const override { return rank; }
  std::uint64_t buffer_slot(std::uint64_t rank) const override { return rank; }
  SourceRuns runs(std::span<const std::uint64_t>, std::uint64_t, std::uint64_t) const override {
    return {};
  }
  std::span<const Tier> tiers() const override { return kAllTiers; }
  std::span<const Tier> read_plans() const override { return kReadPlans; }
  std::span<TensorRef> views(std::span<TensorRef> params, const Layout&, Device&) override {
    return params;
  }
};

// A rank's slice of ZeRO-1/2's flat layout alone: what the optimizer keeps of a group (its fp32
// master partition, its states), each rank reading [r * S, (r + 1) * S) and keeping only that,
// no all-gather (read plan kLoadSlice). The buffer holds the slice; the parameters, whole, are
// not re-pointed (a slice holds pieces of them).
class SlicePlacement final : public Placement {
 public:
  std::string name() const override { return "flat slice"; }
  Layout layout(std::span<const std::uint64_t> numels,
                const FlattenOptions& options) const override;
  std::uint64_t slot(std::uint64_t rank) const override { return rank; }
  std::uint64_t buffer_slot(std::uint64_t) const override { return 0; }
  SourceRuns runs(std::span<const std::uint64_t>, std::uint64_t, std::uint64_t) const override {
    return {};
  }
  std::span<const Tier> tiers() const override { return {}; }
  std::span<const Tier> read_plans() const override { return kSliceReadPlans; }
  std::span<TensorRef> views(std::span<TensorRef> params, const Layout&, Device&) override {
    return params;
  }
};

// ZeRO-3: each rank holds only its own partition of every parameter (layout.h), the partitions
// back to back in the group's order as the Stage 3 optimizer's buffer; its layout is that buffer
// (Zero3Layout::buffer_layout: dp 1, the same on every rank), its one read plan kLoadPartitions
// (no all-gather). The parameters stay whole and untouched; the views are the partitions (1-D).
// No tier builds it from the originals: a group's own storage holds whole parameters.
class PartitionsPlacement final : public Placement {
 public:
  std::string name() const override { return "ZeRO-3 partitions"; }
  Layout layout(std::span<const std::uint64_t> numels,
                const FlattenOptions& options) const override;
  std::uint64_t slot(std::uint64_t) const override { return 0; }
  std::uint64_t buffer_slot(std::uint64_t) const override { return 0; }
  SourceRuns runs(std::span<const std::uint64_t> numels, std::uint64_t world,
                  std::uint64_t rank) const override;
  std::span<const Tier> tiers() const override { return {}; }
  std::span<const Tier> read_plans() const override { return kPartitionReadPlans; }
  std::span<TensorRef> views(std::span<TensorRef> params, const Layout& layout,
                             Device& device) override;

 private:
  std::vector<TensorRef> partitions_;
};

// DTensor shards (dtensor.h): each rank holds its local shard of every parameter, padded to
// the shard's size on every rank (LocalShard::padded_numel), back to back in the group's order
// (a dp-1 layout, the same on every rank); its one read plan kLoadPartitions (each rank reads
// only its shards' bytes, no all-gather). The parameters stay whole and untouched; the views are
// the padded shards (1-D).
class ShardsPlacement final : public Placement {
 public:
  // spec: validated against the parameters' count when the layout is asked for.
  explicit ShardsPlacement(ShardSpec spec, std::vector<Shape> shapes);
  std::string name() const override { return "DTensor shards"; }
  Layout layout(std::span<const std::uint64_t> numels,
                const FlattenOptions& options) const override;
  std::uint64_t slot(std::uint64_t) const override { return 0; }
  std::uint64_t buffer_slot(std::uint64_t) const override { return 0; }
  SourceRuns runs(std::span<const std::uint64_t> numels, std::uint64_t world,
                  std::uint64_t rank) const override;
  std::span<const Tier> tiers() const override { return {}; }
  std::span<const Tier> read_plans() const override { return kPartitionReadPlans; }
  std::span<TensorRef> views(std::span<TensorRef> params, const Layout& layout,
                             Device& device) override;
  // Rank `rank`'s shard of parameter p.
  LocalShard shard(std::size_t p, std::uint64_t rank) const;

 private:
  ShardSpec spec_;
  std::vector<Shape> shapes_;
  std::vector<TensorRef> shards_;
};

// Where the group's values are now, as the pipeline asks it: what comes before and after the
// steps, and what the steps read from (steps()). The pipeline calls, on every rank, in this
// order: prepare() (this rank's own checks, kept until the ranks meet); describe() into the
// options the ranks compare; agree() once they agree on those (collective); plan(); before()
// once a candidate is chosen (collective); the executor's calls on steps(); after() once the
// buffer is complete on every rank (collective); report().
class Source {
 public:
  virtual ~Source() = default;
  // Bytes of the group already on the device (the originals), which the probe counts in use.
  virtual std::uint64_t resident_bytes() const = 0;
  // What the executor reads from and releases, once prepare() has succeeded.
  virtual StepSource& steps() = 0;
  // This rank's own checks of the group it will fill for `placement` (laid out as `layout`, rank
  // `rank` of `world`): throws InvalidArgument (the pipeline carries it to every rank).
  virtual void prepare(std::span<const TensorRef> params, const Layout& layout,
                       const Placement& placement, std::uint64_t world, std::uint64_t rank,
                       Device& device) = 0;
  // What every rank's source must say identically, as "key value" items.
  virtual std::vector<std::string> describe() const = 0;
  // Collective: the ranks compare what their sources hold (a checkpoint's headers); every rank
  // throws at once when they differ.
  virtual void agree(Communicator* comm) = 0;
  // The candidates for `placement` on the planner's input (input.forced: the tier or read plan
  // the caller forces): tiers from the originals, read plans from files. Throws
  // InvalidArgument for a forced tier that is not among them, or a placement this source cannot
  // fill.
  virtual Plan plan(const PlanInput& input, const Placement& placement) const = 0;
  // Collective, once the ranks chose `chosen`: any check before the steps run (the originals'
  // values check, when slices change hands). Throws on every rank when it fails.
  virtual void before(const Candidate& chosen, std::span<const TensorRef> params,
                      const Layout& layout, Device& device, Communicator* comm,
                      FlattenResult& result) = 0;
  // Collective, once the group is complete on every rank: a check of what the ranks read.
  // Throws Error on every rank when it fails.
  virtual void after(const FlatGroup& group, Communicator* comm) = 0;
  // What this source adds to the result (a file source's read report).
  virtual void report(FlattenResult& result) const = 0;
};

// Runs the pipeline for `params` (the group's shapes and dtype, in order; their data as the
// source has it) on every rank of comm, with the rules of flatten_param_group (engine.h) and
// options.local_error carrying the caller's own checks. The result's group holds the
// placement's views and buffer; its master is this rank's slot's fp32 partition.
FlattenResult run_pipeline(std::span<TensorRef> params, Device& device, Communicator* comm,
                           const FlattenOptions& options, Source& source, Placement& placement);

// The ranks of this rank's node sharing the group: options' probe context, else runtime_env(),
// else the group's size (one host).
unsigned local_ranks(const FlattenOptions& options, std::uint64_t ranks);

}  // namespace zeroflat::detail
