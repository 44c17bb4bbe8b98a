// Boxes that must tile a tensor: a name's pieces in a folder saved in pieces (each rank's part,
// placed by DCP_SHARDING_INFO) and a DCP index's chunks of a tensor. One check for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/tensor.h"

namespace zeroflat::detail {

// Elements [offsets, offsets + sizes) of a tensor, along each of its dimensions.
struct Box {
  const Shape* offsets = nullptr;
  const Shape* sizes = nullptr;
};

// What keeps boxes from tiling a tensor: none when ok().
struct TilingProblem {
  bool overlap = false;       // boxes a and b (indices into the boxes given) share elements
  std::size_t a = 0, b = 0;
  std::uint64_t covered = 0;  // elements the boxes hold together
  std::uint64_t total = 0;    // elements of the whole (saturated at 2^64 - 1)
  bool ok() const { return !overlap && covered == total; }
};

// Whether `boxes` (each of whole.size() dimensions, offsets and sizes in [0, 2^62), none
// reaching past `whole`, checked by the caller) overlap and, where `cover`, hold each element of
// `whole` once (else `covered` is set to `total`: only overlaps count). k boxes cost k log k when
// they are cut along one dimension, as FSDP2's Shard(d) cuts them: sorted by their offset along
// the dimension with the most distinct offsets, only boxes that start before one ends along it
// are compared with it.
TilingProblem tiling_problem(const std::vector<Box>& boxes, const Shape& whole, bool cover);

// Every name's pieces in an index opened with pieces (tensors sorted, empty pieces dropped): one
// dtype and rank, no two overlapping, and together exactly the whole, whose shape each piece is
// given (whole_shape). Throws InvalidArgument naming the tensor and its pieces' files (`files`,
// the index's).
void check_piece_tiling(std::vector<CheckpointTensor>& tensors,
                        const std::vector<std::string>& files);

}  // namespace zeroflat::detail
