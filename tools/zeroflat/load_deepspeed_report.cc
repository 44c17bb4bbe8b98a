// `zeroflat load --from deepspeed`: the report of a resume (JSON or a table), one entry per rank
// with what it read against its exact share, and the node's figures as `load` gives them.
#include <cstdio>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/load.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"

namespace zeroflat::cli {
namespace {

std::uint64_t u64(const Json& e, const char* key) { return e[key].get<std::uint64_t>(); }

// What the buffers of one rank are: "fp32 of group 0 (1.02 kB), ...", from an entry's loads.
std::string loads_text(const Json& loads) {
  std::vector<std::string> items;
  for (const Json& l : loads) {
    std::string item = l["target"].get<std::string>();
    if (l["group"].is_number()) item.append(" of group ").append(std::to_string(u64(l, "group")));
    item.append(" ").append(format_bytes(u64(l, "bytes")));
    items.push_back(std::move(item));
  }
  return join(items);
}

// How many sub-groups ZeRO-3 cuts the new run's groups into.
std::uint64_t sub_groups(const LoadConfig& cfg) {
  const DeepSpeedLoad& ds = *cfg.deepspeed;
  return Zero3Layout::compute(ds.plan.group_numels, Zero3Options{cfg.library.layout.dp, ds.plan.sub_group_size,
                                                      DType::kFP32})
      .sub_groups()
      .size();
}

}  // namespace

void print_deepspeed_report(const LoadConfig& cfg, const std::vector<Json>& entries,
                            const LoadOutcome& first, int exit, const std::string& first_error) {
  const DeepSpeedLoad& ds = *cfg.deepspeed;
  const DeepSpeedCheckpoint& ck = ds.ck;
  const bool zero3 = ds.plan.stage == 3;
  const bool no_data = cfg.setup.no_data;
  const NodeFigures node = node_figures(entries, no_data);
  const std::uint64_t kept = deepspeed_kept_bytes(cfg);
  std::uint64_t share = 0;
  for (const Json& e : entries) {
    if (e.contains("share_bytes")) share += u64(e, "share_bytes");
  }
  const std::string plan_reason =
      first.plan.is_array() && !first.plan.empty() && first.plan[0]["plan"].contains("reason")
          ? first.plan[0]["plan"]["reason"].get<std::string>()
          : std::string();
  if (cfg.json) {
    Json doc;
    doc["checkpoint"] = cfg.source;
    doc["from"] = "deepspeed";
    doc["tag"] = ck.tag;
    doc["format"] = std::string(deepspeed_format_name(ck.format));
    doc["zero_stage"] = ck.zero_stage;
    doc["saved_world"] = ck.world;
    doc["ds_version"] = ck.ds_version;
    doc["model_dtype"] = ck.dtype;
    doc["stage"] = ds.plan.stage;
    doc["dp"] = cfg.library.layout.dp;
    doc["dtype"] = "fp32";
    doc["targets"] = ds.plan.targets;
    doc["params"] = ds.plan.params;
    Json left = Json::array();
    for (const std::string& l : cfg.left_out) left.push_back(l);
    doc["left_out"] = std::move(left);
    doc["round_robin"] = !zero3 && ck.round_robin;
    doc["parameter_alignment"] = !zero3 && ck.parameter_alignment;
    doc["sub_group_size"] = zero3 ? Json(ds.plan.sub_group_size) : Json();
    doc["sub_groups"] = zero3 ? Json(sub_groups(cfg)) : Json();
    doc["deepspeed"] = rules_doc(ds.plan.rules);
    doc["device"] = cfg.setup.device_spec;
    doc["no_data"] = no_data;
    doc["comm"] = cfg.setup.comm;
    doc["threads"] = cfg.threads;
    doc["cold"] = cfg.library.read.cold;
    doc["read_plan"] = std::string(tier_name(zero3 ? Tier::kLoadPartitions : Tier::kLoadSlice));
    doc["checkpoint_bytes"] = cfg.checkpoint_bytes;
    doc["kept_bytes"] = kept;
    doc["bytes_read"] = node.bytes;
    doc["share_bytes"] = share;
    print_document(doc, first.plan, node, entries, exit, first_error);
    return;
  }
  std::printf(
      "%s DeepSpeed checkpoint %s (tag %s, %s, ZeRO-%d, saved by %llu rank(s), DeepSpeed %s, "
      "%s) at dp %llu (ZeRO-%d) on %s: %llu parameters in %zu group(s); each rank keeps %s, %s\n",
      no_data ? "rehearsed" : exit == kExitExecFailed ? "failed to resume" : "resumed",
      printable(cfg.source).c_str(),
      printable(ck.tag).c_str(), std::string(deepspeed_format_name(ck.format)).c_str(),
      ck.zero_stage, static_cast<unsigned long long>(ck.world), printable(ck.ds_version).c_str(),
      printable(ck.dtype).c_str(), static_cast<unsigned long long>(cfg.library.layout.dp),
      ds.plan.stage, cfg.setup.device_spec.c_str(), static_cast<unsigned long long>(ds.plan.params),
      ds.plan.group_numels.size(), join(ds.plan.targets).c_str(), format_bytes(kept).c_str());
  if (zero3) {
    std::printf(
        "layout: ZeRO-3's partitions, every parameter cut in %llu, in fp32; %s%s; %llu "
        "sub-group(s) at sub_group_size %s\n",
        static_cast<unsigned long long>(cfg.library.layout.dp), rules_text(ds.plan.rules).c_str(),
        kZero3RulesNote, static_cast<unsigned long long>(sub_groups(cfg)),
        format_count(ds.plan.sub_group_size).c_str());
  } else {
    std::printf(
        "layout: each group's flat buffer at dp %llu (padded to 2 x %llu elements%s%s), its "
        "slice per rank, in fp32; %s\n",
        static_cast<unsigned long long>(cfg.library.layout.dp),
        static_cast<unsigned long long>(cfg.library.layout.dp),
        ck.round_robin ? ", round-robin" : "",
        ck.parameter_alignment ? ", parameters aligned to 16 bytes of the 16-bit buffer" : "",
        rules_text(ds.plan.rules).c_str());
  }
  if (!plan_reason.empty()) std::printf("read plan: %s\n", plan_reason.c_str());
  if (!entries.empty() && entries.front().contains("loads")) {
    std::printf("buffers per rank: %s\n", loads_text(entries.front()["loads"]).c_str());
  }
  if (!cfg.left_out.empty()) std::printf("left out: %s\n", join(cfg.left_out).c_str());
  std::printf("%-5s %11s %11s %6s %6s %9s %7s %8s %7s %11s %24s\n", "rank", "read", "share",
              "ratio", "reads", "seconds", "GB/s", "ceiling", "cache", "kept",
              "device peak pred / meas");
  for (const Json& e : entries) {
    if (!e.contains("bytes_read")) {
      std::printf("%-5llu error (loading %s): %s\n", static_cast<unsigned long long>(u64(e, "rank")),
                  terminal_text(e.value("load", std::string("?"))).c_str(),
                  terminal_text(e.value("error", std::string("?"))).c_str());
      continue;
    }
    const double g = e["read_gbps"].is_number() ? e["read_gbps"].get<double>() : 0;
    const double c = e.contains("ceiling") ? e["ceiling"]["read_gbps"].get<double>() : 0;
    const std::string peaks = format_bytes(u64(e, "predicted_peak_device_bytes")) + " / " +
                              format_bytes(u64(e, "measured_peak_device_bytes"));
    std::printf("%-5llu %11s %11s %6s %6llu %9s %7s %8s %7s %11s %24s\n",
                static_cast<unsigned long long>(u64(e, "rank")),
                format_bytes(u64(e, "bytes_read")).c_str(),
                format_bytes(u64(e, "share_bytes")).c_str(),
                e["read_over_share"].is_number() ? fixed(e["read_over_share"].get<double>(), 2).c_str()
                                                 : "-",
                static_cast<unsigned long long>(u64(e, "reads")),
                fixed(e["seconds"].get<double>(), 4).c_str(),
                no_data ? "-" : fixed(g, 2).c_str(), c > 0 ? fixed(c, 2).c_str() : "-",
                e["page_cache"].is_string() ? e["page_cache"].get<std::string>().c_str() : "-",
                format_bytes(u64(e, "kept_bytes")).c_str(), peaks.c_str());
  }
  if (first_error.empty() || exit == kExitOther) {
    std::printf("all ranks: %s read for a share of %s", format_bytes(node.bytes).c_str(),
                format_bytes(share).c_str());
    if (share > 0) {
      std::printf(" (%.2fx)", static_cast<double>(node.bytes) / static_cast<double>(share));
    }
    std::printf("; each peak counts the buffers kept before its load\n");
  }
  node.print();
  bool all_verified = !entries.empty();
  for (const Json& e : entries) all_verified = all_verified && e.value("verified", false);
  if (cfg.verify) std::printf("verified: %s\n", all_verified ? "yes, every rank" : "NO");
  if (!first_error.empty()) std::printf("error: %s\n", terminal_text(first_error).c_str());
}

}  // namespace zeroflat::cli
