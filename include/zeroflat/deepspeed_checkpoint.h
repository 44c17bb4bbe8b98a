// DeepSpeed ZeRO checkpoint folders read without running them (the library's own torch.save
// reader reads each file, docs/security.md):
// the saving run's stage, world size and release, every optimizer group's parameters, each
// saving rank's fp32 partitions and optimizer states with their byte ranges, frozen parameters
// and buffers; and, for a new world size, which byte ranges each new rank reads to keep its
// share.
//
// The files of one tag (DIR/TAG/, DIR/latest naming TAG), as DeepSpeed 0.14 to 0.19 writes them:
//   ZeRO-1/2   mp_rank_00_model_states.pt (the module's 16-bit state_dict, param_shapes in flat
//              order, frozen_param_shapes, buffer_names, ...), and per saving rank r
//              {bf16_}zero_pp_rank_{r}_mp_rank_00_optim_states.pt: single_partition_of_fp32_groups
//              (per group, rank r's partition of the flat buffer without its padding),
//              base_optimizer_state (the torch optimizer's state over those partitions),
//              param_slice_mappings, group_paddings, partition_count, ...
//   ZeRO-3     per saving rank r zero_pp_rank_{r}_mp_rank_00_model_states.pt (param_shapes per
//              sub-group, frozen_param_fragments: r's partition of each frozen parameter, ...)
//              and {bf16_}zero_pp_rank_{r}_mp_rank_00_optim_states.pt: fp32_flat_groups (per
//              sub-group, r's partitions back to back, layout.h) and optimizer_state_dict.
//   universal  ds_to_universal's output: zero/NAME/{fp32,exp_avg,exp_avg_sq,step}.pt per
//              parameter, zero/optimizer_state.pt, and mp_rank_00_model_states.pt.
// The optimizer files are also found under the name without the underscore before
// "optim_states" (DeepSpeed retries it), and without "bf16_" (fp16 and fp32 runs).
//
// Contract:
//   - Only the zip directories and pickles of the files are read, never tensor data; every file
//     is untrusted (the torch.save reader's contract, docs/security.md, holds for each).
//   - Every disagreement is InvalidArgument naming the files and the entry: a rank's file
//     missing, files of more ranks than partition_count says, two optimizer files for one rank,
//     different releases (ds_version), stages (zero_stage), world sizes (partition_count,
//     dp_world_size), configurations (ds_config) or steps (global_steps) between files;
//     parameter shapes, fragments (param_slice_mappings), paddings or partitions that do not
//     add up; a tensor that is not contiguous where a partition is expected.
//   - Model parallelism (mp_world_size > 1, mp_rank_01...), pipeline parallelism (layer_*
//     files) and MoE expert files are Unsupported, saying so.
//   - Units: elements of the tensor's dtype unless a name says bytes; file offsets in bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"

namespace zeroflat {

namespace detail {
struct SavedFile;  // a file's state as the torch.save reader parsed it (private)
}  // namespace detail

enum class DeepSpeedFormat : std::uint8_t { kZero12, kZero3, kUniversal };
// "zero-1/2", "zero-3", "universal".
std::string_view deepspeed_format_name(DeepSpeedFormat format) noexcept;

// One file of the checkpoint and its saved state.
struct DeepSpeedFile {
  std::string path;
  std::string role;       // "model", "optim", "universal", "universal-common"
  std::int64_t rank = -1; // the saving rank it belongs to; -1 for a file of every rank
  std::string param;      // universal: the parameter it holds
  std::string state;      // universal: "fp32", "exp_avg", ... (the file's stem)
  std::uint64_t file_bytes = 0;      // its size when read
  FileStamp stamp;                   // the file as it was read
  std::uint64_t tensors = 0;         // the tensors of its saved state (one saved under two
                                     // places counts twice)
  std::vector<std::string> globals;  // the globals its pickle named, "module name", in the
                                     // order first named
  // Its saved state as the reader parsed it, for the library's own use (the Python binding
  // makes values of it): opaque here. Copies of the checkpoint share it; it never changes.
  std::shared_ptr<const detail::SavedFile> saved;
};

// A tensor of the checkpoint, contiguous: bytes [offset, offset + bytes) of its file.
struct DeepSpeedTensor {
  std::uint32_t file = 0;     // index into DeepSpeedCheckpoint::files
  // Its place in that file's state: dict keys, list indices and an object's state keys joined
  // by '/' ("optimizer_state_dict/base_optimizer_state/state/0/exp_avg").
  std::string path;
  // zeroflat's name where it has one ("bf16", "fp16", "fp32"), else torch's ("float64",
  // "int64", ...).
  std::string dtype;
  std::optional<DType> type;
  std::uint64_t element_size = 0;
  Shape shape;
  std::uint64_t numel = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;    // numel * element_size
};

// One optimizer state tensor ("exp_avg", "exp_avg_sq", "step", ...).
struct DeepSpeedState {
  std::string name;
  DeepSpeedTensor tensor;
};

// What one saving rank holds of one flat partition (a ZeRO-1/2 group, a ZeRO-3 sub-group).
struct DeepSpeedPartition {
  DeepSpeedTensor fp32;                // the fp32 master partition as saved
  std::vector<DeepSpeedState> states;  // the optimizer's state for it, as saved
  // Padding elements at the end of the rank's partition: ZeRO-1/2's group_paddings[g] (the
  // saved fp32 tensor leaves them out: fp32.numel = partition_numel - padding); ZeRO-3: 0
  // (padding stays inside each parameter's partition).
  std::uint64_t padding = 0;
};

struct DeepSpeedParam {
  std::string name;
  Shape shape;
  std::uint64_t numel = 0;
  std::uint64_t sub_group = 0;  // index into DeepSpeedCheckpoint::sub_groups
  // ZeRO-1/2: its first element in the saved flat buffer. ZeRO-3: its partition's first
  // element in its sub-group's partition (the same on every rank; each partition holds
  // ceil(numel / world) elements). Universal: 0.
  std::uint64_t offset = 0;
};

// A flat fp32 partition every saving rank holds its part of: a ZeRO-1/2 group, a ZeRO-3
// sub-group (none for universal checkpoints).
struct DeepSpeedSubGroup {
  std::uint64_t group = 0;            // the optimizer group it belongs to
  std::uint64_t first_param = 0;      // index into the group's params
  std::uint64_t num_params = 0;
  std::uint64_t partition_numel = 0;  // each rank's partition, padding included
  std::vector<DeepSpeedPartition> ranks;  // per saving rank
};

struct DeepSpeedGroup {
  // Group order (the optimizer's). ZeRO-1/2 saves param_shapes in the flat buffer's order,
  // which round_robin_gradients permutes: DeepSpeedCheckpoint::round_robin says, and the
  // offsets say where each lies.
  std::vector<DeepSpeedParam> params;
  std::uint64_t numel = 0;       // the parameters' elements
  // ZeRO-1/2: partition_numel * world (padding included). ZeRO-3: its sub-groups' partitions
  // times world. Universal: numel.
  std::uint64_t flat_numel = 0;
  std::vector<std::uint64_t> sub_groups;  // indices into DeepSpeedCheckpoint::sub_groups
};

// A parameter the optimizer does not train (requires_grad False).
struct DeepSpeedFrozen {
  std::string name;
  Shape shape;
  std::uint64_t numel = 0;
  // ZeRO-1/2 and universal: one, the whole parameter (the module file's module/NAME). ZeRO-3:
  // per saving rank, its partition (frozen_param_fragments/NAME, at most ceil(numel / world)
  // elements). Empty when the release saved none.
  std::vector<DeepSpeedTensor> fragments;
};

// A universal checkpoint's parameter: its files' tensors.
struct DeepSpeedUniversalParam {
  std::string name;
  Shape shape;
  std::uint64_t numel = 0;
  std::vector<DeepSpeedState> tensors;  // "fp32" (the master weights), "exp_avg", ...
};

struct DeepSpeedCheckpoint {
  std::string dir;    // the folder holding the files (DIR/TAG)
  std::string tag;    // its name
  DeepSpeedFormat format = DeepSpeedFormat::kZero12;
  int zero_stage = 0;               // 1, 2 or 3 (universal: the stage that saved it)
  std::uint64_t world = 0;          // the saving data-parallel world size
  std::uint64_t mp_world = 1;       // always 1 (more is Unsupported)
  std::string ds_version;           // the saving release, as written ("0.19.8")
  std::string dtype;                // the model's 16-bit dtype: "bf16", "fp16" (or "fp32")
  bool round_robin = false;         // ZeRO-1/2: round_robin_gradients
  bool parameter_alignment = false; // ZeRO-1/2: parameter_alignment (param starts padded to
                                    // 16 bytes, 0.19.7+)
  std::uint64_t sub_group_size = 0; // ZeRO-3: zero_optimization.sub_group_size as configured
  std::vector<DeepSpeedFile> files;
  std::vector<DeepSpeedGroup> groups;
  std::vector<DeepSpeedSubGroup> sub_groups;
  std::vector<DeepSpeedFrozen> frozen;
  std::vector<std::string> buffer_names;
  // The module state_dict's tensors in the model file (ZeRO-3: rank 0's, whose parameters are
  // empty placeholders), path "module/NAME".
  std::vector<DeepSpeedTensor> module;
  std::vector<DeepSpeedUniversalParam> universal;  // universal checkpoints only
  // Bookkeeping (absent: -1, or the default).
  std::int64_t global_steps = -1;
  std::int64_t global_samples = -1;
  std::int64_t skipped_steps = -1;
  double loss_scale = 1;            // loss_scaler's cur_scale
  bool dynamic_loss_scale = false;
  double clip_grad = 0;
  bool has_lr_scheduler = false;    // lr_scheduler saved (not None)

  // The module tensor module/NAME, or null.
  const DeepSpeedTensor* find_module(std::string_view name) const;
};

// Whether `dir` is a folder that holds a DeepSpeed checkpoint by its names: a 'latest' or
// 'latest_universal' file, model-states or ZeRO optimizer files, or a universal checkpoint's
// zero/ folder beside mp_rank_00_model_states.pt. Lists the folder only; never throws.
bool is_deepspeed_checkpoint(const std::string& dir) noexcept;

// Opens the checkpoint in `dir`: DIR/TAG when `tag` is given; else the tag DIR/latest names
// (DIR/latest_universal when only that exists); else DIR itself when it holds the files.
// Reads every file's directory and pickle. Throws InvalidArgument as the contract says (no
// checkpoint in the folder: the message lists what it looked for), Unsupported for model or
// pipeline parallelism and MoE expert files.
DeepSpeedCheckpoint open_deepspeed_checkpoint(const std::string& dir,
                                              const std::optional<std::string>& tag = {});

// Whether state s of a saved partition is saved per element of it: as long as the partition's
// fp32 master, with or without its padding (Adam's exp_avg), never step (one element, whatever
// the partition's size). The one test of it; the rest of a state is read whole.
bool deepspeed_state_partitioned(const DeepSpeedState& s, const DeepSpeedPartition& part,
                                 const DeepSpeedSubGroup& sub_group) noexcept;

// The optimizer states saved per element, partitioned as the fp32 master is (Adam's exp_avg and
// exp_avg_sq; not step), in the order the first saving rank's file (universal: the first trained
// parameter's files) lists them: the state targets deepspeed_source takes. A name is one when
// every saved partition (universal: every parameter of the optimizer's groups; frozen ones and
// buffers keep fp32.pt alone) holds it with the fp32 master's elements (with or without the
// partition's padding). Empty for a checkpoint without optimizer states. A state that some
// partitions (parameters) hold so and others lack, or hold with another size, is an incomplete
// checkpoint: InvalidArgument naming the file (folder) where it is missing.
std::vector<std::string> deepspeed_partitioned_states(const DeepSpeedCheckpoint& checkpoint);

// A kind of saved values as tensors the loader reads (loader.h), so that a resume is a load
// of the one pipeline: every run of a saved partition that holds elements of a named parameter
// is one tensor of `index` (its file's bytes, as saved), and each named parameter one LoadParam
// whose sources are its runs in element order, shape [numel] (a resume reads elements; the new
// layout places them). The targets:
// - "fp32": the fp32 master weights (ZeRO-1/2, ZeRO-3 partitions; universal fp32.pt);
// - an optimizer state's name ("exp_avg", "exp_avg_sq", ...): its partitioned tensors (a state
//   that is not partitioned, such as step, is no target: read it whole);
// - "frozen": a parameter the optimizer does not train (ZeRO-1/2: the module file's tensor;
//   ZeRO-3: the saved ranks' partitions, frozen_param_fragments), and a buffer (the module
//   file's tensor);
// - "module": ZeRO-1/2's 16-bit weights of the module file (what DeepSpeed loads without
//   load_from_fp32_weights).
// A parameter the checkpoint does not hold, or holds with another element count, is
// InvalidArgument naming it; so is a target the checkpoint lacks. Pure arithmetic on the
// checkpoint's description: nothing is read.
struct DeepSpeedSource {
  CheckpointIndex index;          // path: the checkpoint's folder; files: all of its files
  std::vector<LoadParam> params;  // one per name asked for, in that order
};
DeepSpeedSource deepspeed_source(const DeepSpeedCheckpoint& checkpoint, std::string_view target,
                                 std::span<const std::string> params,
                                 std::span<const std::uint64_t> numels);

}  // namespace zeroflat
