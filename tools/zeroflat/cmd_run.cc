// `zeroflat run`: the main job. Checks its options, makes sure the run fits in this host's
// memory, runs the ranks (each through the library's front door), and reports. The parts live
// in run_options.cc, run_rank.cc, run_launch.cc and run_report.cc.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/agree.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"

namespace zeroflat::cli {

int subcommand_run(const std::vector<std::string>& argv) {
  Parser p("run", "[--model NAME] [--device DEV] [--comm local|mpi|nccl] [--dp P] [options]",
           "The main job, rehearsed on this machine: materializes the model's tensors on every\n"
           "rank's device (filled with a deterministic pattern), then each rank goes through\n"
           "the library's front door: it probes its device, the ranks agree (options, shapes,\n"
           "free memory) in one collective, plan, run the chosen tier's steps (allocate, gather,\n"
           "release the originals, all-gather, re-point) and build the fp32 master partition.\n"
           "Then it optionally verifies every byte, and reports the predicted and measured peak\n"
           "memory of every rank and the bandwidth next to a memcpy of the same bytes, measured\n"
           "in the same run.");
  add_run_options(p);
  p.epilog(
      "examples:\n"
      "  zeroflat run --model tiny-moe --dp 3 --verify            3 ranks as threads\n"
      "  zeroflat run --model tiny-moe --dp 3 --tier staged --verify\n"
      "  mpirun -n 3 zeroflat run --model tiny-moe --comm mpi --verify\n"
      "  zeroflat run --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data --dp 8\n"
      "  zeroflat run --model qwen3-30b-a3b --layers 48 --device sim:61GiB --no-data --dp 8\n"
      "  zeroflat run --model tiny-moe --dp 2 --tier sharded --inject-fault 4@1\n\n"
      "Exit codes: 0 done; 1 the buffer does not hold the parameters' values (verification\n"
      "failed); 2 bad arguments, or ranks that disagree; 3 no feasible plan (nothing moved);\n"
      "4 a step failed (after rollback; see originals_intact). Bandwidths are bytes of the\n"
      "flat buffer per second (GB = 1e9 bytes): the copy figure writes into a buffer already\n"
      "faulted in, against memcpy into such a buffer; the tier figure includes allocation and\n"
      "first touch, against memcpy into fresh memory.");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  RunConfig cfg = run_config_from_args(args);

  // The ranks: threads of this process, or the MPI job's processes.
  std::unique_ptr<Communicator> world =
      start_world("run", cfg.setup.comm, cfg.timeout, cfg.start_timeout);
  settle_ranks(cfg, args, world.get());
  const int me = world ? world->rank() : 0;

  // mpirun ends the whole job when one rank exits non-zero: the others wait here until rank 0
  // has printed its report.
  auto finish = [&](int code) { return finish_job(world.get(), code); };

  // --- a plan that fits, and room in this host's memory: nothing is allocated before -------------
  Json predicted;
  const std::string why = host_memory_shortfall(cfg, predicted);
  const int short_rank = agree_on_failure(world.get(), !why.empty());
  if (short_rank >= 0) {
    if (me == 0) {
      print_infeasible(cfg, predicted,
                       short_rank == 0 ? why
                                       : "rank " + std::to_string(short_rank) +
                                             " cannot run here: its host lacks the memory (its "
                                             "own message says how much)");
    } else if (!why.empty()) {
      std::fprintf(stderr, "zeroflat run: rank %d: %s\n", me, why.c_str());
    }
    return finish(kExitInfeasible);
  }

  Progress progress(!cfg.quiet && me == 0);
  if (me == 0) {
    progress.note(
        printable(cfg.model.name) + ": " + format_count(cfg.model.tensors.size()) + " tensors, " +
        format_bytes(cfg.model.numel() * element_size(cfg.library.layout.dtype)) + "; dp " +
        std::to_string(cfg.library.layout.dp) + " over " + cfg.setup.comm + " on " +
        cfg.setup.device_spec + ", threads per rank " + std::to_string(cfg.threads));
  }
  const Launched run = launch_ranks(cfg, world.get(), progress);
  if (run.first.exit == kExitInfeasible) {
    if (me == 0) print_infeasible(cfg, run.first.plan, run.first.message);
    return finish(kExitInfeasible);
  }
  std::string first_error;
  int exit = run_exit_code(run.entries, first_error);
  if (run.alone) {
    // The others could not be reached after the steps: every survivor reports for itself.
    if (exit == kExitOk) {
      exit = kExitExecFailed;
      first_error = "rank " + std::to_string(me) +
                    " finished its steps, but the other ranks could not be reached to compare";
    }
    print_run_report(cfg, run, exit, first_error);
    return exit;
  }
  if (me == 0) print_run_report(cfg, run, exit, first_error);
  return finish(exit);
}

}  // namespace zeroflat::cli
