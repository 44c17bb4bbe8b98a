// `zeroflat run`: the ranks as threads of this process (local) or as the MPI job's processes
// (run_ranks, cli/ranks.h), and every rank's entry brought to rank 0.
#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat::cli {

Launched launch_ranks(const RunConfig& cfg, Communicator* world, Progress& progress) {
  Launched out;
  if (world != nullptr) {
    out.me = world->rank();
    out.first = run_rank(cfg, static_cast<std::uint64_t>(out.me), world, progress);
    if (out.first.exit == kExitInfeasible) return out;  // every rank planned the same verdict
    try {
      out.entries = exchange_entries(world, out.first.entry);
    } catch (const CommError&) {
      // A peer is gone: this process says what it holds itself.
      out.entries = {out.first.entry};
      out.alone = true;
    }
    return out;
  }
  const std::uint64_t dp = cfg.library.layout.dp;
  std::vector<RankResult> results(dp);
  run_ranks(dp, nullptr, cfg.timeout, [&](std::uint64_t r, Communicator* c) {
    Progress silent(false);  // one per rank: a Progress is not shared between threads
    results[r] = run_rank(cfg, r, c, r == 0 ? progress : silent);
  });
  out.first = std::move(results[0]);
  if (out.first.exit == kExitInfeasible) return out;
  out.entries.push_back(out.first.entry);
  for (std::uint64_t r = 1; r < dp; ++r) out.entries.push_back(results[r].entry);
  return out;
}

}  // namespace zeroflat::cli
