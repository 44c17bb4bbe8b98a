// `zeroflat run`: the exit code from every rank's entry, and the report (JSON or a table).
#include <cstdio>
#include <string>

#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/common.h"

namespace zeroflat::cli {
namespace {

double ratio(double a, double b) {
  return b > 0 ? a / b : 0.0;
}

Json model_doc(const RunConfig& cfg) {
  const std::uint64_t es = element_size(cfg.library.layout.dtype);
  return {{"name", cfg.model.name},
          {"architecture", cfg.model.architecture},
          {"tensors", cfg.model.tensors.size()},
          {"numel", cfg.model.numel()},
          {"bytes", cfg.model.numel() * es}};
}

// The fields every run document starts with.
Json run_doc(const RunConfig& cfg) {
  const Layout layout = Layout::compute(cfg.model.numels(), cfg.library.layout);
  Json doc;
  doc["model"] = model_doc(cfg);
  doc["dp"] = cfg.library.layout.dp;
  doc["device"] = cfg.setup.device_spec;
  doc["no_data"] = cfg.setup.no_data;
  doc["comm"] = cfg.setup.comm;
  doc["dtype"] = std::string(dtype_name(cfg.library.layout.dtype));
  doc["deepspeed"] = rules_doc(cfg.library.release);
  doc["flat_bytes"] = layout.flat_bytes();
  doc["partition_bytes"] = layout.partition_bytes();
  return doc;
}

void print_json(const Json& doc) {
  std::printf("%s\n", doc.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
}

unsigned long long rank_of(const Json& e) {
  return e["rank"].get<unsigned long long>();
}

void print_human(const RunConfig& cfg, const std::vector<Json>& entries, const RankResult& first) {
  const Json& plan = first.plan;
  const std::uint64_t es = element_size(cfg.library.layout.dtype);
  std::printf("zeroflat run: %s, %s tensors, %s parameters, %s %s\n",
              printable(cfg.model.name).c_str(), format_count(cfg.model.tensors.size()).c_str(),
              format_count(cfg.model.numel()).c_str(), format_bytes(cfg.model.numel() * es).c_str(),
              std::string(dtype_name(cfg.library.layout.dtype)).c_str());
  std::printf(
      "  device %s%s, dp %llu over %s, threads per rank %u\n", cfg.setup.device_spec.c_str(),
      cfg.setup.no_data ? " (no data: memory accounted, nothing copied)" : "",
      static_cast<unsigned long long>(cfg.library.layout.dp), cfg.setup.comm.c_str(), cfg.threads);
  std::printf("  layout: %s\n", rules_text(cfg.library.release).c_str());
  std::printf("  plan: %s (free %s per rank, margin %s)\n",
              plan["reason"].get<std::string>().c_str(),
              format_bytes(plan["free_bytes"].get<std::uint64_t>()).c_str(),
              format_bytes(plan["margin_bytes"].get<std::uint64_t>()).c_str());
  std::printf("  %-4s %-8s %-11s %9s %12s %12s %10s  %-16s %s\n", "rank", "tier", "outcome", "time",
              "peak model", "peak real", "host", "checksum", "verified");
  for (const Json& e : entries) {
    const std::string sum = e["checksum"].is_string() ? e["checksum"].get<std::string>() : "-";
    std::printf("  %-4llu %-8s %-11s %9s %12s %12s %10s  %-16s %s\n", rank_of(e),
                e["tier"].get<std::string>().c_str(), e["outcome"].get<std::string>().c_str(),
                format_seconds(e["seconds"].get<double>()).c_str(),
                format_bytes(e["predicted_peak_device_bytes"].get<std::uint64_t>()).c_str(),
                format_bytes(e["measured_peak_device_bytes"].get<std::uint64_t>()).c_str(),
                format_bytes(e["host_bytes"].get<std::uint64_t>()).c_str(), sum.c_str(),
                e["verified"].get<bool>() ? "yes" : (e.contains("verify_error") ? "NO" : "-"));
  }
  const Json& e0 = entries.front();
  if (e0.contains("memcpy_gbps")) {
    const double f = e0["flatten_gbps"].get<double>();
    const double e2e = e0["end_to_end_gbps"].get<double>();
    std::printf("  rank 0 copy       %6.2f GB/s   %.2f x memcpy (%.2f GB/s)\n", f,
                ratio(f, first.memcpy_gbps), first.memcpy_gbps);
    std::printf("  rank 0 tier e2e   %6.2f GB/s   %.2f x memcpy into fresh memory (%.2f GB/s)\n",
                e2e, ratio(e2e, first.fresh_memcpy_gbps), first.fresh_memcpy_gbps);
    std::printf("  (time: the run that built the buffer; the GB/s: best of %llu rounds of each)\n",
                static_cast<unsigned long long>(cfg.repeat));
  }
  for (const Json& e : entries) {
    if (e.contains("error")) {
      std::printf("  rank %llu: %s; originals intact: %s\n", rank_of(e),
                  e["error"].get<std::string>().c_str(),
                  e["originals_intact"].is_boolean()
                      ? (e["originals_intact"].get<bool>() ? "yes" : "NO")
                      : "unknown (no data)");
    } else if (e["originals_intact"].is_boolean() && !e["originals_intact"].get<bool>()) {
      std::printf("  rank %llu: the parameters no longer hold their original values\n", rank_of(e));
    }
    if (e.contains("master_error")) {
      std::printf("  rank %llu: %s\n", rank_of(e), e["master_error"].get<std::string>().c_str());
    }
    if (e.contains("verify_error")) {
      std::printf("  rank %llu: verification failed: %s\n", rank_of(e),
                  e["verify_error"].get<std::string>().c_str());
    }
  }
}

}  // namespace

int run_exit_code(const std::vector<Json>& entries, std::string& first_error) {
  int exit = kExitOk;
  for (const Json& e : entries) {
    if (e["outcome"] != "done") {
      exit = kExitExecFailed;
      if (first_error.empty()) first_error = e.value("error", std::string("a step failed"));
    } else if (exit == kExitOk &&
               (e.contains("verify_error") ||
                (e["originals_intact"].is_boolean() && !e["originals_intact"].get<bool>()))) {
      // A buffer that does not hold the parameters' values is never a success.
      exit = kExitOther;
    }
  }
  return exit;
}

void print_run_report(const RunConfig& cfg, const Launched& run, int exit,
                      const std::string& first_error) {
  const RankResult& r0 = run.first;
  if (cfg.json) {
    Json doc = run_doc(cfg);
    doc["tier"] = r0.plan["tier"];
    doc["plan"] = r0.plan;
    if (exit == kExitExecFailed) doc["error"] = first_error;
    doc["ranks"] = run.entries;
    doc["ceiling"] = {{"memcpy_gbps", r0.memcpy_gbps}, {"fresh_memcpy_gbps", r0.fresh_memcpy_gbps}};
    const Json& e0 = run.entries.front();
    if (e0.contains("memcpy_gbps")) {
      doc["ceiling"]["flatten_over_memcpy"] =
          ratio(e0["flatten_gbps"].get<double>(), r0.memcpy_gbps);
      doc["ceiling"]["end_to_end_over_fresh_memcpy"] =
          ratio(e0["end_to_end_gbps"].get<double>(), r0.fresh_memcpy_gbps);
    }
    print_json(doc);
  } else {
    print_human(cfg, run.entries, r0);
  }
  if (exit == kExitExecFailed) {
    std::fprintf(stderr, "zeroflat run: execution failed: %s\n",
                 terminal_text(first_error).c_str());
  } else if (exit == kExitOther) {
    bool verify_failed = false;
    for (const Json& e : run.entries) verify_failed |= e.contains("verify_error");
    std::fprintf(stderr, "%s",
                 verify_failed ? "zeroflat run: verification failed (see the report)\n"
                               : "zeroflat run: the parameters no longer hold their original "
                                 "values (see originals_intact in the report)\n");
  }
}

void print_infeasible(const RunConfig& cfg, const Json& plan, const std::string& why) {
  if (cfg.json) {
    Json doc = run_doc(cfg);
    doc["tier"] = Json();
    doc["plan"] = plan;
    doc["error"] = why;
    doc["ranks"] = Json::array();
    print_json(doc);
  }
  std::fprintf(stderr, "zeroflat run: %s\n", terminal_text(why).c_str());
}

}  // namespace zeroflat::cli
