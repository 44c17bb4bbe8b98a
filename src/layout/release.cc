// DeepSpeed's layout rules by release (layout.h).
#include "zeroflat/layout.h"

#include <array>
#include <charconv>

#include "zeroflat/common.h"

namespace zeroflat {
namespace {

struct Version {
  int major = 0, minor = 0, patch = 0;
  auto operator<=>(const Version&) const = default;
};

constexpr std::array<const char*, 7> kTested = {"0.14.5", "0.15.4", "0.16.9", "0.17.6",
                                                "0.18.6", "0.18.9", "0.19.8"};

std::optional<Version> parse_version(std::string_view text) {
  Version v;
  int* parts[3] = {&v.major, &v.minor, &v.patch};
  const char* p = text.data();
  const char* end = text.data() + text.size();
  for (int k = 0; k < 3; ++k) {
    auto [next, ec] = std::from_chars(p, end, *parts[k]);
    if (ec != std::errc() || next == p) return std::nullopt;
    p = next;
    if (k < 2) {
      if (p == end || *p != '.') return std::nullopt;
      ++p;
    }
  }
  // A local or pre-release suffix ("+cu121", ".dev0", "rc1") does not change the rules.
  if (p != end && *p != '+' && *p != '.' && *p != 'r' && *p != 'a' && *p != 'b') {
    return std::nullopt;
  }
  return v;
}

std::string text(const Version& v) {
  return std::to_string(v.major) + "." + std::to_string(v.minor) + "." + std::to_string(v.patch);
}

}  // namespace

std::vector<std::string> tested_deepspeed_releases() {
  return {kTested.begin(), kTested.end()};
}

ReleaseRules deepspeed_rules(std::string_view version) {
  if (version == "latest") version = kTested.back();
  const std::optional<Version> v = parse_version(version);
  if (!v) {
    throw InvalidArgument("DeepSpeed release '" + printable(version) +
                          "': expected a version such as 0.19.8, or latest");
  }
  if (*v < Version{0, 14, 0}) {
    throw InvalidArgument("DeepSpeed " + text(*v) + " is older than the releases zeroflat knows "
                          "the rules of (0.14 and later)");
  }
  ReleaseRules r;
  r.release = std::string(version);
  // The rules are named after the newest tested release at or below v (the thresholds below
  // decide them).
  Version rules = *v;
  for (const char* t : kTested) {
    const Version known = *parse_version(t);
    if (known <= *v) rules = known;
    if (known == *v) r.tested = true;
  }
  r.rules = text(rules);
  r.skips_zero_element = *v >= Version{0, 19, 8};
  r.has_parameter_alignment = *v >= Version{0, 19, 7};
  r.padding_on_last_rank = *v < Version{0, 16, 0};
  r.checks_accelerator_memory = *v >= Version{0, 18, 7};
  return r;
}

ReleaseRules default_deepspeed_rules(std::string_view installed_version) {
  return deepspeed_rules(installed_version.empty() ? std::string_view("latest")
                                                   : installed_version);
}

std::string_view left_out_name(LeftOut why) noexcept {
  return why == LeftOut::kFrozen ? "frozen" : "zero elements";
}

std::uint64_t ReleaseLayout::rank_padding(std::uint64_t rank) const {
  if (!rules.padding_on_last_rank) return layout.rank(rank, false).padding;
  return rank + 1 == layout.options().dp ? layout.padding() : 0;
}

void check_release_options(const LayoutOptions& options, const ReleaseRules& rules) {
  if (options.alignment_factor != 2) {
    throw InvalidArgument("alignment factor " + std::to_string(options.alignment_factor) +
                          ": DeepSpeed pads every group to 2 x dp elements");
  }
  if (options.param_align_bytes != 0 &&
      (options.param_align_bytes != 16 || !rules.has_parameter_alignment)) {
    throw InvalidArgument(
        "parameter alignment of " + std::to_string(options.param_align_bytes) + " bytes: " +
        (rules.has_parameter_alignment
             ? std::string("DeepSpeed's parameter_alignment is 16 bytes")
             : "DeepSpeed " + rules.release + " has no parameter_alignment (it came in 0.19.7)"));
  }
}

ReleaseSelection select_for_release(std::span<const std::uint64_t> numels,
                                    const std::vector<bool>& frozen, const ReleaseRules& rules) {
  if (!frozen.empty() && frozen.size() != numels.size()) {
    throw InvalidArgument("frozen flags for " + std::to_string(frozen.size()) + " of " +
                          std::to_string(numels.size()) + " parameters");
  }
  ReleaseSelection out;
  for (std::uint64_t i = 0; i < numels.size(); ++i) {
    if (!frozen.empty() && frozen[i]) {
      out.left_out.emplace_back(i, LeftOut::kFrozen);
    } else if (numels[i] == 0 && rules.skips_zero_element) {
      out.left_out.emplace_back(i, LeftOut::kZeroElements);
    } else {
      out.kept.push_back(i);
    }
  }
  return out;
}

ReleaseLayout layout_for_release(std::span<const std::uint64_t> numels,
                                 const std::vector<bool>& frozen, const LayoutOptions& options,
                                 const ReleaseRules& rules) {
  ReleaseSelection selection = select_for_release(numels, frozen, rules);
  check_release_options(options, rules);
  ReleaseLayout out;
  out.rules = rules;
  out.num_inputs = numels.size();
  out.kept = std::move(selection.kept);
  out.left_out = std::move(selection.left_out);
  std::vector<std::uint64_t> group;
  for (std::uint64_t i : out.kept) group.push_back(numels[i]);
  out.layout = Layout::compute(group, options);
  return out;
}

}  // namespace zeroflat
