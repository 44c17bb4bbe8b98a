// `zeroflat load`: a safetensors checkpoint straight into every rank's flat buffer through the
// library's loader (loader.h), each rank reading only its partition, one all-gather completing
// the buffer; reported against a sequential read of the same files measured in the same run.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/agree.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/checksum.h"
#include "zeroflat/device.h"
#include "zeroflat/error.h"
#include "zeroflat/loader.h"
#include "zeroflat/report.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"

namespace zeroflat::cli {
namespace {

constexpr std::uint64_t kRehearsalShardBytes = 5'000'000'000;  // Hugging Face's default shards

struct LoadConfig {
  std::string source;  // the checkpoint path, or the model rehearsed
  bool rehearsal = false;
  CheckpointIndex ck;
  std::vector<LoadParam> params;
  std::vector<std::string> left_out;   // tensors the loader does not read (not floating point)
  std::uint64_t checkpoint_bytes = 0;  // of the tensors loaded, as stored
  LayoutOptions options;
  std::string device_spec = "cpu";
  DeviceKind kind = DeviceKind::kCpu;
  bool no_data = false;
  std::optional<std::uint64_t> node_host_bytes;
  std::string comm = "local";
  std::optional<std::uint64_t> margin;
  unsigned threads = 0;
  unsigned local_ranks = 1;
  std::uint64_t ring_chunk = std::uint64_t{16} << 20;
  unsigned ring_depth = 4;
  bool cold = false;
  bool verify = false;
  bool ceiling = true;
  std::chrono::milliseconds timeout{60000};
  std::optional<std::uint64_t> fail_after;
  std::uint64_t fail_rank = 0;
  bool json = false;
  bool quiet = false;
};

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

void add_load_options(Parser& p) {
  p.option("model", "NAME",
           "rehearse instead of reading: the checkpoint `zeroflat write-checkpoint` would write "
           "for this catalog model or config.json, accounted on a sim device with --no-data "
           "(nothing is read)");
  p.option("layers", "N", "with --model: keep the first N transformer layers");
  p.option("experts", "N", "with --model: keep N experts per MoE layer");
  p.option("checkpoint-dtype", "T", "with --model: the dtype the checkpoint stores",
           "the buffer's");
  add_placement_options(p, "the buffer lives", "nothing is read");
  add_layout_options(p);
  p.option("margin", "SIZE", "device bytes the plan never uses", "min(3% of capacity, 1 GiB)");
  p.option("threads", "N", "reader threads per rank", "cores / ranks on this host");
  p.option("ring", "SIZE", "devices the host cannot write: the size of each pinned staging chunk",
           "16MiB");
  p.option("ring-depth", "N", "devices the host cannot write: staging chunks in the ring", "4");
  p.flag("cold",
         "drop the checkpoint's files from the page cache first (posix_fadvise), for "
         "the load and for the ceiling: a cold read without root");
  p.flag("no-ceiling",
         "skip the sequential reads of the same files (before and after the load) that the "
         "load is compared to");
  p.flag("verify",
         "compare every parameter in the buffer with its tensor read whole, on its own, from "
         "the file (and every padding byte with zero)");
  p.option("timeout", "SECONDS", "how long a collective waits for the other ranks", "60");
  p.option("inject-read-error", "BYTES[@R]",
           "testing aid: rank R's reads (default 0) fail as an I/O error once BYTES have been "
           "read; exit 4, with every rank saying so and no buffer kept");
  p.flag("json", "print one JSON document on stdout (docs/cli.md)");
  p.flag("quiet", "no progress on stderr");
}

// The group: every floating-point tensor of the checkpoint, in its natural name order (the
// order `--model CHECKPOINT` flattens them in), with the release's rules applied.
void group_from_checkpoint(LoadConfig& cfg, const Args& args) {
  ModelSpec model;
  model.name = cfg.source;
  std::map<DType, std::uint64_t> bytes_by_type;
  for (const CheckpointTensor& t : cfg.ck.tensors) {
    if (!t.type) {
      cfg.left_out.push_back(t.name + " (" + t.dtype + ")");
      continue;
    }
    model.tensors.push_back(TensorSpec{t.name, t.shape, t.numel});
    bytes_by_type[*t.type] += t.bytes;
  }
  if (model.tensors.empty()) {
    throw InvalidArgument(cfg.source + " holds no bf16, fp16 or fp32 tensor to load");
  }
  // The buffer's dtype defaults to the one holding most of the checkpoint's bytes.
  std::uint64_t best = 0;
  for (const auto& [type, b] : bytes_by_type) {
    if (b > best) {
      best = b;
      model.dtype = type;
    }
  }
  cfg.options = layout_options_from_args(args, &model);
  if (const std::string note = apply_release(args, model, cfg.options); !note.empty()) {
    std::fprintf(stderr, "zeroflat load: %s\n", note.c_str());
  }
  for (const TensorSpec& t : model.tensors) {
    cfg.params.push_back(LoadParam{t.name, t.shape, {}});
    cfg.checkpoint_bytes += cfg.ck.find(t.name)->bytes;
  }
}

LoadConfig load_config_from_args(const Args& args) {
  LoadConfig cfg;
  const Placement pl =
      placement_from_args(args, args.get("dp") ? parse_u64(*args.get("dp"), "--dp") : 1);
  cfg.device_spec = pl.device_spec;
  cfg.kind = pl.kind;
  cfg.no_data = pl.no_data;
  cfg.node_host_bytes = pl.node_host_bytes;
  cfg.comm = pl.comm;
  cfg.cold = args.has("cold");
  cfg.verify = args.has("verify");
  cfg.ceiling = !args.has("no-ceiling");
  cfg.json = args.has("json");
  cfg.quiet = args.has("quiet");

  const auto& pos = args.positionals();
  if (auto m = args.get("model")) {
    if (!pos.empty()) {
      throw InvalidArgument(
          "give a checkpoint or --model, not both: --model rehearses the "
          "checkpoint write-checkpoint would write, without reading files");
    }
    if (!cfg.no_data) {
      throw InvalidArgument(
          "--model rehearses a load without reading anything: it needs "
          "--device sim:... --no-data. To load real files, write them with "
          "`zeroflat write-checkpoint DIR --model " +
          printable(*m) + "` and name DIR");
    }
    ModelSpec model = model_from_args(args, "tiny-moe");
    cfg.options = layout_options_from_args(args, &model);
    if (const std::string note = apply_release(args, model, cfg.options); !note.empty()) {
      std::fprintf(stderr, "zeroflat load: %s\n", note.c_str());
    }
    const DType stored = args.get("checkpoint-dtype") ? parse_dtype(*args.get("checkpoint-dtype"))
                                                      : cfg.options.dtype;
    cfg.rehearsal = true;
    cfg.source = model.name;
    cfg.ck = pattern_checkpoint_index(model, stored, "(" + model.name + ", not written)",
                                      kRehearsalShardBytes);
    for (const TensorSpec& t : model.tensors) {
      cfg.params.push_back(LoadParam{t.name, t.shape, {}});
      cfg.checkpoint_bytes += t.numel * element_size(stored);
    }
  } else {
    if (pos.empty()) {
      throw UsageError(
          "name a checkpoint: a .safetensors file or a directory of them (or "
          "--model NAME with --device sim:... --no-data to rehearse)");
    }
    for (const char* o : {"layers", "experts", "checkpoint-dtype"}) {
      if (args.has(o)) {
        throw InvalidArgument(std::string("--") + o +
                              " applies to --model rehearsals; a "
                              "checkpoint's tensors are what they are");
      }
    }
    if (cfg.no_data) {
      throw InvalidArgument(
          "--no-data reads nothing: rehearse with --model NAME instead of a "
          "checkpoint");
    }
    cfg.source = pos.front();
    cfg.ck = open_checkpoint(cfg.source);
    group_from_checkpoint(cfg, args);
  }

  if (cfg.no_data && cfg.verify) {
    throw InvalidArgument("--verify needs data; drop --no-data");
  }
  if (auto v = args.get("margin")) cfg.margin = parse_size(*v);
  cfg.threads = threads_from_args(args);
  if (auto v = args.get("ring")) {
    cfg.ring_chunk = parse_size(*v);
    if (cfg.ring_chunk < 4096 || cfg.ring_chunk > (std::uint64_t{1} << 32)) {
      throw InvalidArgument("--ring " + printable(*v) + ": expected 4KiB to 4GiB");
    }
  }
  if (auto v = args.get("ring-depth")) {
    const std::uint64_t n = parse_u64(*v, "--ring-depth");
    if (n == 0 || n > 64)
      throw InvalidArgument("--ring-depth " + printable(*v) + ": expected 1 to 64");
    cfg.ring_depth = static_cast<unsigned>(n);
  }
  if (auto v = args.get("timeout")) {
    const std::uint64_t s = parse_u64(*v, "--timeout");
    if (s == 0 || s > 86400)
      throw InvalidArgument("--timeout " + printable(*v) + ": expected 1 to 86400");
    cfg.timeout = std::chrono::milliseconds(s * 1000);
  }
  if (auto v = args.get("inject-read-error")) {
    const auto at = v->find('@');
    cfg.fail_after = parse_u64(v->substr(0, at), "--inject-read-error");
    if (at != std::string::npos)
      cfg.fail_rank = parse_u64(v->substr(at + 1), "--inject-read-error rank");
  }
  if (cfg.options.dp > kMaxRanks) {
    throw InvalidArgument("--dp " + std::to_string(cfg.options.dp) + ": at most " +
                          std::to_string(kMaxRanks) + " ranks");
  }
  return cfg;
}

void settle_load_ranks(LoadConfig& cfg, const Args& args, Communicator* world) {
  settle_world(cfg.options, cfg.local_ranks, args, world);
  if (cfg.fail_after && cfg.fail_rank >= cfg.options.dp) {
    throw InvalidArgument("--inject-read-error: rank " + std::to_string(cfg.fail_rank) +
                          " is outside dp " + std::to_string(cfg.options.dp));
  }
  if (cfg.threads == 0) cfg.threads = default_num_threads(cfg.local_ranks);
}

// Why the ranks of this process cannot hold their buffers in this machine's memory, or "".
std::string load_memory_shortfall(const LoadConfig& cfg) {
  if (cfg.no_data || cfg.kind == DeviceKind::kCuda) return "";
  const Layout layout = Layout::compute(
      [&] {
        std::vector<std::uint64_t> n;
        for (const LoadParam& p : cfg.params) n.push_back(shape_numel(p.shape));
        return n;
      }(),
      cfg.options);
  // The buffer, the ceiling's scratch (about this rank's share of the files), a verify's
  // largest tensor.
  std::uint64_t largest = 0;
  for (const CheckpointTensor& t : cfg.ck.tensors) largest = std::max(largest, t.bytes * 2);
  const std::uint64_t per_rank = layout.flat_bytes() +
                                 (cfg.ceiling ? cfg.checkpoint_bytes / cfg.options.dp + 1 : 0) +
                                 (cfg.verify ? largest : 0);
  const std::optional<HostShortfall> s =
      host_shortfall(per_rank, cfg.comm, cfg.options.dp, cfg.local_ranks);
  if (!s) return "";
  return "this load needs " + format_bytes(s->need) + " of this machine's memory (" +
         std::to_string(s->ranks_here) + " rank(s) here, each " + format_bytes(per_rank) +
         " for its flat buffer" + (cfg.ceiling ? ", the ceiling's scratch" : "") +
         (cfg.verify ? " and verification" : "") + "), and " + format_bytes(s->usable) +
         " is usable. Nothing was allocated. Try --no-ceiling, or rehearse with --model NAME "
         "--device sim:SIZE --no-data";
}

struct RankOutcome {
  int exit = kExitOk;
  std::string message;  // infeasible: why
  Json entry;
  Json plan;
  std::uint64_t flat_bytes = 0;
  std::uint64_t partition_bytes = 0;
};

RankOutcome load_rank(const LoadConfig& cfg, std::uint64_t rank, Communicator* control,
                      Progress& progress) {
  RankOutcome out;
  std::unique_ptr<Device> device =
      make_device(cfg.device_spec, DeviceOptions{cfg.threads, cfg.no_data, cfg.node_host_bytes});
  std::unique_ptr<Communicator> nccl;
  Communicator* comm = control;
  if (cfg.comm == "nccl") {
    nccl = make_nccl_communicator(*control, *device, cfg.timeout);
    comm = nccl.get();
  }
  LoadOptions lo;
  lo.layout = cfg.options;
  lo.margin_bytes = cfg.margin;
  lo.cold = cfg.cold;
  lo.ring_chunk_bytes = cfg.ring_chunk;
  lo.ring_depth = cfg.ring_depth;
  lo.threads = cfg.threads;
  lo.probe.local_ranks = cfg.local_ranks;
  lo.must_match = "source " + cfg.source + ", device " + cfg.device_spec + ", comm " + cfg.comm +
                  ", threads " + std::to_string(cfg.threads) + (cfg.verify ? ", verify" : "") +
                  (cfg.ceiling ? ", ceiling" : "");
  if (cfg.fail_after && rank == cfg.fail_rank) lo.fail_after_bytes = cfg.fail_after;

  Json& e = out.entry;
  e["rank"] = rank;
  // The ceiling: as many bytes of the same files read sequentially, before the load and again
  // after it (memory and cache conditions shift between the two); the faster is kept.
  std::optional<ReadCeiling> ceiling;
  std::uint64_t ceiling_bytes = 0;
  auto measure_ceiling = [&] {
    if (control != nullptr) control->barrier();  // the ranks read together, as they load
    progress.begin("ceiling: read " + format_bytes(ceiling_bytes) + " sequentially", 0);
    const ReadCeiling c = measure_read_ceiling(cfg.ck, rank * ceiling_bytes, ceiling_bytes,
                                               cfg.threads, cfg.cold, device.get());
    progress.end();
    if (!ceiling || c.seconds < ceiling->seconds) ceiling = c;
  };
  const bool with_ceiling = cfg.ceiling && !cfg.no_data;
  if (with_ceiling) {
    ceiling_bytes = partition_read_bytes(cfg.ck, cfg.params, cfg.options, rank);
    measure_ceiling();
  }
  LoadResult res;
  progress.begin(std::string(cfg.no_data ? "account for" : "load") + " this rank's partition of " +
                     format_bytes(cfg.checkpoint_bytes),
                 0);
  try {
    res = load_flat_group(cfg.ck, cfg.params, *device, comm, lo);
  } catch (const InvalidArgument&) {
    throw;  // bad input, the same verdict on every rank: exit 2
  } catch (const Error& err) {
    progress.end();
    out.exit = kExitExecFailed;
    e["error"] = err.what();
    e["buffer_kept"] = false;
    return out;
  }
  progress.end();
  out.plan = Json::parse(candidate_json(res.plan, true));
  if (!res.feasible()) {
    out.exit = kExitInfeasible;
    out.message = "the loader's plan does not fit: " + res.plan.why_not + ". Nothing was read.";
    return out;
  }
  const Layout& layout = res.group.layout;
  out.flat_bytes = layout.flat_bytes();
  out.partition_bytes = layout.partition_bytes();
  e["bytes_read"] = res.bytes_read;
  e["reads"] = res.reads;
  e["read_seconds"] = res.read_seconds;
  e["read_gbps"] = cfg.no_data ? Json() : Json(gbps(res.bytes_read, res.read_seconds));
  e["page_cache"] = cfg.no_data ? Json() : Json(res.page_cache);
  e["cached_fraction"] = cfg.no_data ? Json() : Json(res.cached_fraction);
  e["allgather_seconds"] = res.allgather_seconds;
  e["seconds"] = res.seconds;
  e["predicted_peak_device_bytes"] = res.predicted_peak_device_bytes;
  e["measured_peak_device_bytes"] = res.measured_peak_device_bytes;
  e["predicted_host_bytes"] = res.plan.profile.peak_host_bytes;
  e["host_bytes"] = res.measured_peak_host_bytes;

  if (with_ceiling) {
    measure_ceiling();
    e["ceiling"] = {{"bytes", ceiling->bytes},
                    {"seconds", ceiling->seconds},
                    {"read_gbps", gbps(ceiling->bytes, ceiling->seconds)},
                    {"page_cache", ceiling->page_cache},
                    {"cached_fraction", ceiling->cached_fraction}};
  }
  if (cfg.verify) {
    progress.begin("verify against every tensor read whole", 0);
    const std::string failure = verify_loaded(cfg.ck, cfg.params, *device, res.group);
    progress.end();
    e["verified"] = failure.empty();
    if (!failure.empty()) {
      e["verify_error"] = failure;
      out.exit = kExitOther;
    }
  } else {
    e["verified"] = false;
    e["verify"] = cfg.no_data ? "no data to verify (--no-data)" : "not requested";
  }
  e["checksum"] = device->keeps_data()
                      ? Json(checksum_hex(device->checksum(res.group.flat.data(), out.flat_bytes)))
                      : Json();
  return out;
}

void print_report(const LoadConfig& cfg, const std::vector<Json>& entries, const Json& plan,
                  std::uint64_t flat_bytes, std::uint64_t partition_bytes, int exit,
                  const std::string& first_error) {
  // The node's figures: all bytes over the slowest rank's time.
  std::uint64_t bytes = 0, ceiling_bytes = 0;
  double seconds = 0, ceiling_seconds = 0, cached = 0;
  std::string ceiling_cache;
  bool have_ceiling = false;
  for (const Json& e : entries) {
    if (!e.contains("bytes_read")) continue;
    bytes += e["bytes_read"].get<std::uint64_t>();
    seconds = std::max(seconds, e["read_seconds"].get<double>());
    if (e["cached_fraction"].is_number()) {
      cached += e["cached_fraction"].get<double>() * e["bytes_read"].get<double>();
    }
    if (e.contains("ceiling")) {
      have_ceiling = true;
      ceiling_bytes += e["ceiling"]["bytes"].get<std::uint64_t>();
      ceiling_seconds = std::max(ceiling_seconds, e["ceiling"]["seconds"].get<double>());
    }
  }
  const double load_gbps = gbps(bytes, seconds);
  const double ceil_gbps = gbps(ceiling_bytes, ceiling_seconds);
  const std::string cache = cfg.no_data || bytes == 0
                                ? std::string()
                                : page_cache_word(cached / static_cast<double>(bytes));
  if (have_ceiling) {
    double cc = 0;
    for (const Json& e : entries) {
      if (e.contains("ceiling")) {
        cc += e["ceiling"]["cached_fraction"].get<double>() * e["ceiling"]["bytes"].get<double>();
      }
    }
    ceiling_cache = ceiling_bytes ? page_cache_word(cc / static_cast<double>(ceiling_bytes)) : "";
  }
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
    doc["dtype"] = std::string(dtype_name(cfg.options.dtype));
    doc["dp"] = cfg.options.dp;
    doc["round_robin"] = cfg.options.round_robin;
    doc["device"] = cfg.device_spec;
    doc["no_data"] = cfg.no_data;
    doc["comm"] = cfg.comm;
    doc["threads"] = cfg.threads;
    doc["cold"] = cfg.cold;
    doc["flat_bytes"] = flat_bytes;
    doc["partition_bytes"] = partition_bytes;
    doc["plan"] = plan;
    doc["read_gbps"] = cfg.no_data ? Json() : Json(load_gbps);
    doc["page_cache"] = cache.empty() ? Json() : Json(cache);
    doc["ceiling"] = have_ceiling ? Json{{"bytes", ceiling_bytes},
                                         {"read_gbps", ceil_gbps},
                                         {"page_cache", ceiling_cache}}
                                  : Json();
    doc["vs_ceiling"] = have_ceiling && ceil_gbps > 0 ? Json(load_gbps / ceil_gbps) : Json();
    doc["ranks"] = entries;
    doc["exit"] = exit;
    doc["error"] = first_error.empty() ? Json() : Json(first_error);
    std::printf("%s\n", doc.dump(2).c_str());
    return;
  }
  std::printf(
      "%s %s: %zu tensors in %zu file(s), %s as stored; %s buffers of %s, dp %llu%s, on %s\n",
      cfg.rehearsal ? "rehearsed" : "loaded", printable(cfg.source).c_str(), cfg.params.size(),
      cfg.ck.files.size(), format_bytes(cfg.checkpoint_bytes).c_str(),
      std::string(dtype_name(cfg.options.dtype)).c_str(), format_bytes(flat_bytes).c_str(),
      static_cast<unsigned long long>(cfg.options.dp),
      cfg.options.round_robin ? " (round-robin)" : "", cfg.device_spec.c_str());
  if (!cfg.left_out.empty()) {
    std::printf("left out (not floating point): %s\n", join(cfg.left_out).c_str());
  }
  std::printf("%-5s %12s %7s %9s %12s %7s %8s %24s\n", "rank", "read", "reads", "GB/s",
              "ceiling GB/s", "ratio", "cache", "device peak pred / meas");
  for (const Json& e : entries) {
    if (!e.contains("bytes_read")) {
      std::printf("%-5llu error: %s\n",
                  static_cast<unsigned long long>(e["rank"].get<std::uint64_t>()),
                  e.value("error", std::string("?")).c_str());
      continue;
    }
    const double g = e["read_gbps"].is_number() ? e["read_gbps"].get<double>() : 0;
    const double c = e.contains("ceiling") ? e["ceiling"]["read_gbps"].get<double>() : 0;
    const std::string gs = cfg.no_data ? "-" : fixed(g, 2);
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
  if (!cfg.no_data && seconds > 0) {
    std::printf("node: %.2f GB/s read", load_gbps);
    if (have_ceiling) {
      std::printf(" against a ceiling of %.2f GB/s (%s): %.2fx", ceil_gbps, ceiling_cache.c_str(),
                  ceil_gbps > 0 ? load_gbps / ceil_gbps : 0.0);
    }
    std::printf("; page cache %s\n", cache.c_str());
  }
  bool all_verified = !entries.empty();
  for (const Json& e : entries) all_verified = all_verified && e.value("verified", false);
  if (cfg.verify) std::printf("verified: %s\n", all_verified ? "yes, every rank" : "NO");
  if (!entries.empty() && entries.front()["checksum"].is_string()) {
    std::printf("checksum: %s\n", entries.front()["checksum"].get<std::string>().c_str());
  }
  if (!first_error.empty()) std::printf("error: %s\n", first_error.c_str());
}

}  // namespace

int subcommand_load(const std::vector<std::string>& argv) {
  Parser p("load", "CHECKPOINT [--dp P] [--device DEV] [--comm local|mpi|nccl] [options]",
           "Loads a safetensors checkpoint (a .safetensors file, or a directory of them with\n"
           "model.safetensors.index.json) straight into every rank's flat buffer: each rank\n"
           "reads only the bytes of its own partition, sorted by file offset, merged and split\n"
           "over its threads, straight into its slice of the buffer (through a ring of pinned\n"
           "chunks on a GPU), converting dtypes as torch does; one all-gather completes the\n"
           "buffer. The group is every floating-point tensor of the checkpoint, in the order\n"
           "`--model CHECKPOINT` uses elsewhere. Reports the bytes each rank read, GB/s against\n"
           "a sequential read of the same files measured in the same run, whether the bytes\n"
           "came from the page cache, and the device peak predicted and measured.");
  add_load_options(p);
  p.allow_positionals(1);
  p.epilog(
      "examples:\n"
      "  zeroflat write-checkpoint /tmp/ck --model tiny-moe --shard-size 4MB\n"
      "  zeroflat load /tmp/ck --dp 3 --verify\n"
      "  zeroflat load /tmp/ck --dp 2 --dtype fp16 --round-robin --cold --json\n"
      "  mpirun -n 3 zeroflat load /tmp/ck --comm mpi --verify\n"
      "  zeroflat load --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data --dp "
      "8\n\n"
      "Exit codes: 0 loaded; 1 the buffer does not hold the checkpoint's values (--verify);\n"
      "2 bad arguments or a bad checkpoint (named before anything is read), or ranks that\n"
      "disagree; 3 the buffer does not fit (nothing read); 4 a read failed midway (every rank\n"
      "says so; no buffer is kept). GB = 1e9 bytes; the ceiling reads as many bytes of the\n"
      "same files with the same threads into fresh memory, as the loader's buffer is, before\n"
      "the load and after it (the faster is kept).");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  LoadConfig cfg = load_config_from_args(args);
  std::unique_ptr<Communicator> world;
  if (cfg.comm != "local") world = make_mpi_communicator(cfg.timeout);
  settle_load_ranks(cfg, args, world.get());
  const int me = world ? world->rank() : 0;
  auto finish = [&](int code) { return finish_job(world.get(), code); };
  const std::string why = load_memory_shortfall(cfg);
  const int short_rank = agree_on_failure(world.get(), !why.empty());
  if (short_rank >= 0) {
    if (!why.empty()) std::fprintf(stderr, "zeroflat load: rank %d: %s\n", me, why.c_str());
    return finish(kExitInfeasible);
  }
  Progress progress(!cfg.quiet && me == 0);
  if (me == 0) {
    progress.note(printable(cfg.source) + ": " + format_count(cfg.params.size()) + " tensors in " +
                  std::to_string(cfg.ck.files.size()) + " file(s), " +
                  format_bytes(cfg.checkpoint_bytes) + "; dp " + std::to_string(cfg.options.dp) +
                  " over " + cfg.comm + " on " + cfg.device_spec + ", " +
                  std::to_string(cfg.threads) + " reader thread(s) per rank" +
                  (cfg.cold ? ", cold" : ""));
  }
  std::vector<RankOutcome> outcomes(world ? 1 : cfg.options.dp);
  run_ranks(cfg.options.dp, world.get(), cfg.timeout, [&](std::uint64_t r, Communicator* c) {
    Progress silent(false);
    outcomes[world ? 0 : r] = load_rank(cfg, r, c, r == 0 ? progress : silent);
  });
  const RankOutcome& mine = outcomes.front();
  if (mine.exit == kExitInfeasible) {
    if (me == 0) {
      if (cfg.json) {
        Json doc{{"plan", mine.plan}, {"exit", kExitInfeasible}, {"error", mine.message}};
        std::printf("%s\n", doc.dump(2).c_str());
      } else {
        std::fprintf(stderr, "zeroflat load: %s\n", mine.message.c_str());
      }
    }
    return finish(kExitInfeasible);
  }
  std::vector<Json> entries;
  if (world) {
    entries = exchange_entries(world.get(), mine.entry);
  } else {
    for (const RankOutcome& o : outcomes) entries.push_back(o.entry);
  }
  int exit = kExitOk;
  std::string first_error;
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
    if (code == kExitExecFailed || exit == kExitOk) exit = std::max(exit, code);
  }
  if (me == 0) {
    print_report(cfg, entries, mine.plan, mine.flat_bytes, mine.partition_bytes, exit, first_error);
  }
  return finish(exit);
}

int subcommand_write_checkpoint(const std::vector<std::string>& argv) {
  Parser p("write-checkpoint", "DIR [--model NAME] [--dtype T] [--shard-size SIZE]",
           "Writes a deterministic safetensors checkpoint of a catalog model or config.json into\n"
           "a new directory, sharded like Hugging Face's (model-0000K-of-0000N.safetensors and\n"
           "model.safetensors.index.json; one model.safetensors when it fits one shard). Tensor\n"
           "i holds the same pattern `zeroflat run` fills it with, so a load of it can be\n"
           "compared with a run, byte for byte. No downloads: tests, benchmarks and rehearsals\n"
           "get real files. Every file is created new: a name in DIR that exists already (a\n"
           "file, or a link, even a dangling one) is refused, never written through, and a\n"
           "failed write removes only the files this run created.");
  add_model_options(p, "tiny-moe");
  p.option("dtype", "T", "the dtype stored: bf16, fp16 or fp32", "the model's own, else bf16");
  p.option("values", "T",
           "the pattern of dtype T, stored converted to --dtype (fp32 files holding bf16 "
           "values load into bf16 buffers exactly as `zeroflat run --dtype bf16` fills them)",
           "--dtype");
  p.option("shard-size", "SIZE",
           "the most tensor bytes per file (a larger tensor gets a file "
           "of its own)",
           "5GB");
  p.flag("quiet", "no progress on stderr");
  p.allow_positionals(1);
  p.epilog(
      "examples:\n"
      "  zeroflat write-checkpoint /tmp/ck --model tiny-moe --shard-size 4MB\n"
      "  zeroflat write-checkpoint /tmp/qwen1 --model qwen3-30b-a3b --layers 1 --experts 16\n"
      "  zeroflat write-checkpoint /tmp/ck32 --model tiny-moe --dtype fp32 --values bf16\n");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  if (args.positionals().empty()) throw UsageError("name the directory to write into");
  const std::string dir = args.positionals().front();
  const ModelSpec model = model_from_args(args, "tiny-moe");
  const DType dtype =
      args.get("dtype") ? parse_dtype(*args.get("dtype")) : model.dtype.value_or(DType::kBF16);
  std::optional<DType> values;
  if (auto v = args.get("values")) values = parse_dtype(*v);
  const std::uint64_t shard =
      args.get("shard-size") ? parse_size(*args.get("shard-size")) : std::uint64_t{5'000'000'000};
  if (shard == 0) throw InvalidArgument("--shard-size 0: shards must hold something");
  const std::uint64_t total = model.numel() * element_size(dtype);
  // The disk must hold it: checked before the first byte is written.
  const CheckpointIndex planned = pattern_checkpoint_index(model, dtype, dir, shard);
  std::uint64_t file_total = 0;
  for (std::uint64_t b : planned.file_bytes) file_total += b;
  std::error_code ec;
  std::filesystem::path probe_dir = std::filesystem::absolute(dir, ec);
  while (!probe_dir.empty() && !std::filesystem::exists(probe_dir, ec)) {
    probe_dir = probe_dir.parent_path();
  }
  const auto space = std::filesystem::space(probe_dir, ec);
  if (!ec && space.available < file_total) {
    throw InvalidArgument(dir + ": the checkpoint needs " + format_bytes(file_total) + ", and " +
                          format_bytes(space.available) +
                          " is free there (try --layers or "
                          "--experts)");
  }
  // A file-size limit (ulimit -f) would kill the process midway with SIGXFSZ, leaving half a
  // checkpoint behind; ignored, the write fails with EFBIG instead, and the writer removes the
  // files it created.
  std::signal(SIGXFSZ, SIG_IGN);
  Progress progress(!args.has("quiet"));
  progress.begin(
      "write " + format_bytes(total) + " into " + std::to_string(planned.files.size()) + " file(s)",
      total);
  write_pattern_checkpoint(model, dtype, dir, shard, values,
                           [&](std::uint64_t n) { progress.advance(n); });
  progress.end();
  std::printf("wrote %s: %zu tensors of %s, %s in %zu file(s)%s\n", dir.c_str(),
              model.tensors.size(), printable(model.name).c_str(), format_bytes(total).c_str(),
              planned.files.size(),
              planned.files.size() > 1 ? " with model.safetensors.index.json" : "");
  return kExitOk;
}

}  // namespace zeroflat::cli
