// The checkpoint loader: a group's buffers built straight from a safetensors checkpoint (or any
// CheckpointIndex: a list of tensors at byte ranges of files), through the one pipeline of
// engine.h with the checkpoint as the group's source. The rules:
// - Layout, then reads: the layout fixes, for every byte of a rank's buffer, which parameter and
//   element lands there; the headers fix where that element sits in which file. A rank's reads
//   are sorted by file and offset, neighbours merged, split by bytes over its threads and read
//   with pread straight into its buffer (through a ring of pinned chunks on a device the host
//   cannot write), converted to the buffer's dtype as torch's Tensor.to rounds.
// - Who reads what is the read plan (plan.h), chosen by the cost model or forced
//   (FlattenOptions::tier): load_flat_group's kLoad (each rank its slice, one all-gather) or
//   kLoadWhole (each rank the whole buffer from its node's page cache, no all-gather);
//   load_partitions' kLoadPartitions (each rank only its ZeRO-3 partitions). No rank holds a
//   second copy of the group: the device holds the buffer and at most the ring.
// - Collective, as flatten_param_group: every rank of comm calls it with the same checkpoint,
//   group and options (compared first). An error found on one rank (a missing or mis-shaped
//   tensor, a shard it cannot open, a read that fails) is an error on every rank, after which no
//   buffer is left behind.
// - Each rank opens the checkpoint itself (on many nodes, usually each node's own copy at the
//   same path): before reading the ranks compare what their copies' headers say (every
//   tensor's name, dtype, shape and byte range, every file's size; an error names the first
//   entry that differs and both versions), and after reading a sample of the bytes
//   (ReadOptions::copies): copies that differ are an error naming the file and tensor, never a
//   buffer mixed from several copies.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/comm.h"
#include "zeroflat/device.h"
#include "zeroflat/dtensor.h"
#include "zeroflat/engine.h"
#include "zeroflat/flatten.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"
#include "zeroflat/release.h"

namespace zeroflat {

// One parameter of the group, in group order.
struct LoadParam {
  LoadParam() = default;
  LoadParam(std::string name_, Shape shape_, std::vector<std::string> sources_ = {},
            std::vector<Shape> source_shapes_ = {})
      : name(std::move(name_)),
        shape(std::move(shape_)),
        sources(std::move(sources_)),
        source_shapes(std::move(source_shapes_)) {}

  std::string name;  // names it in errors
  Shape shape;       // must be the checkpoint tensor's
  // The checkpoint tensors holding its values, whole and in order, their elements concatenated
  // (a tied weight names the tensor it shares; a fused parameter, such as the stacked experts of
  // a MoE layer, the tensors it stacks); empty: {name}. One source must have the parameter's
  // shape; several must hold its element count between them.
  std::vector<std::string> sources;
  // Empty, or one shape per source: the shape each source tensor must have (a fused parameter's
  // rule says what each of its tensors is; a tensor of the right size but another shape, such as
  // a transposed expert, is refused naming it).
  std::vector<Shape> source_shapes;
};

// ZeRO-1/2: every rank ends with the whole flat buffer of params (options.layout), each
// parameter a view into it (result.group().views; their names come from params). Collective
// (see above). Throws InvalidArgument for a bad group, checkpoint or options on any rank, or
// ranks whose options or checkpoint headers differ (before anything is read);
// ResourceExhausted when the system refuses a file or a thread; OutOfMemory when the buffer
// cannot be allocated; Error naming the file, tensor and byte range when a read fails midway or
// the ranks' copies hold different bytes (on every rank, the buffer released). No feasible plan
// is reported in the result (nothing allocated). result.read says what this rank read.
FlattenResult load_flat_group(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                              Device& device, Communicator* comm, const FlattenOptions& options);

// ZeRO-3 (zero3.h): each rank reads only its own partition of every parameter, elements
// [r * p, min((r + 1) * p, n)) of the parameter's sources concatenated (converted to the buffer's
// dtype; the elements past n zero), into its buffer: the partitions back to back in the order of
// params, as the Stage 3 optimizer's lp_param_buffer holds them (a caller with several optimizer
// groups passes them in group order: the buffer has no padding between groups). No all-gather,
// no rank reads another's bytes: the read plan is kLoadPartitions, on the same memory and cost
// models; a failed read is an error on every rank with nothing kept, as for load_flat_group.
// Collective over comm with the same rules and options as load_flat_group, except:
// options.layout.dp is the world (the ranks of comm) and its dtype the buffer's; round_robin and
// param_align_bytes are refused (InvalidArgument), alignment_factor is ignored; the tier is none
// or kLoadPartitions. The result's group().layout is the rank buffer's (zero3_buffer_layout:
// dp 1, partition numels as its parameters), group().views the partitions (1-D views, p_i
// elements each), read->bytes this rank's partitions' file bytes (partitions_read_bytes), and
// master, when asked, the fp32 copy of the whole buffer.
FlattenResult load_partitions(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                              Device& device, Communicator* comm, const FlattenOptions& options);

// DTensor shards (dtensor.h: FSDP2's Shard(0), HSDP's (Replicate(), Shard(0)), any Shard(d) and
// Replicate() a mesh holds): each rank reads only the elements of its local shard of every
// parameter (spec.placements[i] on spec.mesh, the rank's coordinate spec.coords[rank]), straight
// from the checkpoint (converted to the buffer's dtype), into its buffer: the shards back to
// back in the order of params, each padded to LocalShard::padded_numel with zeros (the same
// layout on every rank). No all-gather, no rank reads another's bytes (read plan
// kLoadPartitions). Collective over comm with the rules and options of load_partitions; the
// spec is part of what the ranks compare. InvalidArgument for a spec that does not describe
// comm's ranks and params (validate in dtensor.h). The result's group().layout is the rank
// buffer's (dp 1, the padded shards as its parameters), group().views the padded shards (1-D;
// a shard's local tensor is the first LocalShard::numel elements of its view, row-major in
// LocalShard::shape), read->bytes this rank's shards' file bytes (shards_read_bytes).
FlattenResult load_shards(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                          const ShardSpec& spec, Device& device, Communicator* comm,
                          const FlattenOptions& options);

// The file bytes rank `rank` reads for its shards of `params` under spec: what load_shards
// reports as bytes_read, known before it runs. Throws InvalidArgument as partition_read_bytes
// does, and for a spec that does not describe its ranks and params.
std::uint64_t shards_read_bytes(const CheckpointIndex& checkpoint,
                                std::span<const LoadParam> params, const ShardSpec& spec,
                                std::uint64_t rank);

// ZeRO-1/2's optimizer partition alone: each rank reads only its slice [r * S, (r + 1) * S) of
// the flat layout of params (options.layout) and keeps just that (read plan kLoadSlice, no
// all-gather): what a rank's optimizer holds of a group, such as its fp32 master partition or an
// optimizer state, read in the buffer's dtype. Collective with the rules of load_flat_group. The
// result's group().layout is the whole flat layout, group().flat holds only this rank's slice
// (partition_bytes: its partition(0)), the views are not re-pointed (a slice holds pieces of
// parameters), and read->bytes is this rank's slice's file bytes (partition_read_bytes).
FlattenResult load_slice(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                         Device& device, Communicator* comm, const FlattenOptions& options);

// The read ceiling of the same files: `bytes` of the checkpoint's data (every file from its
// first tensor on, in file order, as one sequence) from byte `skip` on (wrapping at the end;
// ranks pass different skips so that they read different bytes), read sequentially by `threads`
// threads into scratch memory allocated for it (fresh, as the loader's buffer is: both pay its
// first touch), after dropping the files from the page cache if cold. With a device the host
// cannot write (cuda), the scratch is its pinned host memory and the time includes one copy of
// it all to the device afterwards: a plain read, then a plain copy. Throws Error when a read or
// the copy fails.
struct ReadCeiling {
  std::uint64_t bytes = 0;
  double seconds = 0;
  double cached_fraction = 0;  // before the read
  std::string page_cache;      // "cold", "warm" or "partly", as LoadResult's
};
ReadCeiling measure_read_ceiling(const CheckpointIndex& checkpoint, std::uint64_t skip,
                                 std::uint64_t bytes, unsigned threads, bool cold,
                                 Device* device = nullptr);

// Every parameter of a loaded group against its tensor read whole, on its own, from the file and
// converted to the buffer's dtype; every padding byte against zero; every view against its
// layout offset. "" when all hold, else the first difference (parameter, file, element). Reads
// the whole checkpoint; copies device memory through host staging where the host cannot read it.
std::string verify_loaded(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group);

// verify_loaded for load_partitions' buffer of rank `rank` of `world`: each parameter's
// partition against the same elements of its tensors read whole and converted, the padding past
// its data zero, each view at its offset. "" when all hold, else the first difference.
std::string verify_partitions(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                              Device& device, const FlatGroup& group, std::uint64_t world,
                              std::uint64_t rank);

// verify_loaded for load_slice's buffer of rank `rank` (group.layout: the whole flat layout of
// params; group.flat: the slice [r * S, (r + 1) * S) alone): each parameter's elements in the
// slice against the same elements of its tensors read whole and converted, every other byte of
// the slice zero. The views are not checked (a slice re-points none); a parameter with no
// element in the slice is not read. "" when all hold, else the first difference.
std::string verify_slice(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                         Device& device, const FlatGroup& group, std::uint64_t rank);

// The file bytes rank `rank` reads for its partition of `params` laid out with `layout`: what
// load_flat_group reports as bytes_read, known before it runs. Throws InvalidArgument for a
// parameter the checkpoint does not hold.
std::uint64_t partition_read_bytes(const CheckpointIndex& checkpoint,
                                   std::span<const LoadParam> params, const LayoutOptions& layout,
                                   std::uint64_t rank);

// The same for load_partitions: the file bytes of rank `rank`'s partitions of every parameter on
// `world` ranks. Throws InvalidArgument as partition_read_bytes does.
std::uint64_t partitions_read_bytes(const CheckpointIndex& checkpoint,
                                    std::span<const LoadParam> params, std::uint64_t world,
                                    std::uint64_t rank);

// Where a load places a group: ZeRO-1/2's slice of the flat layout (load_slice), or ZeRO-3's
// partitions back to back (load_partitions).
enum class LoadPlacement : std::uint8_t { kSlice, kPartitions };

// One file read a load issues: `bytes` of file `file` (an index into checkpoint.files) from
// `offset`, `numel` elements that land at element `dest` of the rank's buffer (its slice; its
// partitions back to back).
struct PlannedRead {
  std::uint32_t file = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t dest = 0;
  std::uint64_t numel = 0;
};

// The reads rank `rank` issues for its buffer of `params` laid out with `layout` (layout.dp: the
// world) under `placement`: the kRead steps of the loader's read plan for that placement, in
// order, known before anything is read. Their bytes are what the load reports as bytes_read.
// Throws InvalidArgument as partition_read_bytes does, and for a rank outside the world.
std::vector<PlannedRead> planned_reads(const CheckpointIndex& checkpoint,
                                       std::span<const LoadParam> params,
                                       const LayoutOptions& layout, LoadPlacement placement,
                                       std::uint64_t rank);

// Tensor `name` of the checkpoint read whole into dst (host memory, t->numel elements of `to`):
// converted to `to` as torch rounds, or, when to is none, its bytes as stored (any dtype, for a
// model's integer buffers). Throws InvalidArgument for a tensor the checkpoint does not hold or
// a dtype the loader does not convert from, Error when the read fails (file and byte range
// named).
void read_checkpoint_tensor(const CheckpointIndex& checkpoint, const std::string& name,
                            std::optional<DType> to, void* dst);

// One destination of read_checkpoint_boxes: the box [offsets, offsets + sizes) of checkpoint
// tensor `name` (dtensor.h's box_runs), its elements in the box's row-major order, converted to
// `to` as torch rounds, into dst (host memory of the box's elements).
struct BoxRead {
  std::string name;
  std::vector<std::uint64_t> offsets;
  std::vector<std::uint64_t> sizes;
  void* dst = nullptr;
  DType to = DType::kBF16;
};

// Reads every box, its exact byte ranges only (pieces of each run, every box's in one pass of
// the reader's threads in file order), with `threads` threads (0: default_num_threads(), the
// cores split among the ranks of this host). Throws InvalidArgument for a tensor the checkpoint
// lacks, a box outside it or a dtype the loader does not convert (before anything is read);
// Error naming the file, byte range and tensor when a read fails. Returns the file bytes read.
// Under exact read-ahead (runtime.h) the kernel's read-ahead is off for the files, unless
// `sole_reader`: the caller knows no other rank reads them (a job of one rank), and the kernel's
// read-ahead, faster, reads nothing another rank needs.
std::uint64_t read_checkpoint_boxes(const CheckpointIndex& checkpoint,
                                    std::span<const BoxRead> boxes, unsigned threads,
                                    bool sole_reader = false);

// Every file that a tensor of the checkpoint lies in is there, a regular file, the file its
// header was read from (its stamp: device, inode, size, modification time) and as long as the
// header says; checked without reading (stat), so that ranks can agree on it before any of them
// writes what it reads. Throws InvalidArgument naming the file and what changed.
void check_checkpoint_files(const CheckpointIndex& checkpoint);

// The word for a cached fraction: "cold" (under 10%), "warm" (over 90%), else "partly".
std::string page_cache_word(double cached_fraction);

// The fraction of [offset, offset + length) of a file that is in the page cache now (mincore).
double cached_fraction(const std::string& file, std::uint64_t offset, std::uint64_t length);

}  // namespace zeroflat
