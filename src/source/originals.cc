// The front door for a group on the device (engine.h: flatten_param_group), and the parameters'
// own storage as the pipeline's source (pipeline.h): the tiers gather from it, and release it
// when the plan says.
#include "exec/pipeline.h"
#include "zeroflat/agree.h"
#include "zeroflat/common.h"
#include "zeroflat/engine.h"

namespace zeroflat::detail {
namespace {

// The parameters' own storage on the device as the pipeline's source (flatten_param_group).
class OriginalsSource final : public Source {
 public:
  OriginalsSource(std::span<const TensorRef> params, Device& device, bool check_values,
                  ReleaseOriginals release_originals);
  std::uint64_t resident_bytes() const override { return bytes_; }
  StepSource& steps() override;
  void prepare(std::span<const TensorRef> params, const Layout& layout, const Placement& placement,
               std::uint64_t world, std::uint64_t rank, Device& device) override;
  std::vector<std::string> describe() const override;
  void agree(Communicator*) override {}
  Plan plan(const PlanInput& input, const Placement& placement) const override;
  void before(const Candidate& chosen, std::span<const TensorRef> params, const Layout& layout,
              Device& device, Communicator* comm, FlattenResult& result) override;
  void after(const FlatGroup&, Communicator*) override {}
  void report(FlattenResult&) const override {}

 private:
  std::vector<TensorRef> params_;
  Device& device_;
  bool check_values_;
  ReleaseOriginals release_;
  std::uint64_t bytes_ = 0;
  std::optional<Layout> layout_;    // once prepared
  std::optional<Originals> steps_;  // once prepared: the executor's source over layout_
};

OriginalsSource::OriginalsSource(std::span<const TensorRef> params, Device& device,
                                 bool check_values, ReleaseOriginals release_originals)
    : params_(params.begin(), params.end()),
      device_(device),
      check_values_(check_values),
      release_(std::move(release_originals)) {
  for (const TensorRef& t : params_) bytes_ += t.num_bytes();
}

void OriginalsSource::prepare(std::span<const TensorRef> params, const Layout& layout,
                              const Placement& placement, std::uint64_t, std::uint64_t,
                              Device& device) {
  if (placement.tiers().empty()) {
    throw InvalidArgument("the " + placement.name() +
                          " are read from files (a checkpoint), not built from the parameters' "
                          "own storage");
  }
  validate_group(params, device, layout.options());
  steps_.reset();
  layout_ = layout;
  steps_.emplace(*layout_, params_, device_, release_);
}

StepSource& OriginalsSource::steps() {
  if (!steps_) {
    throw InternalError("the originals were asked for before the pipeline prepared them");
  }
  return *steps_;
}

std::vector<std::string> OriginalsSource::describe() const {
  return {std::string("value check ") + (check_values_ ? "on" : "off")};
}

Plan OriginalsSource::plan(const PlanInput& input, const Placement&) const {
  return plan_group(input);
}

void OriginalsSource::before(const Candidate& chosen, std::span<const TensorRef> params,
                             const Layout& layout, Device& device, Communicator* comm,
                             FlattenResult& result) {
  // Slices are about to change hands: every rank must hold the same values.
  if (!check_values_ || comm == nullptr || !device.keeps_data() ||
      (chosen.tier != Tier::kSharded && chosen.tier != Tier::kStaged)) {
    return;
  }
  result.value_check = check_same_values(layout, params, device, comm);
  if (result.value_check.first_mismatch >= 0) throw InvalidArgument(result.value_check.error);
}

}  // namespace
}  // namespace zeroflat::detail

namespace zeroflat {

FlattenResult flatten_param_group(std::span<TensorRef> params, Device& device, Communicator* comm,
                                  const FlattenOptions& options,
                                  const ReleaseOriginals& release_originals) {
  detail::OriginalsSource source(params, device, options.check_values, release_originals);
  detail::FlatPlacement placement;
  return detail::run_pipeline(params, device, comm, options, source, placement);
}

}  // namespace zeroflat
