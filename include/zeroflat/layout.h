// DeepSpeed's layouts of a parameter group: ZeRO-1/2's flat buffer (order, offsets, padding,
// partitions and each rank's bookkeeping, exactly as DeepSpeedZeroOptimizer lays it out),
// ZeRO-3's partitions and sub-groups (as the Stage 3 optimizer holds them), and the rules by
// release that say which parameters enter a group.
//
// Pure arithmetic on 64-bit integers: no I/O, no devices, no allocation beyond the result.
// All counts are in elements of the group's dtype unless a name says bytes.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/common.h"

namespace zeroflat {

// --- The ZeRO-1/2 flat layout --------------------------------------------------------------------
// The ZeRO-1/2 flat layout of one parameter group: order, offsets, padding, partitions and
// each rank's bookkeeping, exactly as DeepSpeed's DeepSpeedZeroOptimizer lays it out.

// The most ranks a group may be laid out for.
inline constexpr std::uint64_t kMaxDp = std::uint64_t{1} << 20;
// The most parameter entries (params in and not in each partition) one JSON document lists.
inline constexpr std::uint64_t kMaxJsonEntries = 100'000'000;

struct LayoutOptions {
  // Size of the data-parallel group that shares this parameter group: 1 to kMaxDp.
  std::uint64_t dp = 1;
  // DeepSpeed's nccl_start_alignment_factor: the flat buffer is padded to a multiple of
  // alignment_factor * dp elements. Must be >= 1.
  std::uint64_t alignment_factor = 2;
  // DeepSpeed's round_robin_gradients: parameter i goes to bucket i mod dp, and the flat order
  // is bucket 0's parameters, then bucket 1's, ...
  bool round_robin = false;
  DType dtype = DType::kBF16;
  // 0: parameters packed back to back (DeepSpeed's layout). Otherwise a power of two, at least
  // the element size: every parameter after the first starts at a multiple of this many bytes,
  // and the gap before it is zero padding.
  std::uint64_t param_align_bytes = 0;
};

// Throws InvalidArgument when an option is outside its domain (see LayoutOptions).
void validate(const LayoutOptions& options);

// One contiguous run of a parameter that lies inside a rank's partition.
struct Fragment {
  std::uint64_t param = 0;             // index in the input list
  std::uint64_t partition_offset = 0;  // first element, relative to the partition start
  std::uint64_t param_offset = 0;      // first element, relative to the parameter start
  std::uint64_t numel = 0;             // > 0 always
  bool operator==(const Fragment&) const = default;
};

// What one rank keeps for gradient and optimizer-state partitioning.
struct RankLayout {
  std::uint64_t rank = 0;
  std::uint64_t start = 0;  // [start, end) of the flat buffer is this rank's partition
  std::uint64_t end = 0;
  std::uint64_t padding = 0;  // elements of [start, end) at or after the end of the data
  std::vector<std::uint64_t> params_in_partition;      // input indices, in flat order
  std::vector<std::uint64_t> params_not_in_partition;  // input indices, in flat order
  std::uint64_t first_offset = 0;   // start - offset of the parameter straddling start, or 0
  std::vector<Fragment> fragments;  // in flat order, empty overlaps skipped
};

class Layout {
 public:
  // Computes the layout of a group whose parameters have these element counts, in group order
  // (zero is allowed). Throws InvalidArgument for bad options, or when a size overflows 64
  // bits (in elements or in bytes).
  static Layout compute(std::span<const std::uint64_t> numels, const LayoutOptions& options);

  const LayoutOptions& options() const noexcept { return options_; }
  std::uint64_t num_params() const noexcept { return numels_.size(); }
  const std::vector<std::uint64_t>& numels() const noexcept { return numels_; }
  // Flat order: order()[k] is the input index of the k-th parameter in the buffer.
  const std::vector<std::uint64_t>& order() const noexcept { return order_; }
  // offsets()[i] is the first element of input parameter i in the flat buffer.
  const std::vector<std::uint64_t>& offsets() const noexcept { return offsets_; }

  std::uint64_t element_size() const noexcept { return esize_; }
  std::uint64_t alignment() const noexcept { return alignment_; }  // alignment_factor * dp
  std::uint64_t numel() const noexcept { return numel_; }          // sum of numels
  std::uint64_t data_end() const noexcept { return data_end_; }    // end of the last param
  std::uint64_t flat_numel() const noexcept { return flat_numel_; }
  std::uint64_t padding() const noexcept { return flat_numel_ - numel_; }  // interior + trailing
  std::uint64_t flat_bytes() const noexcept { return flat_numel_ * esize_; }
  std::uint64_t partition_numel() const noexcept { return partition_numel_; }
  std::uint64_t partition_bytes() const noexcept { return partition_numel_ * esize_; }

  // The bookkeeping of one rank, rank < dp. O(num_params) with the not-in list; without it
  // (list_not_in_partition = false, the list left empty) O(log num_params + its parameters).
  RankLayout rank(std::uint64_t rank, bool list_not_in_partition = true) const;

  // Fragments of every parameter overlapping the element range [lo, hi) of the flat buffer,
  // in flat order, with partition_offset relative to lo. O(log num_params + result).
  std::vector<Fragment> fragments_in(std::uint64_t lo, std::uint64_t hi) const;

  // `zeroflat layout --json`'s document (see docs/cli.md), with every rank, on one line.
  std::string to_json() const;
  // The same document written rank by rank, so that memory stays O(num_params) however large
  // dp is; with only_rank, "ranks" holds that rank alone. Every rank's entry lists every
  // parameter (in or not in its partition), so a document of all ranks holds dp x num_params
  // entries: more than kMaxJsonEntries is InvalidArgument, before anything is written.
  void write_json(std::ostream& out, std::optional<std::uint64_t> only_rank = std::nullopt) const;

 private:
  LayoutOptions options_;
  std::vector<std::uint64_t> numels_;
  std::vector<std::uint64_t> order_;
  std::vector<std::uint64_t> offsets_;
  std::uint64_t esize_ = 0;
  std::uint64_t alignment_ = 0;
  std::uint64_t numel_ = 0;
  std::uint64_t data_end_ = 0;
  std::uint64_t flat_numel_ = 0;
  std::uint64_t partition_numel_ = 0;
};

// --- The ZeRO-3 layout ---------------------------------------------------------------------------
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
// enter the groups is the release's rule (below: select_for_release, frozen ones never,
// zero-element ones not from 0.19.8) and the caller's to apply.
//
// Pure arithmetic on 64-bit integers: no I/O, no devices. Counts are elements of the buffer's
// dtype unless a name says bytes.

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

// --- DeepSpeed's rules by release ----------------------------------------------------------------
// DeepSpeed's layout rules by release. The flat layout (above) is the same algorithm in every
// release from 0.14 on; what changed is which parameters a release puts into a group and part of
// its bookkeeping (docs/layout.md lists the changes):
//
//   all releases   frozen parameters (requires_grad False) are left out of the group
//   0.16           groups_padding per rank (the padding inside each rank's partition); before,
//                  the whole padding was recorded on the last rank and zero on the others
//   0.18.7         the memory check: a group is flattened on the accelerator when
//                  accelerator.available_memory() holds its flat buffer, else through the host;
//                  before, every group was copied to the host and flattened there
//   0.19.7         zero_optimization.parameter_alignment: parameter starts padded to 16 bytes
//   0.19.8         zero-element parameters are left out, like frozen ones (by ZeRO-1/2 and by the
//                  Stage 3 optimizer alike: is_optimized_parameter)
//
// ZeRO-3's partitions, its rank buffer and its sub-groups (above) are the same arithmetic in
// every release from 0.14 on; only which parameters enter its groups follows the rules above.
//
// A layout "for release V" takes the group as the model has it (frozen and zero-element
// parameters included), leaves out what V leaves out, and lays out the rest exactly as V does.
// Every caller (the CLI, the Python package, the DeepSpeed drop-in) asks these functions: no
// rule of a release is written down anywhere else.

// The releases the DeepSpeed drop-in is tested against (python/tests), oldest first.
std::vector<std::string> tested_deepspeed_releases();

struct ReleaseRules {
  std::string release;             // as asked: "0.18.6", "0.19.8+cu121"
  std::string rules;               // the release whose rules apply (release itself, or the
                                   // newest known one below it)
  bool tested = false;             // one of tested_deepspeed_releases()
  bool skips_zero_element = false;       // 0.19.8+
  bool has_parameter_alignment = false;  // 0.19.7+
  bool padding_on_last_rank = false;     // before 0.16
  // 0.18.7+: DeepSpeedZeroOptimizer compares a group's flat buffer (its numel rounded up to
  // 2 x dp, times the first parameter's element size) with accelerator.available_memory() right
  // after empty_cache(), and flattens on the accelerator when it fits; otherwise, and always
  // before 0.18.7, it copies every parameter of the group to the host (param.cpu_data), leaves a
  // 1-element placeholder on the device, and flattens on the host.
  bool checks_accelerator_memory = false;
};

// The rules of a release given as "MAJOR.MINOR.PATCH" (a local suffix such as "+cu121" or
// ".dev0" is ignored), or "latest" for the newest tested release. Throws InvalidArgument for
// text that is not a version, or a release older than 0.14.
ReleaseRules deepspeed_rules(std::string_view version);

// The rules that apply when the caller names no release: those of the installed DeepSpeed
// (its version, as deepspeed_rules takes it), or, when there is none (empty), "latest".
ReleaseRules default_deepspeed_rules(std::string_view installed_version = {});

// Why a parameter is not in the release's group.
enum class LeftOut : std::uint8_t { kFrozen, kZeroElements };
std::string_view left_out_name(LeftOut why) noexcept;  // "frozen", "zero elements"

// Which of a group's parameters a release puts into its flat buffer.
struct ReleaseSelection {
  std::vector<std::uint64_t> kept;  // input indices of the parameters in the group, in order
  std::vector<std::pair<std::uint64_t, LeftOut>> left_out;  // input index, why
};

// The selection `rules` make from a group given as numels and frozen flags (empty: none frozen)
// per input parameter, in the model's order: frozen parameters, and zero-element ones where the
// release skips them, are left out. Throws InvalidArgument when frozen has another length.
ReleaseSelection select_for_release(std::span<const std::uint64_t> numels,
                                    const std::vector<bool>& frozen, const ReleaseRules& rules);

// Throws InvalidArgument (naming the option and the release) unless `options` are ones the
// release has: alignment factor 2 (DeepSpeed pads every group to 2 x dp elements) and
// parameter alignment 0, or 16 where the release has parameter_alignment. dp, round-robin and
// dtype are any.
void check_release_options(const LayoutOptions& options, const ReleaseRules& rules);

// A group as a release lays it out.
struct ReleaseLayout {
  ReleaseRules rules;
  std::vector<std::uint64_t> kept;  // input indices of the parameters in the group, in order
  std::vector<std::pair<std::uint64_t, LeftOut>> left_out;  // input index, why
  std::uint64_t num_inputs = 0;
  Layout layout;  // over the kept parameters: its index k is input index kept[k]

  // The release's groups_padding for a rank: the padding inside the rank's partition, or
  // before 0.16 all of it on the last rank.
  std::uint64_t rank_padding(std::uint64_t rank) const;
  // `zeroflat layout --deepspeed V --json`: the layout document of layout.h in input indices
  // (offsets of left-out parameters are null), each rank's padding as the release records it,
  // with "deepspeed" (release, rules) and "left_out" ([{param, why}]). One rank, or all (then
  // bounded as Layout::write_json is).
  void write_json(std::ostream& out, std::optional<std::uint64_t> only_rank = std::nullopt) const;
};

// Lays out a group as `rules` says: select_for_release, then the layout of what it keeps with
// `options`, which check_release_options must accept. Throws InvalidArgument as those do.
ReleaseLayout layout_for_release(std::span<const std::uint64_t> numels,
                                 const std::vector<bool>& frozen, const LayoutOptions& options,
                                 const ReleaseRules& rules);

}  // namespace zeroflat
