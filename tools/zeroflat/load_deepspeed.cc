// `zeroflat load --from deepspeed`: a DeepSpeed ZeRO checkpoint's resume, rehearsed or run. Each
// rank of the new world reads only its share of the saved fp32 master weights and partitioned
// optimizer states: the saved runs that hold its elements are the loader's checkpoint
// (deepspeed_source), one load call per buffer it keeps, as the Python resume reads them
// (python/zeroflat/_resume.py): under ZeRO-1/2 the slice of each optimizer group's flat layout
// at the new world, under ZeRO-3 the partitions of every trainable parameter, each a load().
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/load.h"
#include "zeroflat/common.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/layout.h"
#include "zeroflat/report.h"

namespace zeroflat::cli {
namespace {

bool zero3_of(const LoadConfig& cfg) { return cfg.deepspeed->plan.stage == 3; }

// "fp32 of group 0", "exp_avg" (ZeRO-3: every group in one buffer).
std::string what(const DeepSpeedBuffer& b) {
  return b.group ? b.target + " of group " + std::to_string(*b.group) : b.target;
}

// --states: the partitioned states to read besides the fp32 master.
std::vector<std::string> states_from_args(const Args& args, const DeepSpeedCheckpoint& ck) {
  const std::vector<std::string> partitioned = deepspeed_partitioned_states(ck);
  const std::string v = args.get("states").value_or("all");
  if (v == "all") return partitioned;
  if (v == "none") return {};
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= v.size()) {
    const std::size_t comma = std::min(v.find(',', at), v.size());
    const std::string name = v.substr(at, comma - at);
    at = comma + 1;
    if (name == "fp32") continue;  // always read
    if (std::find(partitioned.begin(), partitioned.end(), name) == partitioned.end()) {
      throw InvalidArgument(
          "--states '" + printable(name) + "': " +
          (name.empty() ? std::string("an empty name") : "not a state this checkpoint saves per "
                                                         "element") +
          " (it has: " + (partitioned.empty() ? std::string("none") : join(partitioned)) +
          "; or all, none)");
    }
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

// The new run's release rules: --deepspeed V (none: every saved parameter), else the saving
// release's.
std::optional<ReleaseRules> rules_from_args(const Args& args, const DeepSpeedCheckpoint& ck) {
  // The options the new run's 16-bit buffer has, for the release to accept.
  LayoutOptions saved;
  saved.dtype = try_parse_dtype(ck.dtype).value_or(DType::kBF16);
  saved.param_align_bytes = ck.parameter_alignment ? 16 : 0;
  if (auto v = args.get("deepspeed")) {
    if (*v == "none") return std::nullopt;
    return release_from_args(args, saved);
  }
  try {
    return deepspeed_rules(ck.ds_version.empty() ? "latest" : ck.ds_version);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(printable(ck.dir, 200) + ": the saving release '" +
                          printable(ck.ds_version) + "' has no layout rules here (" + e.what() +
                          "); name the new run's release with --deepspeed V");
  }
}

}  // namespace

void add_deepspeed_load_options(Parser& p) {
  p.option("from", "FORMAT",
           "what CHECKPOINT is: safetensors (a model's tensors, laid out in one flat buffer), or "
           "deepspeed (a DeepSpeed ZeRO checkpoint folder, the one holding 'latest' or a tag "
           "folder: each rank of a new world of --dp ranks reads only its share of the saved "
           "fp32 master weights and optimizer states, as a resume does)",
           "safetensors");
  p.option("tag", "TAG", "--from deepspeed: the tag folder to read", "the one DIR/latest names");
  p.option("states", "LIST",
           "--from deepspeed: the optimizer states read besides the fp32 master: all (every "
           "state saved per element, such as Adam's exp_avg and exp_avg_sq), none, or names "
           "(exp_avg,exp_avg_sq)",
           "all");
}

bool from_deepspeed(const Args& args) {
  const std::string v = args.get("from").value_or("safetensors");
  if (v == "deepspeed") return true;
  if (v == "safetensors") return false;
  throw UsageError("--from '" + printable(v) + "': expected safetensors or deepspeed");
}

void deepspeed_config(LoadConfig& cfg, const Args& args) {
  for (const char* o : {"model", "layers", "experts", "checkpoint-dtype", "dtype", "round-robin",
                        "alignment-factor", "param-align-bytes", "sub-group-size"}) {
    if (args.has(o)) {
      throw InvalidArgument(std::string("--") + o +
                            " with --from deepspeed: the checkpoint decides the buffers (fp32, "
                            "laid out with the saving run's round-robin, parameter alignment "
                            "and sub-groups)");
    }
  }
  const auto& pos = args.positionals();
  if (pos.empty()) {
    throw UsageError(
        "name the DeepSpeed checkpoint folder: zeroflat load DIR --from deepspeed --dp N");
  }
  LayoutOptions base = layout_options_from_args(args);  // --dp
  base.dtype = DType::kFP32;                            // the master weights and the states
  DeepSpeedLoad ds;
  ds.ck = open_deepspeed_checkpoint(pos.front(), args.get("tag"));
  const DeepSpeedCheckpoint& ck = ds.ck;
  const std::string dir = printable(ck.dir, 200);

  // The new run's stage: ZeRO-1/2 and ZeRO-3 keep different partitions; a universal checkpoint
  // serves either.
  int stage = ck.zero_stage;
  if (auto v = args.get("stage")) {
    const std::uint64_t s = parse_u64(*v, "--stage");
    if (s < 1 || s > 3) throw InvalidArgument("--stage " + printable(*v) + ": expected 1, 2 or 3");
    if (ck.format != DeepSpeedFormat::kUniversal && (s == 3) != (ck.zero_stage == 3)) {
      throw InvalidArgument(
          "--stage " + printable(*v) + ": " + dir + " was saved by ZeRO-" +
          std::to_string(ck.zero_stage) +
          " (ZeRO-1/2 keep each optimizer group's flat buffer, ZeRO-3 each parameter's "
          "partitions): resume it with --stage " + (ck.zero_stage == 3 ? "3" : "1 or 2") +
          ", or convert it to a universal checkpoint (python -m "
          "deepspeed.checkpoint.ds_to_universal), which either stage resumes");
    }
    stage = static_cast<int>(s);
  }
  const bool zero3 = stage == 3;
  const Tier plan = zero3 ? Tier::kLoadPartitions : Tier::kLoadSlice;
  if (auto v = args.get("read-plan"); v && *v != "auto") {
    if (*v != tier_name(plan)) {
      throw InvalidArgument("--read-plan '" + printable(*v) + "': a resume under ZeRO-" +
                            std::to_string(stage) + " reads with auto or " +
                            std::string(tier_name(plan)) + " (each rank reads only its own " +
                            (zero3 ? "partitions" : "slice") + ")");
    }
    cfg.library.tier = plan;
  }
  ResumeOptions ro;
  ro.world = base.dp;
  ro.stage = stage;
  ro.rules = rules_from_args(args, ck);
  ro.select = ro.rules.has_value();
  ro.states = states_from_args(args, ck);
  ds.plan = plan_resume(ck, ro);
  for (const std::string& l : ds.plan.left_out) cfg.left_out.push_back(l);
  cfg.checkpoint_bytes = 0;
  for (const DeepSpeedBuffer& b : ds.plan.buffers) {
    for (const CheckpointTensor& t : b.source.index.tensors) cfg.checkpoint_bytes += t.bytes;
  }
  cfg.source = pos.front();
  cfg.ck = ds.plan.buffers.front().source.index;  // every file of the checkpoint: the ceiling's
  cfg.library.layout = base;
  cfg.stage.zero3 = zero3;
  cfg.stage.sub_group_size = ds.plan.sub_group_size;
  cfg.deepspeed = std::move(ds);
}

std::uint64_t deepspeed_kept_bytes(const LoadConfig& cfg) {
  std::uint64_t bytes = 0;
  for (const DeepSpeedBuffer& b : cfg.deepspeed->plan.buffers) {
    bytes = sat_add(bytes, resume_kept_bytes(b));
  }
  return bytes;
}

std::string deepspeed_note(const LoadConfig& cfg) {
  const DeepSpeedLoad& ds = *cfg.deepspeed;
  return printable(cfg.source) + ": DeepSpeed " + std::string(deepspeed_format_name(ds.ck.format)) +
         " checkpoint, tag " + printable(ds.ck.tag) + ", saved by " +
         std::to_string(ds.ck.world) + " rank(s); " + std::to_string(ds.plan.buffers.size()) +
         " buffer(s) per rank (" + join(ds.plan.targets) + "), " + format_bytes(cfg.checkpoint_bytes) +
         " read by all ranks; dp " + std::to_string(cfg.library.layout.dp) + " (ZeRO-" +
         std::to_string(ds.plan.stage) + ") over " + cfg.setup.comm + " on " + cfg.setup.device_spec +
         ", " + std::to_string(cfg.threads) + " reader thread(s) per rank" +
         (cfg.library.read.cold ? ", cold" : "");
}

LoadOutcome load_deepspeed_rank(const LoadConfig& cfg, std::uint64_t rank, Communicator* control,
                                Progress& progress) {
  const DeepSpeedLoad& ds = *cfg.deepspeed;
  const bool zero3 = zero3_of(cfg);
  const bool no_data = cfg.setup.no_data;
  const std::uint64_t dp = cfg.library.layout.dp;
  LoadOutcome out;
  RankContext ctx = rank_context(cfg, rank, control);
  Device& device = *ctx.device;

  // The ceiling reads as many bytes of the same files as this rank's loads will, known before.
  std::optional<ReadCeiling> ceiling;
  std::uint64_t expected = 0;
  std::vector<ResumeRankBuffer> mine;
  for (const DeepSpeedBuffer& b : ds.plan.buffers) {
    mine.push_back(resume_rank_buffer(b, rank));
    expected += mine.back().read_bytes;
  }
  const bool with_ceiling = cfg.ceiling && !no_data;
  if (with_ceiling) {
    measure_ceiling(cfg, rank, expected, device, control, progress, ceiling);
  }
  // One account of this rank's reads over every buffer, for the progress line.
  ctx.options.read.progress->expected = no_data ? 0 : expected;

  // Every buffer in turn, each a collective; a resume keeps them all.
  std::vector<FlattenResult> results;
  results.reserve(ds.plan.buffers.size());
  Json loads = Json::array();
  Json& plans = out.plan;
  plans = Json::array();
  std::uint64_t bytes_read = 0, reads = 0, copy_bytes = 0, copy_read_bytes = 0, kept = 0, share = 0;
  std::uint64_t predicted_peak = 0, measured_peak = 0;
  double read_seconds = 0, seconds = 0, total_seconds = 0, copy_seconds = 0, cached = 0;
  bool read_any = false;
  progress.begin("rank " + std::to_string(rank) + ": " + (no_data ? "account for " : "load ") +
                     std::to_string(ds.plan.buffers.size()) + " buffer(s)",
                 0, ctx.options.read.progress);
  for (std::size_t bi = 0; bi < ds.plan.buffers.size(); ++bi) {
    const DeepSpeedBuffer& b = ds.plan.buffers[bi];
    FlattenOptions lo = ctx.options;
    lo.must_match.push_back("load " + what(b) + ", " + std::to_string(b.source.params.size()) +
                            " parameters");
    FlattenResult res;
    try {
      res = load_resume_buffer(b, device, ctx.comm, lo);
    } catch (const InvalidArgument&) {
      throw;  // bad input, the same verdict on every rank: exit 2
    } catch (const Error& err) {
      progress.end();
      LoadOutcome failed = failed_load(rank, err);
      failed.entry["load"] = what(b);
      failed.plan = std::move(plans);
      return failed;
    }
    Json e = Json::parse(result_json(res));
    plans.push_back({{"target", b.target},
                     {"group", b.group ? Json(*b.group) : Json()},
                     {"plan", std::move(e["plan"])}});
    if (!res.feasible()) {
      progress.end();
      out.exit = kExitInfeasible;
      out.message = "the loader's plan for " + what(b) + " does not fit: " + res.plan.reason +
                    (results.empty() ? ". Nothing was read."
                                     : ". The buffers read before it were released.");
      return out;
    }
    const std::uint64_t b_kept = mine[bi].kept_bytes;
    const std::uint64_t b_share = mine[bi].share_bytes;
    Json l;
    l["target"] = b.target;
    l["group"] = b.group ? Json(*b.group) : Json();
    l["params"] = b.source.params.size();
    l["bytes"] = b_kept;
    l["share_bytes"] = b_share;
    for (const char* key : {"bytes_read", "reads", "read_seconds", "read_gbps", "page_cache",
                            "cached_fraction", "seconds", "total_seconds",
                            "predicted_peak_device_bytes", "measured_peak_device_bytes",
                            "copy_check_bytes", "copy_check_read_bytes"}) {
      l[key] = e[key];
    }
    bytes_read += e["bytes_read"].get<std::uint64_t>();
    reads += e["reads"].get<std::uint64_t>();
    read_seconds += e["read_seconds"].get<double>();
    seconds += e["seconds"].get<double>();
    total_seconds += e["total_seconds"].get<double>();
    copy_bytes += e["copy_check_bytes"].get<std::uint64_t>();
    copy_read_bytes += e["copy_check_read_bytes"].get<std::uint64_t>();
    copy_seconds += e["copy_check_seconds"].get<double>();
    if (e["cached_fraction"].is_number()) {
      read_any = true;
      cached += e["cached_fraction"].get<double>() * e["bytes_read"].get<double>();
    }
    predicted_peak = std::max(predicted_peak, res.predicted_peak_device_bytes);
    measured_peak = std::max(measured_peak, res.execution.measured_peak_device_bytes);
    kept += b_kept;
    share += b_share;
    loads.push_back(std::move(l));
    results.push_back(std::move(res));
  }
  progress.end();
  if (with_ceiling) measure_ceiling(cfg, rank, expected, device, control, progress, ceiling);

  // Verification: every buffer against the saved tensors read whole.
  std::string failure;
  if (cfg.verify) {
    progress.begin("verify every buffer against the saved tensors read whole", 0);
    for (std::size_t i = 0; i < results.size(); ++i) {
      const DeepSpeedBuffer& b = ds.plan.buffers[i];
      const std::string f = verify_load(b.source.index, b.source.params, b.placement, device,
                                        results[i].group(), dp, rank);
      loads[i]["verified"] = f.empty();
      if (!f.empty() && failure.empty()) failure = what(b) + ": " + f;
    }
    progress.end();
  }
  for (std::size_t i = 0; i < results.size(); ++i) {
    loads[i]["checksum"] =
        device.keeps_data()
            ? Json(checksum_hex(device.checksum(results[i].group().flat.data(),
                                                loads[i]["bytes"].get<std::uint64_t>())))
            : Json();
  }

  Json& e = out.entry;
  e["rank"] = rank;
  e["read_plan"] = std::string(tier_name(zero3 ? Tier::kLoadPartitions : Tier::kLoadSlice));
  e["outcome"] = "done";
  e["bytes_read"] = bytes_read;
  e["share_bytes"] = share;
  e["read_over_share"] = share > 0 ? Json(static_cast<double>(bytes_read) /
                                          static_cast<double>(share))
                                   : Json();
  e["reads"] = reads;
  e["read_seconds"] = read_seconds;
  e["read_gbps"] = read_any ? Json(gbps(bytes_read, read_seconds)) : Json();
  e["page_cache"] =
      read_any && bytes_read > 0
          ? Json(page_cache_word(cached / static_cast<double>(bytes_read)))
          : Json();
  e["cached_fraction"] =
      read_any && bytes_read > 0 ? Json(cached / static_cast<double>(bytes_read)) : Json();
  e["seconds"] = seconds;
  e["total_seconds"] = total_seconds;
  e["kept_bytes"] = kept;
  e["predicted_peak_device_bytes"] = predicted_peak;
  e["measured_peak_device_bytes"] = measured_peak;
  e["copy_check_bytes"] = copy_bytes;
  e["copy_check_read_bytes"] = copy_read_bytes;
  e["copy_check_seconds"] = copy_seconds;
  if (with_ceiling) e["ceiling"] = ceiling_json(*ceiling);
  record_verification(cfg, failure, out);
  e["loads"] = std::move(loads);
  out.flat_bytes = kept;
  out.partition_bytes = kept;
  return out;
}

}  // namespace zeroflat::cli
