// Agreement over the ranks of a group: one all-reduce for options, shapes, local verdicts and
// the planner's facts; the values check before a tier hands slices between ranks.
#include "zeroflat/agree.h"

#include <array>
#include <cstring>

#include "common/clock.h"
#include "zeroflat/checksum.h"
#include "zeroflat/device.h"
#include "zeroflat/error.h"
#include "zeroflat/size.h"

namespace zeroflat {
namespace {

// Failure codes: the maximum over ranks names the lowest failing rank.
constexpr std::uint64_t kNoFailure = 0;
constexpr std::uint64_t kTop = std::uint64_t{1} << 32;

std::uint64_t failure_code(bool failed, int rank) {
  return failed ? kTop - static_cast<std::uint64_t>(rank) : kNoFailure;
}
int failed_rank(std::uint64_t code) {
  return code == kNoFailure ? -1 : static_cast<int>(kTop - code);
}

void append(std::string& out, std::uint64_t v) {
  char b[8];
  std::memcpy(b, &v, 8);
  out.append(b, 8);
}

std::uint64_t param_signature(const TensorRef& t) {
  std::string s;
  append(s, t.shape.size());
  for (std::int64_t d : t.shape) append(s, static_cast<std::uint64_t>(d));
  append(s, static_cast<std::uint64_t>(t.dtype));
  return checksum_serial(s.data(), s.size());
}

std::string name_of(const AgreementInput& in, std::size_t i) {
  if (i < in.names.size() && !in.names[i].empty()) return in.names[i];
  return "parameter " + std::to_string(i);
}

// The index of the first pair (v[2i], v[2i+1] = max of x, max of ~x) whose minimum and maximum
// differ, or -1.
long first_difference(std::span<const std::uint64_t> v) {
  for (std::size_t i = 0; i + 1 < v.size(); i += 2) {
    if (v[i] != ~v[i + 1]) return static_cast<long>(i / 2);
  }
  return -1;
}

// Max-reduces [x_i, ~x_i] pairs so that both the maximum and the minimum come back.
std::vector<std::uint64_t> min_max_pairs(std::span<const std::uint64_t> xs, Communicator& comm) {
  std::vector<std::uint64_t> v;
  v.reserve(xs.size() * 2);
  for (std::uint64_t x : xs) {
    v.push_back(x);
    v.push_back(~x);
  }
  comm.all_reduce_max(v);
  return v;
}

}  // namespace

PlanFacts plan_facts(const Agreement& agreed, std::uint64_t local_ranks) {
  PlanFacts facts;
  facts.capacity_bytes = agreed.capacity_bytes;
  facts.free_bytes = agreed.free_bytes;
  facts.host_free_bytes = agreed.host_free_bytes;
  facts.integrated = agreed.integrated;
  facts.local_ranks = local_ranks;
  return facts;
}

Agreement agree(const AgreementInput& in, Communicator* comm) {
  Agreement a{in.capacity_bytes, in.free_bytes, in.host_free_bytes, in.integrated};
  if (comm == nullptr || comm->size() <= 1) {
    if (!in.error.empty()) throw InvalidArgument(in.error);
    return a;
  }
  std::string group;
  for (const TensorRef& t : in.params) append(group, param_signature(t));
  const std::uint64_t options = checksum_serial(in.options.data(), in.options.size());
  const std::uint64_t shapes = checksum_serial(group.data(), group.size());
  const std::uint64_t n = in.params.size();
  std::array<std::uint64_t, 11> v{options,           ~options,
                                  shapes,            ~shapes,
                                  n,                 ~n,
                                  ~in.capacity_bytes, ~in.free_bytes,
                                  ~in.host_free_bytes, std::uint64_t{in.integrated},
                                  failure_code(!in.error.empty(), comm->rank())};
  comm->all_reduce_max(v);
  const std::string here = " (rank " + std::to_string(comm->rank()) + ")";
  if (const int bad = failed_rank(v[10]); bad >= 0) {
    if (!in.error.empty()) throw InvalidArgument(in.error);
    throw InvalidArgument("rank " + std::to_string(bad) +
                          " refused the group before anything moved (its own error says why); "
                          "nothing was moved on any rank");
  }
  if (v[0] != ~v[1]) {
    throw InvalidArgument("the ranks passed different options: every rank must flatten the group "
                          "the same way; this rank" + here + " passed: " + in.options);
  }
  if (v[4] != ~v[5]) {
    throw InvalidArgument("the ranks passed different groups: from " + std::to_string(~v[5]) +
                          " to " + std::to_string(v[4]) + " parameters; this rank" + here +
                          " passed " + std::to_string(n));
  }
  if (v[2] != ~v[3]) {
    std::vector<std::uint64_t> each;
    each.reserve(in.params.size());
    for (const TensorRef& t : in.params) each.push_back(param_signature(t));
    const long k = first_difference(min_max_pairs(each, *comm));
    if (k < 0) throw InvalidArgument("the ranks passed different groups");
    const TensorRef& t = in.params[static_cast<std::size_t>(k)];
    throw InvalidArgument(name_of(in, static_cast<std::size_t>(k)) +
                          " differs between ranks: shape " + shape_to_string(t.shape) + " (" +
                          std::string(dtype_name(t.dtype)) + ") on this rank" + here +
                          "; every rank must pass the same group");
  }
  a.capacity_bytes = ~v[6];
  a.free_bytes = ~v[7];
  a.host_free_bytes = ~v[8];
  a.integrated = v[9] != 0;
  return a;
}

int agree_on_failure(Communicator* comm, bool failed) {
  if (comm == nullptr || comm->size() <= 1) return failed ? 0 : -1;
  std::array<std::uint64_t, 1> v{failure_code(failed, comm->rank())};
  comm->all_reduce_max(v);
  return failed_rank(v[0]);
}

ValueCheck check_same_values(const Layout& layout, std::span<const TensorRef> params,
                             Device& device, Communicator* comm) {
  ValueCheck out;
  if (comm == nullptr || comm->size() <= 1) return out;
  const auto t0 = detail::Clock::now();
  const std::uint64_t dp = layout.options().dp;
  const std::uint64_t s = layout.partition_numel();
  // One digest per slice: the fragments it holds and the digests of their parameters. A rank
  // that cannot hash says so in the same all-reduce, so nobody waits for it.
  std::vector<std::uint64_t> slices(dp, 0);
  std::string error;
  try {
    std::vector<std::uint64_t> digests(params.size(), 0);
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].numel == 0) continue;
      digests[i] = device.checksum(params[i].data, params[i].num_bytes());
      out.bytes_hashed += params[i].num_bytes();
    }
    for (std::uint64_t r = 0; r < dp; ++r) {
      std::string text;
      for (const Fragment& f : layout.fragments_in(r * s, (r + 1) * s)) {
        append(text, f.param);
        append(text, f.param_offset);
        append(text, f.numel);
        append(text, digests[f.param]);
      }
      slices[r] = checksum_serial(text.data(), text.size());
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::vector<std::uint64_t> v;
  for (std::uint64_t x : slices) {
    v.push_back(x);
    v.push_back(~x);
  }
  v.push_back(failure_code(!error.empty(), comm->rank()));
  comm->all_reduce_max(v);
  out.seconds = detail::seconds_since(t0);
  if (const int bad = failed_rank(v.back()); bad >= 0) {
    throw Error(error.empty() ? "rank " + std::to_string(bad) +
                                    " could not hash its parameters to compare values; nothing "
                                    "was moved"
                              : "hashing the parameters to compare values: " + error +
                                    "; nothing was moved");
  }
  v.pop_back();
  const long r = first_difference(v);
  if (r < 0) return out;
  out.first_mismatch = static_cast<int>(r);
  const auto lo = static_cast<std::uint64_t>(r) * s;
  std::vector<std::string> names;
  for (const Fragment& f : layout.fragments_in(lo, lo + s)) {
    if (names.size() == 8) {
      names.push_back("...");
      break;
    }
    names.push_back(std::to_string(f.param));
  }
  out.error = "the ranks hold different values in rank " + std::to_string(r) +
              "'s slice of the layout (parameters " + join(names) +
              "): the sharded and staged tiers would give every rank the owners' values, so "
              "nothing was moved. Make the ranks' values equal (broadcast from one rank), or "
              "turn the value check off if the difference is intended";
  return out;
}

}  // namespace zeroflat
