// A checkpoint's tensors as the pipeline's source (pipeline.h): which tensors hold each
// parameter, the reads that fill any range of a layout from them, the ranks' comparison of their
// copies (headers before, bytes after), and what a rank read.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <tuple>
#include <vector>

#include "exec/pipeline.h"
#include "source/checkpoint/files.h"
#include "zeroflat/loader.h"

namespace zeroflat::detail {

// Each parameter's checkpoint tensors, in order, their elements concatenated.
using Sources = std::vector<std::vector<const CheckpointTensor*>>;

// Every file's size, then every tensor's name, dtype, shape and byte range, as texts the ranks
// compare entry by entry before they read (CheckpointSource::agree; checkpoint_header_digest).
std::vector<std::string> header_entries(const CheckpointIndex& ck);

// The checkpoint tensors of parameter p, checked against its shape (and each against its
// expected shape, when the parameter says). A name the checkpoint lacks goes to `missing` (and
// none is returned). Throws InvalidArgument for a tensor of the wrong shape or dtype.
std::vector<const CheckpointTensor*> resolve(const CheckpointIndex& ck, const LoadParam& p,
                                             std::vector<std::string>& missing);
// Every parameter's tensors; throws InvalidArgument naming the tensors the checkpoint lacks.
Sources resolve_all(const CheckpointIndex& ck, std::span<const LoadParam> params);

// The file reads that fill layout bytes [lo, hi) (element-aligned), dst relative to lo, in file
// order with neighbours merged: one pread where the bytes follow each other in the file and in
// the buffer. runs: where each parameter's layout elements come from (a placement's runs), or
// empty (parameters whole); the layout's elements past a parameter's runs are padding, not
// read.
std::vector<Read> reads_for(const Layout& layout, const Sources& sources, const SourceRuns& runs,
                            std::uint64_t lo, std::uint64_t hi);

// The pipeline's Source and, for the executor, the StepSource its kRead steps read from.
class CheckpointSource final : public Source, public StepSource {
 public:
  // params: the group in order (their tensors are resolved in prepare()); options: the ring,
  // threads, copies check, cold, fault injection (options.read).
  CheckpointSource(const CheckpointIndex& ck, std::span<const LoadParam> params, Device& device,
                   const FlattenOptions& options);

  // Nothing of the group is on the device before the steps.
  std::uint64_t resident_bytes() const override { return 0; }
  StepSource& steps() override { return *this; }
  void check(std::span<const TensorRef> views, const Layout& layout,
             const Device& device) const override;
  void read(void* dst, std::uint64_t flat_offset, std::uint64_t bytes, void* stage,
            std::uint64_t stage_bytes) override;
  void release() noexcept override {}

  // Source
  void prepare(std::span<const TensorRef> params, const Layout& layout, const Placement& placement,
               std::uint64_t world, std::uint64_t rank, Device& device) override;
  std::vector<std::string> describe() const override;
  void agree(Communicator* comm) override;
  Plan plan(const PlanInput& input, const Placement& placement) const override;
  void before(const Candidate& chosen, std::span<const TensorRef>, const Layout&, Device&,
              Communicator*, FlattenResult&) override {
    chosen_ = chosen.tier;
  }
  void after(const FlatGroup& group, Communicator* comm) override;
  void report(FlattenResult& result) const override;

  // The staging ring's bytes for this device and options (0: the host writes the device).
  std::uint64_t ring_bytes() const { return ring_bytes_; }

 private:
  // Layout bytes [lo, hi) as rank `owner` reads them, for messages: the parameter, tensor, file
  // and file offset of byte lo.
  std::string where(std::uint64_t lo, std::uint64_t owner) const;
  // The layout ranges rank q reads under the chosen read plan.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> read_ranges(std::uint64_t q) const;
  // The files no other rank of this load reads, given to files_ (OpenFiles::own_files) before
  // the first read; found once, for worlds of up to kOwnFilesWorld ranks.
  void find_own_files();
  static constexpr std::uint64_t kOwnFilesWorld = 256;
  bool own_found_ = false;
  // The windows of rank q's reads the copies check compares.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> check_windows(std::uint64_t q) const;

  const CheckpointIndex& ck_;
  std::span<const LoadParam> params_;
  Device& device_;
  const FlattenOptions& options_;
  std::uint64_t ring_bytes_ = 0;
  OpenFiles files_;
  Sources sources_;
  std::vector<std::uint64_t> numels_;
  SourceRuns runs_;  // this rank's (the placement's)
  std::optional<Layout> layout_;
  const Placement* placement_ = nullptr;
  std::uint64_t world_ = 1;
  std::uint64_t rank_ = 0;
  Tier chosen_ = Tier::kLoad;
  unsigned threads_ = 1;
  // What this rank read.
  struct ReadRange {
    std::uint64_t lo = 0, hi = 0;        // layout bytes
    const unsigned char* dst = nullptr;  // where they landed (device memory)
  };
  std::vector<ReadRange> read_;
  // The end of the read step whose bytes progress has planned (the executor may read a step's
  // range in parts: the first plans the whole step).
  std::uint64_t planned_to_ = 0;
  // Where the last part's reads ended (file, file offset, layout byte), sorted: a read of the
  // next part that starts there continues one of them (a tensor cut by the parts' edge) and
  // is not counted again.
  std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>> read_ends_;
  ReadReport report_;
};

}  // namespace zeroflat::detail
