// The one pipeline (pipeline.h) and the front door that hands it a group on the device
// (engine.h): check, probe, agree, plan, check values, execute, master.
#include "zeroflat/engine.h"

#include <algorithm>
#include <string>

#include "common/clock.h"
#include "exec/pipeline.h"
#include "zeroflat/error.h"
#include "zeroflat/flatten.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"
#include "zeroflat/zero3.h"

namespace zeroflat {
namespace {

// Everything besides the group that must be the same on every rank, as text: the options, the
// source's own account of itself, the caller's.
std::string options_text(const FlattenOptions& o, const Device& device,
                         const detail::GroupSource* source, detail::Placement placement) {
  const LayoutOptions& l = o.layout;
  const std::string name = device.name();
  const std::optional<DevicePreset> hw = device.hardware();
  std::string t = "dp " + std::to_string(l.dp) + ", alignment factor " +
                  std::to_string(l.alignment_factor) + ", round-robin " +
                  (l.round_robin ? "on" : "off") + ", dtype " +
                  std::string(dtype_name(l.dtype)) + ", parameter alignment " +
                  std::to_string(l.param_align_bytes) + " B, DeepSpeed rules " +
                  (o.release ? o.release->rules : std::string("none")) + ", margin " +
                  (o.margin_bytes ? std::to_string(*o.margin_bytes) : std::string("default")) +
                  ", master " + (o.master ? "yes" : "no") + ", device " +
                  name.substr(0, name.find(':')) + (hw ? " (" + hw->name + ")" : "") +
                  (device.keeps_data() ? "" : " without data");
  t += std::string(", tier ") + (o.tier ? std::string(tier_name(*o.tier)) : "auto");
  if (placement == detail::Placement::kPartitions) t += ", placement ZeRO-3 partitions";
  if (source == nullptr) {
    t += std::string(", value check ") + (o.check_values ? "on" : "off");
  } else {
    t += ", storage " + std::to_string(o.storage_bytes_per_second) + " B/s; source: " +
         source->must_match();
  }
  if (o.bandwidths) {
    const Bandwidths& b = *o.bandwidths;
    t += ", bandwidths " + std::to_string(b.device_copy) + "/" + std::to_string(b.host_link) +
         "/" + std::to_string(b.allgather_bus) + "/" + std::to_string(b.host_copy);
  }
  if (!o.must_match.empty()) t += "; " + o.must_match;
  return t;
}

std::uint64_t group_bytes(std::span<const TensorRef> params) {
  std::uint64_t n = 0;
  for (const TensorRef& t : params) {
    if (__builtin_add_overflow(n, t.num_bytes(), &n)) return UINT64_MAX;
  }
  return n;
}

std::string probe_failure(const Device& device, const ProbeResult& p) {
  std::vector<std::string> why;
  for (const SourceReport& s : p.sources) {
    if (!s.ok) why.push_back(s.source + ": " + s.detail);
  }
  return device.name() + ": no free-memory source could answer (" + join(why, "; ") +
         "), so no plan can be proven to fit";
}

// This rank's probe as the planner's facts: capacity, free (the group's own bytes counted in use
// when they are on the device, or about to be), host memory it may stage through.
struct LocalFacts {
  ProbeResult probe;
  ProbeResult host_probe;
  AgreementInput facts;  // capacity, free, host free and integrated filled in
};
LocalFacts probe_facts(Device& device, const ProbeContext& context, std::uint64_t original_bytes,
                       bool originals_resident) {
  LocalFacts out;
  out.probe = device.probe_memory(context);
  out.host_probe = device.probe_host_memory(context);
  const std::uint64_t capacity = out.probe.total_bytes;
  std::uint64_t free = std::min(out.probe.free_bytes, capacity);
  if (!originals_resident) {
    free -= std::min(free, original_bytes);
  } else if (capacity >= original_bytes && capacity - free < original_bytes) {
    // The group's own bytes are on this device: whatever a source says, they are in use.
    free = capacity - original_bytes;
  }
  out.facts.capacity_bytes = capacity;
  out.facts.free_bytes = free;
  out.facts.host_free_bytes = out.host_probe.available ? out.host_probe.free_bytes : 0;
  out.facts.integrated = out.probe.integrated;
  return out;
}

// The planner's input from what the ranks agreed, and the plan: the tiers from the originals,
// the read plans from a source.
PlanInput plan_input(const Agreement& agreed, const ProbeContext& context, const Device& device,
                     const FlattenOptions& options, const Layout& layout,
                     std::uint64_t original_bytes, std::uint64_t rank, bool from_source) {
  PlanFacts facts = plan_facts(agreed, context.local_ranks);
  facts.bandwidths =
      options.bandwidths
          ? *options.bandwidths
          : device.hardware().value_or(generic_preset(agreed.capacity_bytes)).bandwidths;
  PlanInput in = make_plan_input(layout, original_bytes, facts, rank,
                                 from_source ? std::nullopt : options.tier, options.margin_bytes);
  if (from_source && options.storage_bytes_per_second > 0) {
    in.bandwidths.storage = options.storage_bytes_per_second;
  }
  return in;
}

}  // namespace

PlannedGroup plan_param_group(const Layout& layout, Device& device,
                              const FlattenOptions& options, std::uint64_t rank) {
  PlannedGroup out;
  ProbeContext context = options.probe;
  if (context.local_ranks == 0) {
    context.local_ranks =
        runtime_env().local_ranks.value_or(static_cast<unsigned>(layout.options().dp));
  }
  std::uint64_t numel = 0;
  for (std::uint64_t n : layout.numels()) {
    if (__builtin_add_overflow(numel, n, &numel)) numel = UINT64_MAX;
  }
  std::uint64_t original_bytes = 0;
  if (__builtin_mul_overflow(numel, layout.element_size(), &original_bytes)) {
    original_bytes = UINT64_MAX;
  }
  LocalFacts here = probe_facts(device, context, original_bytes, /*originals_resident=*/false);
  out.probe = std::move(here.probe);
  out.host_probe = std::move(here.host_probe);
  const Agreement alone = agree(here.facts, nullptr);
  out.input = plan_input(alone, context, device, options, layout, original_bytes, rank, false);
  out.plan = plan_group(out.input);
  return out;
}

namespace detail {

FlattenResult run_pipeline(std::span<TensorRef> params, Device& device, Communicator* comm,
                           const FlattenOptions& options, const ReleaseOriginals& release_originals,
                           GroupSource* source, Placement placement) {
  const bool partitions = placement == Placement::kPartitions;
  FlattenResult res;
  Communicator* group = comm != nullptr && comm->size() > 1 ? comm : nullptr;
  const std::uint64_t ranks = group ? static_cast<std::uint64_t>(group->size()) : 1;
  const std::uint64_t rank = group ? static_cast<std::uint64_t>(group->rank()) : 0;

  // --- this rank's own checks: kept, not thrown, until the ranks have agreed -----------------
  std::string error = options.local_error;
  std::optional<Layout> layout;
  ProbeContext context = options.probe;
  if (error.empty()) {
    try {
      if (options.layout.dp != ranks) {
        throw InvalidArgument("the layout is for dp " + std::to_string(options.layout.dp) +
                              ", but " +
                              (group ? "the communicator has " + std::to_string(ranks) + " ranks"
                                     : std::string("there is no communicator (one rank)")) +
                              ": dp must be the number of ranks sharing the group");
      }
      std::vector<std::uint64_t> numels(params.size());
      for (std::size_t i = 0; i < params.size(); ++i) numels[i] = params[i].numel;
      if (partitions) {
        if (source == nullptr) {
          throw InvalidArgument("ZeRO-3's partitions are read from a source (a checkpoint)");
        }
        layout = zero3_buffer_layout(numels, options.layout);
      } else {
        if (options.release) check_release_options(options.layout, *options.release);
        if (source == nullptr) validate_group(params, device, options.layout);
        layout = Layout::compute(numels, options.layout);
      }
      if (context.local_ranks == 0) {
        context.local_ranks = runtime_env().local_ranks.value_or(static_cast<unsigned>(ranks));
      }
    } catch (const Error& e) {
      error = e.what();
    }
  }
  if (context.local_ranks == 0) context.local_ranks = 1;

  // --- probe (with a source, nothing of the group is on the device yet) ------------------------
  const std::uint64_t original_bytes = source == nullptr ? group_bytes(params) : 0;
  LocalFacts here = probe_facts(device, context, original_bytes, /*originals_resident=*/true);
  res.probe = std::move(here.probe);
  res.host_probe = std::move(here.host_probe);
  if (error.empty() && !res.probe.available) error = probe_failure(device, res.probe);

  // --- agree: one all-reduce; an error anywhere is thrown everywhere ---------------------------
  AgreementInput& ai = here.facts;
  ai.options = options_text(options, device, source, placement);
  ai.params = params;
  ai.names = options.names;
  ai.error = error;
  const Agreement agreed = agree(ai, group);
  // The ranks' sources must say the same (every rank gets here: the agreement threw nowhere).
  if (source != nullptr) source->agree(group);

  // --- plan -------------------------------------------------------------------------------------
  res.input = plan_input(agreed, context, device, options, *layout, original_bytes, rank,
                         source != nullptr);
  res.input.ranks = ranks;
  res.plan = source == nullptr ? plan_group(res.input)
                               : plan_reads(res.input, source->ring_bytes(), options.tier,
                                            partitions ? std::span<const Tier>(kPartitionReadPlans)
                                                       : std::span<const Tier>(kReadPlans));
  const Candidate* chosen = res.plan.chosen_candidate();
  if (chosen == nullptr) return res;  // the same verdict on every rank: nothing moves

  // --- the values check: slices are about to change hands --------------------------------------
  if (source == nullptr && options.check_values && group != nullptr && device.keeps_data() &&
      (chosen->tier == Tier::kSharded || chosen->tier == Tier::kStaged)) {
    res.value_check = check_same_values(*layout, params, device, group);
    if (res.value_check.first_mismatch >= 0) throw InvalidArgument(res.value_check.error);
  }

  // --- execute ----------------------------------------------------------------------------------
  const std::uint64_t resident = std::max(device.memory_info().allocated_bytes, original_bytes);
  res.predicted_peak_device_bytes =
      simulate(chosen->steps, resident, original_bytes, layout->options().dp).peak_device_bytes;
  // The partitions' views are what the steps fill and re-point; the parameters stay whole.
  std::vector<TensorRef> slices;
  if (partitions) {
    for (std::uint64_t p : layout->numels()) {
      slices.push_back(TensorRef{nullptr, p, Shape{static_cast<std::int64_t>(p)},
                                 options.layout.dtype, &device});
    }
  }
  res.execution = execute(chosen->steps, *layout, rank, partitions ? slices : params, device,
                          group, source == nullptr ? release_originals : ReleaseOriginals{},
                          options.execute, source);
  // A source's after-check runs on every rank whose execution completed; the executor's last
  // agreement made that every rank or none.
  if (source != nullptr && res.complete()) source->after(res.execution.group, group);

  // --- the fp32 master partition: it may not fit where the flatten just did ---------------------
  if (options.master && res.complete()) {
    const auto t0 = detail::Clock::now();
    try {
      // A rank's own buffer (partitions) is its layout's one partition.
      res.master = make_master_partition(device, res.execution.group, partitions ? 0 : rank);
      res.master_seconds = detail::seconds_since(t0);
    } catch (const OutOfMemory& e) {
      res.master_error = std::string("the fp32 master partition does not fit: ") + e.what();
    }
  }
  return res;
}

}  // namespace detail

FlattenResult flatten_param_group(std::span<TensorRef> params, Device& device,
                                  Communicator* comm, const FlattenOptions& options,
                                  const ReleaseOriginals& release_originals) {
  return detail::run_pipeline(params, device, comm, options, release_originals, nullptr);
}

}  // namespace zeroflat
