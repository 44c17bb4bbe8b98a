// The resume of a DeepSpeed checkpoint as one library operation. Given a checkpoint
// (deepspeed_checkpoint.h), the new world and the running release's choices, plan_resume says
// what every rank keeps and where it comes from: one buffer per target (the fp32 master, each
// partitioned optimizer state, ZeRO-1/2's 16-bit weights where asked, ZeRO-3's frozen
// partitions) and optimizer group (ZeRO-3: every group's parameters back to back), each with
// its source (the saved runs, deepspeed_source), its layout and its placement; and the values
// kept small (read whole: steps, frozen parameters and buffers under ZeRO-1/2). resume_rank
// gives one rank's figures from the reads the loader issues (planned_reads), and
// load_resume_buffer runs a buffer's load. The command line (`zeroflat load --from deepspeed`,
// `zeroflat inspect --dp`) and the Python resume (engine.load_checkpoint under the drop-in)
// all take their plan from here.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"

namespace zeroflat {

struct ResumeOptions {
  std::uint64_t world = 1;  // the new data-parallel world: 1 to kMaxDp
  // The new run's ZeRO stage: 0 takes the saved one. ZeRO-1/2 and ZeRO-3 checkpoints resume
  // only under their own kind; a universal one under either.
  int stage = 0;
  // The running release's rules: which saved parameters its groups keep (left_out says which
  // it drops). None: the saving release's (its version in the checkpoint). Not used when
  // `groups` is given.
  std::optional<ReleaseRules> rules;
  bool select = true;  // false: every saved parameter, no release's selection
  // The partitioned optimizer states to read besides the weights; none: every state the
  // checkpoint saves per element (deepspeed_partitioned_states). An empty list reads none.
  std::optional<std::vector<std::string>> states;
  // ZeRO-1/2: the weights from the module file's 16-bit tensors (DeepSpeed's resume without
  // load_from_fp32_weights) instead of the fp32 master. A universal checkpoint has none: fp32.
  bool module_weights = false;
  // The running engine's trained parameters, per optimizer group (ZeRO-3: per sub-group; its
  // buffers lay them back to back), names and element counts, in the optimizer's order. Empty:
  // the checkpoint's own groups, as `rules` selects them.
  std::vector<std::vector<std::string>> groups;
  std::vector<std::vector<std::uint64_t>> group_numels;
  // ZeRO-3: one buffer per target and group (each a sub-group's partitions, as the optimizer
  // keeps each sub-group in a tensor of its own, so that a caller can read into those), not one
  // over every group. The same bytes either way.
  bool buffer_per_group = false;
  // Parameters the optimizer does not train, names and element counts. ZeRO-3: their
  // partitions are read too (target "frozen"); ZeRO-1/2: their whole tensors from the module
  // file are the plan's small values (one the file does not hold is left out). Empty: none
  // (ZeRO-1/2: the checkpoint's own frozen parameters are its small values).
  std::vector<std::string> frozen;
  std::vector<std::uint64_t> frozen_numels;
  std::optional<DType> frozen_dtype;  // their buffer's dtype; none: the 16-bit weights'.
  // The running model's persistent buffers, read whole from the module file (small values;
  // one the file does not hold is left out). None: the checkpoint's own (its buffer_names).
  std::optional<std::vector<std::string>> buffers;
  // ZeRO-1/2's flat layout as the new run's optimizer keeps it; none: the saving run's
  // (round_robin_gradients, and 16 bytes of parameter alignment when it aligned them).
  std::optional<bool> round_robin;
  std::optional<bool> parameter_alignment;
  std::uint64_t alignment_factor = 2;  // nccl_start_alignment_factor
  // The 16-bit weights' dtype (the module target's, and what the parameter alignment counts
  // in); none: the checkpoint's.
  std::optional<DType> weights_dtype;
};

// One buffer every rank keeps.
struct ResumeBuffer {
  std::string target;                  // "fp32", "module", an optimizer state's name, "frozen"
  // ZeRO-1/2: its optimizer group; ZeRO-3: its sub-group with buffer_per_group, else none
  std::optional<std::uint64_t> group;
  LoadPlacement placement = LoadPlacement::slice();  // slice (ZeRO-1/2), partitions (ZeRO-3)
  LayoutOptions layout;                // dp: the world; dtype: the buffer's
  DeepSpeedSource source;              // the saved runs, one LoadParam per parameter
  std::vector<std::uint64_t> numels;   // its parameters' element counts, in order
};

// A tensor read whole, kept small.
struct ResumeSmall {
  std::string target;                  // "step", "module" (a frozen parameter or a buffer)
  std::optional<std::uint64_t> group;  // step: the buffer group (ZeRO-3: sub-group) it is for
  std::string name;                    // module: the parameter or buffer
  DeepSpeedTensor tensor;
};

struct ResumePlan {
  int stage = 0;  // the new run's
  std::uint64_t world = 0;
  std::vector<std::string> targets;  // the weights' target first, then the states
  std::vector<ResumeBuffer> buffers;
  // Whole tensors the resume takes besides (steps, ZeRO-1/2's frozen parameters and buffers,
  // ZeRO-3's buffers); the same for every rank.
  std::vector<ResumeSmall> small;
  std::vector<std::string> left_out;  // saved parameters the new run drops: "name (why)"
  std::uint64_t params = 0;           // trained parameters resumed
  // Their element counts per optimizer group (ZeRO-3: as given, or the checkpoint's groups).
  std::vector<std::vector<std::uint64_t>> group_numels;
  std::uint64_t sub_group_size = 0;  // ZeRO-3: the saved configuration's
  std::optional<ReleaseRules> rules;  // the rules that selected the parameters (none: given)
};

// The plan. Throws InvalidArgument naming the checkpoint and what is wrong: a world outside
// [1, kMaxDp], a stage the checkpoint cannot resume under, a state it does not save per element,
// a parameter it lacks or holds with another element count, no trainable parameter, a saving
// release without layout rules (name the running one in `rules`).
ResumePlan plan_resume(const DeepSpeedCheckpoint& checkpoint, const ResumeOptions& options);

// One rank's figures for one buffer: the bytes it keeps (its slice; its partitions), its exact
// share (the data elements of its part, at their saved size: padding is never read), and the
// reads the loader issues for it (planned_reads), with their bytes.
struct ResumeRankBuffer {
  std::uint64_t kept_bytes = 0;
  std::uint64_t share_bytes = 0;
  std::uint64_t read_bytes = 0;
  std::uint64_t partition_numel = 0;  // elements of the rank's buffer
  std::uint64_t data_numel = 0;       // of them, the ones read (the rest is padding)
  std::vector<PlannedRead> reads;
};
ResumeRankBuffer resume_rank_buffer(const ResumeBuffer& buffer, std::uint64_t rank);

// The bytes every rank keeps of buffer b (resume_rank_buffer's kept_bytes, without planning
// any read).
std::uint64_t resume_kept_bytes(const ResumeBuffer& buffer);

// A rank's whole resume: every buffer's figures, in the plan's order, the small tensors' bytes,
// and the sums.
struct ResumeRank {
  std::uint64_t rank = 0;
  std::vector<ResumeRankBuffer> buffers;
  std::uint64_t kept_bytes = 0, share_bytes = 0, read_bytes = 0;  // over the buffers
  std::uint64_t small_bytes = 0;                                  // the small tensors'
};
ResumeRank resume_rank(const ResumePlan& plan, std::uint64_t rank);

// Asks the kernel for every byte a rank reads for the plan's buffers at once (its figures'
// reads, resume_rank), merged by file in file order (POSIX_FADV_WILLNEED): the rank's loads,
// one per buffer, then find their bytes in flight or in the page cache, one pass over each file
// for all of them. Returns the bytes asked for. Only advice: a file that cannot be opened is
// left for the loads to report.
std::uint64_t resume_read_ahead(const ResumePlan& plan, const ResumeRank& rank);

// Runs a buffer's load on this rank: load() with its placement and options.layout set to the
// buffer's. Collective over comm, as load is.
FlattenResult load_resume_buffer(const ResumeBuffer& buffer, Device& device, Communicator* comm,
                                 FlattenOptions options);

}  // namespace zeroflat
