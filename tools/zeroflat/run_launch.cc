// `zeroflat run`: the ranks as threads of this process (local) or as the MPI job's processes,
// and every rank's entry brought to rank 0.
#include <array>
#include <cstring>
#include <exception>
#include <system_error>
#include <thread>

#include "cli/common.h"
#include "cli/run.h"
#include "zeroflat/device.h"
#include "zeroflat/error.h"

namespace zeroflat::cli {

std::vector<Json> exchange_entries(Communicator* control, const Json& entry) {
  const std::string mine = entry.dump();
  if (control == nullptr || control->size() == 1) return {entry};
  std::unique_ptr<Device> host = make_device("cpu", DeviceOptions{1});
  std::array<std::uint64_t, 1> len{mine.size()};
  control->all_reduce_max(len);
  const auto n = static_cast<std::uint64_t>(control->size());
  std::vector<char> buf(len[0] * n, ' ');
  std::memcpy(buf.data() + static_cast<std::uint64_t>(control->rank()) * len[0], mine.data(),
              mine.size());
  control->all_gather_inplace(buf.data(), len[0], *host);
  std::vector<Json> out;
  for (std::uint64_t r = 0; r < n; ++r) {
    out.push_back(Json::parse(buf.begin() + static_cast<std::ptrdiff_t>(r * len[0]),
                              buf.begin() + static_cast<std::ptrdiff_t>((r + 1) * len[0])));
  }
  return out;
}

void run_ranks(std::uint64_t dp, Communicator* world, std::chrono::milliseconds timeout,
               const std::function<void(std::uint64_t, Communicator*)>& body) {
  if (world != nullptr) {
    body(static_cast<std::uint64_t>(world->rank()), world);
    return;
  }
  std::vector<std::exception_ptr> errors(dp);
  std::unique_ptr<LocalGroup> group;
  if (dp > 1) group = std::make_unique<LocalGroup>(static_cast<int>(dp), timeout);
  auto one = [&](std::uint64_t r) {
    try {
      std::unique_ptr<Communicator> c = group ? group->rank(static_cast<int>(r)) : nullptr;
      body(r, c.get());
    } catch (...) {
      errors[r] = std::current_exception();
      if (group) group->rank(static_cast<int>(r))->abort("rank " + std::to_string(r) + " failed");
    }
  };
  std::vector<std::thread> ranks;
  ranks.reserve(dp);
  for (std::uint64_t r = 1; r < dp; ++r) {
    try {
      ranks.emplace_back(one, r);
    } catch (const std::system_error& e) {
      // The ranks already started wait for this one in a collective: tell them, and join them.
      group->rank(0)->abort("rank " + std::to_string(r) + " could not be started");
      for (std::thread& t : ranks) t.join();
      throw ResourceExhausted("cannot start the thread of rank " + std::to_string(r) + ": " +
                              e.what() +
                              " (a limit on processes or memory? fewer ranks or "
                              "--threads)");
    }
  }
  one(0);
  for (std::thread& t : ranks) t.join();
  // The first failure that is not another rank's abort is the one worth reporting.
  std::exception_ptr first;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const CommError&) {
      if (!first) first = e;
    } catch (...) {
      first = e;
      break;
    }
  }
  if (first) std::rethrow_exception(first);
}

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
  const std::uint64_t dp = cfg.options.dp;
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
