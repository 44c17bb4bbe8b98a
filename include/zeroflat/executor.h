// The executor: runs a tier's step list (the very list the planner simulated) on a device and a
// communicator, and keeps the parameters' data safe when anything fails.
//
// Agreement. Ranks that share a group must end in the same state, so before every step that
// cannot be taken back or that needs all of them (releasing the originals, each all-gather) and
// once more at the end, they agree with one small all-reduce on whether every rank's steps so
// far succeeded. A rank whose step failed skips ahead to that agreement point, so nobody waits
// for it in an all-gather.
//
// Rollback. A failure found before the originals are released rolls every rank back: the
// buffers the steps allocated are released and every parameter points at its original storage
// again, untouched. After the originals are released, the only complete copy of the group's
// data is spread over the ranks' slices (or, in the host tier, the host stage); putting it back
// within the memory the plan proved is exactly what the rest of the step list does. So the
// executor recovers forward: each rank re-runs the steps from the one that failed, without the
// injected fault, and the parameters end up holding their original values as views into the
// completed flat buffer. Only when that fails too (the device refuses memory again, the
// communicator is gone) is data lost, and the result says so.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/comm.h"
#include "zeroflat/device.h"
#include "zeroflat/flatten.h"
#include "zeroflat/plan.h"
#include "zeroflat/tensor.h"

namespace zeroflat {

struct ExecuteOptions {
  // Testing aid: step N of the list fails on this rank, as if it had thrown, the first time it
  // runs (the recovery pass runs it normally). Past the last step it changes nothing.
  std::optional<std::size_t> fault_step;
  // Called before each step runs (for progress); index into the step list.
  std::function<void(std::size_t, const Step&)> on_step;
};

enum class Outcome : std::uint8_t {
  kDone,        // the flat buffer is complete; parameters are views into it
  kRolledBack,  // nothing was released: parameters hold their original storage, unchanged
  kRecovered,   // a step failed after the originals were released; the rest of the list was
                // run again and the parameters hold their original values as views into flat
  kLost,        // recovery failed as well: some parameter data is gone (the error says why)
};
std::string_view outcome_name(Outcome outcome) noexcept;

struct Execution {
  Outcome outcome = Outcome::kDone;
  // Empty when done; otherwise "step 4 (all-gather ...) failed on rank 1: ..." and what the
  // executor did about it.
  std::string error;
  std::optional<std::size_t> failed_step;  // the first failure the ranks agreed on
  int failed_rank = -1;
  // When done or recovered: the flat buffer, the views and the layout. Empty otherwise.
  FlatGroup group;
  // Device usage over the run (the device's high-water mark; resident bytes included) and the
  // host staging memory it held at most.
  std::uint64_t measured_peak_device_bytes = 0;
  std::uint64_t measured_peak_host_bytes = 0;
  double seconds = 0;                // the whole step list on this rank, agreement included
  std::vector<double> step_seconds;  // per step of the list (the last run of each)
};

// What the executor needs from the caller besides the tensors: how to free the originals'
// storage. Called at most once, at the step that releases the originals; must not throw.
using ReleaseOriginals = std::function<void()>;

// A source that is not the parameters' own storage: what a kRead step reads from (the checkpoint
// loader's files, loader.h). The executor owns the buffers and the order of the steps; a reader
// only fills bytes it is pointed at, and may be called again for the same range when a step is
// re-run.
class StepReader {
 public:
  virtual ~StepReader() = default;
  // Writes flat-layout bytes [flat_offset, flat_offset + bytes) of the group into dst, device
  // memory of the executor's device (padding as zeros). stage: the step list's live host staging
  // buffer (stage_bytes of pinned host memory), or null; a device the host cannot write is
  // filled through it. Throws Error naming the file, tensor and byte range that failed,
  // OutOfMemory when it cannot allocate its own scratch.
  virtual void read(void* dst, std::uint64_t flat_offset, std::uint64_t bytes, void* stage,
                    std::uint64_t stage_bytes) = 0;
};

// Runs `steps` (a tier's list for this rank from tier_steps, load_steps or the plan) for
// `params` on `device`. With a reader, the group's values come from it (kRead steps), params'
// data pointers are null on entry (nothing of the group is on the device) and a rollback leaves
// them null; without one, a kRead step is refused. `comm` joins the ranks of the group (null, or
// one of size 1, for a single rank); its size must equal the layout's dp, except for a list
// without an all-gather, whose layout may be this rank's own buffer (ZeRO-3's partitions: dp 1,
// rank = comm's rank). On return, each params[i].data points at the parameter's data (original
// storage or a view into the flat buffer, per the outcome); after a release its pointer is null
// only if the outcome is kLost. Throws InvalidArgument for a bad group or a step list that does
// not fit the layout, before any step runs; every other failure is reported in the result,
// never thrown.
Execution execute(const std::vector<Step>& steps, const Layout& layout, std::uint64_t rank,
                  std::span<TensorRef> params, Device& device, Communicator* comm,
                  const ReleaseOriginals& release_originals, const ExecuteOptions& options = {},
                  StepReader* reader = nullptr);

}  // namespace zeroflat
