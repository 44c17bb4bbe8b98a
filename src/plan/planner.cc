// Presets, the cost model, candidate selection, and the estimate of what training needs after.
#include <algorithm>
#include <cmath>
#include <string>

#include "common/saturate.h"
#include "zeroflat/common.h"
#include "zeroflat/plan.h"

namespace zeroflat {
namespace {

using detail::kSaturated;
using detail::sat_add;
using detail::sat_mul;

constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;
// Fixed cost per step (allocation, launch, synchronization), so that of two step lists that
// move the same bytes the shorter one wins.
constexpr double kStepSeconds = 50e-6;
// Page-locking host memory for staging runs at a few GB/s.
constexpr double kPinBytesPerSecond = 8e9;

double predicted_seconds(const Candidate& c, const Bandwidths& bw, std::uint64_t local_ranks) {
  double t = kStepSeconds * static_cast<double>(c.steps.size());
  auto add = [&](std::uint64_t bytes, double rate) {
    if (bytes > 0) t += rate > 0 ? static_cast<double>(bytes) / rate : INFINITY;
  };
  // Each accelerator has its own host link, but the host's memory bandwidth and the kernel's
  // page pinning are shared by the ranks of the node, which all stage at once.
  const double ranks = static_cast<double>(local_ranks > 0 ? local_ranks : 1);
  const double link =
      std::min(bw.host_link, bw.host_copy > 0 ? bw.host_copy / ranks : bw.host_link);
  add(c.profile.device_copy_bytes, bw.device_copy);
  add(c.profile.pcie_bytes, link);
  add(c.profile.comm_bytes, bw.allgather_bus);
  add(c.profile.read_bytes, bw.read);
  add(c.profile.peak_host_bytes, kPinBytesPerSecond / ranks);
  return t;
}

// The ranks sharing the group planned by `in` (a layout of one rank's own buffer has dp 1).
std::uint64_t group_ranks(const PlanInput& in) {
  return std::max<std::uint64_t>(in.ranks > 0 ? in.ranks : in.layout.options().dp, 1);
}

// A read plan's time (plan_load). Three resources: the storage (each node pulls from it its
// ranks' reads, once where they read the same bytes: 1/nodes of the group under kLoad and
// kLoadSlice, all of it under kLoadWhole, its ranks' own partitions under kLoadPartitions; at
// `read` from a node's own storage, or its share of `storage` when the nodes share one), each
// rank's memory copies (a read served by the node's page cache is a copy, and so is an
// all-gather among the ranks of one node, through the host: a rank writes its slice and copies
// the others'), at its share of the node's host_copy, and the network (the all-gather between
// nodes, or between accelerators, at allgather_bus). Added up: a rank's copies out of the page
// cache wait for the storage to fill it, and a cold read is both.
// What a read plan does, for the plan's reason.
std::string read_plan_words(Tier plan) {
  switch (plan) {
    case Tier::kLoad:
      return "each rank reads its slice, one all-gather completes the buffers";
    case Tier::kLoadWhole:
      return "each rank reads the whole buffer from its node's page cache, no all-gather";
    case Tier::kLoadPartitions:
      return "each rank reads only its own partition of every parameter, no all-gather";
    case Tier::kLoadSlice:
      return "each rank reads only its own slice and keeps it, no all-gather";
    default:
      return "";
  }
}

double load_seconds(const Candidate& c, const PlanInput& in, Tier plan) {
  const Bandwidths& bw = in.bandwidths;
  const std::uint64_t dp = group_ranks(in);
  const std::uint64_t local = std::min(std::max<std::uint64_t>(in.local_ranks, 1), dp);
  const double nodes = static_cast<double>((dp + local - 1) / local);
  const double ranks = static_cast<double>(local);
  const double read = static_cast<double>(c.profile.read_bytes);
  const double comm = static_cast<double>(c.profile.comm_bytes);
  const double cache = bw.host_copy > 0 ? bw.host_copy / ranks : bw.read;
  auto over = [](double bytes, double rate) {
    return bytes <= 0 ? 0.0 : rate > 0 ? bytes / rate : INFINITY;
  };
  // Through a staging ring (a device the host cannot write) the reads also cross the host link,
  // each accelerator its own, and the all-gather runs between accelerators.
  const bool ring = c.profile.peak_host_bytes > 0;
  // Under kLoadWhole every rank of a node reads the same bytes; under the others, its own.
  const bool shared = plan == Tier::kLoadWhole;
  const double node_share = shared ? read : read * ranks;
  const double all_nodes = shared ? read * nodes : read * static_cast<double>(dp);
  const double storage = bw.storage > 0 ? over(all_nodes, bw.storage) : over(node_share, bw.read);
  double copies = over(read, cache);
  double network = 0;
  if (ring) {
    copies = std::max(copies, over(read, bw.host_link));
    network = over(comm, bw.allgather_bus);
  } else if (nodes > 1) {
    network = over(comm, bw.allgather_bus);
  } else if (comm > 0) {
    copies += over(read + comm, cache);  // the slice into the window, the others out of it
  }
  return kStepSeconds * static_cast<double>(c.steps.size()) + storage + copies + network +
         over(static_cast<double>(c.profile.peak_host_bytes), kPinBytesPerSecond / ranks);
}

}  // namespace

std::uint64_t default_margin(std::uint64_t capacity_bytes) noexcept {
  return std::min(capacity_bytes / 100 * 3, kGiB);
}

PlanInput make_plan_input(const Layout& layout, std::uint64_t original_bytes,
                          const PlanFacts& facts, std::uint64_t rank, std::optional<Tier> forced,
                          std::optional<std::uint64_t> margin_bytes) {
  PlanInput in;
  in.layout = layout;
  in.original_bytes = original_bytes;
  in.capacity_bytes = facts.capacity_bytes;
  in.free_bytes = facts.free_bytes;
  in.margin_bytes = margin_bytes.value_or(default_margin(facts.capacity_bytes));
  in.host_free_bytes = facts.host_free_bytes;
  in.rank = rank;
  // Staging through the host frees nothing where device memory is host memory, so the planner
  // never picks it there; a forced tier runs its steps as it would on a discrete GPU.
  in.integrated = facts.integrated && !forced;
  in.local_ranks = facts.local_ranks > 0 ? facts.local_ranks : 1;
  in.bandwidths = facts.bandwidths;
  in.forced = forced;
  return in;
}

const Candidate* Plan::chosen_candidate() const {
  if (!chosen) return nullptr;
  for (const Candidate& c : candidates) {
    if (c.tier == *chosen) return &c;
  }
  return nullptr;
}

Plan plan_group(const PlanInput& in) {
  const Layout& l = in.layout;
  const std::uint64_t fb = l.flat_bytes();
  const std::uint64_t sb = l.partition_bytes();
  const std::uint64_t m = in.original_bytes;
  if (in.free_bytes > in.capacity_bytes) {
    throw InvalidArgument("free memory " + format_bytes(in.free_bytes) + " exceeds the capacity " +
                          format_bytes(in.capacity_bytes));
  }
  const std::uint64_t resident = in.capacity_bytes - in.free_bytes;
  const bool model_fits = m <= in.capacity_bytes;
  if (model_fits && m > resident) {
    throw InvalidArgument("free memory " + format_bytes(in.free_bytes) + " leaves " +
                          format_bytes(resident) + " in use, less than the group's own " +
                          format_bytes(m) + ", which are resident");
  }
  const std::uint64_t limit =
      in.capacity_bytes > in.margin_bytes ? in.capacity_bytes - in.margin_bytes : 0;
  const std::uint64_t headroom = limit > resident ? limit - resident : 0;  // free - margin

  // A candidate's steps, their run on the memory model, and their predicted time. When the
  // model does not fit at all, the steps are still shown, run from the model alone.
  auto build = [&](Tier tier, std::uint64_t staged_x) {
    Candidate c;
    c.tier = tier;
    c.steps = tier_steps(tier, l, in.rank, staged_x);
    c.profile = simulate(c.steps, model_fits ? resident : m, m, l.options().dp);
    c.predicted_seconds = predicted_seconds(c, in.bandwidths, in.local_ranks);
    return c;
  };

  Plan plan;
  for (Tier tier : kAllTiers) {
    Candidate c = build(tier, 0);
    if (tier == Tier::kStaged && model_fits) {
      // As much of the slice on the device as fits at both peaks: beside the originals, and
      // beside the flat buffer once the originals are gone.
      const std::uint64_t after_release = sat_add(resident - m, fb);
      const std::uint64_t room2 = limit > after_release ? limit - after_release : 0;
      const std::uint64_t staged_x = std::min({sb, headroom, room2});
      // Keeping a few bytes on the device costs four more steps than keeping none: keep them
      // only when that is faster, so that more free memory never yields a slower plan.
      if (staged_x > 0) {
        Candidate some = build(tier, staged_x);
        if (some.predicted_seconds < c.predicted_seconds) c = std::move(some);
      }
    }
    if (!model_fits) {
      c.feasible = false;
      c.why_not = "the group's " + format_bytes(m) + " do not fit in the device's " +
                  format_bytes(in.capacity_bytes);
      plan.candidates.push_back(std::move(c));
      continue;
    }
    const std::uint64_t peak = c.profile.peak_device_bytes;
    std::string why;
    // A saturated peak is more than 64 bits can count: it fits nowhere, even under a limit of
    // UINT64_MAX.
    if (peak > limit || peak == kSaturated) {
      why = "peak " + format_bytes(peak) + " exceeds capacity " + format_bytes(in.capacity_bytes) +
            " - margin " + format_bytes(in.margin_bytes) + " by " +
            (peak == kSaturated ? "more than 64 bits can count" : format_bytes(peak - limit));
      if (tier == Tier::kDevice) {
        why += ": a second copy (" + format_bytes(fb) + ") does not fit in " +
               format_bytes(headroom) + " free";
      } else if (tier == Tier::kSharded) {
        why += ": the partition buffer (" + format_bytes(sb) + ") does not fit in " +
               format_bytes(headroom) + " free";
      } else {
        why += ": the flat buffer does not fit even after the originals are freed";
      }
    } else if (in.integrated && c.profile.peak_host_bytes > 0) {
      why =
          "on an integrated device host memory is device memory: staging through it frees "
          "nothing";
    } else if (c.profile.peak_host_bytes > in.host_free_bytes ||
               c.profile.peak_host_bytes == kSaturated) {
      why = "needs " + format_bytes(c.profile.peak_host_bytes) + " of pinned host memory; " +
            format_bytes(in.host_free_bytes) + " available to this rank";
    }
    c.feasible = why.empty();
    c.why_not = why;
    plan.candidates.push_back(std::move(c));
  }

  // The fastest feasible candidate (earlier tiers win ties), or the forced one.
  const Candidate* best = nullptr;
  for (const Candidate& c : plan.candidates) {
    if (!c.feasible || (in.forced && c.tier != *in.forced)) continue;
    if (best == nullptr || c.predicted_seconds < best->predicted_seconds) best = &c;
  }
  std::size_t feasible = 0;
  for (const Candidate& c : plan.candidates) feasible += c.feasible;
  if (best != nullptr) {
    plan.chosen = best->tier;
    plan.reason = std::string(tier_name(best->tier)) +
                  (in.forced ? " (forced)"
                             : ": the fastest of " + std::to_string(feasible) + " feasible tier" +
                                   (feasible == 1 ? "" : "s")) +
                  ", " + format_seconds(best->predicted_seconds) + ", peak " +
                  format_bytes(best->profile.peak_device_bytes) + " of " + format_bytes(limit) +
                  " usable (capacity - margin)";
  } else if (in.forced) {
    const Candidate* f = nullptr;
    for (const Candidate& c : plan.candidates) {
      if (c.tier == *in.forced) f = &c;
    }
    plan.reason = "the forced tier " + std::string(tier_name(*in.forced)) +
                  " does not fit: " + (f ? f->why_not : std::string("?"));
  } else {
    // Closest: the smallest excess over the device limit (or over host memory).
    const Candidate* closest = nullptr;
    std::uint64_t closest_excess = UINT64_MAX;
    for (const Candidate& c : plan.candidates) {
      const std::uint64_t dev = c.profile.peak_device_bytes, host = c.profile.peak_host_bytes;
      const std::uint64_t excess =
          dev == kSaturated || host == kSaturated ? kSaturated
          : dev > limit                          ? dev - limit
          : host > in.host_free_bytes            ? host - in.host_free_bytes
                                                 : 0;
      if (closest == nullptr || excess < closest_excess) {
        closest_excess = excess;
        closest = &c;
      }
    }
    plan.reason =
        !model_fits
            ? "no tier fits: the group's " + format_bytes(m) +
                  " are more than the device's capacity of " + format_bytes(in.capacity_bytes)
            : "no tier fits: " + format_bytes(headroom) + " free beyond the margin; closest is " +
                  std::string(tier_name(closest->tier)) + ", short by " +
                  (closest_excess == kSaturated ? std::string("more than 64 bits can count")
                                                : format_bytes(closest_excess)) +
                  " (" + closest->why_not + ")";
  }
  return plan;
}

Candidate plan_load(const PlanInput& in, std::uint64_t ring_bytes, Tier plan) {
  if (in.free_bytes > in.capacity_bytes) {
    throw InvalidArgument("free memory " + format_bytes(in.free_bytes) + " exceeds the capacity " +
                          format_bytes(in.capacity_bytes));
  }
  Candidate c;
  c.tier = plan;
  c.steps = load_steps(in.layout, in.rank, ring_bytes, plan);
  const std::uint64_t resident = in.capacity_bytes - in.free_bytes;
  c.profile = simulate(c.steps, resident, 0, in.layout.options().dp);
  c.predicted_seconds = load_seconds(c, in, plan);
  const std::uint64_t limit =
      in.capacity_bytes > in.margin_bytes ? in.capacity_bytes - in.margin_bytes : 0;
  if (c.profile.peak_device_bytes > limit || c.profile.peak_device_bytes == kSaturated) {
    c.why_not = "peak " + format_bytes(c.profile.peak_device_bytes) + " (the flat buffer of " +
                format_bytes(in.layout.flat_bytes()) + " beside what is resident) exceeds " +
                "capacity " + format_bytes(in.capacity_bytes) + " - margin " +
                format_bytes(in.margin_bytes) + " by " +
                (c.profile.peak_device_bytes == kSaturated
                     ? std::string("more than 64 bits can count")
                     : format_bytes(c.profile.peak_device_bytes - limit));
  } else if (c.profile.peak_host_bytes > in.host_free_bytes ||
             c.profile.peak_host_bytes == kSaturated) {
    c.why_not = "the staging ring needs " + format_bytes(c.profile.peak_host_bytes) +
                " of pinned host memory; " + format_bytes(in.host_free_bytes) +
                " available to this rank";
  }
  c.feasible = c.why_not.empty();
  return c;
}

Plan plan_reads(const PlanInput& in, std::uint64_t ring_bytes, std::optional<Tier> forced,
                std::span<const Tier> plans) {
  if (plans.empty()) throw InvalidArgument("plan_reads: no read plan to choose from");
  std::string names;
  for (Tier t : plans) names += (names.empty() ? "" : " or ") + std::string(tier_name(t));
  if (forced && std::find(plans.begin(), plans.end(), *forced) == plans.end()) {
    throw InvalidArgument("'" + std::string(tier_name(*forced)) +
                          "' is not a read plan here: expected " + names);
  }
  Plan plan;
  for (Tier t : plans) plan.candidates.push_back(plan_load(in, ring_bytes, t));
  const Candidate* best = nullptr;
  for (const Candidate& c : plan.candidates) {
    if (!c.feasible || (forced && c.tier != *forced)) continue;
    if (best == nullptr || c.predicted_seconds < best->predicted_seconds) best = &c;
  }
  const std::uint64_t ranks = group_ranks(in);
  const std::uint64_t local = std::max<std::uint64_t>(in.local_ranks, 1);
  const std::uint64_t nodes = (ranks + local - 1) / local;
  const std::string topology = std::to_string(nodes) + (nodes == 1 ? " node" : " nodes") +
                               " x " + std::to_string(std::min(local, ranks)) + " ranks";
  // One rank: its slice is the whole buffer, and there is nothing to gather.
  if (best != nullptr && !forced && ranks == 1 && plan.candidates[0].feasible) {
    best = &plan.candidates[0];
  }
  if (best != nullptr) {
    plan.chosen = best->tier;
    plan.reason = std::string(tier_name(best->tier)) + (forced ? " (forced)" : "") + " on " +
                  topology + ": " +
                  read_plan_words(best->tier) +
                  ", predicted " + std::to_string(best->predicted_seconds) + " s";
  } else {
    const Candidate* c = &plan.candidates.front();
    for (const Candidate& k : plan.candidates) {
      if (forced && k.tier == *forced) c = &k;
    }
    plan.reason = "no read plan fits: " + c->why_not;
  }
  return plan;
}

AfterInit estimate_after_init(const PlanInput& in, bool zero2, bool offload_optimizer) {
  AfterInit a;
  const std::uint64_t s = in.layout.partition_numel();
  // Saturating: a partition of 2^62 elements needs more than 64 bits of Adam state, which must
  // read as "does not fit", not wrap to a few bytes.
  a.master_bytes = sat_mul(4, s);
  a.optimizer_bytes = sat_mul(8, s);
  // ZeRO-2 keeps the fp32 gradient of this rank's partition only; ZeRO-1 also holds the full
  // low-precision gradients until they are reduced.
  a.gradient_bytes = sat_add(sat_mul(4, s), zero2 ? 0 : in.layout.flat_bytes());
  const std::uint64_t resident = in.capacity_bytes - std::min(in.free_bytes, in.capacity_bytes);
  const std::uint64_t base =
      sat_add(resident - std::min(in.original_bytes, resident), in.layout.flat_bytes());
  a.device_bytes_after =
      sat_add(sat_add(base, offload_optimizer ? 0 : sat_add(a.master_bytes, a.optimizer_bytes)),
              a.gradient_bytes);
  const std::uint64_t limit =
      in.capacity_bytes > in.margin_bytes ? in.capacity_bytes - in.margin_bytes : 0;
  a.fits = a.device_bytes_after <= limit && a.device_bytes_after != kSaturated;
  return a;
}

std::vector<Plan> plan_groups(std::vector<PlanInput> inputs) {
  std::vector<Plan> plans;
  for (std::size_t g = 0; g < inputs.size(); ++g) {
    if (g > 0) {
      const PlanInput& prev = inputs[g - 1];
      const Candidate* c = plans.back().chosen_candidate();
      if (c != nullptr) {
        // What the previous group's plan leaves in use: its flat buffer replaced its originals.
        const std::uint64_t used_after = c->profile.after_step.empty()
                                             ? prev.capacity_bytes - prev.free_bytes
                                             : c->profile.after_step.back().device_bytes;
        inputs[g].free_bytes =
            prev.capacity_bytes > used_after ? prev.capacity_bytes - used_after : 0;
      } else {
        inputs[g].free_bytes = prev.free_bytes;
      }
    }
    plans.push_back(plan_group(inputs[g]));
  }
  return plans;
}

}  // namespace zeroflat
