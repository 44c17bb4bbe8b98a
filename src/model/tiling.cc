#include "model/tiling.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <queue>
#include <set>
#include <string>
#include <utility>

#include "zeroflat/common.h"

namespace zeroflat::detail {

namespace {

// The cut points of each dimension (every box's start and end along it), sorted, distinct.
std::vector<std::vector<std::int64_t>> cuts_of(const std::vector<Box>& boxes,
                                              const std::vector<std::size_t>& live,
                                              std::size_t dims) {
  std::vector<std::vector<std::int64_t>> cuts(dims);
  for (std::size_t d = 0; d < dims; ++d) {
    cuts[d].reserve(2 * live.size());
    for (const std::size_t i : live) {
      cuts[d].push_back((*boxes[i].offsets)[d]);
      cuts[d].push_back((*boxes[i].offsets)[d] + (*boxes[i].sizes)[d]);
    }
    std::sort(cuts[d].begin(), cuts[d].end());
    cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
  }
  return cuts;
}

void record(TilingProblem& out, std::size_t x, std::size_t y) {
  out.overlap = true;
  out.a = std::min(x, y);
  out.b = std::max(x, y);
}

// The boxes on the grid their own cut points make, where that grid has few cells (at most
// 4 per box: DCP's chunks of a save are such a grid, one cell each): each box marks the cells it
// spans; a cell marked twice is an overlap. Time and memory in the cells. False where the grid
// has too many cells for this (boxes cut along several dimensions without lining up).
bool grid_overlap(const std::vector<Box>& boxes, const std::vector<std::size_t>& live,
                  std::size_t dims, TilingProblem& out) {
  const auto cuts = cuts_of(boxes, live, dims);
  const std::uint64_t limit = 4 * static_cast<std::uint64_t>(live.size()) + 1024;
  std::uint64_t cells = 1;
  for (const auto& c : cuts) {
    const std::uint64_t n = c.empty() ? 0 : c.size() - 1;
    if (n != 0 && cells > limit / n) return false;
    cells *= n;
  }
  if (cells > limit) return false;
  std::vector<std::uint32_t> owner(cells, 0);  // box index + 1, 0: free
  std::vector<std::size_t> lo(dims), hi(dims), at(dims);
  for (const std::size_t i : live) {
    for (std::size_t d = 0; d < dims; ++d) {
      const auto& c = cuts[d];
      lo[d] = static_cast<std::size_t>(
          std::lower_bound(c.begin(), c.end(), (*boxes[i].offsets)[d]) - c.begin());
      hi[d] = static_cast<std::size_t>(
          std::lower_bound(c.begin(), c.end(),
                           (*boxes[i].offsets)[d] + (*boxes[i].sizes)[d]) - c.begin());
      at[d] = lo[d];
    }
    for (;;) {  // every cell of the box, the last dimension fastest
      std::uint64_t cell = 0;
      for (std::size_t d = 0; d < dims; ++d) cell = cell * (cuts[d].size() - 1) + at[d];
      if (owner[cell] != 0) {
        record(out, owner[cell] - 1, i);
        return true;
      }
      owner[cell] = static_cast<std::uint32_t>(i + 1);
      std::size_t d = dims;
      while (d > 0 && ++at[d - 1] == hi[d - 1]) at[d - 1] = lo[d - 1], --d;
      if (d == 0) break;
    }
  }
  return true;
}

// Any other layout: a sweep along the dimension with the most distinct starts. The boxes that
// span the sweep's position must be apart in the other dimensions. With two dimensions those
// are intervals, kept in an ordered map, so each box costs a logarithm (n log n in all, a
// staircase of a million chunks included); with more, each box is compared with those that span
// the position, at most kPairs comparisons in all (out.too_many past that).
void sweep_overlap(const std::vector<Box>& boxes, const std::vector<std::size_t>& live,
                   TilingProblem& out) {
  if (live.size() < 2) return;
  const std::size_t dims = boxes[live[0]].offsets->size();
  std::size_t along = 0, most = 0;
  for (std::size_t d = 0; d < dims; ++d) {
    std::vector<std::int64_t> at;
    at.reserve(live.size());
    for (const std::size_t i : live) at.push_back((*boxes[i].offsets)[d]);
    std::sort(at.begin(), at.end());
    const auto n = static_cast<std::size_t>(std::unique(at.begin(), at.end()) - at.begin());
    if (n > most) most = n, along = d;
  }
  std::vector<std::size_t> order = live;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    return (*boxes[x].offsets)[along] < (*boxes[y].offsets)[along];
  });
  auto start = [&](std::size_t i, std::size_t d) { return (*boxes[i].offsets)[d]; };
  auto end = [&](std::size_t i, std::size_t d) {
    return (*boxes[i].offsets)[d] + (*boxes[i].sizes)[d];
  };
  // The boxes spanning the position, by where they end along the sweep (earliest first).
  using Ending = std::pair<std::int64_t, std::size_t>;
  std::priority_queue<Ending, std::vector<Ending>, std::greater<>> ending;
  if (dims == 2) {
    const std::size_t other = 1 - along;
    std::map<std::int64_t, std::size_t> spans;  // start along `other` -> box (apart: unique)
    for (const std::size_t i : order) {
      while (!ending.empty() && ending.top().first <= start(i, along)) {
        spans.erase(start(ending.top().second, other));
        ending.pop();
      }
      auto next = spans.lower_bound(start(i, other));
      if (next != spans.end() && next->first < end(i, other)) return record(out, next->second, i);
      if (next != spans.begin()) {
        const std::size_t before = std::prev(next)->second;
        if (end(before, other) > start(i, other)) return record(out, before, i);
      }
      spans.emplace(start(i, other), i);
      ending.emplace(end(i, along), i);
    }
    return;
  }
  constexpr std::uint64_t kPairs = std::uint64_t{1} << 26;
  std::uint64_t pairs = 0;
  std::vector<std::size_t> spanning;
  for (const std::size_t i : order) {
    spanning.erase(std::remove_if(spanning.begin(), spanning.end(),
                                  [&](std::size_t j) { return end(j, along) <= start(i, along); }),
                   spanning.end());
    for (const std::size_t j : spanning) {
      if (++pairs > kPairs) {
        out.too_many = true;
        return;
      }
      bool overlap = true;
      for (std::size_t d = 0; d < dims && overlap; ++d) {
        overlap = start(j, d) < end(i, d) && start(i, d) < end(j, d);
      }
      if (overlap) return record(out, j, i);
    }
    spanning.push_back(i);
  }
}

}  // namespace

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
  std::vector<std::size_t> live;  // the boxes that hold an element: only those can overlap
  live.reserve(boxes.size());
  for (std::size_t i = 0; i < boxes.size(); ++i) {
    bool empty = false;
    for (const std::int64_t s : *boxes[i].sizes) empty = empty || s == 0;
    if (!empty) live.push_back(i);
  }
  if (whole.empty()) {  // a 0-d tensor: one element, which two boxes would share
    if (live.size() > 1) out.overlap = true, out.a = live[0], out.b = live[1];
    return out;
  }
  if (!grid_overlap(boxes, live, whole.size(), out)) sweep_overlap(boxes, live, out);
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
    if (problem.too_many) {
      throw InvalidArgument(name + ": its " + std::to_string(end - first) +
                            " pieces form no grid and are too many to check for overlap (no "
                            "save places pieces so)");
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
