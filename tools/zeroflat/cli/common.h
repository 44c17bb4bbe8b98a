// Options shared by subcommands: which model, which layout; and the exit-code contract.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "zeroflat/layout.h"
#include "zeroflat/model.h"

namespace zeroflat::cli {

// Exit codes of docs/cli.md.
inline constexpr int kExitOk = 0;
inline constexpr int kExitOther = 1;
inline constexpr int kExitInvalid = 2;
inline constexpr int kExitInfeasible = 3;
inline constexpr int kExitExecFailed = 4;

// --model, --layers, --experts.
void add_model_options(Parser& parser, const std::string& default_model);
// The model the options name; throws InvalidArgument for an unknown model or bad numbers.
ModelSpec model_from_args(const Args& args, const std::string& default_model);
// A path as given, or, for a Hugging Face hub id ("org/name") that is not a path here, the
// snapshot directory the local hub cache holds for it (refs/main, else its only snapshot);
// nothing is downloaded. Catalog names and existing paths come back as they are. Throws
// InvalidArgument when an id is not in the cache, naming where it looked.
std::string resolve_model_path(const std::string& name_or_path);

// Text for a terminal: every control character but newline and tab (an ESC that would start a
// terminal sequence, from a file's name or a checkpoint's contents) shown as '?'; bytes of
// UTF-8 text kept.
std::string terminal_text(std::string_view text);

// --dp, --round-robin, --alignment-factor, --dtype, --param-align-bytes, --deepspeed.
void add_layout_options(Parser& parser);
// Validated layout options (InvalidArgument names the bad value). With a model, its declared
// dtype is used unless --dtype is given.
LayoutOptions layout_options_from_args(const Args& args, const ModelSpec* model = nullptr);
// The DeepSpeed release whose layout rules apply (--deepspeed V): V, or by default the newest
// supported release ("latest"). None (zeroflat's own layout, docs/layout.md) for
// `--deepspeed none`, or by default when the options ask for a layout no release builds
// (--alignment-factor other than 2, --param-align-bytes other than 0 or 16): those are
// zeroflat's own. InvalidArgument for a release given explicitly whose rules refuse the options.
std::optional<ReleaseRules> release_from_args(const Args& args, const LayoutOptions& options);
// --stage, --sub-group-size.
void add_stage_options(Parser& parser);
// Which layout the options ask for: ZeRO-3's partitions (--stage 3, layout.h) with its
// sub_group_size, or ZeRO-1/2's flat buffer (--stage 1 or 2, the default: one layout). With
// --stage 3, the flat layout's options Stage 3 has no use for (--round-robin,
// --alignment-factor, --param-align-bytes) are InvalidArgument naming them, and so is
// --sub-group-size without it.
struct StageChoice {
  bool zero3 = false;
  std::uint64_t sub_group_size = kDefaultSubGroupSize;
};
StageChoice stage_from_args(const Args& args);
// What a ZeRO-3 printout adds to its rules line (rules_text): no release rule changes them.
inline constexpr const char* kZero3RulesNote =
    "; ZeRO-3: partitions and sub-groups as every release from 0.14 cuts them";

// "DeepSpeed 0.19.8's rules" or "zeroflat's own layout (--deepspeed none)", for printouts.
std::string rules_text(const std::optional<ReleaseRules>& rules);
// The "deepspeed" field of a document: {release, rules, tested}, or null for zeroflat's own.
nlohmann::ordered_json rules_doc(const std::optional<ReleaseRules>& rules);
// The model's group as the release forms it: the tensors it leaves out (zero-element ones from
// 0.19.8) are dropped. Without a release, the model as it is. A note for stderr says what was
// left out, or "".
std::string apply_release(const std::optional<ReleaseRules>& rules, ModelSpec& model,
                          const LayoutOptions& options);

int subcommand_bench(const std::vector<std::string>& argv);
int subcommand_layout(const std::vector<std::string>& argv);
int subcommand_run(const std::vector<std::string>& argv);
int subcommand_plan(const std::vector<std::string>& argv);
int subcommand_inspect(const std::vector<std::string>& argv);
int subcommand_probe(const std::vector<std::string>& argv);
int subcommand_load(const std::vector<std::string>& argv);
int subcommand_write_checkpoint(const std::vector<std::string>& argv);

}  // namespace zeroflat::cli
