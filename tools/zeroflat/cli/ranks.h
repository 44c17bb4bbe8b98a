// The ranks of a `run` or a `load` (shared by both): where their buffers live and how they talk,
// how many there are and how many share this host, starting them (threads of this process, or
// the MPI job's processes), bringing their entries together, and what this host can hold.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/args.h"
#include "zeroflat/comm.h"
#include "zeroflat/layout.h"

namespace zeroflat::cli {

using Json = nlohmann::ordered_json;

enum class DeviceKind { kCpu, kSim, kCuda };

// Where the ranks' buffers live and how the ranks talk: --device, --no-data, --host, --comm.
struct DeviceSetup {
  std::string device_spec = "cpu";
  DeviceKind kind = DeviceKind::kCpu;
  bool no_data = false;
  std::optional<std::uint64_t> node_host_bytes;  // --host: the simulated node's host memory
  std::string comm = "local";
};
// what: what lives on the device ("the parameters live"); no_data_effect: what
// --no-data leaves out ("nothing is copied").
void add_device_setup_options(Parser& parser, const std::string& what,
                              const std::string& no_data_effect);
// Checked (InvalidArgument names the bad value; the device is made once, so a GPU that is not
// there is an error before any work). dp: the ranks as given, for the comm checks.
DeviceSetup device_setup_from_args(const Args& args, std::uint64_t dp);
// The --threads value: 0 when not given (settled from the ranks on this host later).
unsigned threads_from_args(const Args& args);
// --timeout SECONDS (1 to 86400; default 60): how long a rank waits for the others in a
// collective.
std::chrono::milliseconds timeout_from_args(const Args& args);
inline constexpr std::int64_t kDefaultStartTimeoutSeconds = 120;
// --start-timeout SECONDS (1 to 86400; default the larger of 120 s and `timeout`): how long the
// MPI job may take to start (start_world). Its own limit, not --timeout: a job's start (the
// launcher's daemons, a loaded machine) takes seconds where a collective takes milliseconds.
std::chrono::milliseconds start_timeout_from_args(const Args& args,
                                                  std::chrono::milliseconds timeout);

// The most ranks one run or load takes.
inline constexpr std::uint64_t kMaxRanks = 256;

// The MPI job this process is a rank of, for --comm mpi and nccl (null for local), its
// collectives bounded by `timeout`. MPI's own start-up waits for every rank of the job without a
// time limit, and a rank that exited before joining (an argument only it refused) would leave the
// others there for good: if the start-up outlasts `start_timeout`, this process says so on stderr
// (naming --start-timeout) and exits 1. `command` names it there.
std::unique_ptr<Communicator> start_world(const std::string& command, const std::string& comm,
                                          std::chrono::milliseconds timeout,
                                          std::chrono::milliseconds start_timeout);
// dp: mpirun's world size (refused when --dp says otherwise), or --dp for ranks as threads; and
// this host's ranks. InvalidArgument beyond kMaxRanks.
void settle_world(LayoutOptions& options, unsigned& local_ranks, const Args& args,
                  Communicator* world);
// mpirun ends the whole job when one rank exits non-zero: every rank waits here (a barrier; a
// broken job skips it) until rank 0 has printed its report. Returns code.
int finish_job(Communicator* world, int code);

// body(rank, comm) for every rank: dp threads of this process joined by a local group (comm null
// for one rank), or once, for this MPI process's rank of world. Rethrows the first failure that
// is not another rank's abort (ResourceExhausted when a rank's thread cannot start).
void run_ranks(std::uint64_t dp, Communicator* world, std::chrono::milliseconds timeout,
               const std::function<void(std::uint64_t, Communicator*)>& body);
// Every rank's entry, in rank order, on every rank (one collective; {entry} alone without one).
std::vector<Json> exchange_entries(Communicator* control, const Json& entry);

// This host's memory against `per_rank` bytes for each of the job's ranks that run here (every
// rank with --comm local, else the launcher's local count): nothing when they fit, when nothing
// is needed or when the host cannot be probed; else what the caller's message says.
struct HostShortfall {
  std::uint64_t ranks_here = 0;
  std::uint64_t need = 0;        // per_rank x ranks_here, saturating
  std::uint64_t usable = 0;      // free less the default margin
  std::uint64_t free_bytes = 0;  // as the probe read it, from `source`
  std::uint64_t margin = 0;
  std::string source;
};
std::optional<HostShortfall> host_shortfall(std::uint64_t per_rank, const std::string& comm,
                                            std::uint64_t dp, unsigned local_ranks);

// Bytes per second in GB/s (0 for no time).
double gbps(std::uint64_t bytes, double seconds);
// Saturating arithmetic for byte counts that may come from huge rehearsals.
std::uint64_t sat_add(std::uint64_t a, std::uint64_t b);
std::uint64_t sat_mul(std::uint64_t a, std::uint64_t b);

}  // namespace zeroflat::cli
