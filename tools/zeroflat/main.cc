// The zeroflat command: dispatch to subcommands and map errors to the exit codes of docs/cli.md.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/common.h"
#include "zeroflat/common.h"
#include "zeroflat/config.h"
#include "zeroflat/device.h"

namespace {

// A message fit for a terminal: whatever a library message quotes stays readable.
std::string shown(const char* what) {
  constexpr std::size_t kMax = 4096;
  const std::string_view w(what);
  using zeroflat::cli::terminal_text;
  if (w.size() <= kMax) return terminal_text(w);
  return terminal_text(w.substr(0, kMax)) + "... (" + std::to_string(w.size() - kMax) +
         " more characters)";
}

// With --json, a failure is a document too, with the same keys every time: the command, the
// exit code, the kind of error ("usage", "invalid input", "not supported", "error") and its
// message; the message goes to stderr as well.
bool wants_json(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--") return false;
    if (a == "--json") return true;
  }
  return false;
}

int failed(const std::string& command, const std::vector<std::string>& args, int code,
           const char* kind, const std::string& message) {
  if (wants_json(args)) {
    nlohmann::json doc = {{"command", command}, {"exit", code}, {"error_kind", kind},
                          {"error", message}};
    std::fputs((doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n").c_str(),
               stdout);
    std::fflush(stdout);
  }
  return code;
}

constexpr const char* kUsage = R"(usage: zeroflat <command> [options]

Builds the flat, partitioned parameter buffers of ZeRO stage 1/2 data-parallel training,
exactly as DeepSpeed lays them out.

commands:
  layout   print the flat layout of one parameter group (offsets, padding, partitions)
  plan     which way of flattening fits a model on a node, its peak memory and time
  run      materialize a model, flatten it, re-point its parameters, verify, report
  probe    what each free-memory source says about a device (cpu, cuda:N)
  inspect  what a checkpoint, a .safetensors file or a config.json holds
  load     a safetensors checkpoint straight into the flat buffers, each rank reading only
           its partition, one all-gather completing them; or (--from deepspeed) a DeepSpeed
           checkpoint resumed at any world size, each rank reading only its share
  write-checkpoint
           a deterministic test checkpoint of a model (sharded, with an index), no downloads
  bench    the flatten against a copy of the same bytes and a loop of per-tensor copies,
           layout and plan against their budget: the benchmark matrix this machine runs
  help     show this text, or `zeroflat help COMMAND` for a command's options

Every command takes --help. Exit codes: 0 ok, 2 invalid input, 3 no feasible plan,
4 failure while executing (parameters restored), 1 anything else.

examples:
  zeroflat layout --numels 5,7,3 --dp 4
  zeroflat layout --model qwen3-30b-a3b --layers 2 --dp 8 --json
  zeroflat run --model qwen3-30b-a3b --layers 1 --experts 16 --verify
  zeroflat write-checkpoint /tmp/ck --model tiny-moe --shard-size 4MB
  zeroflat load /tmp/ck --dp 3 --verify
)";

}  // namespace

int main(int argc, char** argv) {
  using namespace zeroflat;
  using namespace zeroflat::cli;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::fputs(kUsage, stderr);
    return kExitInvalid;
  }
  std::string command = args.front();
  args.erase(args.begin());
  if (command == "help" && !args.empty()) {
    command = args.front();
    args = {"--help"};
  }
  try {
    if (command == "-h" || command == "--help" || command == "help") {
      std::fputs(kUsage, stdout);
      return kExitOk;
    }
    if (command == "--version" || command == "version") {
      const std::string devices = join(device_prefixes());
      std::printf(
          "zeroflat %s\n  devices: %s\n  toolchains found at build time: cuda %s, nccl %s, "
          "mpi %s, python+torch %s\n",
          ZEROFLAT_VERSION, devices.c_str(), ZEROFLAT_HAVE_CUDA ? "yes" : "no",
          ZEROFLAT_HAVE_NCCL ? "yes" : "no", ZEROFLAT_HAVE_MPI ? "yes" : "no",
          ZEROFLAT_HAVE_PYTHON ? "yes" : "no");
      return kExitOk;
    }
    int code = kExitInvalid;
    if (command == "layout") {
      code = subcommand_layout(args);
    } else if (command == "run") {
      code = subcommand_run(args);
    } else if (command == "plan") {
      code = subcommand_plan(args);
    } else if (command == "inspect") {
      code = subcommand_inspect(args);
    } else if (command == "probe") {
      code = subcommand_probe(args);
    } else if (command == "load") {
      code = subcommand_load(args);
    } else if (command == "write-checkpoint") {
      code = subcommand_write_checkpoint(args);
    } else if (command == "bench") {
      code = subcommand_bench(args);
    } else {
      std::fprintf(stderr, "zeroflat: unknown command '%s'\n\n%s", printable(command).c_str(),
                   kUsage);
      return kExitInvalid;
    }
    // A document that did not reach its reader is a failure, whatever the command concluded.
    std::cout.flush();
    if (!std::cout || std::fflush(stdout) != 0 || std::ferror(stdout)) {
      std::fprintf(stderr, "zeroflat %s: error: could not write the output (%s)\n", command.c_str(),
                   std::strerror(errno));
      return kExitOther;
    }
    return code;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "zeroflat %s: %s\n(see `zeroflat %s --help`)\n", command.c_str(),
                 shown(e.what()).c_str(), command.c_str());
    return failed(command, args, kExitInvalid, "usage", shown(e.what()));
  } catch (const InvalidArgument& e) {
    std::fprintf(stderr, "zeroflat %s: invalid input: %s\n", command.c_str(),
                 shown(e.what()).c_str());
    return failed(command, args, kExitInvalid, "invalid input", shown(e.what()));
  } catch (const Unsupported& e) {
    std::fprintf(stderr, "zeroflat %s: not supported: %s\n", command.c_str(),
                 shown(e.what()).c_str());
    return failed(command, args, kExitInvalid, "not supported", shown(e.what()));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zeroflat %s: error: %s\n", command.c_str(), shown(e.what()).c_str());
    return failed(command, args, kExitOther, "error", shown(e.what()));
  }
}
