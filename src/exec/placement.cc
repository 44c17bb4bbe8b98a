// The placements of the one pipeline (pipeline.h): what each rank holds at the end.
#include "exec/pipeline.h"
#include "zeroflat/error.h"
#include "zeroflat/zero3.h"

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

std::vector<std::uint64_t> PartitionsPlacement::starts(std::span<const std::uint64_t> numels,
                                                       std::uint64_t world,
                                                       std::uint64_t rank) const {
  return zero3_partition_starts(numels, world, rank);
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

}  // namespace zeroflat::detail
