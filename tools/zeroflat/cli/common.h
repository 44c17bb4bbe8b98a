// Options shared by subcommands: which model, which layout; and the exit-code contract.
#pragma once

#include <cstdint>
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

// --dp, --round-robin, --alignment-factor, --dtype, --param-align-bytes.
void add_layout_options(Parser& parser);
// Validated layout options (InvalidArgument names the bad value). With a model, its declared
// dtype is used unless --dtype is given.
LayoutOptions layout_options_from_args(const Args& args, const ModelSpec* model = nullptr);

int subcommand_layout(const std::vector<std::string>& argv);
int subcommand_run(const std::vector<std::string>& argv);
int subcommand_plan(const std::vector<std::string>& argv);
int subcommand_inspect(const std::vector<std::string>& argv);
int subcommand_probe(const std::vector<std::string>& argv);

}  // namespace zeroflat::cli
