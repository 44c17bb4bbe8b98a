// The one pipeline (pipeline.h) and the front door that hands it a group on the device
// (engine.h): check, probe, agree, plan, check values, execute, master.
#include "zeroflat/engine.h"

#include <algorithm>
#include <string>

#include "common/clock.h"
#include "common/saturate.h"
#include "exec/pipeline.h"
#include "zeroflat/agree.h"
#include "zeroflat/common.h"
#include "zeroflat/engine.h"
#include "zeroflat/layout.h"

namespace zeroflat {
namespace {

std::string bytes_text(std::optional<std::uint64_t> b) {
  return b ? std::to_string(*b) + " B" : std::string("default");
}

// Everything besides the group that must be the same on every rank, as "key value" items: the
// options, the placement, the source's own account of itself, the caller's.
std::vector<std::string> options_items(const FlattenOptions& o, const Device& device,
                                       const detail::Source& source,
                                       const detail::Placement& placement) {
  const LayoutOptions& l = o.layout;
  const std::string name = device.name();
  const std::optional<DevicePreset> hw = device.hardware();
  std::vector<std::string> items{
      "dp " + std::to_string(l.dp),
      "alignment factor " + std::to_string(l.alignment_factor),
      std::string("round-robin ") + (l.round_robin ? "on" : "off"),
      "dtype " + std::string(dtype_name(l.dtype)),
      "parameter alignment " + std::to_string(l.param_align_bytes) + " B",
      "DeepSpeed rules " + (o.release ? o.release->rules : std::string("none")),
      "margin " + bytes_text(o.margin_bytes),
      std::string("master ") + (o.master ? "yes" : "no"),
      "device " + name.substr(0, name.find(':')) + (hw ? " (" + hw->name + ")" : "") +
          (device.keeps_data() ? "" : " without data"),
      "tier " + (o.tier ? std::string(tier_name(*o.tier)) : std::string("auto")),
      "placement " + placement.name(),
      "storage " + std::to_string(o.storage_bytes_per_second) + " B/s",
  };
  if (o.bandwidths) {
    const Bandwidths& b = *o.bandwidths;
    items.push_back("bandwidths " + std::to_string(b.device_copy) + "/" +
                    std::to_string(b.host_link) + "/" + std::to_string(b.allgather_bus) + "/" +
                    std::to_string(b.host_copy));
  }
  for (std::string& item : source.describe()) items.push_back(std::move(item));
  items.insert(items.end(), o.must_match.begin(), o.must_match.end());
  return items;
}

std::string probe_failure(const Device& device, const ProbeResult& p) {
  std::vector<std::string> why;
  for (const SourceReport& s : p.sources) {
    if (!s.ok) why.push_back(s.source + ": " + s.detail);
  }
  return device.name() + ": no free-memory source could answer (" + join(why, "; ") +
         "), so no plan can be proven to fit";
}

// This rank's probe as the planner's facts: capacity, free (the group's own bytes counted in use:
// `resident` of them on the device now, `to_place` about to be put there before the steps),
// host memory it may stage through.
struct LocalFacts {
  ProbeResult probe;
  ProbeResult host_probe;
  AgreementInput facts;  // capacity, free, host free and integrated filled in
};
LocalFacts probe_facts(Device& device, const ProbeContext& context, std::uint64_t to_place,
                       std::uint64_t resident) {
  LocalFacts out;
  out.probe = device.probe_memory(context);
  out.host_probe = device.probe_host_memory(context);
  const std::uint64_t capacity = out.probe.total_bytes;
  std::uint64_t free = std::min(out.probe.free_bytes, capacity);
  free -= std::min(free, to_place);
  if (capacity >= resident && capacity - free < resident) {
    // The group's own bytes are on this device: whatever a source says, they are in use.
    free = capacity - resident;
  }
  out.facts.capacity_bytes = capacity;
  out.facts.free_bytes = free;
  out.facts.host_free_bytes = out.host_probe.available ? out.host_probe.free_bytes : 0;
  out.facts.integrated = out.probe.integrated;
  return out;
}

// The planner's input from what the ranks agreed.
PlanInput plan_input(const Agreement& agreed, unsigned local_ranks, const Device& device,
                     const FlattenOptions& options, const Layout& layout,
                     std::uint64_t original_bytes, std::uint64_t slot, std::uint64_t ranks,
                     std::optional<Tier> tier) {
  PlanFacts facts = plan_facts(agreed, local_ranks);
  facts.bandwidths =
      options.bandwidths
          ? *options.bandwidths
          : device.hardware().value_or(generic_preset(agreed.capacity_bytes)).bandwidths;
  PlanInput in = make_plan_input(layout, original_bytes, facts, slot, tier, options.margin_bytes);
  if (options.storage_bytes_per_second > 0)
    in.bandwidths.storage = options.storage_bytes_per_second;
  in.ranks = ranks;
  return in;
}

// The caller's own account of the layout (FlattenOptions::expected_offsets), when it gave one.
void check_expected_layout(const Layout& layout, const FlattenOptions& o) {
  const std::vector<std::uint64_t>& want = o.expected_offsets;
  if (!want.empty()) {
    if (want.size() != layout.num_params()) {
      throw InvalidArgument("the caller's layout has " + std::to_string(want.size()) +
                            " offsets for " + std::to_string(layout.num_params()) + " parameters");
    }
    for (std::size_t i = 0; i < want.size(); ++i) {
      if (want[i] != layout.offsets()[i]) {
        throw InvalidArgument((i < o.names.size() ? o.names[i] : "parameter " + std::to_string(i)) +
                              " is at element " + std::to_string(layout.offsets()[i]) +
                              " of zeroflat's layout but at " + std::to_string(want[i]) +
                              " of the caller's");
      }
    }
  }
  if (o.expected_flat_numel && *o.expected_flat_numel != layout.flat_numel()) {
    throw InvalidArgument("zeroflat's flat buffer has " + std::to_string(layout.flat_numel()) +
                          " elements, the caller's " + std::to_string(*o.expected_flat_numel));
  }
}

std::uint64_t numel_bytes(std::span<const std::uint64_t> numels, std::uint64_t esize) {
  std::uint64_t numel = 0;
  for (std::uint64_t n : numels) numel = detail::sat_add(numel, n);
  return detail::sat_mul(numel, esize);
}

}  // namespace

const Candidate& FlattenResult::chosen() const {
  if (const Candidate* c = plan.chosen_candidate()) return *c;
  if (plan.candidates.empty()) throw InvalidArgument("the result holds no plan");
  return plan.candidates.front();
}

PlannedGroup plan_param_group(const Layout& layout, Device& device, const FlattenOptions& options,
                              std::uint64_t rank) {
  PlannedGroup out;
  ProbeContext context = options.probe;
  context.local_ranks = detail::local_ranks(options, layout.options().dp);
  const std::uint64_t bytes = numel_bytes(layout.numels(), layout.element_size());
  LocalFacts here = probe_facts(device, context, /*to_place=*/bytes, /*resident=*/0);
  out.probe = std::move(here.probe);
  out.host_probe = std::move(here.host_probe);
  const Agreement alone = agree(here.facts, nullptr);
  out.input = plan_input(alone, context.local_ranks, device, options, layout, bytes, rank,
                         layout.options().dp, options.tier);
  out.plan = plan_group(out.input);
  return out;
}

namespace detail {

unsigned local_ranks(const FlattenOptions& options, std::uint64_t ranks) {
  if (options.probe.local_ranks > 0) return options.probe.local_ranks;
  return runtime_env().local_ranks.value_or(
      static_cast<unsigned>(std::clamp<std::uint64_t>(ranks, 1, UINT32_MAX)));
}

FlattenResult run_pipeline(std::span<TensorRef> params, Device& device, Communicator* comm,
                           const FlattenOptions& options, Source& source, Placement& placement) {
  const auto t_start = Clock::now();
  FlattenResult res;
  Communicator* group = comm != nullptr && comm->size() > 1 ? comm : nullptr;
  const std::uint64_t ranks = group ? static_cast<std::uint64_t>(group->size()) : 1;
  const std::uint64_t rank = group ? static_cast<std::uint64_t>(group->rank()) : 0;
  const std::uint64_t slot = placement.slot(rank);
  res.rank = rank;
  ProbeContext context = options.probe;
  context.local_ranks = local_ranks(options, ranks);

  // --- this rank's own checks: kept, not thrown, until the ranks have agreed -----------------
  std::string error = options.local_error;
  std::optional<Layout> layout;
  std::vector<std::uint64_t> numels(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) numels[i] = params[i].numel;
  if (error.empty()) {
    try {
      if (options.layout.dp != ranks) {
        throw InvalidArgument("the layout is for dp " + std::to_string(options.layout.dp) +
                              ", but " +
                              (group ? "the communicator has " + std::to_string(ranks) + " ranks"
                                     : std::string("there is no communicator (one rank)")) +
                              ": dp must be the number of ranks sharing the group");
      }
      layout = placement.layout(numels, options);
      check_expected_layout(*layout, options);
      source.prepare(params, *layout, placement, ranks, rank, device);
    } catch (const Error& e) {
      error = e.what();
    }
  }

  // --- probe: the group's bytes the source holds on the device are in use already -------------
  LocalFacts here = probe_facts(device, context, /*to_place=*/0, source.resident_bytes());
  res.probe = std::move(here.probe);
  res.host_probe = std::move(here.host_probe);
  if (error.empty() && !res.probe.available) error = probe_failure(device, res.probe);

  // --- agree: one all-reduce; an error anywhere is thrown everywhere ---------------------------
  AgreementInput& ai = here.facts;
  const std::vector<std::string> items = options_items(options, device, source, placement);
  ai.options = items;
  ai.params = params;
  ai.names = options.names;
  ai.error = error;
  const Agreement agreed = agree(ai, group);
  source.agree(group);  // every rank gets here: the agreement threw nowhere

  // --- plan -------------------------------------------------------------------------------------
  res.input = plan_input(agreed, context.local_ranks, device, options, *layout,
                         source.resident_bytes(), slot, ranks, options.tier);
  res.plan = source.plan(res.input, placement);
  const Candidate* chosen = res.plan.chosen_candidate();
  if (chosen == nullptr) {  // the same verdict on every rank: nothing moves
    res.seconds = seconds_since(t_start);
    return res;
  }
  source.before(*chosen, params, *layout, device, group, res);

  // --- execute ----------------------------------------------------------------------------------
  const std::uint64_t resident =
      std::max(device.memory_info().allocated_bytes, source.resident_bytes());
  res.predicted_peak_device_bytes = chosen->profile.peak_from(resident);
  // Where this rank's master partition is built as its slice is read (a host device's load), its
  // memory is held from the read on, beside the step list's peak (which the read's stage is).
  ExecuteOptions execute_options = options.execute;
  execute_options.master_slot = placement.buffer_slot(rank);
  execute_options.master =
      options.master &&
      builds_master(chosen->steps, *layout, slot, execute_options.master_slot, device);
  if (execute_options.master) {
    res.predicted_peak_device_bytes += layout->partition_numel() * 4;
  }
  res.execution = execute(chosen->steps, *layout, slot, placement.views(params, *layout, device),
                          device, group, source.steps(), execute_options);
  // The after-check runs on every rank whose execution completed; the executor's last agreement
  // made that every rank or none.
  if (res.complete()) source.after(res.execution.group, group);
  source.report(res);

  // --- the fp32 master partition: it may not fit where the buffer just did ----------------------
  if (options.master && res.complete() && res.execution.master) {
    res.master = std::move(res.execution.master);
    res.master_seconds = res.execution.master_seconds;
  } else if (options.master && res.complete()) {
    const auto t0 = Clock::now();
    try {
      res.master = make_master_partition(device, res.execution.group, placement.buffer_slot(rank));
      res.master_seconds = seconds_since(t0);
    } catch (const OutOfMemory& e) {
      res.master_error = std::string("the fp32 master partition does not fit: ") + e.what();
    }
  }
  res.seconds = seconds_since(t_start);
  return res;
}

}  // namespace detail

}  // namespace zeroflat
