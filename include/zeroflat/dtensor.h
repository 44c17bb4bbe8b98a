// DTensor shards (PyTorch's FSDP2, HSDP, tensor parallelism): which elements of a parameter each
// rank holds, as the arithmetic of torch.distributed.tensor places them.
//
//   mesh        the ranks as an n-dimensional grid (DeviceMesh's shape); a rank's coordinate is
//               its index along each mesh dimension.
//   placements  one per mesh dimension: Replicate() (every index along it holds the same
//               elements) or Shard(d) (tensor dimension d cut in torch.chunk's way along it:
//               chunks of c = ceil(size / n) rows, index i holding [i * c, min(size, (i + 1) * c)),
//               the last indices fewer rows or none). Several mesh dimensions may cut the same
//               tensor dimension: each cuts what the mesh dimensions before it left (left to
//               right, as DTensor's compute_local_shape_and_global_offset does).
//   local shard the sub-box of the global tensor a coordinate holds (its local shape and global
//               offsets), row-major as to_local() returns it: in the checkpoint's row-major
//               tensor, runs of consecutive elements (one run under Shard(0) or Replicate();
//               one per outer index under Shard(d > 0)).
//   padded      the local shard's elements when every sharded dimension holds its full chunk
//               (the largest any coordinate holds): the same on every rank, as FSDP2's padded
//               sharded data is; a shard's elements past its own are padding.
//
// Pure arithmetic on 64-bit integers: no I/O, no devices.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/common.h"

namespace zeroflat {

// One mesh dimension's placement of a tensor.
struct MeshPlacement {
  enum class Kind : std::uint8_t { kReplicate, kShard };
  Kind kind = Kind::kReplicate;
  std::uint32_t dim = 0;  // the tensor dimension cut, under kShard
  bool operator==(const MeshPlacement&) const = default;
};

// "Replicate()" or "Shard(d)", as torch prints them.
std::string placement_name(const MeshPlacement& p);
// The placement placement_name prints. Throws InvalidArgument for any other text (torch's
// _StridedShard, Partial and the like are not placements a checkpoint can be read into).
MeshPlacement parse_placement(std::string_view text);

// Consecutive elements of a row-major tensor: [first, first + numel).
struct ElementRun {
  std::uint64_t first = 0;
  std::uint64_t numel = 0;
  bool operator==(const ElementRun&) const = default;
};

struct LocalShard {
  Shape shape;                         // the local tensor's shape (to_local().shape)
  std::vector<std::uint64_t> offsets;  // its first element's index along each dimension
  std::uint64_t numel = 0;             // its elements
  std::uint64_t padded_numel = 0;      // the same on every coordinate (see above)
  std::vector<ElementRun> runs;        // its elements in the global tensor, in local order
};

// The shard that mesh coordinate `coord` holds of a tensor of shape `global`. Throws
// InvalidArgument for a mesh dimension of size 0, placements or a coordinate of another length
// than the mesh, a coordinate outside it, a Shard(d) of a dimension the tensor lacks, a negative
// dimension, or sizes whose element counts overflow 64 bits.
LocalShard local_shard(const Shape& global, std::span<const std::uint64_t> mesh,
                       std::span<const MeshPlacement> placements,
                       std::span<const std::uint64_t> coord);

// The elements of the box [offsets, offsets + sizes) of a row-major tensor of shape `global`, in
// the box's own row-major order, as runs (one per outer index of the innermost dimension the
// box cuts; one run for a box of whole rows). Throws InvalidArgument for a box outside the
// tensor or of another number of dimensions.
std::vector<ElementRun> box_runs(const Shape& global, std::span<const std::uint64_t> offsets,
                                 std::span<const std::uint64_t> sizes);

// The ranks of a load over DTensor shards: the mesh and, per rank of the communicator (in its
// rank order), that rank's mesh coordinate; and per parameter of the group, its placements.
struct ShardSpec {
  std::vector<std::uint64_t> mesh;
  std::vector<std::vector<std::uint64_t>> coords;          // [rank][mesh dimension]
  std::vector<std::vector<MeshPlacement>> placements;      // [parameter][mesh dimension]
};

// Throws InvalidArgument unless spec describes `world` ranks (one coordinate each, every
// coordinate of the mesh exactly once) and `params` parameters (their placements of the mesh's
// length).
void validate(const ShardSpec& spec, std::uint64_t world, std::uint64_t params);

}  // namespace zeroflat
