// The one place that reads ZEROFLAT_* and launcher variables; core and thread counts.
#include "zeroflat/runtime.h"

#include <sched.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <fstream>
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
  if (n == 0 || n > kMaxThreads) {
    throw InvalidArgument(std::string(name) + "='" + value + "': expected an integer from 1 to " +
                          std::to_string(kMaxThreads) + " (unset it for the default)");
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

std::optional<RuntimeEnv::HostMemory> host_memory_env() {
  const char* v = std::getenv("ZEROFLAT_HOST_MEMORY");
  if (v == nullptr || *v == '\0') return std::nullopt;
  const std::string s = v;
  if (s == "huge") return RuntimeEnv::HostMemory::kHuge;
  if (s == "plain") return RuntimeEnv::HostMemory::kPlain;
  if (s == "torch") return RuntimeEnv::HostMemory::kTorch;
  throw InvalidArgument("ZEROFLAT_HOST_MEMORY='" + s +
                        "': expected huge, plain or torch (unset it for the default)");
}

RuntimeEnv read_env() {
  RuntimeEnv env;
  env.host_memory = host_memory_env();
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

VisibleDevices visible_devices() {
  for (const char* var : {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') return {v, var};
  }
  return {};
}

std::string hf_hub_cache() {
  auto var = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v != nullptr ? v : "";
  };
  for (const char* name : {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"}) {
    if (std::string v = var(name); !v.empty()) return v;
  }
  if (std::string v = var("HF_HOME"); !v.empty()) return v + "/hub";
  if (std::string v = var("XDG_CACHE_HOME"); !v.empty()) return v + "/huggingface/hub";
  if (std::string v = var("HOME"); !v.empty()) return v + "/.cache/huggingface/hub";
  return "";
}

// The CPU quota of this process's cgroup (v2 cpu.max "quota period", v1 cfs files), in whole
// cores rounded up; 0 when there is none.
unsigned cgroup_cpu_quota() noexcept {
  auto read = [](const char* path) {
    std::ifstream in(path);
    std::string a, b;
    in >> a >> b;
    return std::pair<std::string, std::string>(a, b);
  };
  try {
    auto [quota, period] = read("/sys/fs/cgroup/cpu.max");
    if (!quota.empty() && quota != "max" && !period.empty()) {
      const double cores = std::stod(quota) / std::stod(period);
      return cores > 0 ? static_cast<unsigned>(std::ceil(cores)) : 0;
    }
    auto [q1, unused1] = read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us");
    auto [p1, unused2] = read("/sys/fs/cgroup/cpu/cpu.cfs_period_us");
    if (!q1.empty() && !p1.empty() && std::stod(q1) > 0) {
      return static_cast<unsigned>(std::ceil(std::stod(q1) / std::stod(p1)));
    }
  } catch (...) {
  }
  return 0;
}

unsigned available_cores() noexcept {
  unsigned n = 0;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = static_cast<unsigned>(CPU_COUNT(&set));
  if (n == 0) n = std::thread::hardware_concurrency();
  if (n == 0) n = 1;
  // A container limited to 2 CPUs on a 64-core host must not run 64 threads.
  const unsigned quota = cgroup_cpu_quota();
  return quota > 0 && quota < n ? quota : n;
}

unsigned default_num_threads(unsigned local_ranks) {
  const RuntimeEnv& env = runtime_env();
  if (env.num_threads) return *env.num_threads;
  unsigned ranks = local_ranks > 0 ? local_ranks : env.local_ranks.value_or(1);
  unsigned threads = available_cores() / ranks;
  return threads > 0 ? threads : 1;
}

}  // namespace zeroflat
