// The checkpoint loader: a group's buffers built straight from a safetensors checkpoint (or any
// CheckpointIndex: a list of tensors at byte ranges of files), through the one pipeline of
// engine.h with the checkpoint as the group's source. The rules:
// - Layout, then reads: the layout fixes, for every byte of a rank's buffer, which parameter and
//   element lands there; the headers fix where that element sits in which file. A rank's reads
//   are sorted by file and offset, neighbours merged, split by bytes over its threads and read
//   with pread straight into its buffer (through a ring of pinned chunks on a device the host
//   cannot write), converted to the buffer's dtype as torch's Tensor.to rounds.
// - Who reads what is the read plan (plan.h), chosen by the cost model or forced
//   (FlattenOptions::tier), for the placement (LoadPlacement below): ZeRO-1/2's whole buffer
//   (kLoad: each rank its slice, one all-gather; kLoadWhole: each rank the whole buffer from
//   its node's page cache), its slice alone (kLoadSlice), ZeRO-3's partitions or DTensor shards
//   (kLoadPartitions: each rank only its own). No rank holds a second copy of the group: the
//   device holds the buffer and at most the ring. One call, load(), for every placement.
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
//
// Then, for the shards of a DTensor load (storage="map" in Python): the shards that lie in the
// checkpoint's files as they are, mapped rather than read.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/dtensor.h"
#include "zeroflat/engine.h"
#include "zeroflat/layout.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"

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

// Where a load places a group on each rank: the one value that load, load_read_bytes,
// planned_reads and verify_load take, whatever the framework.
//   kFlat        ZeRO-1/2: every rank ends with the whole flat buffer of params (options.layout),
//                each parameter a view into it (result.group().views; their names come from
//                params). The read plan is the cost model's (or FlattenOptions::tier): kLoad
//                (each rank its slice, one all-gather) or kLoadWhole (each rank the whole
//                buffer from its node's page cache, no all-gather).
//   kSlice       ZeRO-1/2's optimizer partition alone: each rank reads only its slice
//                [r * S, (r + 1) * S) of the flat layout of params (options.layout) and keeps
//                just that (read plan kLoadSlice, no all-gather): what a rank's optimizer holds
//                of a group, such as its fp32 master partition or an optimizer state, read in
//                the buffer's dtype. group().layout is the whole flat layout, group().flat holds
//                only this rank's slice (partition_bytes: its partition(0)); the views are not
//                re-pointed (a slice holds pieces of parameters).
//   kPartitions  ZeRO-3 (layout.h): each rank reads only its own partition of every parameter,
//                elements [r * p, min((r + 1) * p, n)) of the parameter's sources concatenated
//                (the elements past n zero), into its buffer: the partitions back to back in
//                the order of params, as the Stage 3 optimizer's lp_param_buffer holds them (a
//                caller with several optimizer groups passes them in group order: no padding
//                between groups). options.layout.dp is the world (the ranks of comm);
//                round_robin and param_align_bytes are refused (InvalidArgument),
//                alignment_factor is ignored; the tier is none or kLoadPartitions.
//                group().layout is the rank buffer's (zero3_buffer_layout: dp 1, partition
//                numels as its parameters), group().views the partitions (1-D views, p_i
//                elements each), and master, when asked, the fp32 copy of the whole buffer.
//   kShards      DTensor shards (dtensor.h: FSDP2's Shard(0), HSDP's (Replicate(), Shard(0)),
//                any Shard(d) and Replicate() a mesh holds): each rank reads only the elements
//                of its local shard of every parameter (shards.placements[i] on shards.mesh,
//                the rank's coordinate shards.coords[rank]) into its buffer: the shards back to
//                back in the order of params, each padded to LocalShard::padded_numel with zeros
//                (the same layout on every rank). The options' rules are kPartitions'; the spec
//                is part of what the ranks compare, and one that does not describe comm's ranks
//                and params is InvalidArgument (validate in dtensor.h). group().layout is the
//                rank buffer's (dp 1, the padded shards as its parameters), group().views the
//                padded shards (1-D; a shard's local tensor is the first LocalShard::numel
//                elements of its view, row-major in LocalShard::shape).
// Only kFlat gathers; under the others no rank reads another's bytes.
struct LoadPlacement {
  enum class Kind : std::uint8_t { kFlat, kSlice, kPartitions, kShards };
  Kind kind = Kind::kFlat;
  ShardSpec shards;  // kShards only

  static LoadPlacement flat() { return {}; }
  static LoadPlacement slice() { return {Kind::kSlice, {}}; }
  static LoadPlacement partitions() { return {Kind::kPartitions, {}}; }
  static LoadPlacement sharded(ShardSpec spec) { return {Kind::kShards, std::move(spec)}; }
};

// "flat", "slice", "partitions", "shards".
std::string_view load_placement_name(LoadPlacement::Kind kind) noexcept;
// The kind load_placement_name prints; InvalidArgument naming `what` for any other text.
LoadPlacement::Kind parse_load_placement(std::string_view text, std::string_view what);

// The group `params` built from the checkpoint on this rank, placed as `placement` says.
// Collective (see above). Throws InvalidArgument for a bad group, checkpoint, placement or
// options on any rank, or ranks whose options or checkpoint headers differ (before anything is
// read); ResourceExhausted when the system refuses a file or a thread; OutOfMemory when the
// buffer cannot be allocated; Error naming the file, tensor and byte range when a read fails
// midway or the ranks' copies hold different bytes (on every rank, the buffer released). No
// feasible plan is reported in the result (nothing allocated). result.read says what this rank
// read: read->bytes is load_read_bytes of its rank.
FlattenResult load(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                   const LoadPlacement& placement, Device& device, Communicator* comm,
                   const FlattenOptions& options);

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

// A loaded group of rank `rank` of `world` (load with `placement`) against its tensors read
// whole, on their own, from the files and converted to the buffer's dtype: each parameter's
// elements in the buffer (its whole data, its slice's part, its partition, its shard) against
// the same elements of its tensors, every other byte of the buffer zero, every view at its
// layout offset (a slice re-points none). "" when all hold, else the first difference
// (parameter, file, element). Reads every tensor the rank holds a part of; copies device memory
// through host staging where the host cannot read it. `world` is the ranks of the load (kFlat
// and kSlice: the layout's dp; kShards: the spec's ranks).
std::string verify_load(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                        const LoadPlacement& placement, Device& device, const FlatGroup& group,
                        std::uint64_t world, std::uint64_t rank);

// The file bytes rank `rank` reads for its buffer of `params` laid out with `layout` under
// `placement` (layout.dp: the world; kShards: the spec's ranks): what load reports as
// bytes_read (of a kFlat load, under its first read plan, kLoad), known before it runs. Throws
// InvalidArgument for a parameter the checkpoint does not hold, a rank outside the world, or a
// placement that does not describe it.
std::uint64_t load_read_bytes(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                              const LoadPlacement& placement, const LayoutOptions& layout,
                              std::uint64_t rank);

// One file read a load issues: `bytes` of file `file` (an index into checkpoint.files) from
// `offset`, `numel` elements that land at element `dest` of the rank's buffer (the whole flat
// buffer; its slice; its partitions or shards back to back).
struct PlannedRead {
  std::uint32_t file = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t dest = 0;
  std::uint64_t numel = 0;
};

// The reads rank `rank` issues for its buffer (load_read_bytes' arguments): the kRead steps of
// the loader's read plan for the placement (kFlat: kLoad), in order, known before anything is
// read. Their bytes sum to load_read_bytes. Throws as load_read_bytes does.
std::vector<PlannedRead> planned_reads(const CheckpointIndex& checkpoint,
                                       std::span<const LoadParam> params,
                                       const LoadPlacement& placement, const LayoutOptions& layout,
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
// Under exact read-ahead (common.h) the kernel's read-ahead is off for the files, unless
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

// --- Shards used in place: mapped, not read ------------------------------------------------------
// A rank's shards used where they lie in the checkpoint's files: mapped, not read. A DTensor's
// local shard whose elements follow one another in one tensor of the file, stored in the dtype
// the model holds, is one byte range of that file; a private (copy-on-write) mapping of it is
// the shard, with no copy into fresh memory. The pages are brought in during the load (the page
// cache's pages mapped where they are there, the file read where they are not), so the first
// touch afterwards faults nothing; a write to the memory (a training step) copies the page it
// writes, and the file is never changed.
//
// What a mapping costs the caller: the memory stays tied to the file. A file truncated while
// mapped (a checkpoint rewritten in place, not replaced by a rename) makes the pages past its
// new end unreadable (SIGBUS on access); a file rewritten in place changes the values of the
// pages not yet written. Replacing the file by a rename, as checkpoint writers do, changes
// nothing of a mapping. check_taken_copies compares the ranks' copies in what they took so (and
// in values read whole outside a load), as a load compares its own reads.

// One byte range of one checkpoint file.
struct FileRange {
  std::uint32_t file = 0;  // index into CheckpointIndex::files
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  bool operator==(const FileRange&) const = default;
};

// Per parameter, rank `rank`'s local shard under spec as one byte range of one file, where the
// parameter can be used in place: every rank's shard one run of consecutive elements of one
// checkpoint tensor (a shard of whole rows, as Shard(0) and Replicate() make: each sharded
// dimension has only dimensions of size 1 before it), stored as `dtype` (no conversion), from a
// byte of the file that is a multiple of the element size, the tensor stored whole (not a piece
// of a DCP-sharded file). A rank whose shard is empty gets a range of 0 bytes. Else none: the
// loader reads it (a conversion, a shard of several runs, a parameter several tensors make up).
// Which parameters have a range depends on the checkpoint, shapes and placements only: the same
// on every rank, so that the ranks' loads of the rest agree. Throws InvalidArgument as
// load_read_bytes does for the shards.
std::vector<std::optional<FileRange>> shard_file_ranges(const CheckpointIndex& checkpoint,
                                                        std::span<const LoadParam> params,
                                                        const ShardSpec& spec, std::uint64_t rank,
                                                        DType dtype);

// How map_file_ranges brings the pages in.
struct MapOptions {
  unsigned threads = 0;  // 0: default_num_threads()
  // Counts each piece brought in (planned, then done); may be null.
  ReadProgress* progress = nullptr;
  // No other rank reads the files: the kernel's read-ahead, which then reads nothing another
  // rank needs, even under exact read-ahead.
  bool sole_reader = false;
  // Drop the files from the page cache first (ReadOptions::cold: a cold load measured without
  // root).
  bool cold = false;
};

// Ranges of a checkpoint's files, mapped. Each file is mapped once, over the pages its ranges
// span; a range's mapping lives while this object or any handle from keep() does.
class MappedRanges {
 public:
  MappedRanges() = default;
  std::size_t size() const noexcept { return data_.size(); }
  // Range k's first byte (writable: the mapping is private); null for a range of 0 bytes.
  unsigned char* data(std::size_t k) const { return data_.at(k); }
  // A handle that keeps range k's mapping alive (for a tensor's deleter).
  std::shared_ptr<const void> keep(std::size_t k) const { return keep_.at(k); }
  // The ranges' bytes (what was brought in: file bytes read where they were not cached).
  std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  friend MappedRanges map_file_ranges(const CheckpointIndex&, std::span<const FileRange>,
                                      const MapOptions&);
  std::vector<unsigned char*> data_;
  std::vector<std::shared_ptr<const void>> keep_;
  std::uint64_t bytes_ = 0;
};

// Maps `ranges` (each within its file, as the headers say; one of 0 bytes maps nothing)
// privately and brings every page of them in on options.threads threads. Each file is checked to
// be the one whose headers were read, as the loader checks before reading. Under exact
// read-ahead (common.h) the pages are asked for exactly, the kernel's read-around off for the
// mappings, unless options.sole_reader. Throws InvalidArgument for a range outside its file, a file
// replaced, truncated or not mappable, naming it; Error naming the file and byte range where a page
// cannot be read (an I/O error). Nothing stays mapped when it throws.
MappedRanges map_file_ranges(const CheckpointIndex& checkpoint, std::span<const FileRange> ranges,
                             const MapOptions& options = {});

// What a rank took from its copy of the checkpoint outside a load (load() compares its own
// reads: FlattenOptions' copies): ranges used where they lie (mapped shards) and values read
// whole (a model's buffers).
struct TakenBytes {
  // Per rank, the ranges it took, listed in the same order on every rank; `what` names each
  // (a parameter) for the error.
  std::vector<std::vector<FileRange>> ranges;
  std::vector<std::vector<std::string>> what;
  // This rank's bytes of its own ranges, as it took them (a range of 0 bytes: any pointer).
  std::vector<const unsigned char*> mine;
  // The values read whole, the same on every rank: what each is, for the error ("buffer
  // 'counts'"), and this rank's bytes of it.
  std::vector<std::string> value_names;
  std::vector<std::span<const unsigned char>> values;
};

// The ranks' copies compared in what they took, by the loads' rule (copies): each rank digests
// windows of its ranges' bytes, laid end to end (kSampled: 16 windows of 64 KiB spread over
// them, placed by its rank; kFull, or 1 MiB or less: every byte), and every value; the ranks
// exchange the digests in one all-reduce; each rank then digests the other ranks' windows as
// its own copy of the files holds them (read with pread) and compares, and every value's
// digest is compared across the ranks. One more all-reduce makes a difference every rank's
// InvalidArgument, named by the rank that found it (file, byte, parameter or value). Returns
// the file bytes this rank read to compare. Collective; nothing for one rank or kOff.
std::uint64_t check_taken_copies(const CheckpointIndex& checkpoint, const TakenBytes& taken,
                                 Communicator& comm, CopyCheck mode);

}  // namespace zeroflat
