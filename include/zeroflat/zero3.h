// The ZeRO-3 layout: each parameter partitioned on its own over the ranks, and each rank's
// partitions laid out as DeepSpeed's Stage 3 optimizer holds them (DeepSpeedZeroOptimizer_Stage3:
// the flat buffer lp_param_buffer, cut into sub-groups).
//
//   partition  a parameter of n elements on W ranks: p = ceil(n / W) elements per rank (0 when
//              n = 0); rank r holds elements [r * p, min((r + 1) * p, n)) of the flattened
//              parameter, then zeros up to p: p * W - n elements of padding in all, at the
//              end of the last rank's slice (and, when they are more than p, as when n < W,
//              of the ranks before it): zero.Init's _partition_param and padding_size.
//   buffer     every optimizer group's parameters' partitions, groups in order, parameters in
//              group order, back to back, with no other padding: the same offsets on every rank
//              (only the padding's place differs).
//   sub-groups each group cut in order, as _create_fp16_sub_groups does: a group whose
//              partitions add up to at most sub_group_size elements is one sub-group; otherwise
//              parameters are added to the current sub-group until its partition elements reach
//              sub_group_size (>=) or the group ends. A group without parameters has none
//              (DeepSpeed drops it before cutting: _get_trainable_parameter_groups).
//   padding    groups_padding: per sub-group, each parameter's p * W - n on the last rank, 0 on
//              every other (DeepSpeed records it all on the last rank, wherever it lies).
//
// Every DeepSpeed release from 0.14 on partitions and cuts sub-groups this way; which parameters
// enter the groups is the release's rule (release.h: select_for_release, frozen ones never,
// zero-element ones not from 0.19.8) and the caller's to apply.
//
// Pure arithmetic on 64-bit integers: no I/O, no devices. Counts are elements of the buffer's
// dtype unless a name says bytes.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/layout.h"

namespace zeroflat {

// DeepSpeed's default zero_optimization.sub_group_size.
inline constexpr std::uint64_t kDefaultSubGroupSize = 1'000'000'000;

struct Zero3Options {
  // The ranks each parameter is partitioned over (DeepSpeed's partition world size): 1 to
  // kMaxDp.
  std::uint64_t world = 1;
  // zero_optimization.sub_group_size, in partition elements; any value (0: every parameter of a
  // non-empty group is a sub-group of its own).
  std::uint64_t sub_group_size = kDefaultSubGroupSize;
  DType dtype = DType::kBF16;
};

// Throws InvalidArgument when world is outside [1, kMaxDp] or the dtype unknown.
void validate(const Zero3Options& options);

// Elements of rank `rank`'s partition of a parameter of n elements on `world` ranks: p =
// ceil(n / world). Never overflows. world >= 1.
constexpr std::uint64_t zero3_partition_numel(std::uint64_t n, std::uint64_t world) noexcept {
  return n / world + (n % world != 0 ? 1 : 0);
}

// How many of a rank's p partition elements hold data: min((rank + 1) * p, n) - rank * p,
// clamped at 0 (the rest is padding). Never overflows.
constexpr std::uint64_t zero3_data_numel(std::uint64_t n, std::uint64_t world,
                                         std::uint64_t rank) noexcept {
  const std::uint64_t p = zero3_partition_numel(n, world);
  if (p == 0 || rank > n / p) return 0;
  const std::uint64_t first = rank * p;  // <= n here: no overflow
  return n - first < p ? n - first : p;
}

// Where rank `rank`'s partition of each parameter (element counts `numels`, on `world` ranks)
// starts within the parameter: rank * p, or n when the rank holds none of its data (only
// padding, which is never read). world >= 1.
std::vector<std::uint64_t> zero3_partition_starts(std::span<const std::uint64_t> numels,
                                                  std::uint64_t world, std::uint64_t rank);

struct Zero3SubGroup {
  std::uint64_t group = 0;        // the optimizer group it is cut from
  std::uint64_t first_param = 0;  // flat parameter index (over all groups) of its first
  std::uint64_t num_params = 0;
  std::uint64_t offset = 0;  // first element in the rank buffer
  std::uint64_t numel = 0;   // its partitions' elements (fp16_partitioned_groups_flat_numel)
  bool operator==(const Zero3SubGroup&) const = default;
};

class Zero3Layout {
 public:
  // The layout of optimizer groups given as the element counts of their parameters, in order
  // (zero is allowed; a group may be empty). Parameters are numbered flat over the groups.
  // Throws InvalidArgument for bad options, or when the parameters' elements, or the buffer's
  // size in elements or in bytes, overflow 64 bits.
  static Zero3Layout compute(std::span<const std::vector<std::uint64_t>> groups,
                             const Zero3Options& options);

  const Zero3Options& options() const noexcept { return options_; }
  std::uint64_t num_groups() const noexcept { return group_first_.size(); }
  std::uint64_t num_params() const noexcept { return numels_.size(); }
  // Per flat parameter index:
  const std::vector<std::uint64_t>& numels() const noexcept { return numels_; }
  const std::vector<std::uint64_t>& groups() const noexcept { return group_of_; }  // its group
  const std::vector<std::uint64_t>& partition_numels() const noexcept { return partition_; }
  const std::vector<std::uint64_t>& offsets() const noexcept { return offsets_; }  // in the buffer
  // p * W - n: the parameter's padding over all ranks (DeepSpeed's padding_size()).
  std::uint64_t padding(std::uint64_t param) const noexcept;

  std::uint64_t numel() const noexcept { return numel_; }  // every parameter's elements
  std::uint64_t element_size() const noexcept { return zeroflat::element_size(options_.dtype); }
  std::uint64_t buffer_numel() const noexcept { return buffer_numel_; }  // the same on every rank
  std::uint64_t buffer_bytes() const noexcept { return buffer_numel_ * element_size(); }
  const std::vector<Zero3SubGroup>& sub_groups() const noexcept { return sub_groups_; }

  // groups_padding of rank `rank` (< world): per sub-group, per parameter in it, its padding on
  // that rank. Throws InvalidArgument for a rank outside the world.
  std::vector<std::vector<std::uint64_t>> groups_padding(std::uint64_t rank) const;
  // Elements of the rank's buffer that hold data (the rest is the last rank's padding).
  std::uint64_t data_numel(std::uint64_t rank) const;

  // The rank buffer as a one-rank flat layout (dp 1, no alignment, the partitions as its
  // parameters, in order): the layout a rank's step list fills and re-points into, the same on
  // every rank.
  Layout buffer_layout() const;

  // `zeroflat layout --stage 3 --json`'s document (docs/cli.md): the options, every parameter
  // (group, numel, partition_numel, padding, offset), the buffer, the sub-groups, and each
  // rank's groups_padding and data elements (or only_rank's). A document of all ranks lists
  // world x num_params paddings: more than kMaxJsonEntries is InvalidArgument, before anything
  // is written.
  void write_json(std::ostream& out, std::optional<std::uint64_t> only_rank = std::nullopt) const;

 private:
  Zero3Options options_;
  std::vector<std::uint64_t> numels_;
  std::vector<std::uint64_t> group_of_;
  std::vector<std::uint64_t> group_first_;  // flat index of each group's first parameter
  std::vector<std::uint64_t> partition_;
  std::vector<std::uint64_t> offsets_;
  std::uint64_t numel_ = 0;
  std::uint64_t buffer_numel_ = 0;
  std::vector<Zero3SubGroup> sub_groups_;
};

// The rank buffer of one group whose parameters have these element counts, from the options a
// flat layout takes (the loader's LoadOptions::layout: dp = the world, dtype): the partitions back
// to back (Zero3Layout::buffer_layout), the same on every rank. alignment_factor is ignored
// (ZeRO-3 pads each parameter to the world, never the group). Throws InvalidArgument for
// round-robin or a parameter alignment, which no Stage 3 buffer has, and as compute() does.
Layout zero3_buffer_layout(std::span<const std::uint64_t> numels, const LayoutOptions& options);

}  // namespace zeroflat
