// `zeroflat probe`: what each free-memory source says about a device, and which one counts.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "zeroflat/common.h"
#include "zeroflat/error.h"
#include "zeroflat/probe.h"
#include "zeroflat/size.h"

namespace zeroflat::cli {

int subcommand_probe(const std::vector<std::string>& argv) {
  Parser p("probe", "[--device cpu|cuda:N] [--local-ranks N] [--json]",
           "Asks every source of free-memory figures about a device and shows each answer or\n"
           "error, and the number the planner would use. cpu: /proc/meminfo's MemAvailable and\n"
           "the process's cgroup (v2 or v1), shared among the ranks on this host. cuda:N: NVML\n"
           "(whole device), cudaMemGetInfo, the process's own view; integrated devices are\n"
           "capped by the host's available memory. A source's failure is reported, never fatal.");
  p.option("device", "DEV", "cpu or cuda:N", "cpu");
  p.option("local-ranks", "N", "ranks sharing this host", "the launcher's count, else 1");
  p.flag("json", "print one JSON document");
  p.epilog(
      "exit codes: 0 the device answered; 2 it is not available here (the sources say why).\n\n"
      "examples:\n  zeroflat probe\n  zeroflat probe --device cuda:0 --json");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  const std::string device = args.get("device").value_or("cpu");
  unsigned ranks = 0;
  if (auto v = args.get("local-ranks")) {
    std::uint64_t n = parse_u64(*v, "--local-ranks");
    if (n == 0 || n > 4096) throw InvalidArgument("--local-ranks " + *v + ": expected 1 to 4096");
    ranks = static_cast<unsigned>(n);
  }
  ProbeResult r;
  if (device == "cpu") {
    r = probe_host(system_host_sources(ranks));
  } else if (device.rfind("cuda:", 0) == 0) {
    const std::uint64_t index = parse_u64(device.substr(5), "--device cuda:N");
    if (index > 1024) throw InvalidArgument("--device " + device + ": no such index");
    r = probe_cuda(static_cast<int>(index), system_cuda_sources());
  } else {
    throw InvalidArgument("--device '" + device + "': expected cpu or cuda:N");
  }
  if (args.has("json")) {
    nlohmann::ordered_json doc;
    doc["device"] = r.device;
    doc["available"] = r.available;
    doc["total_bytes"] = r.total_bytes;
    doc["free_bytes"] = r.free_bytes;
    doc["used"] = r.used;
    doc["sources"] = nlohmann::ordered_json::array();
    for (const SourceReport& s : r.sources) {
      doc["sources"].push_back({{"source", s.source},
                                {"ok", s.ok},
                                {"total_bytes", s.total_bytes},
                                {"free_bytes", s.free_bytes},
                                {"detail", s.detail}});
    }
    doc["notes"] = r.notes;
    std::printf("%s\n", doc.dump(2).c_str());
  } else {
    if (r.available) {
      std::printf("%s: %s free of %s, from %s\n", r.device.c_str(),
                  format_bytes(r.free_bytes).c_str(), format_bytes(r.total_bytes).c_str(),
                  r.used.c_str());
    } else {
      std::printf("%s: not available here\n", r.device.c_str());
    }
    for (const SourceReport& s : r.sources) {
      if (s.ok && s.total_bytes > 0) {
        std::printf("  %-18s %-5s total %-10s free %-10s %s\n", s.source.c_str(), "ok",
                    format_bytes(s.total_bytes).c_str(), format_bytes(s.free_bytes).c_str(),
                    s.detail.c_str());
      } else {
        std::printf("  %-18s %-5s %s\n", s.source.c_str(), s.ok ? "ok" : "no", s.detail.c_str());
      }
    }
    for (const std::string& n : r.notes) std::printf("  note: %s\n", n.c_str());
  }
  return r.available ? kExitOk : kExitInvalid;
}

}  // namespace zeroflat::cli
