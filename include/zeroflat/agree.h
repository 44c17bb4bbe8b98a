// Agreement: before anything moves, the ranks that share a group compare what must be identical
// (options, and the group's shapes and dtypes), learn whether every rank's own checks passed, and
// settle the facts the planner reads, in one collective. So an error on one rank is an error on
// every rank at the same moment, and no rank is left waiting in a collective the others never
// reach.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"
#include "zeroflat/plan.h"

namespace zeroflat {

class Device;

// What one rank brings.
struct AgreementInput {
  // Everything besides the group that every rank must pass identically (options, the caller's
  // own settings, the sources' accounts), as "key value" items: compared by digest; when the
  // ranks differ, the error names the first item that differs and what each side passed.
  std::span<const std::string> options;
  // The group: shapes and dtypes are compared (not values, not addresses).
  std::span<const TensorRef> params;
  // How errors name parameter i; empty: "parameter i".
  std::span<const std::string> names;
  // The planner's facts on this rank.
  std::uint64_t capacity_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::uint64_t host_free_bytes = 0;
  bool integrated = false;
  // Non-empty: this rank's own checks failed, and this is why.
  std::string error;
};

// What the ranks agreed on: the minimum of each fact over the ranks (a plan every rank can
// carry out), and integrated if any rank's device is.
struct Agreement {
  std::uint64_t capacity_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::uint64_t host_free_bytes = 0;
  bool integrated = false;
};

// The planner's facts from what the ranks agreed (capacity, free, host free, integrated) and
// this node's rank count; bandwidths are left for the caller (the device's hardware or its own).
PlanFacts plan_facts(const Agreement& agreed, std::uint64_t local_ranks);

// Collective: every rank of comm calls it (null, or a communicator of size 1: this rank alone,
// no collective). One all-reduce when everything matches; two more, only on a mismatch, to name
// the first option or parameter that differs and what each side has. Throws InvalidArgument on
// every rank at once when any rank set `error` (this rank's own message where it failed, "rank
// R: ..." on the others) or the ranks passed different options or groups; CommError when the
// ranks cannot talk.
Agreement agree(const AgreementInput& input, Communicator* comm);

// Where the ranks' lists of entries (texts, compared in order) first differ: the entry's index,
// and two of its versions with a rank holding each (an entry past the end of a rank's list reads
// "(none)"). None when every rank's list is the same.
struct Difference {
  std::size_t index = 0;
  std::string here;     // this rank's version
  std::string other;    // a version another rank holds
  int other_rank = -1;  // the lowest rank holding it
};
// Collective: every rank of comm calls it with its own list; two small all-reduces (a third,
// of the two texts, only when they differ). Entries are shown cut to 240 bytes. Throws CommError.
std::optional<Difference> first_difference(std::span<const std::string> entries,
                                           Communicator& comm);
// "what: 'here' on this rank (R), 'other' on rank Q" for messages.
std::string describe_difference(const Difference& d, std::string_view what, int rank);

// Collective: whether any rank failed a check of its own, in one all-reduce. Returns the lowest
// failing rank, or -1 when none did. For callers with a local verdict to share before a
// collective step (the CLI's check that a run fits in this host's memory).
int agree_on_failure(Communicator* comm, bool failed);

// The values check before the sharded and staged tiers release the originals (ValueCheck,
// plan.h): every rank hashes every parameter's bytes on its device, folds the hashes into one
// digest per rank's slice of the layout, and the ranks compare the digests in one all-reduce.
// Ranks whose values differ would otherwise each end up with the owners' values of every slice.
// Collective over comm, as agree().
ValueCheck check_same_values(const Layout& layout, std::span<const TensorRef> params,
                             Device& device, Communicator* comm);

}  // namespace zeroflat
