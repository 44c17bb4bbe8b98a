// Checking a loaded buffer against the checkpoint read whole, tensor by tensor (loader.h).
#include <algorithm>
#include <cstring>

#include "common/convert.h"
#include "source/checkpoint/source.h"
#include "zeroflat/error.h"
#include "zeroflat/size.h"
#include "zeroflat/zero3.h"

namespace zeroflat {
namespace {

using detail::OpenFiles;

// verify_loaded and verify_partitions: parameter i's elements [starts[i], +its layout numel) of
// its tensors read whole (starts empty: all of them, from 0), the layout's elements past its
// data zero, every byte no parameter covers zero, every view at its layout offset.
std::string verify_buffer(const CheckpointIndex& ck, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group,
                          std::span<const std::uint64_t> starts) {
  const Layout& layout = group.layout;
  const DType dtype = layout.options().dtype;
  const std::uint64_t es = element_size(dtype);
  if (params.size() != layout.num_params() || group.views.size() != params.size()) {
    return "the group has " + std::to_string(group.views.size()) + " views for " +
           std::to_string(params.size()) + " parameters";
  }
  if (!device.keeps_data()) return "";
  OpenFiles files(ck);
  // What the device holds, a piece at a time on the host.
  const bool direct = device.host_accessible();
  constexpr std::uint64_t kPiece = std::uint64_t{64} << 20;
  void* stage = direct ? nullptr : device.allocate_host(kPiece);
  struct StageGuard {
    Device& d;
    void* p;
    ~StageGuard() { d.release_host(p, kPiece); }
  } guard{device, stage};
  auto held = [&](std::uint64_t flat_byte, std::uint64_t n) -> const unsigned char* {
    const auto* p = static_cast<const unsigned char*>(group.flat.data()) + flat_byte;
    if (direct) return p;
    device.copy(stage, p, n);
    device.synchronize();
    return static_cast<const unsigned char*>(stage);
  };
  // The bytes of each parameter's data: [offset, offset + data) of the layout, in elements.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  std::vector<unsigned char> whole, want;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const LoadParam& p = params[i];
    std::vector<std::string> missing;
    const std::vector<const CheckpointTensor*> src = detail::resolve(ck, p, missing);
    if (!missing.empty()) return "no tensor '" + missing.front() + "'";
    const std::uint64_t n = shape_numel(p.shape);
    const std::uint64_t first = starts.empty() ? 0 : std::min(starts[i], n);
    const std::uint64_t data = std::min(layout.numels()[i], n - first);
    // The tensors read whole, on their own, and converted on their own.
    want.assign(n * es, 0);
    std::uint64_t filled = 0;
    for (const CheckpointTensor* t : src) {
      whole.resize(t->bytes);
      files.get(t->file)->read_at(whole.data(), t->bytes, t->offset);
      detail::convert_range(want.data() + filled, dtype, whole.data(), *t->type, t->numel);
      filled += t->numel * es;
    }
    const std::string name = src.empty() ? p.name : src.front()->name;
    const std::string file = src.empty() ? std::string("?") : files.path(src.front()->file);
    const std::uint64_t at = layout.offsets()[i] * es;
    for (std::uint64_t done = 0; done < data * es;) {
      const std::uint64_t m = std::min(kPiece, data * es - done);
      const unsigned char* got = held(at + done, m);
      const unsigned char* expected = want.data() + first * es + done;
      if (std::memcmp(got, expected, m) != 0) {
        std::uint64_t k = 0;
        while (got[k] == expected[k]) ++k;
        return "parameter '" + printable(p.name) + "' differs from tensor '" + printable(name) +
               "' of " + file + (src.size() > 1 ? " (or a tensor after it)" : "") + " at element " +
               std::to_string(first + (done + k) / es);
      }
      done += m;
    }
    if (group.views[i].data != static_cast<const unsigned char*>(group.flat.data()) + at) {
      return "parameter '" + printable(p.name) + "' is not a view at its layout offset";
    }
    spans.emplace_back(at, at + data * es);
  }
  // Padding: every byte no parameter's data covers is zero.
  std::sort(spans.begin(), spans.end());
  std::uint64_t gap = 0;
  spans.emplace_back(layout.flat_bytes(), layout.flat_bytes());
  for (const auto& [lo, hi] : spans) {
    for (std::uint64_t b = gap; b < lo;) {
      const std::uint64_t m = std::min(kPiece, lo - b);
      const unsigned char* got = held(b, m);
      for (std::uint64_t k = 0; k < m; ++k) {
        if (got[k] != 0) return "padding byte " + std::to_string(b + k) + " is not zero";
      }
      b += m;
    }
    gap = std::max(gap, hi);
  }
  return "";
}

}  // namespace

std::string verify_loaded(const CheckpointIndex& ck, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group) {
  return verify_buffer(ck, params, device, group, {});
}

std::string verify_partitions(const CheckpointIndex& ck, std::span<const LoadParam> params,
                              Device& device, const FlatGroup& group, std::uint64_t world,
                              std::uint64_t rank) {
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
  LayoutOptions o;
  o.dp = world;
  o.dtype = group.layout.options().dtype;
  if (rank >= world) {
    return "rank " + std::to_string(rank) + " is outside the world of " + std::to_string(world);
  }
  if (group.layout.numels() != zero3_buffer_layout(numels, o).numels()) {
    return "the group is not the ZeRO-3 buffer of these " + std::to_string(params.size()) +
           " parameters on " + std::to_string(world) + " ranks";
  }
  return verify_buffer(ck, params, device, group, zero3_partition_starts(numels, world, rank));
}

}  // namespace zeroflat
