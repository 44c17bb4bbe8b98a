// Options shared by subcommands: which model, which layout; and the exit-code contract.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "zeroflat/layout.h"
#include "zeroflat/model.h"
#include "zeroflat/release.h"

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

// --dp, --round-robin, --alignment-factor, --dtype, --param-align-bytes, --deepspeed.
void add_layout_options(Parser& parser);
// Validated layout options (InvalidArgument names the bad value). With a model, its declared
// dtype is used unless --dtype is given.
LayoutOptions layout_options_from_args(const Args& args, const ModelSpec* model = nullptr);
// --deepspeed V: that release's rules, or none.
std::optional<ReleaseRules> release_from_args(const Args& args);
// The model's group as the release lays it out: the tensors it leaves out (zero-element ones
// from 0.19.8) are dropped, and the options checked against its rules. Without a release, the
// model as it is. A note for stderr says what was left out, or "".
std::string apply_release(const Args& args, ModelSpec& model, const LayoutOptions& options);

int subcommand_layout(const std::vector<std::string>& argv);
int subcommand_run(const std::vector<std::string>& argv);
int subcommand_plan(const std::vector<std::string>& argv);
int subcommand_inspect(const std::vector<std::string>& argv);
int subcommand_probe(const std::vector<std::string>& argv);
int subcommand_load(const std::vector<std::string>& argv);
int subcommand_write_checkpoint(const std::vector<std::string>& argv);

}  // namespace zeroflat::cli
