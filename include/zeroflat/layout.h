// The ZeRO-1/2 flat layout of one parameter group: order, offsets, padding, partitions and
// each rank's bookkeeping, exactly as DeepSpeed's DeepSpeedZeroOptimizer lays it out.
//
// Pure arithmetic on 64-bit integers: no I/O, no devices, no allocation beyond the result.
// All counts are in elements of the group's dtype unless a name says bytes.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/common.h"

namespace zeroflat {

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

}  // namespace zeroflat
