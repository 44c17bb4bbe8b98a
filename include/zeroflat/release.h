// DeepSpeed's layout rules by release. The flat layout (layout.h) is the same algorithm in every
// release from 0.14 on; what changed is which parameters a release puts into a group and part of
// its bookkeeping (docs/layout.md lists the changes):
//
//   all releases   frozen parameters (requires_grad False) are left out of the group
//   0.16           groups_padding per rank (the padding inside each rank's partition); before,
//                  the whole padding was recorded on the last rank and zero on the others
//   0.18.7         the memory check: a group is flattened on the accelerator when
//                  accelerator.available_memory() holds its flat buffer, else through the host;
//                  before, every group was copied to the host and flattened there
//   0.19.7         zero_optimization.parameter_alignment: parameter starts padded to 16 bytes
//   0.19.8         zero-element parameters are left out, like frozen ones (by ZeRO-1/2 and by the
//                  Stage 3 optimizer alike: is_optimized_parameter)
//
// ZeRO-3's partitions, its rank buffer and its sub-groups (zero3.h) are the same arithmetic in
// every release from 0.14 on; only which parameters enter its groups follows the rules above.
//
// A layout "for release V" takes the group as the model has it (frozen and zero-element
// parameters included), leaves out what V leaves out, and lays out the rest exactly as V does.
// Every caller (the CLI, the Python package, the DeepSpeed drop-in) asks these functions: no
// rule of a release is written down anywhere else.
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
  // 0.18.7+: DeepSpeedZeroOptimizer compares a group's flat buffer (its numel rounded up to
  // 2 x dp, times the first parameter's element size) with accelerator.available_memory() right
  // after empty_cache(), and flattens on the accelerator when it fits; otherwise, and always
  // before 0.18.7, it copies every parameter of the group to the host (param.cpu_data), leaves a
  // 1-element placeholder on the device, and flattens on the host.
  bool checks_accelerator_memory = false;
};

// The rules of a release given as "MAJOR.MINOR.PATCH" (a local suffix such as "+cu121" or
// ".dev0" is ignored), or "latest" for the newest tested release. Throws InvalidArgument for
// text that is not a version, or a release older than 0.14.
ReleaseRules deepspeed_rules(std::string_view version);

// The rules that apply when the caller names no release: those of the installed DeepSpeed
// (its version, as deepspeed_rules takes it), or, when there is none (empty), "latest".
ReleaseRules default_deepspeed_rules(std::string_view installed_version = {});

// Why a parameter is not in the release's group.
enum class LeftOut : std::uint8_t { kFrozen, kZeroElements };
std::string_view left_out_name(LeftOut why) noexcept;  // "frozen", "zero elements"

// Which of a group's parameters a release puts into its flat buffer.
struct ReleaseSelection {
  std::vector<std::uint64_t> kept;  // input indices of the parameters in the group, in order
  std::vector<std::pair<std::uint64_t, LeftOut>> left_out;  // input index, why
};

// The selection `rules` make from a group given as numels and frozen flags (empty: none frozen)
// per input parameter, in the model's order: frozen parameters, and zero-element ones where the
// release skips them, are left out. Throws InvalidArgument when frozen has another length.
ReleaseSelection select_for_release(std::span<const std::uint64_t> numels,
                                    const std::vector<bool>& frozen, const ReleaseRules& rules);

// Throws InvalidArgument (naming the option and the release) unless `options` are ones the
// release has: alignment factor 2 (DeepSpeed pads every group to 2 x dp elements) and
// parameter alignment 0, or 16 where the release has parameter_alignment. dp, round-robin and
// dtype are any.
void check_release_options(const LayoutOptions& options, const ReleaseRules& rules);

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

// Lays out a group as `rules` says: select_for_release, then the layout of what it keeps with
// `options`, which check_release_options must accept. Throws InvalidArgument as those do.
ReleaseLayout layout_for_release(std::span<const std::uint64_t> numels,
                                 const std::vector<bool>& frozen, const LayoutOptions& options,
                                 const ReleaseRules& rules);

}  // namespace zeroflat
