// The one place that reads ZEROFLAT_* and launcher variables; core and thread counts.
#include "zeroflat/runtime.h"

#include <sched.h>

#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include "zeroflat/error.h"
#include "zeroflat/size.h"

namespace zeroflat {
namespace {

std::optional<unsigned> positive_env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  std::uint64_t n = 0;
  try {
    n = parse_u64(value, name);
  } catch (const InvalidArgument&) {
    n = 0;
  }
  if (n == 0 || n > 1u << 20) {
    throw InvalidArgument(std::string(name) + "='" + value +
                          "': expected a positive integer (unset it for the default)");
  }
  return static_cast<unsigned>(n);
}

// Launcher variables are facts, not user settings: ignore a malformed one.
std::optional<unsigned> launcher_env(const char* name) {
  try {
    return positive_env(name);
  } catch (const InvalidArgument&) {
    return std::nullopt;
  }
}

RuntimeEnv read_env() {
  RuntimeEnv env;
  env.num_threads = positive_env("ZEROFLAT_NUM_THREADS");
  env.local_ranks = positive_env("ZEROFLAT_LOCAL_RANKS");
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "LOCAL_WORLD_SIZE"}) {
    if (env.local_ranks) break;
    env.local_ranks = launcher_env(name);
  }
  return env;
}

}  // namespace

const RuntimeEnv& runtime_env() {
  // A bad variable is reported on every call, not only the first.
  static const std::exception_ptr error_or_null = [] {
    try {
      (void)read_env();
      return std::exception_ptr();
    } catch (...) {
      return std::current_exception();
    }
  }();
  if (error_or_null) std::rethrow_exception(error_or_null);
  static const RuntimeEnv env = read_env();
  return env;
}

unsigned available_cores() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<unsigned>(n);
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? n : 1;
}

unsigned default_num_threads(unsigned local_ranks) {
  const RuntimeEnv& env = runtime_env();
  if (env.num_threads) return *env.num_threads;
  unsigned ranks = local_ranks > 0 ? local_ranks : env.local_ranks.value_or(1);
  unsigned threads = available_cores() / ranks;
  return threads > 0 ? threads : 1;
}

}  // namespace zeroflat
