// ZeRO-3 layout arithmetic: per-parameter partitions, the rank buffer and its sub-groups
// (layout.h).
#include "zeroflat/layout.h"

#include <string>

#include "common/saturate.h"
#include "zeroflat/common.h"

namespace zeroflat {

using detail::checked_add;
using detail::checked_mul;

void validate(const Zero3Options& options) {
  if (options.world == 0 || options.world > kMaxDp) {
    throw InvalidArgument("world = " + std::to_string(options.world) +
                          ": the ranks a parameter is partitioned over must be 1 to " +
                          std::to_string(kMaxDp));
  }
  if (zeroflat::element_size(options.dtype) == 0) throw InvalidArgument("unknown dtype");
}

Zero3Layout Zero3Layout::compute(std::span<const std::vector<std::uint64_t>> groups,
                                 const Zero3Options& options) {
  validate(options);
  Zero3Layout l;
  l.options_ = options;
  const std::uint64_t w = options.world;
  for (std::uint64_t g = 0; g < groups.size(); ++g) {
    l.group_first_.push_back(l.numels_.size());
    // The group's partition elements, which decide whether it is cut at all.
    std::uint64_t group_numel = 0;
    const std::uint64_t first = l.numels_.size();
    for (std::uint64_t n : groups[g]) {
      const std::uint64_t p = zero3_partition_numel(n, w);
      l.numel_ = checked_add(l.numel_, n, "sum of parameter sizes");
      l.numels_.push_back(n);
      l.group_of_.push_back(g);
      l.partition_.push_back(p);
      l.offsets_.push_back(l.buffer_numel_);
      l.buffer_numel_ = checked_add(l.buffer_numel_, p, "the rank buffer's elements");
      group_numel += p;  // bounded by buffer_numel_, which did not overflow
    }
    // A group without parameters has no sub-group: DeepSpeed leaves it out of the optimizer's
    // groups before cutting them (_get_trainable_parameter_groups).
    const std::uint64_t last = l.numels_.size();
    if (first == last) continue;
    // _create_fp16_sub_groups: the whole group when it holds at most sub_group_size partition
    // elements; else cut after the parameter whose partition brings the running count to
    // sub_group_size or more, and after the group's last parameter.
    if (options.sub_group_size >= group_numel) {
      l.sub_groups_.push_back(
          Zero3SubGroup{g, first, last - first, l.offsets_[first], group_numel});
      continue;
    }
    Zero3SubGroup cur{g, first, 0, l.offsets_[first], 0};
    for (std::uint64_t i = first; i < last; ++i) {
      ++cur.num_params;
      cur.numel += l.partition_[i];
      if (cur.numel >= options.sub_group_size || i + 1 == last) {
        l.sub_groups_.push_back(cur);
        cur = Zero3SubGroup{g, i + 1, 0, cur.offset + cur.numel, 0};
      }
    }
  }
  (void)checked_mul(l.buffer_numel_, l.element_size(), "the rank buffer's bytes");
  return l;
}

std::uint64_t Zero3Layout::padding(std::uint64_t param) const noexcept {
  // p * W - n without forming p * W, which may not fit in 64 bits.
  const std::uint64_t rest = numels_[param] % options_.world;
  return rest == 0 ? 0 : options_.world - rest;
}

std::vector<std::vector<std::uint64_t>> Zero3Layout::groups_padding(std::uint64_t rank) const {
  if (rank >= options_.world) {
    throw InvalidArgument("rank " + std::to_string(rank) + " is outside [0, " +
                          std::to_string(options_.world) + ")");
  }
  const bool last = rank + 1 == options_.world;
  std::vector<std::vector<std::uint64_t>> out;
  out.reserve(sub_groups_.size());
  for (const Zero3SubGroup& s : sub_groups_) {
    std::vector<std::uint64_t>& v = out.emplace_back(s.num_params, 0);
    if (!last) continue;
    for (std::uint64_t k = 0; k < s.num_params; ++k) v[k] = padding(s.first_param + k);
  }
  return out;
}

std::uint64_t Zero3Layout::data_numel(std::uint64_t rank) const {
  if (rank >= options_.world) {
    throw InvalidArgument("rank " + std::to_string(rank) + " is outside [0, " +
                          std::to_string(options_.world) + ")");
  }
  std::uint64_t n = 0;
  for (std::uint64_t n_i : numels_) n += zero3_data_numel(n_i, options_.world, rank);
  return n;
}

Layout Zero3Layout::buffer_layout() const {
  LayoutOptions o;
  o.dp = 1;
  o.alignment_factor = 1;
  o.dtype = options_.dtype;
  return Layout::compute(partition_, o);
}

Layout zero3_buffer_layout(std::span<const std::uint64_t> numels, const LayoutOptions& options) {
  if (options.round_robin) {
    throw InvalidArgument(
        "round-robin order: ZeRO-3 keeps every parameter's partition in group "
        "order (round_robin_gradients is a ZeRO-1/2 option)");
  }
  if (options.param_align_bytes != 0) {
    throw InvalidArgument("a parameter alignment of " + std::to_string(options.param_align_bytes) +
                          " bytes: the Stage 3 buffer packs the partitions back to back");
  }
  const std::vector<std::vector<std::uint64_t>> group = {{numels.begin(), numels.end()}};
  return Zero3Layout::compute(group, Zero3Options{options.dp, kDefaultSubGroupSize, options.dtype})
      .buffer_layout();
}

std::vector<std::uint64_t> zero3_partition_starts(std::span<const std::uint64_t> numels,
                                                  std::uint64_t world, std::uint64_t rank) {
  std::vector<std::uint64_t> out;
  out.reserve(numels.size());
  for (std::uint64_t n : numels) {
    out.push_back(zero3_data_numel(n, world, rank) == 0 ? n
                                                         : rank * zero3_partition_numel(n, world));
  }
  return out;
}

}  // namespace zeroflat
