// The one place that reads ZEROFLAT_* and launcher variables; core and thread counts.
#include "zeroflat/common.h"

#include <sched.h>

#include <cmath>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <iterator>
#include <string_view>
#include <thread>
#include <utility>

#include "common/cgroup_cpu.h"
#include "zeroflat/common.h"

namespace zeroflat {

std::optional<RuntimeEnv::HostMemory> parse_host_memory(const std::string& name) {
  if (name == "huge") return RuntimeEnv::HostMemory::kHuge;
  if (name == "plain") return RuntimeEnv::HostMemory::kPlain;
  if (name == "torch") return RuntimeEnv::HostMemory::kTorch;
  return std::nullopt;
}

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
  if (const auto m = parse_host_memory(v)) return m;
  throw InvalidArgument("ZEROFLAT_HOST_MEMORY='" + std::string(v) +
                        "': expected huge, plain or torch (unset it for the default)");
}

RuntimeEnv::ReadAhead read_ahead_env() {
  const char* v = std::getenv("ZEROFLAT_READ_AHEAD");
  if (v == nullptr || *v == '\0') return RuntimeEnv::ReadAhead::kExact;
  const std::string s = v;
  if (s == "exact") return RuntimeEnv::ReadAhead::kExact;
  if (s == "kernel") return RuntimeEnv::ReadAhead::kKernel;
  throw InvalidArgument("ZEROFLAT_READ_AHEAD='" + s +
                        "': expected exact or kernel (unset it for the default, exact)");
}

RuntimeEnv::SaveIo save_io_env() {
  const char* v = std::getenv("ZEROFLAT_SAVE_IO");
  if (v == nullptr || *v == '\0') return RuntimeEnv::SaveIo::kDirect;
  const std::string s = v;
  if (s == "direct") return RuntimeEnv::SaveIo::kDirect;
  if (s == "buffered") return RuntimeEnv::SaveIo::kBuffered;
  throw InvalidArgument("ZEROFLAT_SAVE_IO='" + s +
                        "': expected direct or buffered (unset it for the default, direct)");
}

RuntimeEnv read_env() {
  RuntimeEnv env;
  env.host_memory = host_memory_env();
  env.read_ahead = read_ahead_env();
  env.save_io = save_io_env();
  env.num_threads = positive_env("ZEROFLAT_NUM_THREADS");
  env.gather_parts = positive_env("ZEROFLAT_GATHER_PARTS");
  if (const char* v = std::getenv("ZEROFLAT_TEST_SAVE_FAULT")) env.save_fault = v;
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

namespace detail {

unsigned cgroup_cpu_quota(std::string_view proc_self_cgroup, const std::string& root) noexcept {
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    std::string a, b;
    in >> a >> b;
    return std::pair<std::string, std::string>(a, b);
  };
  // This process's cgroup, per hierarchy: v1 lines name their controllers ("4:cpu,cpuacct:/x"),
  // the v2 line has none ("0::/x").
  std::string v1_path, v2_path;
  bool v1 = false, v2 = false;
  std::size_t at = 0;
  while (at < proc_self_cgroup.size()) {
    std::size_t end = proc_self_cgroup.find('\n', at);
    if (end == std::string_view::npos) end = proc_self_cgroup.size();
    const std::string_view line = proc_self_cgroup.substr(at, end - at);
    at = end + 1;
    const std::size_t c1 = line.find(':');
    const std::size_t c2 = c1 == std::string_view::npos ? c1 : line.find(':', c1 + 1);
    if (c2 == std::string_view::npos) continue;
    const std::string_view controllers = line.substr(c1 + 1, c2 - c1 - 1);
    const std::string path(line.substr(c2 + 1));
    if (controllers.empty()) {
      v2 = true;
      v2_path = path;
      continue;
    }
    for (std::size_t p = 0; p <= controllers.size();) {
      std::size_t q = controllers.find(',', p);
      if (q == std::string_view::npos) q = controllers.size();
      if (controllers.substr(p, q - p) == "cpu") {
        v1 = true;
        v1_path = path;
      }
      p = q + 1;
    }
  }
  // The tightest quota on the way from this process's cgroup up to the root: a parent's limit
  // holds for its children.
  double best = 0;
  auto consider = [&](double cores) {
    if (cores > 0 && (best == 0 || cores < best)) best = cores;
  };
  auto each_level = [](std::string path, const auto& fn) {
    for (;;) {
      fn(path);
      if (path.empty() || path == "/") return;
      const std::size_t slash = path.find_last_of('/');
      path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
    }
  };
  try {
    if (v1) {
      for (const char* dir : {"/cpu", "/cpu,cpuacct", "/cpuacct,cpu"}) {
        each_level(v1_path, [&](const std::string& level) {
          const std::string base = root + dir + (level == "/" ? "" : level);
          auto [q, unused1] = read(base + "/cpu.cfs_quota_us");
          auto [p, unused2] = read(base + "/cpu.cfs_period_us");
          if (!q.empty() && !p.empty() && std::stod(q) > 0 && std::stod(p) > 0) {
            consider(std::stod(q) / std::stod(p));
          }
        });
      }
    }
    if (v2 || !v1) {
      each_level(v2 ? v2_path : std::string("/"), [&](const std::string& level) {
        auto [quota, period] = read(root + (level == "/" ? "" : level) + "/cpu.max");
        if (!quota.empty() && quota != "max" && !period.empty() && std::stod(period) > 0) {
          consider(std::stod(quota) / std::stod(period));
        }
      });
    }
  } catch (...) {
  }
  return best > 0 ? static_cast<unsigned>(std::ceil(best)) : 0;
}

}  // namespace detail

namespace {

// The CPU quota of this process's cgroup and its parents, in whole cores rounded up; 0 when
// there is none.
unsigned cgroup_cpu_quota() noexcept {
  std::ifstream in("/proc/self/cgroup");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return detail::cgroup_cpu_quota(text, "/sys/fs/cgroup");
}

}  // namespace

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
