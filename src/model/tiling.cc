#include "model/tiling.h"

#include <algorithm>
#include <set>

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

}  // namespace zeroflat::detail
