// Checking a loaded buffer against the checkpoint read whole, tensor by tensor (loader.h).
#include <algorithm>
#include <cstring>

#include "common/convert.h"
#include "source/checkpoint/source.h"
#include "zeroflat/common.h"
#include "zeroflat/dtensor.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"

namespace zeroflat {
namespace {

using detail::OpenFiles;

// Where parameter i's data lies in a buffer: elements [first, first + numel) of the parameter
// at element `at` of the buffer.
struct Span {
  std::uint64_t at = 0;
  std::uint64_t first = 0;
  std::uint64_t numel = 0;
};

// Every placement's check: each parameter's spans against the same elements of its tensors
// read whole (a parameter with no element in the buffer is not read), every byte of the
// buffer's `buffer_bytes` no span covers zero, and (views) every view at its span.
std::string verify_buffer(const CheckpointIndex& ck, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group,
                          std::span<const std::vector<Span>> spans_in, std::uint64_t buffer_bytes,
                          bool views) {
  const DType dtype = group.layout.options().dtype;
  const std::uint64_t es = element_size(dtype);
  if (spans_in.size() != params.size() || (views && group.views.size() != params.size())) {
    return "the group has " + std::to_string(group.views.size()) + " views for " +
           std::to_string(params.size()) + " parameters";
  }
  if (group.flat.num_bytes() < buffer_bytes) {
    return "the buffer holds " + std::to_string(group.flat.num_bytes()) + " bytes, " +
           std::to_string(buffer_bytes) + " expected";
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
  // The bytes of the buffer holding a parameter's data.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  std::vector<unsigned char> whole, want;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const LoadParam& p = params[i];
    const std::vector<Span>& pieces = spans_in[i];
    if (views && !pieces.empty() &&
        group.views[i].data !=
            static_cast<const unsigned char*>(group.flat.data()) + pieces.front().at * es) {
      return "parameter '" + printable(p.name) + "' is not a view at its layout offset";
    }
    std::uint64_t held_numel = 0;
    for (const Span& span : pieces) held_numel += span.numel;
    if (held_numel == 0) continue;
    std::vector<std::string> missing;
    const std::vector<const CheckpointTensor*> src = detail::resolve(ck, p, missing);
    if (!missing.empty()) return "no tensor '" + missing.front() + "'";
    const std::uint64_t n = shape_numel(p.shape);
    for (const Span& span : pieces) {
      if (span.first + span.numel > n || (span.at + span.numel) * es > buffer_bytes) {
        return "parameter '" + printable(p.name) + "': elements " + std::to_string(span.first) +
               " to " + std::to_string(span.first + span.numel) + " are outside it or the buffer";
      }
    }
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
    for (const Span& span : pieces) {
      const std::uint64_t at = span.at * es;
      const std::uint64_t data = span.numel;
      const std::uint64_t first = span.first;
      for (std::uint64_t done = 0; done < data * es;) {
        const std::uint64_t m = std::min(kPiece, data * es - done);
        const unsigned char* got = held(at + done, m);
        const unsigned char* expected = want.data() + first * es + done;
        if (std::memcmp(got, expected, m) != 0) {
          std::uint64_t k = 0;
          while (got[k] == expected[k]) ++k;
          return "parameter '" + printable(p.name) + "' differs from tensor '" + printable(name) +
                 "' of " + file + (src.size() > 1 ? " (or a tensor after it)" : "") +
                 " at element " + std::to_string(first + (done + k) / es);
        }
        done += m;
      }
      if (data > 0) spans.emplace_back(at, at + data * es);
    }
  }
  // Padding: every byte no parameter's data covers is zero.
  std::sort(spans.begin(), spans.end());
  std::uint64_t gap = 0;
  spans.emplace_back(buffer_bytes, buffer_bytes);
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

// Each parameter's data at its layout offset, from its element starts[i] (empty: 0) on.
std::vector<std::vector<Span>> layout_spans(std::span<const LoadParam> params, const Layout& layout,
                                            std::span<const std::uint64_t> starts) {
  std::vector<std::vector<Span>> out;
  for (std::size_t i = 0; i < params.size() && i < layout.num_params(); ++i) {
    const std::uint64_t n = shape_numel(params[i].shape);
    const std::uint64_t first = starts.empty() ? 0 : std::min(starts[i], n);
    out.push_back({Span{layout.offsets()[i], first, std::min(layout.numels()[i], n - first)}});
  }
  return out;
}

std::string verify_flat(const CheckpointIndex& ck, std::span<const LoadParam> params,
                        Device& device, const FlatGroup& group) {
  if (params.size() != group.layout.num_params()) {
    return "the layout has " + std::to_string(group.layout.num_params()) + " parameters, " +
           std::to_string(params.size()) + " given";
  }
  return verify_buffer(ck, params, device, group, layout_spans(params, group.layout, {}),
                       group.layout.flat_bytes(), true);
}

std::string verify_partitions(const CheckpointIndex& ck, std::span<const LoadParam> params,
                              Device& device, const FlatGroup& group, std::uint64_t world,
                              std::uint64_t rank) {
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
  LayoutOptions o;
  o.dp = world;
  o.dtype = group.layout.options().dtype;
  if (group.layout.numels() != zero3_buffer_layout(numels, o).numels()) {
    return "the group is not the ZeRO-3 buffer of these " + std::to_string(params.size()) +
           " parameters on " + std::to_string(world) + " ranks";
  }
  return verify_buffer(
      ck, params, device, group,
      layout_spans(params, group.layout, zero3_partition_starts(numels, world, rank)),
      group.layout.flat_bytes(), true);
}

std::string verify_slice(const CheckpointIndex& ck, std::span<const LoadParam> params,
                         Device& device, const FlatGroup& group, std::uint64_t rank) {
  const Layout& layout = group.layout;
  if (rank >= layout.options().dp) {
    return "rank " + std::to_string(rank) + " is outside the layout's " +
           std::to_string(layout.options().dp) + " ranks";
  }
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
  if (layout.numels() != numels) {
    return "the group is not the flat layout of these " + std::to_string(params.size()) +
           " parameters";
  }
  // The slice [r * S, (r + 1) * S): each parameter's elements in it, at their place in it.
  const std::uint64_t lo = rank * layout.partition_numel();
  const std::uint64_t hi = lo + layout.partition_numel();
  std::vector<std::vector<Span>> spans;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::uint64_t a = std::max(layout.offsets()[i], lo);
    const std::uint64_t b = std::min(layout.offsets()[i] + numels[i], hi);
    spans.push_back({b > a ? Span{a - lo, a - layout.offsets()[i], b - a} : Span{}});
  }
  return verify_buffer(ck, params, device, group, spans, layout.partition_bytes(), false);
}

// Each parameter's shard at its place in the rank buffer: its runs of the global tensor, one
// after another from the shard's offset.
std::string verify_shards(const CheckpointIndex& ck, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group, const ShardSpec& spec,
                          std::uint64_t rank) {
  const Layout& layout = group.layout;
  if (layout.num_params() != params.size()) {
    return "the layout has " + std::to_string(layout.num_params()) + " parameters, " +
           std::to_string(params.size()) + " given";
  }
  std::vector<std::vector<Span>> spans;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const LocalShard s =
        local_shard(params[i].shape, spec.mesh, spec.placements[i], spec.coords[rank]);
    if (s.padded_numel != layout.numels()[i]) {
      return "parameter '" + printable(params[i].name) + "': the buffer holds " +
             std::to_string(layout.numels()[i]) + " elements of its shard, " +
             std::to_string(s.padded_numel) + " expected";
    }
    std::vector<Span> pieces;
    std::uint64_t at = layout.offsets()[i];
    for (const ElementRun& r : s.runs) {
      pieces.push_back(Span{at, r.first, r.numel});
      at += r.numel;
    }
    if (pieces.empty()) pieces.push_back(Span{layout.offsets()[i], 0, 0});
    spans.push_back(std::move(pieces));
  }
  return verify_buffer(ck, params, device, group, spans, layout.flat_bytes(), true);
}

}  // namespace

std::string verify_load(const CheckpointIndex& ck, std::span<const LoadParam> params,
                        const LoadPlacement& placement, Device& device, const FlatGroup& group,
                        std::uint64_t world, std::uint64_t rank) {
  if (rank >= world) {
    return "rank " + std::to_string(rank) + " is outside the world of " + std::to_string(world);
  }
  switch (placement.kind) {
    case LoadPlacement::Kind::kFlat:
      return verify_flat(ck, params, device, group);
    case LoadPlacement::Kind::kSlice:
      return verify_slice(ck, params, device, group, rank);
    case LoadPlacement::Kind::kPartitions:
      return verify_partitions(ck, params, device, group, world, rank);
    case LoadPlacement::Kind::kShards:
      validate(placement.shards, world, params.size());
      return verify_shards(ck, params, device, group, placement.shards, rank);
  }
  return "a load placement of no known kind";
}

}  // namespace zeroflat
