// DTensor shards (dtensor.h): torch.chunk's cut along each mesh dimension, the sub-box a
// coordinate holds, and its runs in the row-major global tensor.
#include "zeroflat/dtensor.h"

#include <algorithm>

#include "common/saturate.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

using detail::checked_mul;

// torch.chunk of `size` rows into `n` pieces: piece i's rows and where they start (an empty
// piece starts at `size`, as DTensor reports it).
std::pair<std::uint64_t, std::uint64_t> chunk(std::uint64_t size, std::uint64_t n,
                                              std::uint64_t i) {
  const std::uint64_t c = size / n + (size % n != 0 ? 1 : 0);
  if (c == 0 || i >= (size + c - 1) / c) return {0, size};
  const std::uint64_t first = i * c;
  return {std::min(c, size - first), first};
}

}  // namespace

std::string placement_name(const MeshPlacement& p) {
  return p.kind == MeshPlacement::Kind::kShard ? "Shard(" + std::to_string(p.dim) + ")"
                                               : "Replicate()";
}

MeshPlacement parse_placement(std::string_view text) {
  if (text == "Replicate()") return {};
  constexpr std::string_view kShard = "Shard(";
  if (text.size() > kShard.size() + 1 && text.substr(0, kShard.size()) == kShard &&
      text.back() == ')') {
    const std::string_view digits = text.substr(kShard.size(), text.size() - kShard.size() - 1);
    std::uint64_t dim = 0;
    bool ok = !digits.empty() && digits.size() <= 9;
    for (char c : digits) {
      ok = ok && c >= '0' && c <= '9';
      dim = dim * 10 + static_cast<std::uint64_t>(c - '0');
    }
    if (ok) return {MeshPlacement::Kind::kShard, static_cast<std::uint32_t>(dim)};
  }
  throw InvalidArgument("placement '" + printable(text) +
                        "': zeroflat reads into Replicate() and Shard(d) placements");
}

LocalShard local_shard(const Shape& global, std::span<const std::uint64_t> mesh,
                       std::span<const MeshPlacement> placements,
                       std::span<const std::uint64_t> coord) {
  if (placements.size() != mesh.size() || coord.size() != mesh.size()) {
    throw InvalidArgument("a mesh of " + std::to_string(mesh.size()) + " dimension(s) with " +
                          std::to_string(placements.size()) + " placement(s) and a coordinate of " +
                          std::to_string(coord.size()) + ": one each per mesh dimension");
  }
  (void)shape_numel(global);  // throws on a negative dimension, overflow
  const std::size_t nd = global.size();
  std::vector<std::uint64_t> size(global.begin(), global.end()), padded = size;
  std::vector<std::uint64_t> offset(nd, 0);
  for (std::size_t m = 0; m < mesh.size(); ++m) {
    if (mesh[m] == 0) throw InvalidArgument("mesh dimension " + std::to_string(m) + " has size 0");
    if (coord[m] >= mesh[m]) {
      throw InvalidArgument("coordinate " + std::to_string(coord[m]) + " along mesh dimension " +
                            std::to_string(m) + " of size " + std::to_string(mesh[m]));
    }
    const MeshPlacement& p = placements[m];
    if (p.kind == MeshPlacement::Kind::kReplicate) continue;
    if (p.dim >= nd) {
      throw InvalidArgument(placement_name(p) + " of a tensor of shape " +
                            shape_to_string(global) + " (" + std::to_string(nd) +
                            " dimension(s))");
    }
    const auto [rows, first] = chunk(size[p.dim], mesh[m], coord[m]);
    offset[p.dim] += first;
    size[p.dim] = rows;
    padded[p.dim] = padded[p.dim] / mesh[m] + (padded[p.dim] % mesh[m] != 0 ? 1 : 0);
  }
  LocalShard out;
  out.shape.assign(size.begin(), size.end());
  out.offsets = offset;
  out.numel = 1;
  out.padded_numel = 1;
  for (std::size_t d = 0; d < nd; ++d) {
    out.numel *= size[d];  // <= total: no overflow
    out.padded_numel = checked_mul(out.padded_numel, padded[d], "the padded shard's elements");
  }
  out.runs = box_runs(global, out.offsets, size);
  return out;
}

std::vector<ElementRun> box_runs(const Shape& global, std::span<const std::uint64_t> offsets,
                                 std::span<const std::uint64_t> size) {
  const std::size_t nd = global.size();
  if (offsets.size() != nd || size.size() != nd) {
    throw InvalidArgument("a box of " + std::to_string(offsets.size()) + "/" +
                          std::to_string(size.size()) + " dimension(s) in a tensor of shape " +
                          shape_to_string(global));
  }
  const std::uint64_t total = shape_numel(global);
  std::uint64_t numel = 1;
  for (std::size_t d = 0; d < nd; ++d) {
    const auto g = static_cast<std::uint64_t>(global[d]);
    if (offsets[d] > g || size[d] > g - offsets[d]) {
      throw InvalidArgument("a box of " + std::to_string(size[d]) + " from " +
                            std::to_string(offsets[d]) + " along dimension " + std::to_string(d) +
                            " of a tensor of shape " + shape_to_string(global));
    }
    numel *= size[d];
  }
  std::vector<ElementRun> runs;
  if (numel == 0) return runs;
  if (nd == 0) return {ElementRun{0, 1}};
  // Row-major strides; the innermost dimension that is cut: each run spans it and all after.
  std::vector<std::uint64_t> stride(nd, 1);
  for (std::size_t d = nd - 1; d > 0; --d) {
    stride[d - 1] = stride[d] * static_cast<std::uint64_t>(global[d]);
  }
  std::size_t cut = 0;
  bool any = false;
  for (std::size_t d = 0; d < nd; ++d) {
    if (size[d] != static_cast<std::uint64_t>(global[d])) {
      cut = d;
      any = true;
    }
  }
  if (!any) return {ElementRun{0, total}};
  const std::uint64_t run = size[cut] * stride[cut];
  std::uint64_t count = 1;
  for (std::size_t d = 0; d < cut; ++d) count *= size[d];
  runs.reserve(count);
  std::vector<std::uint64_t> idx(cut, 0);  // an odometer over the dimensions before `cut`
  for (std::uint64_t k = 0; k < count; ++k) {
    std::uint64_t first = offsets[cut] * stride[cut];
    for (std::size_t d = 0; d < cut; ++d) first += (offsets[d] + idx[d]) * stride[d];
    runs.push_back(ElementRun{first, run});
    for (std::size_t d = cut; d-- > 0;) {
      if (++idx[d] < size[d]) break;
      idx[d] = 0;
    }
  }
  return runs;
}

void validate(const ShardSpec& spec, std::uint64_t world, std::uint64_t params) {
  std::uint64_t cells = 1;
  for (std::uint64_t n : spec.mesh) {
    if (n == 0) throw InvalidArgument("a mesh dimension of size 0");
    cells = checked_mul(cells, n, "the mesh's size");
  }
  if (cells != world || spec.coords.size() != world) {
    throw InvalidArgument("a mesh of " + std::to_string(cells) + " rank(s) with " +
                          std::to_string(spec.coords.size()) + " coordinate(s), for " +
                          std::to_string(world) + " rank(s): each rank one coordinate");
  }
  std::vector<bool> seen(world, false);
  for (std::size_t r = 0; r < spec.coords.size(); ++r) {
    const std::vector<std::uint64_t>& c = spec.coords[r];
    if (c.size() != spec.mesh.size()) {
      throw InvalidArgument("rank " + std::to_string(r) + "'s coordinate has " +
                            std::to_string(c.size()) + " dimension(s), the mesh " +
                            std::to_string(spec.mesh.size()));
    }
    std::uint64_t cell = 0;
    for (std::size_t m = 0; m < c.size(); ++m) {
      if (c[m] >= spec.mesh[m]) {
        throw InvalidArgument("rank " + std::to_string(r) + "'s coordinate " +
                              std::to_string(c[m]) + " along mesh dimension " +
                              std::to_string(m) + " of size " + std::to_string(spec.mesh[m]));
      }
      cell = cell * spec.mesh[m] + c[m];
    }
    if (seen[cell]) {
      throw InvalidArgument("rank " + std::to_string(r) +
                            " has the coordinate of an earlier rank: each rank one cell");
    }
    seen[cell] = true;
  }
  if (spec.placements.size() != params) {
    throw InvalidArgument(std::to_string(spec.placements.size()) + " placement lists for " +
                          std::to_string(params) + " parameter(s)");
  }
  for (std::size_t p = 0; p < params; ++p) {
    if (spec.placements[p].size() != spec.mesh.size()) {
      throw InvalidArgument("parameter " + std::to_string(p) + " has " +
                            std::to_string(spec.placements[p].size()) +
                            " placement(s) for a mesh of " + std::to_string(spec.mesh.size()) +
                            " dimension(s)");
    }
  }
}

}  // namespace zeroflat
