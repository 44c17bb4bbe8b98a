// `zeroflat plan`: which way of flattening fits, its peak memory and predicted time, and why the
// others were not chosen; for a model and a node you may not have.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/common.h"
#include "cli/svg.h"
#include "zeroflat/agree.h"
#include "zeroflat/common.h"
#include "zeroflat/plan.h"
#include "zeroflat/report.h"

namespace zeroflat::cli {
namespace {

// The chart into `path`, a new file or a regular one (replaced whole, its mode and, where this
// process may, its owner kept): a link, a FIFO, a device or a folder there is refused, never
// followed or waited on; written into a file of a short name of its own in the same folder
// first (a name near NAME_MAX takes no suffix) and renamed over it, so that a failed write
// leaves what was there.
void write_svg(const std::string& path, const std::string& text) {
  const std::string shown = "--svg " + printable(path, 200);
  struct stat st {};
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  if (exists && !S_ISREG(st.st_mode)) {
    throw InvalidArgument(shown + ": exists and is not a regular file (a link, a FIFO, a device "
                          "or a folder); name a new file or a regular one");
  }
  const std::size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const std::string tmp =
      (slash == std::string::npos ? "" : dir) + ".zeroflat-svg-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd < 0) {
    throw InvalidArgument(shown + ": cannot write beside it (" + std::strerror(errno) + ")");
  }
  if (exists) {
    (void)::fchown(fd, st.st_uid, st.st_gid);  // only a privileged process may give it away
    (void)::fchmod(fd, st.st_mode & 07777);
  }
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0 && errno != EINTR) break;
    if (n > 0) done += static_cast<std::size_t>(n);
  }
  const bool written = done == text.size();
  const bool closed = ::close(fd) == 0;
  if (!written || !closed || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw Error(shown + ": write failed (" + why + ")");
  }
}

}  // namespace

int subcommand_plan(const std::vector<std::string>& argv) {
  std::vector<std::string> preset_names;
  for (const DevicePreset& p : device_presets()) preset_names.push_back(p.name);
  const std::string presets = join(preset_names);
  Parser p("plan", "--model NAME --dp P --device PRESET|SIZE [options]",
           "Plans the flatten of one parameter group holding every tensor of the model, with the\n"
           "model already resident on each of P devices: builds the four tiers (device, sharded,\n"
           "staged, host) as step lists, runs each on a memory model for its peak device and host\n"
           "bytes and its traffic, predicts its time from the device's bandwidths, and picks the\n"
           "fastest one that fits. Nothing is allocated: plan a node you do not have.");
  add_model_options(p, "");
  add_layout_options(p);
  p.option("device", "PRESET|SIZE", "accelerator preset (" + presets + ") or a capacity (80GiB)");
  p.option("free", "SIZE", "free device memory per rank", "capacity - model bytes");
  p.option("margin", "SIZE", "reserve never planned into", "3% of capacity, at most 1 GiB");
  p.option("host", "SIZE", "host memory of the node, shared by its ranks (at most 8 per node)",
           "the preset's node; 2 TiB for a plain SIZE");
  p.option("host-free", "SIZE", "host memory each rank may use for staging (overrides --host)",
           "--host / ranks on the node");
  p.option("tier", "TIER", "auto, or force one of device, sharded, staged, host", "auto");
  p.option("svg", "FILE", "draw device memory over the steps of each tier into FILE");
  p.flag("json", "print one JSON document (docs/cli.md)");
  p.epilog(
      "exit codes: 0 a plan fits; 3 no tier fits (or the forced one does not), with the numbers;\n"
      "2 invalid input.\n\n"
      "examples:\n"
      "  zeroflat plan --model qwen3-30b-a3b --layers 32 --dp 8 --device h100-80gb\n"
      "  zeroflat plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --free 4GiB --json\n"
      "  zeroflat plan --model qwen3-30b-a3b --dp 1 --device h100-80gb --free 2GiB --svg plan.svg");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  if (!args.has("model")) throw UsageError("--model is required");
  if (!args.has("device")) throw UsageError("--device is required (a preset or a size)");
  ModelSpec model = model_from_args(args, "");
  LayoutOptions options = layout_options_from_args(args, &model);
  const std::optional<ReleaseRules> rules = release_from_args(args, options);
  if (const std::string note = apply_release(rules, model, options); !note.empty()) {
    std::fprintf(stderr, "zeroflat plan: %s\n", note.c_str());
  }
  const std::string device_text = *args.get("device");
  DevicePreset preset;
  if (auto found = find_preset(device_text)) {
    preset = *found;
  } else {
    try {
      preset = generic_preset(parse_size(device_text));
    } catch (const InvalidArgument&) {
      throw InvalidArgument("--device '" + printable(device_text) + "': expected a preset (" +
                            presets + ") or a capacity such as 80GiB");
    }
    if (preset.capacity_bytes == 0) throw InvalidArgument("--device 0: a device needs capacity");
  }
  std::optional<Tier> forced;
  if (auto t = args.get("tier")) forced = parse_tier_choice(*t, "--tier");
  const std::uint64_t es = element_size(options.dtype);
  const std::uint64_t model_bytes = model.numel() * es;
  // The node described by hand: its facts go through the same conversion and policy as a real
  // run's agreed facts (plan_facts, make_plan_input).
  Agreement node;
  node.capacity_bytes = preset.capacity_bytes;
  node.free_bytes = model_bytes < preset.capacity_bytes ? preset.capacity_bytes - model_bytes : 0;
  if (auto v = args.get("free")) {
    node.free_bytes = parse_size(*v, "--free");
    if (node.free_bytes > preset.capacity_bytes) {
      throw InvalidArgument("--free " + *v + " is more than the device's capacity of " +
                            format_bytes(preset.capacity_bytes));
    }
    if (model_bytes <= preset.capacity_bytes &&
        preset.capacity_bytes - node.free_bytes < model_bytes) {
      throw InvalidArgument("--free " + *v + " leaves " +
                            format_bytes(preset.capacity_bytes - node.free_bytes) +
                            " in use, less than the model's own " + format_bytes(model_bytes) +
                            ", which are resident");
    }
  }
  const std::uint64_t ranks_per_node = std::min<std::uint64_t>(options.dp, 8);
  if (auto v = args.get("host")) preset.host_bytes_per_node = parse_size(*v, "--host");
  node.host_free_bytes = preset.host_bytes_per_node / ranks_per_node;
  if (auto v = args.get("host-free")) node.host_free_bytes = parse_size(*v, "--host-free");
  node.integrated = preset.integrated;
  PlanFacts facts = plan_facts(node, ranks_per_node);
  facts.bandwidths = preset.bandwidths;
  std::optional<std::uint64_t> margin;
  if (auto v = args.get("margin")) margin = parse_size(*v, "--margin");
  const PlanInput in = make_plan_input(Layout::compute(model.numels(), options), model_bytes, facts,
                                       0, forced, margin);
  Plan plan = plan_group(in);
  AfterInit after = estimate_after_init(in);
  // Beside the tiers: the checkpoint loader, for which nothing of the model is on the device yet
  // (zeroflat load), with its default staging ring.
  PlanInput load_in = in;
  load_in.free_bytes = std::min(preset.capacity_bytes, in.free_bytes + model_bytes);
  load_in.original_bytes = 0;
  const Candidate load = plan_load(load_in, kDefaultRingBytes);
  const Candidate* chosen = plan.chosen_candidate();

  if (auto svg_path = args.get("svg")) {
    write_svg(*svg_path, plan_svg(plan, in,
                                  model.name + ", dp " + std::to_string(options.dp) + ", " +
                                      preset.name));
  }

  if (args.has("json")) {
    nlohmann::ordered_json doc;
    doc["model"] = {{"name", model.name},
                    {"architecture", model.architecture},
                    {"tensors", model.tensors.size()},
                    {"numel", model.numel()},
                    {"bytes", model_bytes}};
    doc["dp"] = options.dp;
    doc["deepspeed"] = rules_doc(rules);
    doc["device"] = {{"preset", preset.name}, {"capacity_bytes", preset.capacity_bytes}};
    doc["free_bytes"] = in.free_bytes;
    doc["margin_bytes"] = in.margin_bytes;
    doc["host_free_bytes"] = in.host_free_bytes;
    doc["flat_bytes"] = in.layout.flat_bytes();
    doc["partition_bytes"] = in.layout.partition_bytes();
    doc["tier"] = chosen ? nlohmann::ordered_json(std::string(tier_name(chosen->tier)))
                         : nlohmann::ordered_json();
    doc["feasible"] = chosen != nullptr;
    doc["reason"] = plan.reason;
    nlohmann::ordered_json cands = nlohmann::ordered_json::array();
    for (const Candidate& c : plan.candidates) {
      cands.push_back(nlohmann::ordered_json::parse(candidate_json(c, true)));
    }
    doc["candidates"] = std::move(cands);
    doc["load"] = nlohmann::ordered_json::parse(candidate_json(load, true));
    doc["after_init"] = {{"master_bytes", after.master_bytes},
                         {"optimizer_bytes", after.optimizer_bytes},
                         {"gradient_bytes", after.gradient_bytes},
                         {"device_bytes", after.device_bytes_after},
                         {"fits", after.fits}};
    std::printf("%s\n",
                doc.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
  } else {
    std::printf("plan: %s, %s tensors, %s parameters, %s %s; dp %llu on %s (%s)\n",
                printable(model.name, 200).c_str(), format_count(model.tensors.size()).c_str(),
                format_count(model.numel()).c_str(), format_bytes(model_bytes).c_str(),
                std::string(dtype_name(options.dtype)).c_str(),
                static_cast<unsigned long long>(options.dp), preset.name.c_str(),
                format_bytes(preset.capacity_bytes).c_str());
    std::printf("  layout: %s\n", rules_text(rules).c_str());
    std::printf("  free %s per rank, margin %s, host %s per rank; flat buffer %s, partition %s\n\n",
                format_bytes(in.free_bytes).c_str(), format_bytes(in.margin_bytes).c_str(),
                format_bytes(in.host_free_bytes).c_str(),
                format_bytes(in.layout.flat_bytes()).c_str(),
                format_bytes(in.layout.partition_bytes()).c_str());
    std::printf("  %-8s %-4s %12s %11s %11s %11s %10s  %s\n", "tier", "fits", "peak device", "host",
                "pcie", "all-gather", "time", "why not");
    for (const Candidate& c : plan.candidates) {
      std::printf(
          "  %-8s %-4s %12s %11s %11s %11s %10s  %s\n", std::string(tier_name(c.tier)).c_str(),
          c.feasible ? "yes" : "no", format_bytes(c.profile.peak_device_bytes).c_str(),
          format_bytes(c.profile.peak_host_bytes).c_str(),
          format_bytes(c.profile.pcie_bytes).c_str(), format_bytes(c.profile.comm_bytes).c_str(),
          format_seconds(c.predicted_seconds).c_str(), c.why_not.c_str());
    }
    std::printf("  %-8s %-4s %12s %11s %11s %11s %10s  %s\n", "load*", load.feasible ? "yes" : "no",
                format_bytes(load.profile.peak_device_bytes).c_str(),
                format_bytes(load.profile.peak_host_bytes).c_str(),
                format_bytes(load.profile.read_bytes).c_str(),
                format_bytes(load.profile.comm_bytes).c_str(),
                format_seconds(load.predicted_seconds).c_str(), load.why_not.c_str());
    std::printf(
        "  * zeroflat load: the buffer read from a checkpoint, each rank its partition (the "
        "pcie column: bytes read at %.1f GB/s), nothing of the model on the device "
        "before\n",
        preset.bandwidths.read / 1e9);
    std::printf("\n%s: %s\n", chosen ? "chosen" : "NO PLAN", plan.reason.c_str());
    if (chosen) {
      std::printf("steps:\n");
      for (std::size_t k = 0; k < chosen->steps.size(); ++k) {
        std::printf("  %2zu. %-72s device %s\n", k, chosen->steps[k].describe().c_str(),
                    format_bytes(chosen->profile.after_step[k].device_bytes).c_str());
      }
    }
    std::printf(
        "\nafter init, per rank: master %s + Adam %s + gradients %s -> device %s: %s\n",
        format_bytes(after.master_bytes).c_str(), format_bytes(after.optimizer_bytes).c_str(),
        format_bytes(after.gradient_bytes).c_str(), format_bytes(after.device_bytes_after).c_str(),
        after.fits ? "fits" : "WARNING: init fits but training will not");
  }
  if (chosen && !after.fits) {
    std::fprintf(
        stderr,
        "zeroflat plan: warning: init fits, but training needs %s per rank (%s "
        "usable)\n",
        format_bytes(after.device_bytes_after).c_str(),
        format_bytes(in.capacity_bytes - std::min(in.margin_bytes, in.capacity_bytes)).c_str());
  }
  return chosen ? kExitOk : kExitInfeasible;
}

}  // namespace zeroflat::cli
