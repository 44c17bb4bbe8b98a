// The checkpoint loader: a group's flat buffer built straight from a safetensors checkpoint,
// each rank reading only the bytes of its own partition, one all-gather completing it.
//
// The layout fixes, for every byte of a rank's partition, which parameter and which element of
// it lands there; the checkpoint's headers fix where that parameter's bytes sit in which file. So
// each rank turns its partition's fragments into (file, offset, length) reads, sorts them by file
// and offset, merges neighbours, splits them by bytes over its threads and reads them with pread
// straight into its slice of the flat buffer (on a device the host cannot write, through a ring
// of pinned chunks, reading one while the previous is copied to the device), converting the
// checkpoint's dtype to the buffer's on the way as torch's Tensor.to rounds. Then the ranks
// all-gather the slices in place. Nothing is read twice, no second copy of the group is ever
// held, and no rank reads more than its partition: on every rank the device holds the flat
// buffer and at most the ring.
//
// It is the same pipeline as flatten_param_group's (engine.h: check, probe, agree, plan,
// execute, master), with the checkpoint as the group's source: reading is the step list's kRead
// step, the all-gather and the views are its later steps.
//
// Collective, as flatten_param_group: every rank of comm calls it with the same checkpoint, group
// and options (compared first); an error found on one rank (a missing or mis-shaped tensor, a
// shard it cannot open, a read that fails) is an error on every rank, after which no buffer is
// left behind. Each rank opens the checkpoint itself (on many nodes, usually each node's own copy
// at the same path), so before reading the ranks compare what their copies' headers say (every
// tensor's name, dtype, shape and byte range, every file's size) and, after reading, a sample of
// the bytes (LoadOptions::copies): copies that differ are an error naming the file and tensor,
// never a buffer mixed from several copies.
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

  std::string name;    // names it in errors
  Shape shape;         // must be the checkpoint tensor's
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

// How the ranks check, after reading, that their copies of the checkpoint hold the same bytes
// (their headers are always compared).
enum class CopyCheck : std::uint8_t {
  kOff,      // no check of the bytes
  kSampled,  // each rank re-reads 16 windows of 64 KiB of every other rank's slice from its own
             // copy and compares them with what that rank read: at most 1 MiB per other rank
  kFull,     // each rank re-reads every other rank's slice: (N - 1) / N of the checkpoint more
};
std::string_view copy_check_name(CopyCheck check) noexcept;  // "off", "sampled", "full"
// "off", "sampled" or "full"; throws InvalidArgument naming `what` otherwise.
CopyCheck parse_copy_check(std::string_view text, std::string_view what);

struct LoadOptions {
  // The buffer's layout and dtype; dp must be the ranks of comm. Must match on every rank.
  LayoutOptions layout;
  std::optional<std::uint64_t> margin_bytes;  // none: default_margin(capacity)
  // Drop the files this rank reads from from the page cache before reading (posix_fadvise), so
  // that a cold load is measured without root.
  bool cold = false;
  // The staging ring, for devices the host cannot write: depth chunks of chunk_bytes of pinned
  // host memory. Must match.
  std::uint64_t ring_chunk_bytes = std::uint64_t{16} << 20;
  unsigned ring_depth = 4;
  // Testing aid: go through the ring on a host device too.
  bool through_ring = false;
  // Reader threads; 0: the device's team (default_num_threads of the local ranks).
  unsigned threads = 0;
  // The DeepSpeed release whose layout the group follows (see FlattenOptions::release). Must
  // match.
  std::optional<ReleaseRules> release;
  // Build this rank's fp32 master partition once the buffer is complete. Must match.
  bool master = false;
  // The check of the ranks' copies after reading (see CopyCheck). Must match.
  CopyCheck copies = CopyCheck::kSampled;
  // The read plan (plan.h: Tier::kLoad, each rank its slice and an all-gather; kLoadWhole, each
  // rank the whole buffer from its node's page cache; load_partitions: kLoadPartitions, its
  // only one); none: the faster by the cost model, from
  // the nodes (the ranks over the local ranks of ProbeContext/runtime_env) and the bandwidths.
  // Must match.
  std::optional<Tier> read_plan;
  // The bandwidth of the storage every node reads from, when it is shared (a network file
  // system), in bytes/s; 0: each node's own. Must match.
  double storage_bytes_per_second = 0;
  ProbeContext probe;
  // More that every rank must pass identically (compared).
  std::string must_match;
  // Non-empty: the caller's own checks failed on this rank, and this is why. The ranks still
  // meet once, and every rank raises InvalidArgument (this rank with this text).
  std::string local_error;
  // Testing aid: this rank's reads fail once this many bytes have been read, as an I/O error.
  std::optional<std::uint64_t> fail_after_bytes;
};

struct LoadResult {
  ProbeResult probe;       // this rank's device
  ProbeResult host_probe;  // the host memory this rank may stage through
  PlanInput input;    // what the plan was made with, agreed over the ranks
  Candidate plan;     // the chosen read plan: its steps, peak, traffic and predicted time
  Plan read_plans;    // every read plan, which was chosen and why
  bool feasible() const noexcept { return plan.feasible; }
  FlatGroup group;  // the flat buffer and each parameter's view (empty when not feasible)
  std::uint64_t bytes_read = 0;  // file bytes this rank read (its slice's, or the whole buffer's)
  std::uint64_t reads = 0;       // pread ranges after merging neighbours
  // How much of what this rank read was in the page cache before it read it (0 to 1), and the
  // word for it: "cold" (under 10%), "warm" (over 90%), "partly".
  double cached_fraction = 0;
  std::string page_cache;
  double read_seconds = 0;  // reading this rank's slice (conversion and staging included)
  double allgather_seconds = 0;
  double seconds = 0;  // the whole load on this rank, agreement included
  std::uint64_t predicted_peak_device_bytes = 0;
  std::uint64_t measured_peak_device_bytes = 0;
  std::uint64_t measured_peak_host_bytes = 0;
  // The copies check (LoadOptions::copies): bytes this rank read again to compare, and how long.
  std::uint64_t copy_check_bytes = 0;
  double copy_check_seconds = 0;
  DeviceBuffer master;        // this rank's fp32 master partition, when asked
  double master_seconds = 0;  // building it
  std::string master_error;   // why there is no master although one was asked
};

// Collective (see above). Throws InvalidArgument for a bad group, checkpoint or options on any
// rank, or ranks whose options or checkpoint headers differ (before anything is read);
// ResourceExhausted when the system refuses a file or a thread; OutOfMemory when the buffer
// cannot be allocated; Error naming the file, tensor and byte range when a read fails midway or
// the ranks' copies hold different bytes (on every rank, the buffer released). No feasible plan
// is reported in the result (nothing allocated). The views point into group.flat.
LoadResult load_flat_group(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                           Device& device, Communicator* comm, const LoadOptions& options);

// ZeRO-3 (zero3.h): each rank reads only its own partition of every parameter, elements
// [r * p, min((r + 1) * p, n)) of the parameter's sources concatenated (converted to the buffer's
// dtype; the elements past n zero), into its buffer: the partitions back to back in the order of
// params, as the Stage 3 optimizer's lp_param_buffer holds them (a caller with several optimizer
// groups passes them in group order: the buffer has no padding between groups). No all-gather,
// no rank reads another's bytes: the read plan is kLoadPartitions, on the same memory and cost
// models; a failed read is an error on every rank with nothing kept, as for load_flat_group.
// Collective over comm with the same rules and options as load_flat_group, except:
// options.layout.dp is the world (the ranks of comm) and its dtype the buffer's; round_robin and
// param_align_bytes are refused (InvalidArgument), alignment_factor is ignored; read_plan is none
// or kLoadPartitions; the copies check compares, in the same windows of every buffer, each rank's
// bytes with what the next rank's copy holds for them. The result's group.layout is the rank
// buffer's (zero3_buffer_layout: dp 1, partition numels as its parameters), group.views the
// partitions (1-D views, p_i elements each), bytes_read this rank's partitions' file bytes
// (partitions_read_bytes), and master, when asked, the fp32 copy of the whole buffer.
LoadResult load_partitions(const CheckpointIndex& checkpoint, std::span<const LoadParam> params,
                           Device& device, Communicator* comm, const LoadOptions& options);

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

// Tensor `name` of the checkpoint read whole into dst (host memory, t->numel elements of `to`):
// converted to `to` as torch rounds, or, when to is none, its bytes as stored (any dtype, for a
// model's integer buffers). Throws InvalidArgument for a tensor the checkpoint does not hold or
// a dtype the loader does not convert from, Error when the read fails (file and byte range
// named).
void read_checkpoint_tensor(const CheckpointIndex& checkpoint, const std::string& name,
                            std::optional<DType> to, void* dst);

// The word for a cached fraction: "cold" (under 10%), "warm" (over 90%), else "partly".
std::string page_cache_word(double cached_fraction);

// The fraction of [offset, offset + length) of a file that is in the page cache now (mincore).
double cached_fraction(const std::string& file, std::uint64_t offset, std::uint64_t length);

}  // namespace zeroflat
