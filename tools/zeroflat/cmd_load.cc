// `zeroflat load`: a safetensors checkpoint straight into every rank's flat buffer through the
// library's loader (loader.h), each rank reading only its partition, one all-gather completing
// the buffer; or (--from deepspeed) a DeepSpeed checkpoint's resume, each rank reading only its
// share of the fp32 master and optimizer states; reported against a sequential read of the same
// files measured in the same run. The parts live in load_options.cc, load_rank.cc,
// load_report.cc, load_deepspeed.cc and load_deepspeed_report.cc (cli/load.h).
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/common.h"
#include "cli/load.h"
#include "zeroflat/agree.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"

namespace zeroflat::cli {

int subcommand_load(const std::vector<std::string>& argv) {
  Parser p("load",
           "CHECKPOINT [--dp P] [--device DEV] [--comm local|mpi|nccl] [options]\n"
           "       zeroflat load DIR --from deepspeed --dp N [--stage S] [--tag T] [--states LIST] "
           "[options]",
           "Loads a safetensors checkpoint (a .safetensors file, a directory of them with or\n"
           "without model.safetensors.index.json, a folder of pytorch_model.bin or its shards,\n"
           "whose pickles are read without being run, or a Hugging Face hub id org/name\n"
           "already in the local hub cache) straight into every rank's flat buffer: each rank\n"
           "reads only the bytes of its own partition, sorted by file offset, merged and split\n"
           "over its threads, straight into its slice of the buffer (through a ring of pinned\n"
           "chunks on a GPU), converting dtypes as torch does; one all-gather completes the\n"
           "buffer. The group is every floating-point tensor of the checkpoint, in the order\n"
           "`--model CHECKPOINT` uses elsewhere. Reports the bytes each rank read, GB/s against\n"
           "a sequential read of the same files measured in the same run, whether the bytes\n"
           "came from the page cache, and the device peak predicted and measured.\n"
           "With --stage 3 each rank keeps only its own ZeRO-3 partition of every parameter\n"
           "(p = ceil(n / dp) elements, the last ranks' padding zero), back to back as\n"
           "DeepSpeed's Stage 3 optimizer holds them: it reads only those bytes, with no\n"
           "all-gather (read plan load-partitions), and --verify checks every partition\n"
           "against its tensors read whole.\n\n"
           "With --from deepspeed, DIR is a DeepSpeed ZeRO checkpoint folder (the one holding\n"
           "'latest', or a tag folder) and the load is a resume at a new world of --dp ranks\n"
           "(any N, the saved world or another): each rank reads only its share of the saved\n"
           "fp32 master weights and of every optimizer state saved per element (--states),\n"
           "from whichever saved rank's file holds each element, and keeps one fp32 buffer per\n"
           "state and group: under ZeRO-1/2 its slice of each group's flat buffer as DeepSpeed\n"
           "lays it out at N ranks (read plan load-slice), under ZeRO-3 its partition of every\n"
           "parameter (load-partitions). Nothing of the files is executed (their pickles are\n"
           "read by zeroflat's own reader). Each rank reports the bytes it read against its\n"
           "exact share (the data bytes of its partitions), the device peaks predicted and\n"
           "measured (counting the buffers it already keeps) and what it keeps; --verify\n"
           "checks every buffer against the saved tensors read whole. --stage defaults to\n"
           "the saved run's and must be of its kind (1 or 2 for a ZeRO-1/2 checkpoint, 3 for\n"
           "ZeRO-3; a universal checkpoint takes either); --deepspeed V names the new run's\n"
           "release (default: the saving one's); on a sim device with --no-data the resume is\n"
           "rehearsed from the checkpoint's headers alone.");
  add_load_options(p);
  p.allow_positionals(1);
  p.epilog(
      "examples:\n"
      "  zeroflat write-checkpoint /tmp/ck --model tiny-moe --shard-size 4MB\n"
      "  zeroflat load /tmp/ck --dp 3 --verify\n"
      "  zeroflat load /tmp/ck --dp 2 --dtype fp16 --round-robin --cold --json\n"
      "  mpirun -n 3 zeroflat load /tmp/ck --comm mpi --verify\n"
      "  zeroflat load --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data --dp "
      "8\n"
      "  zeroflat load /tmp/ck --dp 3 --stage 3 --verify\n"
      "  zeroflat load --stage 3 --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb "
      "--no-data --dp 8\n"
      "  zeroflat inspect /ckpt/run1 --dp 3    # what each new rank reads, without reading it\n"
      "  zeroflat load /ckpt/run1 --from deepspeed --dp 3 --verify\n"
      "  zeroflat load /ckpt/run1 --from deepspeed --dp 8 --tag global_step1000 --states none "
      "--json\n"
      "  zeroflat load /ckpt/run1 --from deepspeed --dp 64 --device sim:h100-80gb --no-data\n"
      "  mpirun -n 4 zeroflat load /ckpt/run1 --from deepspeed --comm mpi --verify\n\n"
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
  std::unique_ptr<Communicator> world =
      start_world("load", cfg.setup.comm, cfg.timeout, cfg.start_timeout);
  settle_load_ranks(cfg, args, world.get());
  const int me = world ? world->rank() : 0;
  auto finish = [&](int code) { return finish_job(world.get(), code); };
  const std::string why = load_memory_shortfall(cfg);
  const int short_rank = agree_on_failure(world.get(), !why.empty());
  if (short_rank >= 0) {
    if (!why.empty()) {
      std::fprintf(stderr, "zeroflat load: rank %d: %s\n", me, terminal_text(why).c_str());
    }
    if (me == 0 && cfg.json) {
      // The keys every stopped command's document has.
      const std::string message =
          short_rank == 0 ? why
                          : "rank " + std::to_string(short_rank) +
                                " cannot load here: its host lacks the memory (its own message "
                                "says how much)";
      const Json doc{{"command", "load"},
                     {"exit", kExitInfeasible},
                     {"error_kind", "no feasible plan"},
                     {"error", message}};
      std::printf("%s\n", doc.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
    }
    return finish(kExitInfeasible);
  }
  Progress progress(!cfg.quiet && me == 0);
  if (me == 0 && cfg.deepspeed) {
    progress.note(deepspeed_note(cfg));
  } else if (me == 0) {
    progress.note(printable(cfg.source) + ": " + format_count(cfg.params.size()) + " tensors in " +
                  std::to_string(cfg.ck.files.size()) + " file(s), " +
                  format_bytes(cfg.checkpoint_bytes) + "; dp " +
                  std::to_string(cfg.library.layout.dp) + " over " + cfg.setup.comm + " on " +
                  cfg.setup.device_spec + ", " + std::to_string(cfg.threads) +
                  " reader thread(s) per rank" + (cfg.library.read.cold ? ", cold" : ""));
  }
  std::vector<LoadOutcome> outcomes(world ? 1 : cfg.library.layout.dp);
  run_ranks(cfg.library.layout.dp, world.get(), cfg.timeout, [&](std::uint64_t r, Communicator* c) {
    Progress silent(false);
    Progress& mine = r == 0 ? progress : silent;
    outcomes[world ? 0 : r] =
        cfg.deepspeed ? load_deepspeed_rank(cfg, r, c, mine) : load_rank(cfg, r, c, mine);
  });
  const LoadOutcome& mine = outcomes.front();
  if (mine.exit == kExitInfeasible) {
    if (me == 0) {
      if (cfg.json) {
        // The keys every stopped command's document has, the plan beside them.
        Json doc{{"command", "load"},
                 {"exit", kExitInfeasible},
                 {"error_kind", "no feasible plan"},
                 {"error", mine.message},
                 {"plan", mine.plan}};
        std::printf("%s\n", doc.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
      } else {
        std::fprintf(stderr, "zeroflat load: %s\n", terminal_text(mine.message).c_str());
      }
    }
    return finish(kExitInfeasible);
  }
  std::vector<Json> entries;
  if (world) {
    entries = exchange_entries(world.get(), mine.entry);
  } else {
    for (const LoadOutcome& o : outcomes) entries.push_back(o.entry);
  }
  std::string first_error;
  const int exit = load_exit_code(entries, first_error);
  if (me == 0 && cfg.deepspeed) {
    print_deepspeed_report(cfg, entries, mine, exit, first_error);
  } else if (me == 0) {
    print_load_report(cfg, entries, mine, exit, first_error);
  }
  return finish(exit);
}

}  // namespace zeroflat::cli
