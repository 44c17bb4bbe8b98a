// The planner:
// - Each way of building a group's buffer is a list of steps: a tier (from the originals on the
//   device: device, sharded, staged, host) or a read plan (from files: load, load-whole,
//   load-partitions). Which candidates a group has is its placement's and its source's to say.
// - A memory model (simulate, on a StepMachine) runs a list symbolically: peak device and host
//   bytes after every step, and its traffic; a cost model turns the traffic into seconds.
// - The planner keeps the candidates that fit in free - margin (device) and the host memory
//   this rank may use, and picks the fastest, or the forced one; none fitting is a verdict with
//   the numbers, never a throw.
// - The executor runs the very same lists (engine.h: Execution), so the planner's account of
//   memory and the executor's cannot drift apart.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/layout.h"
#include "zeroflat/probe.h"

namespace zeroflat {

// The ways of flattening a group that is on the device (kAllTiers), and the loader's read plans,
// its ways of building a buffer from files (loader.h):
// - kLoad: each rank reads its own slice and an all-gather completes the buffers (each node
//   reads 1/nodes of the checkpoint from storage);
// - kLoadWhole: each rank reads the whole buffer, which its node's page cache serves after the
//   first reader (each node reads the whole checkpoint once, no all-gather);
// - kLoadPartitions: ZeRO-3's placement (layout.h), each rank reads only its own partition of
//   every parameter into its buffer, no all-gather;
// - kLoadSlice: each rank reads only its own slice of the flat layout and keeps just that (an
//   optimizer's partition of fp32 weights or states), no all-gather.
enum class Tier : std::uint8_t {
  kDevice,
  kSharded,
  kStaged,
  kHost,
  kLoad,
  kLoadWhole,
  kLoadPartitions,
  kLoadSlice
};
inline constexpr Tier kAllTiers[] = {Tier::kDevice, Tier::kSharded, Tier::kStaged, Tier::kHost};
inline constexpr Tier kReadPlans[] = {Tier::kLoad, Tier::kLoadWhole};
inline constexpr Tier kPartitionReadPlans[] = {Tier::kLoadPartitions};
inline constexpr Tier kSliceReadPlans[] = {Tier::kLoadSlice};

// "device", "sharded", "staged", "host"; the read plans "load", "load-whole",
// "load-partitions" and "load-slice".
std::string_view tier_name(Tier tier) noexcept;
std::optional<Tier> try_parse_tier(std::string_view text) noexcept;
// "auto" (none: the planner chooses) or a tier's name. Throws InvalidArgument naming `what`
// (the option, "--tier" or "tier") and the accepted names.
std::optional<Tier> parse_tier_choice(std::string_view text, std::string_view what);

// The buffers a step list names. kPartition and kFlat live on the device, kHostStage in
// (pinned) host memory; kOriginals are the parameters as they are before flattening.
enum class Buffer : std::uint8_t { kNone, kOriginals, kFlat, kPartition, kHostStage };
std::string_view buffer_name(Buffer buffer) noexcept;
bool on_host(Buffer buffer) noexcept;

enum class Op : std::uint8_t {
  kAllocate,          // buffer, bytes
  kGather,            // write flat-layout bytes [flat_offset, +bytes) from the originals into
                      // buffer at dst_offset (padding as zeros); over the host link when buffer
                      // is on the host
  kCopy,              // buffer[dst_offset, +bytes) = source[src_offset, +bytes); over the host
                      // link when exactly one of the two is on the host
  kReleaseOriginals,  // the original parameter storage is freed
  kAllGather,         // every rank's slice [r * S, (r + 1) * S) of the layout, read from
                      // source at src_offset (source == buffer: in place), lands in buffer;
                      // bytes = the whole buffer
  kRepoint,           // parameters become views into kFlat
  kRelease,           // buffer
  kRead,              // write flat-layout bytes [flat_offset, +bytes) from the checkpoint's
                      // files into buffer at dst_offset (padding as zeros): the loader's gather
};
std::string_view op_name(Op op) noexcept;

struct Step {
  Op op = Op::kRepoint;
  Buffer buffer = Buffer::kNone;
  Buffer source = Buffer::kNone;
  std::uint64_t bytes = 0;
  std::uint64_t flat_offset = 0;
  std::uint64_t dst_offset = 0;
  std::uint64_t src_offset = 0;

  // "allocate partition 7.63 GB", "gather [0, 7.63 GB) -> partition", ...
  std::string describe() const;
};

// What a step list costs, from the memory model.
struct StepAccount {
  std::uint64_t device_bytes = 0;  // device usage after the step (resident included)
  std::uint64_t host_bytes = 0;    // host bytes held by the step list after the step
};

struct Profile {
  std::uint64_t peak_device_bytes = 0;   // highest device usage, resident bytes included
  std::uint64_t peak_host_bytes = 0;     // highest host memory the steps hold
  std::uint64_t device_copy_bytes = 0;   // bytes copied device to device
  std::uint64_t pcie_bytes = 0;          // bytes over the host link, both directions
  std::uint64_t comm_bytes = 0;          // bytes each rank receives from the communicator
  std::uint64_t read_bytes = 0;          // layout bytes read from checkpoint files
  std::vector<StepAccount> after_step;   // one per step
  std::uint64_t start_device_bytes = 0;  // what was resident before the first step

  // The peak had the list started from `resident` device bytes instead (the same list on
  // another rank's account): the rise over the start is the same. Saturates.
  std::uint64_t peak_from(std::uint64_t resident) const noexcept;
};

// The state a step list walks through: which buffers are live and how large, whether the
// originals are still there, and the bytes held on the device and on the host. The memory model
// (simulate) and the executor drive this one machine, so the rules a list must follow and the
// account of its memory are written once.
class StepMachine {
 public:
  // resident_device_bytes are in use on the device before the first step, original_bytes of
  // them the group's originals.
  StepMachine(std::uint64_t resident_device_bytes, std::uint64_t original_bytes) noexcept;

  // Throws InternalError naming the problem when `step` cannot run now: a buffer allocated
  // twice, used or released before it is allocated, the originals read or released after their
  // release, a byte range outside its buffer, a re-point without a flat buffer.
  void check(const Step& step) const;
  // Records the step's effect on the state; check() it first.
  void apply(const Step& step) noexcept;

  bool live(Buffer buffer) const noexcept;
  std::uint64_t size(Buffer buffer) const noexcept;  // 0 when not live
  bool originals_released() const noexcept { return released_; }
  std::uint64_t device_bytes() const noexcept { return device_; }
  std::uint64_t host_bytes() const noexcept { return host_; }

 private:
  static constexpr std::size_t kBuffers = 5;
  std::uint64_t sizes_[kBuffers] = {};
  bool live_[kBuffers] = {};
  bool released_ = false;
  std::uint64_t device_ = 0;
  std::uint64_t host_ = 0;
  std::uint64_t original_bytes_ = 0;
};

// Runs steps on a StepMachine, starting from resident_device_bytes on the device (the
// originals included, original_bytes of them), and adds up their traffic. Throws InternalError
// for a list the machine refuses (see StepMachine::check).
Profile simulate(const std::vector<Step>& steps, std::uint64_t resident_device_bytes,
                 std::uint64_t original_bytes, std::uint64_t dp);

struct PlanInput {
  Layout layout;                      // the group's layout (dp = ranks sharing it)
  std::uint64_t original_bytes = 0;   // the group's parameter bytes as they sit on the device
  std::uint64_t capacity_bytes = 0;   // device capacity
  std::uint64_t free_bytes = 0;       // agreed free device bytes (minimum over ranks)
  std::uint64_t margin_bytes = 0;     // never planned into
  std::uint64_t host_free_bytes = 0;  // host bytes this rank may use
  std::uint64_t rank = 0;             // whose slice the step lists name (they differ only there)
  bool integrated = false;            // device memory is host memory: staging frees nothing
  std::uint64_t local_ranks = 1;      // ranks of this node staging through its host at once
  // The ranks sharing the group; 0: layout.options().dp. A layout of one rank's own buffer
  // (ZeRO-3's partitions, Zero3Layout::buffer_layout) has dp 1 on each of them.
  std::uint64_t ranks = 0;
  Bandwidths bandwidths;
  std::optional<Tier> forced;  // plan only this tier (the others are still reported)
};

// The facts one rank plans with (agreed over the ranks, or a node described by hand) and the
// policy that turns them into the planner's input, in one place: the default margin, the rule
// that an integrated device never stages (its host memory is its device memory) unless a tier
// is forced, and the forced tier.
struct PlanFacts {
  std::uint64_t capacity_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::uint64_t host_free_bytes = 0;
  bool integrated = false;
  std::uint64_t local_ranks = 1;  // ranks of this node staging through its host at once
  Bandwidths bandwidths;
};
PlanInput make_plan_input(const Layout& layout, std::uint64_t original_bytes,
                          const PlanFacts& facts, std::uint64_t rank, std::optional<Tier> forced,
                          std::optional<std::uint64_t> margin_bytes);

struct Candidate {
  Tier tier = Tier::kDevice;
  std::vector<Step> steps;
  Profile profile;
  double predicted_seconds = 0;
  bool feasible = false;
  std::string why_not;  // empty when feasible
};

struct Plan {
  std::vector<Candidate> candidates;  // all four tiers, in kAllTiers order
  std::optional<Tier> chosen;         // none when nothing is feasible
  std::string reason;                 // one line: why this tier, or why none

  const Candidate* chosen_candidate() const;
};

// The check that the ranks hold the same values before the sharded and staged tiers hand slices
// between them (agree.h: check_same_values).
struct ValueCheck {
  double seconds = 0;
  std::uint64_t bytes_hashed = 0;  // on this rank: the whole group
  int first_mismatch = -1;         // the first slice (rank) whose digests differ, or -1
  std::string error;               // what differs, when first_mismatch >= 0
};

// The default margin: 3% of capacity or 1 GiB, whichever is smaller.
std::uint64_t default_margin(std::uint64_t capacity_bytes) noexcept;

// The step list of one tier. staged_device_bytes is how much of the rank's slice the staged
// tier keeps on the device (the rest goes through the host).
std::vector<Step> tier_steps(Tier tier, const Layout& layout, std::uint64_t rank,
                             std::uint64_t staged_device_bytes = 0);

// The loader's step list for a read plan (loader.h): allocate the flat buffer; where the host
// cannot write the device, a ring of ring_bytes of pinned staging memory; read this rank's slice
// of the layout (kLoad) or all of it (kLoadWhole, and kLoadPartitions, whose layout is the
// rank's own buffer: rank is not checked against its dp) from the checkpoint; release the ring;
// for kLoad, all-gather the slices in place; re-point.
std::vector<Step> load_steps(const Layout& layout, std::uint64_t rank, std::uint64_t ring_bytes,
                             Tier plan = Tier::kLoad);

// A read plan as a candidate: its step list on the memory model from what is resident now
// (input.original_bytes is 0: nothing of the group is on the device yet), its traffic
// (read_bytes, comm_bytes), its predicted time, and whether it fits in free - margin (device)
// and host_free (the ring). The time model: the nodes are ranks / local_ranks; each node's
// share of the storage (bandwidths.storage, when shared) carries 1/nodes of the group under
// kLoad, all of it under kLoadWhole, and its ranks' own buffers under kLoadPartitions; a rank
// reads at bandwidths.read, or from its node's page cache at its share of host_copy; the
// all-gather runs at allgather_bus between nodes and as a memory copy within one.
Candidate plan_load(const PlanInput& input, std::uint64_t ring_bytes, Tier plan = Tier::kLoad);

// The read plans `plans` (kReadPlans for a flat buffer, kPartitionReadPlans for ZeRO-3's
// partitions), the fastest that fits chosen (or the forced one, if it fits). Throws
// InvalidArgument for a forced tier that is not one of them.
Plan plan_reads(const PlanInput& input, std::uint64_t ring_bytes,
                std::optional<Tier> forced = std::nullopt,
                std::span<const Tier> plans = kReadPlans);
// The loader's default ring: 4 chunks of 16 MiB (LoadOptions).
inline constexpr std::uint64_t kDefaultRingBytes = std::uint64_t{64} << 20;

// Plans one group: every tier is built, simulated, costed, and checked against
// free - margin (device) and host_free (host). Picks the fastest feasible one, or the forced one
// if feasible. Throws InvalidArgument when free exceeds capacity or original_bytes exceeds
// what is resident.
Plan plan_group(const PlanInput& input);

// What training needs after init, per rank (bytes).
struct AfterInit {
  std::uint64_t master_bytes = 0;        // fp32 master partition, 4 * S
  std::uint64_t optimizer_bytes = 0;     // Adam's two fp32 moments, 8 * S
  std::uint64_t gradient_bytes = 0;      // ZeRO-2: the fp32 gradient partition, 4 * S
  std::uint64_t device_bytes_after = 0;  // resident after init plus the three above
  bool fits = false;
};
AfterInit estimate_after_init(const PlanInput& input, bool zero2 = true,
                              bool offload_optimizer = false);

// Plans several groups one after another: the originals freed by group g make room for g + 1.
// free_bytes of each input after the first is replaced by what the previous plan leaves free.
std::vector<Plan> plan_groups(std::vector<PlanInput> inputs);

}  // namespace zeroflat
