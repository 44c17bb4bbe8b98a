// `zeroflat load`: the exit code from every rank's entry, and the report (JSON or a table), with
// the node's figures: all ranks' bytes over the slowest rank's time, against the ceiling's.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/load.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"

namespace zeroflat::cli {

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

namespace {

// How many sub-groups Stage 3 cuts the loaded group into (one optimizer group).
std::uint64_t zero3_sub_groups(const LoadConfig& cfg) {
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : cfg.params) numels.push_back(shape_numel(p.shape));
  const std::vector<std::vector<std::uint64_t>> groups = {numels};
  return Zero3Layout::compute(groups, Zero3Options{cfg.library.layout.dp, cfg.stage.sub_group_size,
                                                   cfg.library.layout.dtype})
      .sub_groups()
      .size();
}

}  // namespace

int load_exit_code(const std::vector<Json>& entries, std::string& first_error) {
  int exit = kExitOk;
  for (std::size_t r = 0; r < entries.size(); ++r) {
    const Json& e = entries[r];
    int code = kExitOk;
    if (e.contains("error")) {
      code = kExitExecFailed;
      if (first_error.empty())
        first_error = "rank " + std::to_string(r) + ": " + e["error"].get<std::string>();
    } else if (e.contains("verify_error")) {
      code = kExitOther;
      if (first_error.empty()) {
        first_error = "rank " + std::to_string(r) + ": " + e["verify_error"].get<std::string>();
      }
    }
    // A failed read outranks a failed verification.
    if (code == kExitExecFailed || exit == kExitOk) exit = std::max(exit, code);
  }
  return exit;
}

NodeFigures node_figures(const std::vector<Json>& entries, bool no_data) {
  NodeFigures n;
  n.no_data = no_data;
  double cached = 0, ceiling_seconds = 0, ceiling_cached = 0;
  for (const Json& e : entries) {
    if (!e.contains("bytes_read")) continue;
    n.bytes += e["bytes_read"].get<std::uint64_t>();
    n.seconds = std::max(n.seconds, e["read_seconds"].get<double>());
    if (e["cached_fraction"].is_number()) {
      cached += e["cached_fraction"].get<double>() * e["bytes_read"].get<double>();
    }
    if (e.contains("ceiling")) {
      const Json& c = e["ceiling"];
      n.have_ceiling = true;
      n.ceiling_bytes += c["bytes"].get<std::uint64_t>();
      ceiling_seconds = std::max(ceiling_seconds, c["seconds"].get<double>());
      ceiling_cached += c["cached_fraction"].get<double>() * c["bytes"].get<double>();
    }
  }
  n.read_gbps = gbps(n.bytes, n.seconds);
  n.ceiling_gbps = gbps(n.ceiling_bytes, ceiling_seconds);
  if (!no_data && n.bytes > 0) n.cache = page_cache_word(cached / static_cast<double>(n.bytes));
  if (n.ceiling_bytes > 0) {
    n.ceiling_cache = page_cache_word(ceiling_cached / static_cast<double>(n.ceiling_bytes));
  }
  return n;
}

void NodeFigures::add_json(Json& doc) const {
  doc["read_gbps"] = no_data ? Json() : Json(read_gbps);
  doc["page_cache"] = cache.empty() ? Json() : Json(cache);
  doc["ceiling"] = have_ceiling ? Json{{"bytes", ceiling_bytes},
                                       {"read_gbps", ceiling_gbps},
                                       {"page_cache", ceiling_cache}}
                                : Json();
  doc["vs_ceiling"] = have_ceiling && ceiling_gbps > 0 ? Json(read_gbps / ceiling_gbps) : Json();
}

void NodeFigures::print() const {
  if (no_data || seconds <= 0) return;
  std::printf("node: %.2f GB/s read", read_gbps);
  if (have_ceiling) {
    std::printf(" against a ceiling of %.2f GB/s (%s): %.2fx", ceiling_gbps, ceiling_cache.c_str(),
                ceiling_gbps > 0 ? read_gbps / ceiling_gbps : 0.0);
  }
  std::printf("; page cache %s\n", cache.c_str());
}

void print_document(Json& doc, const Json& plan, const NodeFigures& node,
                    const std::vector<Json>& entries, int exit, const std::string& first_error) {
  doc["plan"] = plan;
  node.add_json(doc);
  doc["ranks"] = entries;
  doc["exit"] = exit;
  doc["error"] = first_error.empty() ? Json() : Json(first_error);
  std::printf("%s\n", doc.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
}

void print_load_report(const LoadConfig& cfg, const std::vector<Json>& entries,
                       const LoadOutcome& first, int exit, const std::string& first_error) {
  const Json& plan = first.plan;
  const std::uint64_t flat_bytes = first.flat_bytes;
  const std::uint64_t partition_bytes = first.partition_bytes;
  const bool no_data = cfg.setup.no_data;
  const NodeFigures node = node_figures(entries, no_data);
  if (cfg.json) {
    Json doc;
    doc["checkpoint"] = cfg.rehearsal ? Json() : Json(cfg.source);
    doc["model"] = cfg.rehearsal ? Json(cfg.source) : Json();
    doc["files"] = cfg.ck.files.size();
    doc["tensors"] = cfg.params.size();
    Json left = Json::array();
    for (const std::string& l : cfg.left_out) left.push_back(l);
    doc["left_out"] = std::move(left);
    doc["checkpoint_bytes"] = cfg.checkpoint_bytes;
    doc["dtype"] = std::string(dtype_name(cfg.library.layout.dtype));
    doc["dp"] = cfg.library.layout.dp;
    doc["stage"] = cfg.stage.zero3 ? 3 : 2;
    doc["sub_group_size"] = cfg.stage.zero3 ? Json(cfg.stage.sub_group_size) : Json();
    doc["sub_groups"] = cfg.stage.zero3 ? Json(zero3_sub_groups(cfg)) : Json();
    doc["round_robin"] = cfg.library.layout.round_robin;
    doc["deepspeed"] = rules_doc(cfg.library.release);
    doc["device"] = cfg.setup.device_spec;
    doc["no_data"] = no_data;
    doc["comm"] = cfg.setup.comm;
    doc["threads"] = cfg.threads;
    doc["cold"] = cfg.library.read.cold;
    doc["flat_bytes"] = flat_bytes;
    doc["partition_bytes"] = partition_bytes;
    print_document(doc, plan, node, entries, exit, first_error);
    return;
  }
  std::printf(
      "%s %s: %zu tensors in %zu file(s), %s as stored; %s buffers of %s%s, dp %llu%s, on %s\n",
      cfg.rehearsal ? "rehearsed" : "loaded", printable(cfg.source).c_str(), cfg.params.size(),
      cfg.ck.files.size(), format_bytes(cfg.checkpoint_bytes).c_str(),
      std::string(dtype_name(cfg.library.layout.dtype)).c_str(), format_bytes(flat_bytes).c_str(),
      cfg.stage.zero3 ? " (ZeRO-3: each rank's own partitions)" : "",
      static_cast<unsigned long long>(cfg.library.layout.dp),
      cfg.library.layout.round_robin ? " (round-robin)" : "", cfg.setup.device_spec.c_str());
  if (cfg.stage.zero3) {
    std::printf("layout: %s%s; %llu sub-group(s) at sub_group_size %s\n",
                rules_text(cfg.library.release).c_str(), kZero3RulesNote,
                static_cast<unsigned long long>(zero3_sub_groups(cfg)),
                format_count(cfg.stage.sub_group_size).c_str());
  } else {
    std::printf("layout: %s\n", rules_text(cfg.library.release).c_str());
  }
  // The read plan, the same on every rank.
  if (first.plan.contains("reason")) {
    std::printf("read plan: %s\n", first.plan["reason"].get<std::string>().c_str());
  }
  if (!cfg.left_out.empty()) {
    std::printf("left out: %s\n", join(cfg.left_out).c_str());
  }
  std::printf("%-5s %12s %7s %9s %12s %7s %8s %24s\n", "rank", "read", "reads", "GB/s",
              "ceiling GB/s", "ratio", "cache", "device peak pred / meas");
  for (const Json& e : entries) {
    if (!e.contains("bytes_read")) {
      std::printf("%-5llu error: %s\n",
                  static_cast<unsigned long long>(e["rank"].get<std::uint64_t>()),
                  terminal_text(e.value("error", std::string("?"))).c_str());
      continue;
    }
    const double g = e["read_gbps"].is_number() ? e["read_gbps"].get<double>() : 0;
    const double c = e.contains("ceiling") ? e["ceiling"]["read_gbps"].get<double>() : 0;
    const std::string gs = no_data ? "-" : fixed(g, 2);
    const std::string cs = c > 0 ? fixed(c, 2) : "-";
    const std::string rs = c > 0 && g > 0 ? fixed(g / c, 2) : "-";
    const std::string peaks = format_bytes(e["predicted_peak_device_bytes"].get<std::uint64_t>()) +
                              " / " +
                              format_bytes(e["measured_peak_device_bytes"].get<std::uint64_t>());
    std::printf("%-5llu %12s %7llu %9s %12s %7s %8s %24s\n",
                static_cast<unsigned long long>(e["rank"].get<std::uint64_t>()),
                format_bytes(e["bytes_read"].get<std::uint64_t>()).c_str(),
                static_cast<unsigned long long>(e["reads"].get<std::uint64_t>()), gs.c_str(),
                cs.c_str(), rs.c_str(),
                e["page_cache"].is_string() ? e["page_cache"].get<std::string>().c_str() : "-",
                peaks.c_str());
  }
  node.print();
  bool all_verified = !entries.empty();
  for (const Json& e : entries) all_verified = all_verified && e.value("verified", false);
  if (cfg.verify) std::printf("verified: %s\n", all_verified ? "yes, every rank" : "NO");
  // A rank that failed has no checksum (a const operator[] of a missing key is undefined).
  if (!entries.empty() && entries.front().contains("checksum") &&
      entries.front()["checksum"].is_string()) {
    std::printf("checksum: %s\n", entries.front()["checksum"].get<std::string>().c_str());
  }
  if (!first_error.empty()) std::printf("error: %s\n", terminal_text(first_error).c_str());
}

}  // namespace zeroflat::cli
