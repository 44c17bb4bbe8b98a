// DeepSpeed's layout rules by release. The flat layout (layout.h) is the same algorithm in every
// release from 0.14 on; what changed is which parameters a release puts into a group and part of
// its bookkeeping (docs/layout.md lists the changes):
//
//   all releases   frozen parameters (requires_grad False) are left out of the group
//   0.16           groups_padding per rank (the padding inside each rank's partition); before,
//                  the whole padding was recorded on the last rank and zero on the others
//   0.19.7         zero_optimization.parameter_alignment: parameter starts padded to 16 bytes
//   0.19.8         zero-element parameters are left out, like frozen ones
//
// A layout "for release V" takes the group as the model has it (frozen and zero-element
// parameters included), leaves out what V leaves out, and lays out the rest exactly as V does.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/layout.h"

namespace zeroflat {

// The releases the DeepSpeed drop-in is tested against (python/tests), oldest first.
std::vector<std::string> tested_deepspeed_releases();

struct ReleaseRules {
  std::string release;             // as asked: "0.18.6", "0.19.8+cu121"
  std::string rules;               // the release whose rules apply (release itself, or the
                                   // newest known one below it)
  bool tested = false;             // one of tested_deepspeed_releases()
  bool skips_zero_element = false;       // 0.19.8+
  bool has_parameter_alignment = false;  // 0.19.7+
  bool padding_on_last_rank = false;     // before 0.16
};

// The rules of a release given as "MAJOR.MINOR.PATCH" (a local suffix such as "+cu121" or
// ".dev0" is ignored), or "latest" for the newest tested release. Throws InvalidArgument for
// text that is not a version, or a release older than 0.14.
ReleaseRules deepspeed_rules(std::string_view version);

// Why a parameter is not in the release's group.
enum class LeftOut : std::uint8_t { kFrozen, kZeroElements };
std::string_view left_out_name(LeftOut why) noexcept;  // "frozen", "zero elements"

// A group as a release lays it out.
struct ReleaseLayout {
  ReleaseRules rules;
  std::vector<std::uint64_t> kept;  // input indices of the parameters in the group, in order
  std::vector<std::pair<std::uint64_t, LeftOut>> left_out;  // input index, why
  std::uint64_t num_inputs = 0;
  Layout layout;  // over the kept parameters: its index k is input index kept[k]

  // The release's groups_padding for a rank: the padding inside the rank's partition, or
  // before 0.16 all of it on the last rank.
  std::uint64_t rank_padding(std::uint64_t rank) const;
  // `zeroflat layout --deepspeed V --json`: the layout document of layout.h in input indices
  // (offsets of left-out parameters are null), each rank's padding as the release records it,
  // with "deepspeed" (release, rules) and "left_out" ([{param, why}]). One rank, or all (then
  // bounded as Layout::write_json is).
  void write_json(std::ostream& out, std::optional<std::uint64_t> only_rank = std::nullopt) const;
};

// Throws InvalidArgument naming the option when `options` is not a layout the release builds:
// alignment_factor must be 2 (DeepSpeed pads to 2 x dp), param_align_bytes 0, or 16 where the
// release has parameter_alignment.
void check_release_options(const LayoutOptions& options, const ReleaseRules& rules);

// Lays out a group as `rules` says: numels and frozen (empty: none frozen) per input parameter
// in the model's order. options.alignment_factor must be 2 (DeepSpeed pads to 2 x dp);
// options.param_align_bytes must be 0, or 16 where the release has parameter_alignment. Throws
// InvalidArgument naming the option or the release otherwise.
ReleaseLayout layout_for_release(std::span<const std::uint64_t> numels, const std::vector<bool>& frozen,
                                 const LayoutOptions& options, const ReleaseRules& rules);

}  // namespace zeroflat
