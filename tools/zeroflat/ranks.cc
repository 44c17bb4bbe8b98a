// The ranks of a `run` or a `load` (cli/ranks.h): device setup options, the MPI job's start-up
// under a deadline, ranks as threads, every rank's entry brought together, and this host's room.
#include "cli/ranks.h"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

#include "cli/common.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/plan.h"
#include "zeroflat/probe.h"

namespace zeroflat::cli {

void add_device_setup_options(Parser& p, const std::string& what,
                              const std::string& no_data_effect) {
  p.option("device", "DEV",
           "where " + what +
               ": cpu, cuda:N, or sim:SIZE / sim:PRESET (a device of that "
               "capacity with exact accounting, backed by host memory)",
           "cpu");
  p.flag("no-data",
         "sim devices: keep no data at all (memory is accounted, " + no_data_effect + ")");
  p.option("host", "SIZE",
           "sim devices: the host memory of the simulated node, shared by its ranks (staging is "
           "planned against it, not against this machine)",
           "the preset's node; 2 TiB for sim:SIZE");
  p.option("comm", "NAME",
           "how the ranks talk: local (ranks as threads of this process), mpi (rank and size "
           "from mpirun), nccl (cuda devices; bootstrapped over mpi)",
           "local");
}

DeviceSetup device_setup_from_args(const Args& args, std::uint64_t dp) {
  DeviceSetup pl;
  pl.device_spec = args.get("device").value_or("cpu");
  pl.no_data = args.has("no-data");
  pl.comm = args.get("comm").value_or("local");
  const bool sim = pl.device_spec.rfind("sim:", 0) == 0;
  // The spec is checked by making the device once (an unknown name, a bad size, a GPU that is
  // not there): before any work.
  (void)make_device(pl.device_spec, DeviceOptions{1, pl.no_data && sim, std::nullopt});
  if (sim) {
    pl.kind = DeviceKind::kSim;
  } else if (pl.device_spec == "cpu") {
    pl.kind = DeviceKind::kCpu;
  } else if (pl.device_spec.rfind("cuda", 0) == 0) {
    pl.kind = DeviceKind::kCuda;
  } else {
    throw InvalidArgument("--device '" + printable(pl.device_spec) +
                          "': expected cpu, sim:SIZE or cuda:N");
  }
  if (auto v = args.get("host")) {
    if (pl.kind != DeviceKind::kSim) {
      throw InvalidArgument("--host is the host memory of a simulated node (--device sim:...); " +
                            pl.device_spec + " uses this machine's");
    }
    pl.node_host_bytes = parse_size(*v, "--host");
  }
  if (pl.no_data && pl.kind != DeviceKind::kSim) {
    throw InvalidArgument("--no-data is for sim devices (--device sim:SIZE); " + pl.device_spec +
                          " keeps its data");
  }
  if (pl.comm != "local" && pl.comm != "mpi" && pl.comm != "nccl") {
    throw InvalidArgument("--comm '" + printable(pl.comm) + "': expected local, mpi or nccl");
  }
  if (pl.comm == "nccl" && pl.kind != DeviceKind::kCuda) {
    throw InvalidArgument(
        "--comm nccl moves device memory of cuda devices; use --comm local or "
        "mpi with " +
        pl.device_spec);
  }
  if (pl.comm == "local" && pl.kind == DeviceKind::kCuda && dp > 1) {
    throw InvalidArgument(
        "--comm local copies host memory; with cuda devices and --dp > 1 use "
        "--comm nccl under mpirun");
  }
  return pl;
}

unsigned threads_from_args(const Args& args) {
  auto v = args.get("threads");
  if (!v) return 0;
  const std::uint64_t n = parse_u64(*v, "--threads");
  if (n == 0 || n > kMaxThreads) {
    throw InvalidArgument("--threads " + printable(*v) + ": expected 1 to " +
                          std::to_string(kMaxThreads));
  }
  return static_cast<unsigned>(n);
}

std::chrono::milliseconds timeout_from_args(const Args& args) {
  auto v = args.get("timeout");
  if (!v) return std::chrono::milliseconds(60000);
  const std::uint64_t s = parse_u64(*v, "--timeout");
  if (s == 0 || s > 86400) {
    throw InvalidArgument("--timeout " + printable(*v) + ": expected 1 to 86400");
  }
  return std::chrono::milliseconds(s * 1000);
}

std::chrono::milliseconds start_timeout_from_args(const Args& args,
                                                  std::chrono::milliseconds timeout) {
  auto v = args.get("start-timeout");
  // The larger of the two: a --timeout raised for slow collectives never shortens the start.
  if (!v) return std::max(std::chrono::milliseconds(kDefaultStartTimeoutSeconds * 1000), timeout);
  const std::uint64_t s = parse_u64(*v, "--start-timeout");
  if (s == 0 || s > 86400) {
    throw InvalidArgument("--start-timeout " + printable(*v) + ": expected 1 to 86400");
  }
  return std::chrono::milliseconds(s * 1000);
}

std::unique_ptr<Communicator> start_world(const std::string& command, const std::string& comm,
                                          std::chrono::milliseconds timeout,
                                          std::chrono::milliseconds start_timeout) {
  if (comm == "local") return nullptr;
  // The library never exits the process, and MPI offers no way to interrupt its start-up: the
  // watchdog is the command's. It only waits, so it does not count as a thread calling MPI.
  std::mutex m;
  std::condition_variable cv;
  bool started = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(m);
    if (cv.wait_for(lock, start_timeout, [&] { return started; })) return;
    std::fprintf(stderr,
                 "zeroflat %s: error: the MPI job did not start within --start-timeout %lld s: a "
                 "rank has not joined it (a rank that exited early says why in its own message), "
                 "the ranks cannot reach each other, or the start needs longer (raise "
                 "--start-timeout)\n",
                 command.c_str(), static_cast<long long>(start_timeout.count() / 1000));
    std::fflush(nullptr);
    std::_Exit(kExitOther);
  });
  auto stop = [&] {
    {
      std::lock_guard<std::mutex> lock(m);
      started = true;
    }
    cv.notify_all();
    watchdog.join();
  };
  std::unique_ptr<Communicator> world;
  try {
    world = make_mpi_communicator(timeout);
  } catch (...) {
    stop();
    throw;
  }
  stop();
  return world;
}

void settle_world(LayoutOptions& options, unsigned& local_ranks, const Args& args,
                  Communicator* world) {
  if (world != nullptr) {
    const auto size = static_cast<std::uint64_t>(world->size());
    if (args.get("dp") && options.dp != size) {
      throw InvalidArgument("--dp " + std::to_string(options.dp) + " but mpirun started " +
                            std::to_string(size) + " ranks; leave --dp out or make them equal");
    }
    options.dp = size;
    local_ranks = runtime_env().local_ranks.value_or(static_cast<unsigned>(size));
  } else {
    local_ranks = static_cast<unsigned>(options.dp);
  }
  if (options.dp > kMaxRanks) {
    throw InvalidArgument("--dp " + std::to_string(options.dp) + ": at most " +
                          std::to_string(kMaxRanks) + " ranks");
  }
}

int finish_job(Communicator* world, int code) {
  if (world != nullptr) {
    std::fflush(stdout);
    try {
      world->barrier();
    } catch (const CommError&) {  // rank 0's report stands on its own
    }
  }
  return code;
}

void run_ranks(std::uint64_t dp, Communicator* world, std::chrono::milliseconds timeout,
               const std::function<void(std::uint64_t, Communicator*)>& body) {
  if (world != nullptr) {
    body(static_cast<std::uint64_t>(world->rank()), world);
    return;
  }
  std::vector<std::exception_ptr> errors(dp);
  // Every rank's communicator made here, before any thread starts: a rank's failure (a
  // std::bad_alloc under an address-space limit too) then tells the others without allocating
  // anything more, and nothing thrown ever leaves a thread.
  std::unique_ptr<LocalGroup> group;
  std::vector<std::unique_ptr<Communicator>> comms(dp);
  if (dp > 1) {
    group = std::make_unique<LocalGroup>(static_cast<int>(dp), timeout);
    for (std::uint64_t r = 0; r < dp; ++r) comms[r] = group->rank(static_cast<int>(r));
  }
  auto fail = [&](std::uint64_t r, const char* what) noexcept {
    if (!comms[r]) return;
    try {
      comms[r]->abort("rank " + std::to_string(r) + what);
    } catch (...) {  // no memory for the words: the abort alone
      comms[r]->abort(std::string());
    }
  };
  auto one = [&](std::uint64_t r) noexcept {
    try {
      body(r, comms[r].get());
    } catch (...) {
      errors[r] = std::current_exception();
      fail(r, " failed");
    }
  };
  std::vector<std::thread> ranks;
  ranks.reserve(dp);
  for (std::uint64_t r = 1; r < dp; ++r) {
    try {
      ranks.emplace_back(one, r);
    } catch (const std::exception& e) {
      // std::system_error, or std::bad_alloc for the thread's own state under an address-space
      // limit. The ranks already started wait for this one in a collective: tell them, and
      // join them.
      fail(r, " could not be started");
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

std::vector<Json> exchange_entries(Communicator* control, const Json& entry) {
  const std::string mine = entry.dump(-1, ' ', false, Json::error_handler_t::replace);
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

std::uint64_t sat_add(std::uint64_t a, std::uint64_t b) {
  return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b) {
  return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

std::optional<HostShortfall> host_shortfall(std::uint64_t per_rank, const std::string& comm,
                                            std::uint64_t dp, unsigned local_ranks) {
  HostShortfall s;
  s.ranks_here = comm == "local" ? dp : local_ranks;
  s.need = sat_mul(per_rank, s.ranks_here);
  if (s.need == 0) return std::nullopt;
  const ProbeResult machine = probe_host(system_host_sources(1));
  s.margin = default_margin(machine.total_bytes);
  s.usable = machine.free_bytes > s.margin ? machine.free_bytes - s.margin : 0;
  if (!machine.available || s.need <= s.usable) return std::nullopt;
  s.free_bytes = machine.free_bytes;
  s.source = machine.used;
  return s;
}

}  // namespace zeroflat::cli
