// `zeroflat run`: materialize a model, flatten it (the `device` tier), re-point, build the fp32
// master partition, verify, and report bandwidth against the memcpy ceiling of the same run.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "device/cpu_device.h"
#include "zeroflat/checksum.h"
#include "zeroflat/common.h"
#include "zeroflat/error.h"
#include "zeroflat/flatten.h"
#include "zeroflat/pattern.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"
#include "zeroflat/progress.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"

namespace zeroflat::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

// A piece of one tensor: elements [lo, hi) of tensor `tensor`.
struct Piece {
  std::uint64_t tensor;
  std::uint64_t lo;
  std::uint64_t hi;
};

std::vector<Piece> split_tensors(const std::vector<TensorRef>& tensors) {
  constexpr std::uint64_t kPiece = std::uint64_t{1} << 20;
  std::vector<Piece> out;
  for (std::uint64_t i = 0; i < tensors.size(); ++i) {
    for (std::uint64_t lo = 0; lo < tensors[i].numel; lo += kPiece) {
      out.push_back(Piece{i, lo, std::min(tensors[i].numel, lo + kPiece)});
    }
  }
  return out;
}

// Runs fn(piece) over pieces on the device's team, handing out pieces dynamically.
template <typename Fn>
void for_pieces(detail::CpuDevice& dev, const std::vector<Piece>& pieces, Fn fn) {
  std::atomic<std::size_t> next{0};
  dev.parallel([&](unsigned) {
    for (std::size_t k = next++; k < pieces.size(); k = next++) fn(pieces[k]);
  });
}

// An independent reference for the up-cast check: IEEE half to float by arithmetic.
float half_to_float_reference(std::uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v = 0;
  if (exp == 0) {
    v = std::ldexp(mant / 1024.0, -14);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  }
  return static_cast<float>(sign ? -v : v);
}

std::uint32_t float_bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

struct Timings {
  double first_flatten = 0;  // the flatten that built the group
  double end_to_end = 0;     // the tier: allocate + gather (+ plan), fresh memory, best round
  double copy_only = 1e300;  // gather into the faulted-in flat buffer, best of repeats
  double memcpy = 1e300;     // ceiling, faulted-in destination, best of repeats
  double fresh_memcpy = 1e300;
};

std::string verify_all(detail::CpuDevice& dev, const std::vector<TensorRef>& originals,
                       const FlatGroup& group, const float* master, std::uint64_t rank,
                       Progress& progress) {
  const Layout& l = group.layout;
  const std::uint64_t es = l.element_size();
  const DType dtype = l.options().dtype;
  const auto* flat = static_cast<const unsigned char*>(group.flat.data());
  // Views: where they point and what they say.
  for (std::uint64_t i = 0; i < originals.size(); ++i) {
    const TensorRef& v = group.views[i];
    if (v.data != flat + l.offsets()[i] * es || v.numel != originals[i].numel ||
        v.shape != originals[i].shape || v.dtype != dtype) {
      return "view of parameter " + std::to_string(i) + " does not point at its layout offset " +
             std::to_string(l.offsets()[i]) + " with its shape";
    }
  }
  // Every parameter's bytes in the flat buffer, against the fill pattern.
  progress.begin("verify " + format_bytes(l.flat_bytes()), l.flat_bytes());
  std::vector<Piece> pieces = split_tensors(group.views);
  std::atomic<bool> bad{false};
  std::string first_bad;
  std::mutex bad_mutex;
  for_pieces(dev, pieces, [&](const Piece& p) {
    const TensorRef& v = group.views[p.tensor];
    const auto* at = static_cast<const unsigned char*>(v.data) + p.lo * es;
    std::uint64_t ok = match_pattern(at, dtype, p.tensor, p.lo, p.hi - p.lo);
    if (ok != p.hi - p.lo) {
      std::lock_guard<std::mutex> lock(bad_mutex);
      if (!bad.exchange(true)) {
        first_bad = "flat buffer: parameter " + std::to_string(p.tensor) + " element " +
                    std::to_string(p.lo + ok) + " differs from its original";
      }
    }
    progress.advance((p.hi - p.lo) * es);
  });
  if (bad) return first_bad;
  // Every padding byte (interior gaps and the tail) is zero.
  std::uint64_t cursor = 0;
  auto check_zero = [&](std::uint64_t lo, std::uint64_t hi) -> std::string {
    for (std::uint64_t b = lo; b < hi; ++b) {
      if (flat[b] != 0) return "flat buffer: padding byte " + std::to_string(b) + " is not zero";
    }
    return "";
  };
  for (std::uint64_t i : l.order()) {
    const std::uint64_t lo = l.offsets()[i] * es;
    if (std::string e = check_zero(cursor, lo); !e.empty()) return e;
    cursor = std::max(cursor, lo + l.numels()[i] * es);
  }
  if (std::string e = check_zero(cursor, l.flat_bytes()); !e.empty()) return e;
  progress.end();
  // The master partition: the up-cast of this rank's partition, padding included.
  TensorRef part = group.partition(rank);
  const std::uint64_t n = part.numel;
  const unsigned parts = dev.num_threads();
  std::atomic<std::uint64_t> first_master_bad{UINT64_MAX};
  dev.parallel([&](unsigned t) {
    detail::Range r = detail::split_range(n, parts, t, 1024);
    for (std::uint64_t k = r.begin; k < r.end; ++k) {
      std::uint32_t want = 0;
      if (dtype == DType::kFP32) {
        std::memcpy(&want, static_cast<const unsigned char*>(part.data) + k * 4, 4);
      } else {
        std::uint16_t h;
        std::memcpy(&h, static_cast<const unsigned char*>(part.data) + k * 2, 2);
        want =
            dtype == DType::kBF16 ? std::uint32_t{h} << 16 : float_bits(half_to_float_reference(h));
      }
      if (float_bits(master[k]) != want) {
        std::uint64_t cur = first_master_bad.load();
        while (k < cur && !first_master_bad.compare_exchange_weak(cur, k)) {
        }
        return;
      }
    }
  });
  if (first_master_bad.load() != UINT64_MAX) {
    return "master partition: element " + std::to_string(first_master_bad.load()) +
           " is not the up-cast of the partition";
  }
  return "";
}

}  // namespace

int subcommand_run(const std::vector<std::string>& argv) {
  Parser p("run", "[--model NAME] [--layers L] [--experts E] [options]",
           "The main job, rehearsed on this machine: materializes the model's tensors (filled\n"
           "with a deterministic pattern), flattens them into one buffer in DeepSpeed's layout,\n"
           "re-points every parameter as a view into it, builds this rank's fp32 master\n"
           "partition, optionally verifies every byte, and reports the flatten's bandwidth next\n"
           "to a memcpy of the same bytes with the same threads, measured in the same run.");
  add_model_options(p, "tiny-moe");
  p.option("device", "DEV", "where the parameters live: cpu", "cpu");
  p.option("comm", "NAME", "communicator: local", "local");
  add_layout_options(p);
  p.option("tier", "TIER", "how to flatten: auto or device", "auto");
  p.option("threads", "N", "host threads for this rank (overrides ZEROFLAT_NUM_THREADS)",
           "cores / ranks on this host");
  p.option("repeat", "N", "timed repetitions of the copy and of each ceiling (best kept)", "3");
  p.flag("verify", "check every byte of the flat buffer, every view and the master partition");
  p.flag("json", "print one JSON document on stdout (docs/cli.md)");
  p.flag("quiet", "no progress on stderr");
  p.option("inject-corruption", "BYTE",
           "testing aid: flip one byte of the flat buffer after the flatten, to see --verify "
           "catch it");
  p.epilog(
      "examples:\n"
      "  zeroflat run --model tiny-moe --verify\n"
      "  zeroflat run --model qwen3-30b-a3b --layers 1 --experts 16 --verify --json\n"
      "  ZEROFLAT_NUM_THREADS=1 zeroflat run --model llama-3.1-8b --layers 1\n\n"
      "Bandwidths are bytes of the flat buffer per second (GB = 1e9 bytes). The copy-only figure\n"
      "writes into a buffer already faulted in and is compared with memcpy into such a buffer;\n"
      "the end-to-end figure includes allocation and first touch and is compared with memcpy\n"
      "into freshly allocated memory. Memory needed: about the model's bytes plus three times\n"
      "the flat buffer (flat, the ceiling's destination, the fp32 master partition).");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;

  // --- everything is validated before anything is allocated ---------------------------------
  ModelSpec model = model_from_args(args, "tiny-moe");
  LayoutOptions options = layout_options_from_args(args, &model);
  const std::string device_spec = args.get("device").value_or("cpu");
  const std::string comm = args.get("comm").value_or("local");
  const std::string tier = args.get("tier").value_or("auto");
  if (device_spec.rfind("sim", 0) == 0 || device_spec.rfind("cuda", 0) == 0) {
    throw Unsupported("--device " + device_spec +
                      ": this version runs on the cpu device (the sim device exists in the "
                      "library; running tiers on it comes with the executor)");
  }
  if (comm != "local") {
    throw Unsupported("--comm " + comm + ": this version runs one rank in-process (local)");
  }
  if (options.dp != 1) {
    throw Unsupported("--dp " + std::to_string(options.dp) +
                      ": this version runs a single rank (--dp 1); use `zeroflat layout --dp " +
                      std::to_string(options.dp) + "` to see that layout");
  }
  if (tier != "auto" && tier != "device") {
    if (tier == "sharded" || tier == "staged" || tier == "host") {
      throw Unsupported("--tier " + tier + ": this version runs the device tier only");
    }
    throw InvalidArgument("--tier '" + tier + "': expected auto, device, sharded, staged or host");
  }
  unsigned threads = 0;
  if (auto v = args.get("threads")) {
    std::uint64_t n = parse_u64(*v, "--threads");
    if (n == 0 || n > kMaxThreads) {
      throw InvalidArgument("--threads " + *v + ": expected 1 to " + std::to_string(kMaxThreads));
    }
    threads = static_cast<unsigned>(n);
  } else {
    threads = default_num_threads();
  }
  std::uint64_t repeat = 3;
  if (auto v = args.get("repeat")) {
    repeat = parse_u64(*v, "--repeat");
    if (repeat == 0 || repeat > 1000) {
      throw InvalidArgument("--repeat " + *v + ": expected 1 to 1000");
    }
  }
  const bool json = args.has("json");
  const bool verify = args.has("verify");
  Progress progress(!args.has("quiet"));

  std::unique_ptr<Device> device = make_device(device_spec, DeviceOptions{threads});
  auto* cpu = dynamic_cast<detail::CpuDevice*>(device.get());
  if (cpu == nullptr) throw Unsupported("device " + device_spec + " is not a host device");
  const DType dtype = options.dtype;
  const std::uint64_t es = element_size(dtype);
  const Layout planned = Layout::compute(model.numels(), options);
  const std::uint64_t model_bytes = model.numel() * es;
  const std::uint64_t flat_bytes = planned.flat_bytes();
  std::optional<std::uint64_t> corrupt;
  if (auto v = args.get("inject-corruption")) {
    corrupt = parse_u64(*v, "--inject-corruption");
    if (*corrupt >= flat_bytes) {
      throw InvalidArgument("--inject-corruption " + *v + ": the flat buffer has " +
                            std::to_string(flat_bytes) + " bytes");
    }
  }

  // --- does it fit in this host's memory? Nothing is allocated before this answer ----------
  // Peak: the originals, the flat buffer and the ceiling's buffer of the same size during the
  // timing rounds; later the flat buffer and the fp32 master partition.
  // (Saturating: an absurd layout must read as "too big", not wrap around to a small number.)
  auto sat_add = [](std::uint64_t a, std::uint64_t b) {
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
  };
  auto sat_mul = [](std::uint64_t a, std::uint64_t b) {
    return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
  };
  const std::uint64_t need = std::max(sat_add(model_bytes, sat_mul(2, flat_bytes)),
                                      sat_add(flat_bytes, sat_mul(4, planned.partition_numel())));
  {
    ProbeResult host = probe_host(system_host_sources());
    const std::uint64_t margin = default_margin(host.total_bytes);
    const std::uint64_t usable = host.free_bytes > margin ? host.free_bytes - margin : 0;
    if (host.available && need > usable) {
      std::fprintf(stderr,
                   "zeroflat run: no feasible plan: this run needs %s of host memory (the model's "
                   "%s, the flat buffer and a ceiling buffer of %s each; then the fp32 master "
                   "partition), and %s is usable here (%s free from %s, less a %s margin). "
                   "Nothing was allocated. Try --layers or --experts to scale the model down.\n",
                   format_bytes(need).c_str(), format_bytes(model_bytes).c_str(),
                   format_bytes(flat_bytes).c_str(), format_bytes(usable).c_str(),
                   format_bytes(host.free_bytes).c_str(), host.used.c_str(),
                   format_bytes(margin).c_str());
      return kExitInfeasible;
    }
  }
  progress.note(model.name + ": " + format_count(model.tensors.size()) + " tensors, " +
                format_count(model.numel()) + " parameters, " + format_bytes(model_bytes) + " " +
                std::string(dtype_name(dtype)) + "; " + std::to_string(threads) + " threads");

  // --- materialize the originals, each its own allocation, filled with the pattern ----------
  std::vector<DeviceBuffer> storage;
  std::vector<TensorRef> params;
  storage.reserve(model.tensors.size());
  params.reserve(model.tensors.size());
  for (const TensorSpec& t : model.tensors) {
    storage.emplace_back(*device, t.numel * es);
    params.push_back(TensorRef{storage.back().data(), t.numel, t.shape, dtype, device.get()});
  }
  progress.begin("materialize " + format_bytes(model_bytes), model_bytes);
  for_pieces(*cpu, split_tensors(params), [&](const Piece& piece) {
    fill_pattern(static_cast<unsigned char*>(params[piece.tensor].data) + piece.lo * es, dtype,
                 piece.tensor, piece.lo, piece.hi - piece.lo);
    progress.advance((piece.hi - piece.lo) * es);
  });
  progress.end();
  const std::uint64_t resident_bytes = device->memory_info().allocated_bytes;

  // --- the device tier: allocate the flat buffer, gather, re-point --------------------------
  Timings time;
  progress.begin("flatten " + format_bytes(flat_bytes) + " (device tier)", 0);
  auto t0 = Clock::now();
  FlatGroup group = flatten_group(*device, params, options);
  time.first_flatten = seconds_since(t0);
  time.end_to_end = time.first_flatten;
  progress.end();
  // The planner's memory model on the tier's own step list, against the device's counters.
  const std::uint64_t predicted_peak =
      simulate(tier_steps(Tier::kDevice, planned, 0), resident_bytes, model_bytes, options.dp)
          .peak_device_bytes;
  // The tier's peak: originals and flat buffer together. Later timing rounds do not count.
  const std::uint64_t measured_peak = device->memory_info().peak_allocated_bytes;

  if (corrupt) static_cast<unsigned char*>(group.flat.data())[*corrupt] ^= 0x01;

  // --- timing rounds against the memcpy ceilings, interleaved ------------------------------
  // Each figure is the best of `repeat` rounds, the ceilings too, so that the ratio is not
  // skewed by whichever ran first (first-touch costs of memory new to this process vary).
  // The rounds write into a scratch buffer: the flat buffer stays exactly as the flatten that
  // built it left it, which is what --verify then checks.
  {
    progress.begin("time the flatten against memcpy (" + std::to_string(repeat) + " rounds)", 0);
    std::vector<Segment> segments = gather_segments(group.layout, params, 0, flat_bytes);
    void* scratch = detail::host_allocate(flat_bytes);
    cpu->zero_parallel(scratch, flat_bytes);
    for (std::uint64_t r = 0; r < repeat; ++r) {
      t0 = Clock::now();
      device->gather(scratch, flat_bytes, segments);
      time.copy_only = std::min(time.copy_only, seconds_since(t0));
      t0 = Clock::now();
      cpu->memcpy_parallel(scratch, group.flat.data(), flat_bytes);
      time.memcpy = std::min(time.memcpy, seconds_since(t0));
    }
    detail::host_release(scratch, flat_bytes);
    for (std::uint64_t r = 0; r < repeat; ++r) {
      if (r > 0) {  // round 0 is the real flatten above
        t0 = Clock::now();
        FlatGroup again = flatten_group(*device, params, options);
        time.end_to_end = std::min(time.end_to_end, seconds_since(t0));
      }
      t0 = Clock::now();
      void* fresh = detail::host_allocate(flat_bytes);
      cpu->memcpy_parallel(fresh, group.flat.data(), flat_bytes);
      time.fresh_memcpy = std::min(time.fresh_memcpy, seconds_since(t0));
      detail::host_release(fresh, flat_bytes);
    }
    progress.end();
  }

  // --- the tier's last step: the originals go; the views own the data now --------------------
  storage.clear();
  for (TensorRef& t : params) t.data = nullptr;  // shapes stay for the checks; the data is gone

  progress.begin("fp32 master partition", 0);
  DeviceBuffer master = make_master_partition(*device, group, 0);
  progress.end();

  std::string failure;
  if (verify) {
    failure =
        verify_all(*cpu, params, group, static_cast<const float*>(master.data()), 0, progress);
  }
  progress.begin("checksum", 0);
  const std::uint64_t checksum = device->checksum(group.flat.data(), flat_bytes);
  progress.end();

  const double flatten_gbps = gbps(flat_bytes, time.copy_only);
  const double e2e_gbps = gbps(flat_bytes, time.end_to_end);
  const double memcpy_gbps = gbps(flat_bytes, time.memcpy);
  const double fresh_gbps = gbps(flat_bytes, time.fresh_memcpy);

  if (json) {
    nlohmann::ordered_json doc;
    doc["model"] = {{"name", model.name},
                    {"architecture", model.architecture},
                    {"tensors", model.tensors.size()},
                    {"numel", model.numel()},
                    {"bytes", model_bytes}};
    doc["dp"] = options.dp;
    doc["tier"] = "device";
    doc["device"] = device->name();
    doc["dtype"] = std::string(dtype_name(dtype));
    doc["flat_bytes"] = flat_bytes;
    doc["partition_bytes"] = group.layout.partition_bytes();
    nlohmann::ordered_json rank;
    rank["rank"] = 0;
    rank["tier"] = "device";
    rank["threads"] = threads;
    rank["seconds"] = time.first_flatten;
    rank["flatten_gbps"] = flatten_gbps;
    rank["end_to_end_gbps"] = e2e_gbps;
    rank["predicted_peak_device_bytes"] = predicted_peak;
    rank["measured_peak_device_bytes"] = measured_peak;
    rank["host_bytes"] = 0;
    rank["master_bytes"] = master.num_bytes();
    rank["verified"] = verify && failure.empty();
    rank["verify"] = verify ? "every byte, view and master element" : "not requested";
    if (!failure.empty()) rank["error"] = failure;
    rank["checksum"] = checksum_hex(checksum);
    doc["ranks"] = nlohmann::ordered_json::array({rank});
    doc["ceiling"] = {
        {"memcpy_gbps", memcpy_gbps},
        {"fresh_memcpy_gbps", fresh_gbps},
        {"flatten_over_memcpy", memcpy_gbps > 0 ? flatten_gbps / memcpy_gbps : 0.0},
        {"end_to_end_over_fresh_memcpy", fresh_gbps > 0 ? e2e_gbps / fresh_gbps : 0.0}};
    std::printf("%s\n",
                doc.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
  } else {
    std::printf("zeroflat run: %s, %s tensors, %s parameters, %s %s\n", model.name.c_str(),
                format_count(model.tensors.size()).c_str(), format_count(model.numel()).c_str(),
                format_bytes(model_bytes).c_str(), std::string(dtype_name(dtype)).c_str());
    std::printf("  device %s, %u threads, dp %llu, tier device\n", device->name().c_str(), threads,
                static_cast<unsigned long long>(options.dp));
    std::printf("  flat buffer       %s, %s elements of padding\n",
                format_bytes(flat_bytes).c_str(), format_count(group.layout.padding()).c_str());
    std::printf("  flatten, copy     %6.2f GB/s   %.2f x memcpy (%.2f GB/s)\n", flatten_gbps,
                memcpy_gbps > 0 ? flatten_gbps / memcpy_gbps : 0.0, memcpy_gbps);
    std::printf("  flatten, e2e      %6.2f GB/s   %.2f x memcpy into fresh memory (%.2f GB/s)\n",
                e2e_gbps, fresh_gbps > 0 ? e2e_gbps / fresh_gbps : 0.0, fresh_gbps);
    std::printf("  peak memory       %s predicted, %s measured\n",
                format_bytes(predicted_peak).c_str(), format_bytes(measured_peak).c_str());
    std::printf("  master partition  fp32, %s\n", format_bytes(master.num_bytes()).c_str());
    if (verify) {
      std::printf("  verified          %s\n",
                  failure.empty() ? "yes: every byte of the flat buffer, every view, the master"
                                  : ("NO: " + failure).c_str());
    }
    std::printf("  checksum          %s\n", checksum_hex(checksum).c_str());
  }
  if (!failure.empty()) {
    std::fprintf(stderr, "zeroflat run: verification failed: %s\n", failure.c_str());
    return kExitOther;
  }
  return kExitOk;
}

}  // namespace zeroflat::cli
