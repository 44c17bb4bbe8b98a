#include "model/tiling.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>

#include "zeroflat/error.h"
#include "zeroflat/size.h"

namespace zeroflat::detail {

TilingProblem tiling_problem(const std::vector<Box>& boxes, const Shape& whole, bool cover) {
  TilingProblem out;
  // Counts below 2^62 each: the whole's volume saturates rather than wraps.
  std::uint64_t total = 1;
  for (const std::int64_t d : whole) {
    const auto u = static_cast<std::uint64_t>(d);
    total = (u != 0 && total > (std::uint64_t{1} << 62) / u) ? ~std::uint64_t{0} : total * u;
  }
  std::uint64_t covered = 0;
  for (const Box& b : boxes) {
    std::uint64_t n = 1;
    for (const std::int64_t s : *b.sizes) {
      const auto u = static_cast<std::uint64_t>(s);
      n = (u != 0 && n > (std::uint64_t{1} << 62) / u) ? ~std::uint64_t{0} : n * u;
    }
    covered = covered > ~std::uint64_t{0} - n ? ~std::uint64_t{0} : covered + n;
  }
  out.total = total;
  out.covered = cover ? covered : total;
  std::size_t along = 0, most = 0;
  for (std::size_t d = 0; d < whole.size(); ++d) {
    std::set<std::int64_t> at;
    for (const Box& b : boxes) at.insert((*b.offsets)[d]);
    if (at.size() > most) most = at.size(), along = d;
  }
  std::vector<std::size_t> order(boxes.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (!whole.empty()) {
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
      return (*boxes[x].offsets)[along] < (*boxes[y].offsets)[along];
    });
  }
  for (std::size_t oi = 0; oi < order.size(); ++oi) {
    const Box& t = boxes[order[oi]];
    for (std::size_t oj = oi + 1; oj < order.size(); ++oj) {
      const Box& u = boxes[order[oj]];
      if (!whole.empty() && (*u.offsets)[along] >= (*t.offsets)[along] + (*t.sizes)[along]) {
        break;
      }
      bool overlap = true;
      for (std::size_t d = 0; d < whole.size() && overlap; ++d) {
        overlap = (*u.offsets)[d] < (*t.offsets)[d] + (*t.sizes)[d] &&
                  (*t.offsets)[d] < (*u.offsets)[d] + (*u.sizes)[d];
      }
      if (overlap) {
        out.overlap = true;
        out.a = std::min(order[oi], order[oj]);
        out.b = std::max(order[oi], order[oj]);
        return out;
      }
    }
  }
  return out;
}

void check_piece_tiling(std::vector<CheckpointTensor>& tensors,
                        const std::vector<std::string>& files) {
  auto in = [&](const CheckpointTensor& t) {
    return " (" + printable(std::filesystem::path(files[t.file]).filename().string()) + ")";
  };
  for (std::size_t first = 0; first < tensors.size();) {
    std::size_t end = first + 1;
    while (end < tensors.size() && tensors[end].name == tensors[first].name) ++end;
    const CheckpointTensor& a = tensors[first];
    const std::string name = "tensor '" + printable(a.name) + "'";
    Shape whole(a.shape.size(), 0);
    for (std::size_t i = first; i < end; ++i) {
      const CheckpointTensor& t = tensors[i];
      if (t.dtype != a.dtype || t.shape.size() != a.shape.size()) {
        throw InvalidArgument(name + ": its pieces disagree: " + a.dtype + " " +
                              shape_to_string(a.shape) + " at saved_offsets " +
                              shape_to_string(a.piece_offsets) + in(a) + ", " + t.dtype + " " +
                              shape_to_string(t.shape) + " at saved_offsets " +
                              shape_to_string(t.piece_offsets) + in(t));
      }
      for (std::size_t d = 0; d < whole.size(); ++d) {
        whole[d] = std::max(whole[d], t.piece_offsets[d] + t.shape[d]);
      }
    }
    std::vector<Box> boxes;
    for (std::size_t i = first; i < end; ++i) {
      boxes.push_back(Box{&tensors[i].piece_offsets, &tensors[i].shape});
    }
    const TilingProblem problem = tiling_problem(boxes, whole, true);
    if (problem.overlap) {
      const CheckpointTensor& x = tensors[first + problem.a];
      const CheckpointTensor& y = tensors[first + problem.b];
      throw InvalidArgument(name + ": its pieces at saved_offsets " +
                            shape_to_string(x.piece_offsets) + in(x) + " and " +
                            shape_to_string(y.piece_offsets) + in(y) + " overlap");
    }
    if (!problem.ok()) {
      std::string held;
      std::set<std::uint32_t> shown;
      for (std::size_t i = first; i < end; ++i) {
        if (!shown.insert(tensors[i].file).second) continue;
        if (shown.size() > 4) {
          held += ", ...";
          break;
        }
        held += (held.empty() ? "" : ", ") +
                printable(std::filesystem::path(files[tensors[i].file]).filename().string());
      }
      throw InvalidArgument(name + ": its pieces (in " + held + ") hold " +
                            std::to_string(problem.covered) + " of the " +
                            std::to_string(problem.total) + " elements of the whole " +
                            shape_to_string(whole) +
                            " they place it in (a rank's part of the folder missing?)");
    }
    for (std::size_t i = first; i < end; ++i) tensors[i].whole_shape = whole;
    first = end;
  }
}

}  // namespace zeroflat::detail
