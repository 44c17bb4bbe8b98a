// `zeroflat bench`: the flatten's benchmark matrix that runs on this machine (docs/performance.md),
// each row timed side by side in one process: the flatten (Device::gather, the step every tier
// ends in) against the ceiling (one copy of the same bytes from one contiguous buffer, the same
// threads: memcpy on the host, a device-to-device copy on a GPU) and against the peer's way (a
// loop of one copy per tensor, as hand-written code and Megatron do); the layout of a million
// parameters and the plan of the seed model against their 100 ms budget.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/progress.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/engine.h"
#include "zeroflat/layout.h"

extern char** environ;

namespace zeroflat::cli {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::ordered_json;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// One row of the table: zeroflat's time, the ceiling's and the peer's (0: not measured), the
// target of the figure it is held to (empty: none), and whether the row's median meets it.
struct Row {
  std::string device, what, target;
  std::uint64_t bytes = 0, tensors = 0;
  double ours = 0, ceiling = 0, peer = 0;
  double vs_ceiling = 0, vs_peer = 0;  // medians of the rounds' ratios
  std::optional<bool> met;
  std::string skipped;
};

// `count` bf16 tensors of uneven sizes (offsets not all aligned) adding up to `total` bytes,
// each an allocation of its own on `d`, filled with non-zero bytes; laid out as DeepSpeed lays
// out a group of 8 ranks.
struct Workload {
  std::vector<DeviceBuffer> storage;
  std::vector<TensorRef> params;
  std::vector<Segment> segments;
  std::uint64_t flat_bytes = 0;
};

Workload make_workload(Device& d, std::uint64_t total, std::uint64_t count) {
  Workload w;
  const std::uint64_t elems = std::max<std::uint64_t>(total / 2, count);
  const std::uint64_t base = elems / count;
  std::uint64_t used = 0, largest = 0;
  std::vector<std::uint64_t> numels;
  for (std::uint64_t i = 0; i < count; ++i) {
    std::uint64_t n = count > 1 && base > 8 ? (i % 2 == 0 ? base - 3 : base + 3) : base;
    if (i + 1 == count) n = elems - used;
    used += n;
    numels.push_back(n);
    largest = std::max(largest, n * 2);
  }
  void* fill = d.allocate_host(largest);
  try {
    for (std::size_t i = 0; i < numels.size(); ++i) {
      const std::uint64_t n = numels[i];
      // Each tensor its own bytes: a copy to the wrong place or in the wrong order shows.
      std::memset(fill, static_cast<int>(1 + (i * 37) % 251), n * 2);
      w.storage.emplace_back(d, n * 2);
      d.copy(w.storage.back().data(), fill, n * 2);
      w.params.push_back(TensorRef{w.storage.back().data(), n,
                                   Shape{static_cast<std::int64_t>(n)}, DType::kBF16, &d});
    }
  } catch (...) {
    d.release_host(fill, largest);
    throw;
  }
  d.release_host(fill, largest);
  LayoutOptions o;
  o.dp = 8;
  const Layout layout = Layout::compute(numels, o);
  w.flat_bytes = layout.flat_bytes();
  w.segments = gather_segments(layout, w.params, 0, w.flat_bytes);
  return w;
}

// Copy only (every destination already written once): the flatten, the ceiling and the loop of
// per-tensor copies, `rounds` times each in turn; the medians. The loop: on the host one plain
// memcpy per tensor (what a hand-written loop does), on a GPU one Device::copy per tensor (a
// copy and a wait each, as a loop of synchronous copies).
void measure_copy(Device& d, Row& row, unsigned rounds) {
  Workload w = make_workload(d, row.bytes, row.tensors);
  const std::uint64_t n = w.flat_bytes;
  const bool host = d.host_accessible();
  DeviceBuffer flat(d, n), src(d, n), dst(d, n);
  d.gather(src.data(), n, w.segments);  // every buffer written once: no first touch timed
  d.copy(flat.data(), src.data(), n);
  d.copy(dst.data(), src.data(), n);
  auto timed = [&](auto&& fn) {
    d.synchronize();
    const auto t0 = Clock::now();
    fn();
    d.synchronize();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  std::vector<double> f, c, p, vc, vp;
  for (unsigned r = 0; r < rounds; ++r) {
    f.push_back(timed([&] { d.gather(flat.data(), n, w.segments); }));
    c.push_back(timed([&] { d.copy(dst.data(), src.data(), n); }));
    if (r + 1 == rounds) {
      // The copy's result first, then the loop's into a cleared buffer: each compared below.
      if (d.checksum(dst.data(), n) != d.checksum(src.data(), n)) {
        throw InternalError("bench: the copy left other bytes than its source");
      }
      d.gather(dst.data(), n, {});  // zeros: no segment covers any byte
    }
    p.push_back(timed([&] {
      auto* out = static_cast<unsigned char*>(dst.data());
      for (const Segment& s : w.segments) {
        if (host) {
          std::memcpy(out + s.dst_offset, s.src, s.num_bytes);
        } else {
          d.copy(out + s.dst_offset, s.src, s.num_bytes);
        }
      }
    }));
    vc.push_back(c.back() / f.back());
    vp.push_back(p.back() / f.back());
  }
  // The flatten's result is the layout the loop built tensor by tensor (padding zero in both).
  if (d.checksum(flat.data(), n) != d.checksum(dst.data(), n)) {
    throw InternalError("bench: the flatten and the per-tensor copies left different bytes");
  }
  row.ours = median(f);
  row.ceiling = median(c);
  row.peer = median(p);
  row.vs_ceiling = median(vc);
  row.vs_peer = median(vp);
}

// End to end on the host: allocate the flat buffer, flatten into it, release; against the same
// with one copy from a contiguous buffer (first touch on both sides).
void measure_fresh(Device& d, Row& row, unsigned rounds) {
  Workload w = make_workload(d, row.bytes, row.tensors);
  const std::uint64_t n = w.flat_bytes;
  DeviceBuffer src(d, n);
  d.gather(src.data(), n, w.segments);
  std::vector<double> f, c, vc;
  for (unsigned r = 0; r <= rounds; ++r) {  // round 0 untimed: the process's first fault-ins
    auto t0 = Clock::now();
    {
      DeviceBuffer flat(d, n);
      d.gather(flat.data(), n, w.segments);
    }
    const double fs = std::chrono::duration<double>(Clock::now() - t0).count();
    t0 = Clock::now();
    {
      DeviceBuffer dst(d, n);
      d.copy(dst.data(), src.data(), n);
    }
    const double cs = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r == 0) continue;
    f.push_back(fs);
    c.push_back(cs);
    vc.push_back(cs / fs);
  }
  row.ours = median(f);
  row.ceiling = median(c);
  row.vs_ceiling = median(vc);
}

// The time of `argv` run as a child of this program (its output discarded), process start
// included: an upper bound on the work it does.
double child_seconds(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  std::string self = "/proc/self/exe";
  args.push_back(self.data());
  std::vector<std::string> copy = argv;
  for (std::string& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  const auto t0 = Clock::now();
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw Error(std::string("could not start the plan: ") + std::strerror(rc));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw Error("the plan of the seed model did not finish (status " + std::to_string(status) +
                ")");
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string ratio_text(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f x", x);
  return b;
}

}  // namespace

int subcommand_bench(const std::vector<std::string>& argv) {
  Parser p("bench", "[--quick] [--size SIZE] [--rounds N] [--no-gpu] [--json]",
           "The flatten's benchmark matrix on this machine, each row timed side by side in this\n"
           "process with the same threads: the flatten of N bf16 tensors into a DeepSpeed\n"
           "layout (the step every tier ends in) against one copy of the same bytes from a\n"
           "contiguous buffer (the ceiling: memcpy on the host, device to device on a GPU) and\n"
           "against a loop of one copy per tensor (the peer's way); then the layout of a million\n"
           "parameters and the plan of the seed model (qwen3-30b-a3b, 48 layers) against their\n"
           "100 ms budget. A GPU row runs where cuda:0 opens. Ratios are medians over the\n"
           "rounds of each round's ratio (above 1: zeroflat faster).");
  p.flag("quick", "fewer rows and rounds (a minute or less on a laptop)");
  p.flag("no-gpu", "the host's rows only, even where cuda:0 opens");
  p.option("size", "SIZE",
           "the total size of the large rows (the shape is yours to choose; the smaller rows "
           "scale with it)",
           "256MiB, and 1GiB too without --quick");
  p.option("rounds", "N", "timed rounds per row, 1 to 100", "3 with --quick, else 5");
  p.flag("json", "print one JSON document");
  p.epilog(
      "Targets (docs/performance.md): host flatten >= 0.85 x the copy at >= 256 MiB; GPU\n"
      ">= 0.90 x the device-to-device copy at >= 1 GiB, >= 10 x the per-tensor loop at 100k\n"
      "tensors; layout and plan under 100 ms. A row that does not fit in the free memory is\n"
      "listed as skipped.\n\n"
      "examples:\n  zeroflat bench --quick\n  zeroflat bench --size 1GiB --rounds 7 --json");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  const bool quick = args.has("quick");
  std::uint64_t size = std::uint64_t{256} << 20;
  if (auto v = args.get("size")) {
    size = parse_size(*v, "--size");
    if (size < (std::uint64_t{1} << 20) || size > (std::uint64_t{1} << 40)) {
      throw InvalidArgument("--size " + printable(*v) + ": expected 1 MiB to 1 TiB");
    }
  }
  unsigned rounds = quick ? 3 : 5;
  if (auto v = args.get("rounds")) {
    const std::uint64_t n = parse_u64(*v, "--rounds");
    if (n < 1 || n > 100) throw InvalidArgument("--rounds " + printable(*v) + ": expected 1 to 100");
    rounds = static_cast<unsigned>(n);
  }
  const unsigned threads = default_num_threads();
  const bool json = args.has("json");

  std::vector<std::pair<std::string, std::unique_ptr<Device>>> devices;
  devices.emplace_back("cpu", make_device("cpu", DeviceOptions{threads}));
  std::string gpu_note = "no GPU rows (--no-gpu)";
  if (!args.has("no-gpu")) {
    gpu_note = "no GPU here (cuda:0 did not open)";
    try {
      devices.emplace_back("cuda:0", make_device("cuda:0", DeviceOptions{threads}));
      gpu_note.clear();
    } catch (const std::exception& e) {
      gpu_note += std::string(": ") + e.what();
    }
  }

  std::vector<Row> rows;
  for (auto& [name, dev] : devices) {
    const bool gpu = name != "cpu";
    const std::uint64_t big = gpu ? std::max(size, std::uint64_t{1} << 30) : size;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> shapes;  // (bytes, tensors)
    shapes.push_back({big / 16, 1});
    for (std::uint64_t count : {std::uint64_t{1}, std::uint64_t{1000}, std::uint64_t{100000}}) {
      shapes.push_back({big, count});
    }
    if (!quick) {
      shapes.push_back({big, 12579});  // the seed model's tensor count
      if (!gpu && size < (std::uint64_t{1} << 30)) shapes.push_back({std::uint64_t{1} << 30, 100});
    }
    if (gpu) shapes.push_back({std::uint64_t{100000} * 4096, 100000});  // 100k of 4 KiB
    for (const auto& [bytes, count] : shapes) {
      Row row;
      row.device = name;
      row.what = "flatten (copy only)";
      row.bytes = bytes;
      row.tensors = count;
      if (gpu && count == 100000 && bytes == std::uint64_t{100000} * 4096) {
        row.target = ">= 10 x the per-tensor loop";
      } else if (!gpu && bytes >= (std::uint64_t{256} << 20)) {
        row.target = ">= 0.85 x the copy";
      } else if (gpu && bytes >= (std::uint64_t{1} << 30)) {
        row.target = ">= 0.90 x the copy";
      }
      rows.push_back(row);
    }
    if (!gpu && !quick) {
      for (std::uint64_t count : {std::uint64_t{100}, std::uint64_t{100000}}) {
        Row row;
        row.device = name;
        row.what = "flatten (allocation and first touch too)";
        row.bytes = size;
        row.tensors = count;
        rows.push_back(row);
      }
    }
  }

  Progress progress(!json);
  for (Row& row : rows) {
    Device& d = *std::find_if(devices.begin(), devices.end(),
                              [&](const auto& e) { return e.first == row.device; })
                     ->second;
    // The tensors, the flat buffer, the copy's source and destination, with room to spare.
    const std::uint64_t need = row.bytes * 4 + row.tensors * 4096;
    const std::uint64_t free = d.memory_info().free_bytes;
    if (need > free / 10 * 8) {
      row.skipped = "needs " + format_bytes(need) + ", " + format_bytes(free) + " free";
      continue;
    }
    progress.note(row.device + ": " + row.what + ", " + format_bytes(row.bytes) + " in " +
                  format_count(row.tensors) + " tensors");
    if (row.what.rfind("flatten (copy", 0) == 0) {
      measure_copy(d, row, rounds);
      if (row.target.find("per-tensor") != std::string::npos) {
        row.met = row.vs_peer >= 10;
      } else if (!row.target.empty()) {
        row.met = row.vs_ceiling >= (row.device == "cpu" ? 0.85 : 0.90);
      }
    } else {
      measure_fresh(d, row, rounds);
    }
  }

  // The layout of a million parameters (sizes as a model's, uneven), and the seed model's plan.
  {
    std::vector<std::uint64_t> numels(1000000);
    for (std::size_t i = 0; i < numels.size(); ++i) numels[i] = 1 + (i * 2654435761u) % 40000;
    LayoutOptions o;
    o.dp = 8;
    std::vector<double> t;
    for (unsigned r = 0; r < rounds; ++r) {
      const auto t0 = Clock::now();
      const Layout l = Layout::compute(numels, o);
      t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      if (l.flat_bytes() == 0) throw InternalError("an empty layout");
    }
    Row row;
    row.device = "cpu";
    row.what = "layout of 1M parameters";
    row.tensors = numels.size();
    row.ours = median(t);
    row.vs_ceiling = 0.1 / row.ours;
    row.target = "< 100 ms";
    row.met = row.ours < 0.1;
    rows.push_back(row);
    std::vector<double> s;
    for (unsigned r = 0; r < rounds; ++r) {
      s.push_back(child_seconds({"plan", "--model", "qwen3-30b-a3b", "--layers", "48", "--dp",
                                 "8", "--device", "h100-80gb", "--json"}));
    }
    Row plan;
    plan.device = "cpu";
    plan.what = "plan of the seed model (a process)";
    plan.ours = median(s);
    plan.vs_ceiling = 0.1 / plan.ours;
    plan.target = "< 100 ms";
    plan.met = plan.ours < 0.1;
    rows.push_back(plan);
  }

  if (json) {
    Json doc;
    doc["threads"] = threads;
    doc["rounds"] = rounds;
    doc["quick"] = quick;
    doc["gpu"] = gpu_note.empty() ? Json("cuda:0") : Json(nullptr);
    if (!gpu_note.empty()) doc["gpu_note"] = gpu_note;
    Json list = Json::array();
    for (const Row& r : rows) {
      Json j{{"device", r.device}, {"what", r.what}, {"bytes", r.bytes}, {"tensors", r.tensors}};
      if (!r.skipped.empty()) {
        j["skipped"] = r.skipped;
      } else {
        j["seconds"] = r.ours;
        j["ceiling_seconds"] = r.ceiling > 0 ? Json(r.ceiling) : Json(nullptr);
        j["peer_seconds"] = r.peer > 0 ? Json(r.peer) : Json(nullptr);
        j["vs_ceiling"] = r.vs_ceiling;
        j["vs_peer"] = r.peer > 0 ? Json(r.vs_peer) : Json(nullptr);
      }
      j["target"] = r.target.empty() ? Json(nullptr) : Json(r.target);
      j["met"] = r.met ? Json(*r.met) : Json(nullptr);
      list.push_back(std::move(j));
    }
    doc["rows"] = std::move(list);
    std::printf("%s\n", doc.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
    return kExitOk;
  }
  std::printf("zeroflat bench: %u threads, %u rounds a row%s\n", threads, rounds,
              gpu_note.empty() ? "" : ("; " + gpu_note).c_str());
  std::printf("%-7s %-44s %10s %8s %10s %12s %12s  %s\n", "device", "row", "bytes", "tensors",
              "ours GB/s", "vs copy", "vs per-tensor", "target");
  for (const Row& r : rows) {
    if (!r.skipped.empty()) {
      std::printf("%-7s %-44s %10s %8s  skipped: %s\n", r.device.c_str(), r.what.c_str(),
                  format_bytes(r.bytes).c_str(), format_count(r.tensors).c_str(),
                  r.skipped.c_str());
      continue;
    }
    const bool timed_only = r.bytes == 0;
    char gbps[32] = "-";
    if (!timed_only) std::snprintf(gbps, sizeof gbps, "%.2f", r.bytes / r.ours / 1e9);
    char ms[32];
    std::snprintf(ms, sizeof ms, "%.1f ms", r.ours * 1e3);
    const std::string target =
        r.target.empty() ? "-" : r.target + (r.met ? (*r.met ? ": met" : ": NOT met") : "");
    std::printf("%-7s %-44s %10s %8s %10s %12s %12s  %s\n", r.device.c_str(), r.what.c_str(),
                timed_only ? ms : format_bytes(r.bytes).c_str(),
                r.tensors ? format_count(r.tensors).c_str() : "-", gbps,
                timed_only ? "-" : ratio_text(r.vs_ceiling).c_str(),
                r.peer > 0 ? ratio_text(r.vs_peer).c_str() : "-", target.c_str());
  }
  return kExitOk;
}

}  // namespace zeroflat::cli
