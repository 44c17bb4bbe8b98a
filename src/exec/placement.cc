// The placements of the one pipeline (pipeline.h): what each rank holds at the end.
#include "exec/pipeline.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"

namespace zeroflat::detail {

Layout FlatPlacement::layout(std::span<const std::uint64_t> numels,
                             const FlattenOptions& options) const {
  if (options.release) check_release_options(options.layout, *options.release);
  return Layout::compute(numels, options.layout);
}

Layout SlicePlacement::layout(std::span<const std::uint64_t> numels,
                              const FlattenOptions& options) const {
  return FlatPlacement().layout(numels, options);
}

Layout PartitionsPlacement::layout(std::span<const std::uint64_t> numels,
                                   const FlattenOptions& options) const {
  return zero3_buffer_layout(numels, options.layout);
}

SourceRuns PartitionsPlacement::runs(std::span<const std::uint64_t> numels, std::uint64_t world,
                                     std::uint64_t rank) const {
  SourceRuns out(numels.size());
  const std::vector<std::uint64_t> starts = zero3_partition_starts(numels, world, rank);
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const std::uint64_t data = zero3_data_numel(numels[i], world, rank);
    if (data > 0) out[i].push_back(ElementRun{starts[i], data});
  }
  return out;
}

std::span<TensorRef> PartitionsPlacement::views(std::span<TensorRef> params, const Layout& layout,
                                                Device& device) {
  partitions_.clear();
  for (std::uint64_t p : layout.numels()) {
    partitions_.push_back(TensorRef{nullptr, p, Shape{static_cast<std::int64_t>(p)},
                                    layout.options().dtype, &device});
  }
  (void)params;  // whole parameters: they stay as they are
  return partitions_;
}

ShardsPlacement::ShardsPlacement(ShardSpec spec, std::vector<Shape> shapes)
    : spec_(std::move(spec)), shapes_(std::move(shapes)) {}

LocalShard ShardsPlacement::shard(std::size_t p, std::uint64_t rank) const {
  if (p >= shapes_.size() || p >= spec_.placements.size() || rank >= spec_.coords.size()) {
    throw InvalidArgument("parameter " + std::to_string(p) + ", rank " + std::to_string(rank) +
                          ": outside the shards' specification");
  }
  return local_shard(shapes_[p], spec_.mesh, spec_.placements[p], spec_.coords[rank]);
}

Layout ShardsPlacement::layout(std::span<const std::uint64_t> numels,
                               const FlattenOptions& options) const {
  validate(spec_, options.layout.dp, numels.size());
  if (shapes_.size() != numels.size()) {
    throw InvalidArgument(std::to_string(shapes_.size()) + " shapes for " +
                          std::to_string(numels.size()) + " parameter(s)");
  }
  std::vector<std::uint64_t> padded;
  padded.reserve(numels.size());
  for (std::size_t p = 0; p < numels.size(); ++p) {
    if (shape_numel(shapes_[p]) != numels[p]) {
      throw InvalidArgument("parameter " + std::to_string(p) + " has " +
                            std::to_string(numels[p]) + " elements, its shape " +
                            shape_to_string(shapes_[p]) + " says otherwise");
    }
    padded.push_back(shard(p, 0).padded_numel);
  }
  LayoutOptions one = options.layout;
  one.dp = 1;
  return zero3_buffer_layout(padded, one);
}

SourceRuns ShardsPlacement::runs(std::span<const std::uint64_t> numels, std::uint64_t,
                                 std::uint64_t rank) const {
  SourceRuns out(numels.size());
  for (std::size_t p = 0; p < numels.size(); ++p) out[p] = shard(p, rank).runs;
  return out;
}

std::span<TensorRef> ShardsPlacement::views(std::span<TensorRef>, const Layout& layout,
                                            Device& device) {
  shards_.clear();
  for (std::uint64_t n : layout.numels()) {
    shards_.push_back(TensorRef{nullptr, n, Shape{static_cast<std::int64_t>(n)},
                                layout.options().dtype, &device});
  }
  return shards_;
}

}  // namespace zeroflat::detail
