// Agreement over the ranks of a group: one all-reduce for options, shapes, local verdicts and
// the planner's facts; the values check before a tier hands slices between ranks.
#include "zeroflat/agree.h"

#include <array>
#include <cstring>

#include "common/clock.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"

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

std::string name_of(const AgreementInput& in, std::size_t i) {
  if (i < in.names.size() && !in.names[i].empty()) return in.names[i];
  return "parameter " + std::to_string(i);
}

// The index of the first pair (v[2i], v[2i+1] = max of x, max of ~x) whose minimum and maximum
// differ, or -1.
long first_differing_pair(std::span<const std::uint64_t> v) {
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

constexpr std::size_t kShownBytes = 240;
constexpr std::size_t kShownWords = kShownBytes / 8;

// A text in kShownWords words of an all-reduce (max): its first kShownBytes, zero-padded. Only
// one rank writes each slot, so the maximum over ranks is that rank's text.
void put_shown(std::uint64_t* at, std::string_view text) {
  std::memcpy(at, text.data(), std::min(text.size(), kShownBytes));
}
// The text back from its words, "..." where it was cut.
std::string shown(const std::uint64_t* at) {
  const char* text = reinterpret_cast<const char*>(at);
  std::string out(text, strnlen(text, kShownBytes));
  if (out.size() == kShownBytes) out += "...";
  return out;
}

std::uint64_t digest(std::string_view text) {
  return checksum_serial(text.data(), text.size());
}

// A parameter as the ranks compare it: its name, shape and dtype.
std::string param_entry(const AgreementInput& in, std::size_t i) {
  const TensorRef& t = in.params[i];
  return name_of(in, i) + " " + shape_to_string(t.shape) + " " + std::string(dtype_name(t.dtype));
}

}  // namespace

std::optional<Difference> first_difference(std::span<const std::string> entries,
                                           Communicator& comm) {
  static const std::string kNone = "(none)";
  std::array<std::uint64_t, 2> n{entries.size(), ~std::uint64_t{entries.size()}};
  comm.all_reduce_max(n);
  const std::uint64_t longest = n[0];
  std::vector<std::uint64_t> digests(longest);
  for (std::uint64_t k = 0; k < longest; ++k) {
    digests[k] = digest(k < entries.size() ? std::string_view(entries[k]) : kNone);
  }
  const std::vector<std::uint64_t> v = min_max_pairs(digests, comm);
  const long k = first_differing_pair(v);
  if (k < 0) return std::nullopt;
  const auto i = static_cast<std::size_t>(k);
  const std::uint64_t high = v[2 * i];
  const std::uint64_t low = ~v[2 * i + 1];
  // The two versions' texts (the highest and the lowest digest), and the lowest rank holding
  // each: a rank holding a version writes its text and ~rank into that version's slots.
  const std::string& mine = i < entries.size() ? entries[i] : kNone;
  std::vector<std::uint64_t> texts(2 * (kShownWords + 1), 0);
  for (int side = 0; side < 2; ++side) {
    if (digests[i] != (side == 0 ? high : low)) continue;
    std::uint64_t* at = texts.data() + side * (kShownWords + 1);
    put_shown(at, mine);
    at[kShownWords] = ~static_cast<std::uint64_t>(comm.rank());
  }
  comm.all_reduce_max(texts);
  Difference d;
  d.index = i;
  d.here = mine.size() > kShownBytes ? mine.substr(0, kShownBytes) + "..." : mine;
  const int side = digests[i] == high ? 1 : 0;  // the other version
  const std::uint64_t* at = texts.data() + side * (kShownWords + 1);
  d.other = shown(at);
  d.other_rank = static_cast<int>(~at[kShownWords]);
  return d;
}

namespace {

// The failing rank's error as the other ranks show it (every rank calls this, a collective).
std::string failing_rank_text(const std::string& error, bool mine, Communicator& comm) {
  std::vector<std::uint64_t> words(kShownWords, 0);
  if (mine) put_shown(words.data(), error);
  comm.all_reduce_max(words);
  const std::string out = shown(words.data());
  return out.empty() ? std::string("(its error has no text)") : out;
}

}  // namespace

std::string describe_difference(const Difference& d, std::string_view what, int rank) {
  return std::string(what) + " '" + d.here + "' on this rank (" + std::to_string(rank) + "), '" +
         d.other + "' on rank " + std::to_string(d.other_rank);
}

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
  std::string options;
  for (const std::string& item : in.options) append(options, digest(item));
  std::string group;
  for (std::size_t i = 0; i < in.params.size(); ++i) append(group, digest(param_entry(in, i)));
  const std::uint64_t options_digest = digest(options);
  const std::uint64_t shapes = digest(group);
  const std::uint64_t n = in.params.size();
  std::array<std::uint64_t, 11> v{options_digest,
                                  ~options_digest,
                                  shapes,
                                  ~shapes,
                                  n,
                                  ~n,
                                  ~in.capacity_bytes,
                                  ~in.free_bytes,
                                  ~in.host_free_bytes,
                                  std::uint64_t{in.integrated},
                                  failure_code(!in.error.empty(), comm->rank())};
  comm->all_reduce_max(v);
  if (const int bad = failed_rank(v[10]); bad >= 0) {
    // Every rank learned that one failed: one more collective hands the others its words.
    const std::string said = failing_rank_text(in.error, comm->rank() == bad, *comm);
    if (!in.error.empty()) throw InvalidArgument(in.error);
    throw InvalidArgument("rank " + std::to_string(bad) + " refused the group before anything " +
                          "moved: " + said + "; nothing was moved on any rank");
  }
  if (v[0] != ~v[1]) {
    const std::optional<Difference> d = first_difference(in.options, *comm);
    throw InvalidArgument(
        "the ranks passed different options: every rank must build the group the same way; " +
        (d ? describe_difference(*d, "option", comm->rank())
           : std::string("they differ in order")));
  }
  if (v[2] != ~v[3] || v[4] != ~v[5]) {
    std::vector<std::string> entries;
    entries.reserve(in.params.size());
    for (std::size_t i = 0; i < in.params.size(); ++i) entries.push_back(param_entry(in, i));
    const std::optional<Difference> d = first_difference(entries, *comm);
    std::string what = "the ranks passed different groups";
    if (v[4] != ~v[5]) {
      what += " (from " + std::to_string(~v[5]) + " to " + std::to_string(v[4]) + " parameters; " +
              std::to_string(n) + " on this rank)";
    }
    if (d) {
      what += ": " + describe_difference(*d, "", comm->rank()).substr(1) +
              " (the first parameter that differs, position " + std::to_string(d->index) +
              " of the group)";
    }
    throw InvalidArgument(what + "; every rank must pass the same group");
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
    throw Error(error.empty()
                    ? "rank " + std::to_string(bad) +
                          " could not hash its parameters to compare values; nothing "
                          "was moved"
                    : "hashing the parameters to compare values: " + error + "; nothing was moved");
  }
  v.pop_back();
  const long r = first_differing_pair(v);
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
