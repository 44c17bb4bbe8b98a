// Layout arithmetic: DeepSpeed's ZeRO-1/2 flat buffer (rules in docs/layout.md).
#include "zeroflat/layout.h"

#include <algorithm>
#include <string>

#include "common/saturate.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

using detail::checked_add;
using detail::checked_mul;

// Smallest multiple of m that is >= x (m >= 1).
std::uint64_t round_up(std::uint64_t x, std::uint64_t m, const char* what) {
  std::uint64_t r = x % m;
  return r == 0 ? x : checked_add(x, m - r, what);
}

}  // namespace

void validate(const LayoutOptions& options) {
  if (options.dp == 0 || options.dp > kMaxDp) {
    throw InvalidArgument("dp = " + std::to_string(options.dp) +
                          ": the data-parallel size must be 1 to " + std::to_string(kMaxDp));
  }
  if (options.alignment_factor == 0) {
    throw InvalidArgument("alignment factor = 0: it must be at least 1");
  }
  std::uint64_t esize = zeroflat::element_size(options.dtype);
  if (esize == 0) throw InvalidArgument("unknown dtype");
  std::uint64_t b = options.param_align_bytes;
  if (b != 0 && ((b & (b - 1)) != 0 || b < esize)) {
    throw InvalidArgument("param_align_bytes = " + std::to_string(b) +
                          ": expected 0 or a power of two of at least the element size (" +
                          std::to_string(esize) + " bytes for " +
                          std::string(dtype_name(options.dtype)) + ")");
  }
  (void)checked_mul(options.alignment_factor, options.dp, "alignment factor * dp");
}

Layout Layout::compute(std::span<const std::uint64_t> numels, const LayoutOptions& options) {
  validate(options);
  Layout l;
  l.options_ = options;
  l.numels_.assign(numels.begin(), numels.end());
  l.esize_ = zeroflat::element_size(options.dtype);
  l.alignment_ = options.alignment_factor * options.dp;
  const std::uint64_t n = numels.size();
  const std::uint64_t dp = options.dp;

  l.order_.reserve(n);
  if (options.round_robin && dp > 1) {
    for (std::uint64_t bucket = 0; bucket < dp && bucket < n; ++bucket) {
      for (std::uint64_t i = bucket; i < n; i += dp) l.order_.push_back(i);
    }
  } else {
    for (std::uint64_t i = 0; i < n; ++i) l.order_.push_back(i);
  }

  const std::uint64_t align_elems =
      options.param_align_bytes == 0 ? 1 : options.param_align_bytes / l.esize_;
  l.offsets_.assign(n, 0);
  std::uint64_t cursor = 0;
  for (std::uint64_t k = 0; k < n; ++k) {
    std::uint64_t i = l.order_[k];
    if (k > 0 && align_elems > 1) cursor = round_up(cursor, align_elems, "parameter offset");
    l.offsets_[i] = cursor;
    cursor = checked_add(cursor, numels[i], "sum of parameter sizes");
    l.numel_ = checked_add(l.numel_, numels[i], "sum of parameter sizes");
  }
  l.data_end_ = cursor;
  l.flat_numel_ = round_up(cursor, l.alignment_, "padded flat size");
  (void)checked_mul(l.flat_numel_, l.esize_, "flat buffer size in bytes");
  l.partition_numel_ = l.flat_numel_ / dp;
  return l;
}

RankLayout Layout::rank(std::uint64_t r, bool list_not_in_partition) const {
  if (r >= options_.dp) {
    throw InvalidArgument("rank " + std::to_string(r) + " is outside [0, " +
                          std::to_string(options_.dp) + ")");
  }
  RankLayout out;
  out.rank = r;
  out.start = r * partition_numel_;
  out.end = out.start + partition_numel_;
  const std::uint64_t s = out.start;
  const std::uint64_t e = out.end;
  out.padding = e > std::max(s, data_end_) ? e - std::max(s, data_end_) : 0;
  auto in_partition = [&](std::uint64_t i) {
    const std::uint64_t o = offsets_[i];
    const std::uint64_t m = numels_[i];
    if (s <= o && o < e) return true;
    if (o < s && s < o + m) {
      out.first_offset = s - o;
      return true;
    }
    return false;
  };
  if (list_not_in_partition) {
    for (std::uint64_t i : order_) {
      (in_partition(i) ? out.params_in_partition : out.params_not_in_partition).push_back(i);
    }
  } else {
    // Only parameters ending after s can be in: start at the first one (offsets never decrease
    // along the flat order) and stop at the first one starting at or after e.
    auto it = std::partition_point(order_.begin(), order_.end(), [&](std::uint64_t i) {
      return offsets_[i] + numels_[i] <= s && offsets_[i] < s;
    });
    for (; it != order_.end() && offsets_[*it] < e; ++it) {
      if (in_partition(*it)) out.params_in_partition.push_back(*it);
    }
  }
  out.fragments = fragments_in(s, e);
  return out;
}

std::vector<Fragment> Layout::fragments_in(std::uint64_t lo, std::uint64_t hi) const {
  std::vector<Fragment> out;
  if (lo >= hi) return out;
  // Offsets are non-decreasing in flat order: find the first parameter ending after lo.
  auto first = std::partition_point(order_.begin(), order_.end(), [&](std::uint64_t i) {
    return offsets_[i] + numels_[i] <= lo;
  });
  for (auto it = first; it != order_.end(); ++it) {
    const std::uint64_t i = *it;
    const std::uint64_t o = offsets_[i];
    if (o >= hi) break;
    const std::uint64_t a = std::max(o, lo);
    const std::uint64_t b = std::min(o + numels_[i], hi);
    if (b > a) out.push_back(Fragment{i, a - lo, a - o, b - a});
  }
  return out;
}

}  // namespace zeroflat
