// Boxes that must tile a tensor: a name's pieces in a folder saved in pieces (each rank's part,
// placed by DCP_SHARDING_INFO) and a DCP index's chunks of a tensor. One check for both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

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
  bool too_many = false;      // no grid, more than 3 dimensions, too many pairs to compare
  bool ok() const { return !overlap && !too_many && covered == total; }
};

// Whether `boxes` (each of whole.size() dimensions, offsets and sizes in [0, 2^62), none
// reaching past `whole`, checked by the caller) overlap and, where `cover`, hold each element of
// `whole` once (else `covered` is set to `total`: only overlaps count). Boxes with no element
// overlap nothing. Time n log n for n boxes whatever their layout in one or two dimensions: on
// the grid their cut points make, where it has at most 4 cells per box (the chunks of any save,
// in any number of dimensions), each box marks its cells; else a sweep along one dimension with
// the boxes spanning it kept in an ordered map (two dimensions: a staircase of a million chunks
// included). With three or more dimensions and no such grid, at most 2^26 pairs are compared
// and `too_many` is set past them (no save makes such an index).
TilingProblem tiling_problem(const std::vector<Box>& boxes, const Shape& whole, bool cover);

// Every name's pieces in an index opened with pieces (tensors sorted, empty pieces dropped): one
// dtype and rank, no two overlapping, and together exactly the whole, whose shape each piece is
// given (whole_shape). Throws InvalidArgument naming the tensor and its pieces' files (`files`,
// the index's).
void check_piece_tiling(std::vector<CheckpointTensor>& tensors,
                        const std::vector<std::string>& files);

}  // namespace zeroflat::detail
