// `zeroflat probe`: what each free-memory source says about a device, and which one counts.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <memory>
#include <optional>

#include "cli/common.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/probe.h"
#include "zeroflat/report.h"

namespace zeroflat::cli {

int subcommand_probe(const std::vector<std::string>& argv) {
  Parser p("probe", "[--device cpu|cuda:N|sim:SIZE] [--local-ranks N] [--json]",
           "Asks every source of free-memory figures about a device and shows each answer or\n"
           "error, and the number the planner would use. cpu: /proc/meminfo's MemAvailable and\n"
           "the process's cgroup (v2 or v1), shared among the ranks on this host. cuda:N: NVML\n"
           "(whole device), cudaMemGetInfo, the process's own view; integrated devices are\n"
           "capped by the host's available memory. A source's failure is reported, never fatal.");
  p.option("device", "DEV", "cpu, cuda:N, or sim:SIZE (a simulated device's accounting)", "cpu");
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
  // A malformed ZEROFLAT_LOCAL_RANKS (or ZEROFLAT_NUM_THREADS) is an error here, as everywhere.
  const unsigned local = ranks > 0 ? ranks : runtime_env().local_ranks.value_or(1);
  const ProbeContext context{local, 0, 0};
  ProbeResult r;
  if (device.rfind("cuda", 0) == 0) {
    // The device's own probe when the GPU opens; the same sources, asked directly, when it does
    // not (they say why).
    std::unique_ptr<Device> dev;
    try {
      dev = make_device(device, DeviceOptions{1});
    } catch (const Unsupported&) {
    }
    if (dev) {
      r = dev->probe_memory(context);
    } else {
      const std::uint64_t index = device == "cuda" ? 0 : parse_u64(device.substr(5), "--device cuda:N");
      if (index > 1024) throw InvalidArgument("--device " + printable(device) + ": no such index");
      r = probe_cuda(static_cast<int>(index), system_cuda_sources());
    }
  } else if (device == "cpu" || device.rfind("sim:", 0) == 0) {
    r = make_device(device, DeviceOptions{1})->probe_memory(context);
  } else {
    throw InvalidArgument("--device '" + printable(device) + "': expected cpu, cuda:N or sim:SIZE");
  }
  if (args.has("json")) {
    std::printf("%s\n", nlohmann::ordered_json::parse(probe_json(r)).dump(2).c_str());
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
