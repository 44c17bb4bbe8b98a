// `zeroflat load`: its options, and the group read from the checkpoint's headers (or the model
// rehearsed), checked before anything is read.
#include <algorithm>
#include <cstdio>
#include <map>
#include <span>
#include <string>

#include "cli/common.h"
#include "cli/load.h"
#include "zeroflat/common.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/layout.h"

namespace zeroflat::cli {
namespace {

constexpr std::uint64_t kRehearsalShardBytes = 5'000'000'000;  // Hugging Face's default shards

// The release's group of `model`: the tensors it leaves out (zero-element ones from 0.19.8) are
// dropped from the model and listed in cfg.left_out.
void apply_release_to_group(LoadConfig& cfg, ModelSpec& model) {
  if (!cfg.library.release) return;
  const ReleaseLayout rl =
      layout_for_release(model.numels(), {}, cfg.library.layout, *cfg.library.release);
  if (rl.left_out.empty()) return;
  for (const auto& [i, why] : rl.left_out) {
    cfg.left_out.push_back(model.tensors[i].name + " (" + std::string(left_out_name(why)) +
                           ", DeepSpeed " + cfg.library.release->release + ")");
  }
  std::vector<TensorSpec> kept;
  for (std::uint64_t i : rl.kept) kept.push_back(model.tensors[i]);
  model.tensors = std::move(kept);
}

// The group: every floating-point tensor of the checkpoint, in its natural name order (the
// order `--model CHECKPOINT` flattens them in), with the release's rules applied.
void group_from_checkpoint(LoadConfig& cfg, const Args& args) {
  ModelSpec model;
  model.name = cfg.source;
  std::map<DType, std::uint64_t> bytes_by_type;
  std::map<std::string, std::uint64_t> stored_bytes;  // by exact name, as stored
  for (const CheckpointTensor& t : cfg.ck.tensors) {
    if (t.alias) continue;  // a tied weight's other name in a torch.save'd state dict
    if (!t.type) {
      cfg.left_out.push_back(t.name + " (" + t.dtype + ")");
      continue;
    }
    model.tensors.push_back(TensorSpec{t.name, t.shape, t.numel});
    stored_bytes[t.name] = t.bytes;
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
  cfg.library.layout = layout_options_from_args(args, &model);
  cfg.library.release = release_from_args(args, cfg.library.layout);
  apply_release_to_group(cfg, model);
  for (const TensorSpec& t : model.tensors) {
    cfg.params.push_back(LoadParam{t.name, t.shape, {}});
    cfg.checkpoint_bytes += stored_bytes.at(t.name);
  }
}

}  // namespace

void add_load_options(Parser& p) {
  add_deepspeed_load_options(p);
  p.option("model", "NAME",
           "rehearse instead of reading: the checkpoint `zeroflat write-checkpoint` would write "
           "for this catalog model or config.json, accounted on a sim device with --no-data "
           "(nothing is read)");
  p.option("layers", "N", "with --model: keep the first N transformer layers");
  p.option("experts", "N", "with --model: keep N experts per MoE layer");
  p.option("checkpoint-dtype", "T", "with --model: the dtype the checkpoint stores",
           "the buffer's");
  add_device_setup_options(p, "the buffer lives", "nothing is read");
  add_layout_options(p);
  add_stage_options(p);
  p.option("margin", "SIZE", "device bytes the plan never uses", "min(3% of capacity, 1 GiB)");
  p.option("threads", "N", "reader threads per rank", "cores / ranks on this host");
  p.option("ring", "SIZE", "devices the host cannot write: the size of each pinned staging chunk",
           "4MiB");
  p.option("ring-depth", "N",
           "devices the host cannot write: staging chunks in the ring (the threads fill several "
           "at once while full ones are copied)",
           "16");
  p.flag("cold",
         "drop the checkpoint's files from the page cache first (posix_fadvise), for "
         "the load and for the ceiling: a cold read without root");
  p.option("read-plan", "PLAN",
           "who reads what: load (each rank reads its slice, one all-gather completes the "
           "buffers; each node reads 1/nodes of the checkpoint), load-whole (each rank reads "
           "the whole buffer from its node's page cache, no all-gather), or auto (the faster by "
           "the cost model, from the nodes = ranks / ranks per host, and --storage); with "
           "--stage 3 the one plan is load-partitions (each rank reads only its own partition "
           "of every parameter, no all-gather)",
           "auto");
  p.option("storage", "SIZE",
           "the read bandwidth, per second, of storage all nodes share (a network file system), "
           "for the read plan's cost model, e.g. 400MB",
           "each node reads its own storage");
  p.option("copies", "CHECK",
           "after reading, compare the ranks' copies of the checkpoint: sampled (16 windows of "
           "64 KiB of every other rank's slice, at most 1 MiB per rank), full (every other "
           "rank's slice read again: (N-1)/N of the checkpoint more), or off; their headers are "
           "always compared",
           "sampled");
  p.flag("no-ceiling",
         "skip the sequential reads of the same files (before and after the load) that the "
         "load is compared to");
  p.flag("verify",
         "compare every parameter in the buffer with its tensor read whole, on its own, from "
         "the file (and every padding byte with zero)");
  p.option("timeout", "SECONDS", "how long a rank waits for the others in a collective", "60");
  p.option("start-timeout", "SECONDS",
           "--comm mpi and nccl: how long the MPI job may take to start (every rank joining it)",
           "the larger of 120 and --timeout");
  p.option("inject-read-error", "BYTES[@R]",
           "testing aid: rank R's reads (default 0) fail as an I/O error once BYTES have been "
           "read; exit 4, with every rank saying so and no buffer kept");
  p.flag("json", "print one JSON document on stdout (docs/cli.md)");
  p.flag("quiet", "no progress on stderr");
}

namespace {

// --read-plan for a safetensors load.
std::optional<Tier> read_plan_from_args(const Args& args, bool zero3) {
  auto v = args.get("read-plan");
  if (!v || *v == "auto") return std::nullopt;
  const std::span<const Tier> plans =
      zero3 ? std::span<const Tier>(kPartitionReadPlans) : std::span<const Tier>(kReadPlans);
  for (Tier plan : plans) {
    if (*v == tier_name(plan)) return plan;
  }
  throw InvalidArgument(
      "--read-plan '" + printable(*v) + "': expected " +
      (zero3 ? std::string("auto or load-partitions (--stage 3 reads partitions)")
             : std::string("auto, load or load-whole") +
                   (*v == tier_name(Tier::kLoadPartitions)
                        ? " (load-partitions is ZeRO-3's: add --stage 3)"
                        : "")));
}

}  // namespace

LoadConfig load_config_from_args(const Args& args) {
  LoadConfig cfg;
  cfg.library.master = false;  // DeepSpeed builds its own from the buffer; --verify reads the views
  cfg.setup = device_setup_from_args(args, args.get("dp") ? parse_u64(*args.get("dp"), "--dp") : 1);
  cfg.library.read.cold = args.has("cold");
  const bool deepspeed = from_deepspeed(args);
  if (!deepspeed) {
    for (const char* o : {"tag", "states"}) {
      if (args.has(o)) {
        throw UsageError(std::string("--") + o +
                         " is for DeepSpeed checkpoints: add --from deepspeed");
      }
    }
    cfg.stage = stage_from_args(args);
    cfg.library.tier = read_plan_from_args(args, cfg.stage.zero3);
  }
  if (auto v = args.get("storage")) {
    cfg.library.storage_bytes_per_second = static_cast<double>(parse_size(*v, "--storage"));
    if (cfg.library.storage_bytes_per_second <= 0)
      throw InvalidArgument("--storage " + printable(*v) + ": expected > 0");
  }
  if (auto v = args.get("copies")) cfg.library.read.copies = parse_copy_check(*v, "--copies");
  cfg.verify = args.has("verify");
  cfg.ceiling = !args.has("no-ceiling");
  cfg.json = args.has("json");
  cfg.quiet = args.has("quiet");

  // One limit for --dp, said before anything is laid out for it (the layout's own, far larger,
  // would answer first otherwise).
  if (auto v = args.get("dp"); v && parse_u64(*v, "--dp") > kMaxRanks) {
    throw InvalidArgument("--dp " + printable(*v) + ": at most " + std::to_string(kMaxRanks) +
                          " ranks");
  }
  const auto& pos = args.positionals();
  if (deepspeed) {
    deepspeed_config(cfg, args);
  } else if (auto m = args.get("model")) {
    if (!pos.empty()) {
      throw InvalidArgument(
          "give a checkpoint or --model, not both: --model rehearses the "
          "checkpoint write-checkpoint would write, without reading files");
    }
    if (!cfg.setup.no_data) {
      throw InvalidArgument(
          "--model rehearses a load without reading anything: it needs "
          "--device sim:... --no-data. To load real files, write them with "
          "`zeroflat write-checkpoint DIR --model " +
          printable(*m) + "` and name DIR");
    }
    ModelSpec model = model_from_args(args, "tiny-moe");
    cfg.library.layout = layout_options_from_args(args, &model);
    cfg.library.release = release_from_args(args, cfg.library.layout);
    apply_release_to_group(cfg, model);
    const DType stored = args.get("checkpoint-dtype") ? parse_dtype(*args.get("checkpoint-dtype"))
                                                      : cfg.library.layout.dtype;
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
          "name a checkpoint: a .safetensors file, a directory of them or of pytorch_model.bin (or "
          "--model NAME with --device sim:... --no-data to rehearse)");
    }
    for (const char* o : {"layers", "experts", "checkpoint-dtype"}) {
      if (args.has(o)) {
        throw InvalidArgument(std::string("--") + o +
                              " applies to --model rehearsals; a "
                              "checkpoint's tensors are what they are");
      }
    }
    if (cfg.setup.no_data) {
      throw InvalidArgument(
          "--no-data reads nothing: rehearse with --model NAME instead of a "
          "checkpoint");
    }
    cfg.source = pos.front();
    if (is_deepspeed_checkpoint(cfg.source)) {
      throw UsageError(printable(cfg.source) +
                       " is a DeepSpeed checkpoint folder: resume from it with --from deepspeed "
                       "(each rank reads its share of the fp32 master and optimizer states)");
    }
    // A hub id is found where the model options find one (the local hub cache).
    cfg.ck = open_checkpoint(resolve_model_path(cfg.source));
    group_from_checkpoint(cfg, args);
  }

  if (cfg.setup.no_data && cfg.verify) {
    throw InvalidArgument("--verify needs data; drop --no-data");
  }
  if (auto v = args.get("margin")) cfg.library.margin_bytes = parse_size(*v, "--margin");
  cfg.threads = threads_from_args(args);
  if (auto v = args.get("ring")) {
    cfg.library.read.ring_chunk_bytes = parse_size(*v, "--ring");
    if (cfg.library.read.ring_chunk_bytes < 4096 ||
        cfg.library.read.ring_chunk_bytes > (std::uint64_t{1} << 32)) {
      throw InvalidArgument("--ring " + printable(*v) + ": expected 4KiB to 4GiB");
    }
  }
  if (auto v = args.get("ring-depth")) {
    const std::uint64_t n = parse_u64(*v, "--ring-depth");
    if (n == 0 || n > 64)
      throw InvalidArgument("--ring-depth " + printable(*v) + ": expected 1 to 64");
    cfg.library.read.ring_depth = static_cast<unsigned>(n);
  }
  cfg.timeout = timeout_from_args(args);
  cfg.start_timeout = start_timeout_from_args(args, cfg.timeout);
  if (auto v = args.get("inject-read-error")) {
    const auto at = v->find('@');
    cfg.fail_after = parse_u64(v->substr(0, at), "--inject-read-error");
    if (at != std::string::npos)
      cfg.fail_rank = parse_u64(v->substr(at + 1), "--inject-read-error rank");
  }
  if (cfg.library.layout.dp > kMaxRanks) {
    throw InvalidArgument("--dp " + std::to_string(cfg.library.layout.dp) + ": at most " +
                          std::to_string(kMaxRanks) + " ranks");
  }
  return cfg;
}

void settle_load_ranks(LoadConfig& cfg, const Args& args, Communicator* world) {
  settle_world(cfg.library.layout, cfg.library.probe.local_ranks, args, world);
  if (cfg.deepspeed) {
    // The resume's buffers are laid out for the world the ranks settled on.
    cfg.deepspeed->plan.world = cfg.library.layout.dp;
    for (DeepSpeedBuffer& b : cfg.deepspeed->plan.buffers) b.layout.dp = cfg.library.layout.dp;
  }
  if (cfg.fail_after && cfg.fail_rank >= cfg.library.layout.dp) {
    throw InvalidArgument("--inject-read-error: rank " + std::to_string(cfg.fail_rank) +
                          " is outside dp " + std::to_string(cfg.library.layout.dp));
  }
  if (cfg.threads == 0) cfg.threads = default_num_threads(cfg.library.probe.local_ranks);
}

std::string load_memory_shortfall(const LoadConfig& cfg) {
  // Each rank's bookkeeping, kept on the host whatever the device: its plan, the header entries
  // the ranks compare, its reads' lists, its report; about 650-700 bytes per tensor measured
  // (ZeRO-2 and ZeRO-3, 40k tensors, 8 to 32 ranks). A rehearsal of many ranks in one process
  // holds it once per rank, on a sim device too (1.2M tensors at 64 ranks is ~50 GB).
  constexpr std::uint64_t kBookkeepingPerTensor = 1024;
  std::uint64_t tensors = std::max<std::uint64_t>(cfg.ck.tensors.size(), cfg.params.size());
  if (cfg.deepspeed) {
    tensors = 0;
    for (const DeepSpeedBuffer& b : cfg.deepspeed->plan.buffers) tensors += b.source.params.size();
  }
  const std::uint64_t bookkeeping = sat_mul(tensors, kBookkeepingPerTensor);
  const bool host_data = !cfg.setup.no_data && cfg.setup.kind != DeviceKind::kCuda;
  std::uint64_t kept = 0;
  std::uint64_t largest = 0;  // a verify's largest tensor, read whole and converted
  if (host_data && cfg.deepspeed) {
    kept = deepspeed_kept_bytes(cfg);
    for (const DeepSpeedBuffer& b : cfg.deepspeed->plan.buffers) {
      for (const LoadParam& p : b.source.params) {
        largest = std::max(largest, shape_numel(p.shape) * 4 * 2);
      }
    }
  } else if (host_data) {
    std::vector<std::uint64_t> numels;
    numels.reserve(cfg.params.size());
    for (const LoadParam& p : cfg.params) numels.push_back(shape_numel(p.shape));
    const Layout layout = cfg.stage.zero3 ? zero3_buffer_layout(numels, cfg.library.layout)
                                          : Layout::compute(numels, cfg.library.layout);
    kept = layout.flat_bytes();
    for (const CheckpointTensor& t : cfg.ck.tensors) largest = std::max(largest, t.bytes * 2);
  }
  // The buffers, the ceiling's scratch (about this rank's share of the files), a verify's
  // largest tensor, the bookkeeping.
  const bool ceiling = host_data && cfg.ceiling;
  const bool verify = host_data && cfg.verify;
  const std::uint64_t per_rank =
      sat_add(kept + (ceiling ? cfg.checkpoint_bytes / cfg.library.layout.dp + 1 : 0) +
                  (verify ? largest : 0),
              bookkeeping);
  const std::optional<HostShortfall> s = host_shortfall(
      per_rank, cfg.setup.comm, cfg.library.layout.dp, cfg.library.probe.local_ranks);
  if (!s) return "";
  std::string parts = host_data ? (cfg.deepspeed ? "the buffers it keeps" : "its flat buffer")
                                : "";
  if (ceiling) parts += ", the ceiling's scratch";
  if (verify) parts += ", verification";
  parts += (parts.empty() ? "" : " and ") + std::string("the bookkeeping of ") +
           format_count(tensors) + " tensors";
  const std::string fix =
      host_data ? std::string("Try --no-ceiling, or rehearse with ") +
                      (cfg.deepspeed ? "" : "--model NAME ") + "--device sim:SIZE --no-data"
                : "Rehearse fewer ranks in this process (--dp), or run the ranks as processes "
                  "(--comm mpi) over several machines";
  return "this load needs " + format_bytes(s->need) + " of this machine's memory (" +
         std::to_string(s->ranks_here) + " rank(s) here, each " + format_bytes(per_rank) +
         " for " + parts + "), and " + format_bytes(s->usable) + " is usable. Nothing was " +
         "allocated. " + fix;
}

}  // namespace zeroflat::cli
