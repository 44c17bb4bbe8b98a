// The host's memory as this process may use it: /proc/meminfo (else sysinfo) and the cgroup
// limits (v2 walk to the mount root, v1 hierarchical limit).
#include <sys/sysinfo.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "zeroflat/common.h"
#include "zeroflat/probe.h"

namespace zeroflat {
namespace {

std::optional<std::string> read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

std::optional<std::uint64_t> read_number(const std::string& path) {
  auto line = read_first_line(path);
  if (!line) return std::nullopt;
  try {
    std::size_t used = 0;
    const unsigned long long v = std::stoull(*line, &used);
    return static_cast<std::uint64_t>(v);
  } catch (...) {
    return std::nullopt;
  }
}

// A "key value" line of a cgroup memory.stat file; 0 when absent.
std::uint64_t stat_value(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string k;
  std::uint64_t v = 0;
  while (in >> k >> v) {
    if (k == key) return v;
  }
  return 0;
}

// v2: the leaf's memory.max and each ancestor's up to the mount root; the level with the least
// room decides (a Slurm job's or a systemd slice's limit sits above the process's own cgroup).
std::optional<CgroupMemory> read_v2(const std::string& root, const std::string& leaf) {
  std::string rel = leaf == "/" ? "" : leaf;
  std::optional<CgroupMemory> best;
  std::optional<CgroupMemory> leaf_info;
  std::uint64_t best_room = UINT64_MAX;
  for (;;) {
    const std::string dir = root + rel;
    auto max = read_first_line(dir + "/memory.max");
    auto current = read_number(dir + "/memory.current");
    if (max && current) {
      const std::uint64_t inactive = stat_value(dir + "/memory.stat", "inactive_file");
      CgroupMemory m{2, std::nullopt, *current - std::min(*current, inactive), dir + "/memory.max"};
      if (*max != "max") {
        try {
          m.limit_bytes = std::stoull(*max);
        } catch (...) {
          m.limit_bytes = std::nullopt;
        }
      }
      if (!leaf_info) leaf_info = m;
      if (m.limit_bytes) {
        const std::uint64_t room =
            *m.limit_bytes > m.usage_bytes ? *m.limit_bytes - m.usage_bytes : 0;
        if (room < best_room) {
          best_room = room;
          best = m;
        }
      }
    }
    if (rel.empty()) break;
    rel = rel.substr(0, rel.rfind('/'));
  }
  return best ? best : leaf_info;
}

// v1: memory.limit_in_bytes, and memory.stat's hierarchical_memory_limit, which already takes
// the ancestors' limits into account.
std::optional<CgroupMemory> read_v1(const std::string& root, const std::string& leaf) {
  for (const std::string& base : {root + "/memory" + (leaf == "/" ? "" : leaf), root + "/memory"}) {
    auto limit = read_number(base + "/memory.limit_in_bytes");
    auto usage = read_number(base + "/memory.usage_in_bytes");
    if (!limit || !usage) continue;
    const std::uint64_t inactive = stat_value(base + "/memory.stat", "total_inactive_file");
    const std::uint64_t hierarchical =
        stat_value(base + "/memory.stat", "hierarchical_memory_limit");
    CgroupMemory m{1, std::nullopt, *usage - std::min(*usage, inactive),
                   base + "/memory.limit_in_bytes"};
    std::uint64_t effective = *limit;
    if (hierarchical > 0) effective = std::min(effective, hierarchical);
    // v1 reports "no limit" as a huge page-rounded number.
    if (effective < (std::uint64_t{1} << 60)) m.limit_bytes = effective;
    return m;
  }
  return std::nullopt;
}

Answer<CgroupMemory> read_cgroup() {
  std::ifstream in("/proc/self/cgroup");
  if (!in) return Answer<CgroupMemory>::fail("cannot read /proc/self/cgroup");
  std::ostringstream text;
  text << in.rdbuf();
  return read_cgroup_memory("/sys/fs/cgroup", text.str());
}

}  // namespace

Answer<MemoryPair> parse_meminfo(std::string_view text) {
  std::optional<std::uint64_t> total, available;
  while (!text.empty()) {
    const std::size_t end = std::min(text.find('\n'), text.size());
    const std::string_view line = text.substr(0, end);
    text.remove_prefix(std::min(end + 1, text.size()));
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos) continue;
    const std::string_view key = line.substr(0, colon);
    if (key != "MemTotal" && key != "MemAvailable") continue;
    std::size_t i = colon + 1;
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) ++i;
    std::uint64_t kb = 0;
    const std::size_t first = i;
    for (; i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i) {
      if (kb > (UINT64_MAX - 9) / 10 / 1024) {
        return Answer<MemoryPair>::fail(key == "MemTotal" ? "/proc/meminfo: MemTotal too large"
                                                          : "/proc/meminfo: MemAvailable too large");
      }
      kb = kb * 10 + static_cast<std::uint64_t>(line[i] - '0');
    }
    if (i == first) {
      return Answer<MemoryPair>::fail(key == "MemTotal" ? "/proc/meminfo: MemTotal not a number"
                                                        : "/proc/meminfo: MemAvailable not a number");
    }
    (key == "MemTotal" ? total : available) = kb * 1024;
  }
  if (!total || !available) {
    return Answer<MemoryPair>::fail("/proc/meminfo has no MemTotal or MemAvailable");
  }
  // Some sandboxes answer zeros for a process they have given a GPU: no answer, so that the
  // cgroup decides (rather than "nothing free", which no plan that stages through the host fits).
  if (*total == 0) return Answer<MemoryPair>::fail("/proc/meminfo reports MemTotal 0");
  return Answer<MemoryPair>::ok({*total, std::min(*available, *total)});
}

Answer<MemoryPair> read_sysinfo() {
  struct sysinfo info {};
  if (::sysinfo(&info) != 0) {
    return Answer<MemoryPair>::fail(std::string("sysinfo failed: ") + std::strerror(errno));
  }
  const std::uint64_t unit = info.mem_unit > 0 ? info.mem_unit : 1;
  const std::uint64_t total = static_cast<std::uint64_t>(info.totalram) * unit;
  const std::uint64_t free =
      (static_cast<std::uint64_t>(info.freeram) + static_cast<std::uint64_t>(info.bufferram)) *
      unit;
  if (total == 0) return Answer<MemoryPair>::fail("sysinfo reports totalram 0");
  return Answer<MemoryPair>::ok({total, std::min(free, total)});
}

Answer<MemoryPair> read_proc_meminfo() {
  std::ifstream in("/proc/meminfo", std::ios::binary);
  if (!in) return Answer<MemoryPair>::fail("cannot read /proc/meminfo");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_meminfo(text.str());
}

Answer<CgroupMemory> read_cgroup_memory(const std::string& root, std::string_view self_cgroup) {
  std::string v2_path, v1_path;
  std::istringstream lines{std::string(self_cgroup)};
  std::string line;
  while (std::getline(lines, line)) {
    // "0::/path" (v2) or "N:memory:/path" (v1; the controller list may hold several).
    const auto a = line.find(':');
    if (a == std::string::npos) continue;
    const auto b = line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && controllers.empty()) v2_path = path;
    std::stringstream list(controllers);
    std::string c;
    while (std::getline(list, c, ',')) {
      if (c == "memory") v1_path = path;
    }
  }
  if (!v1_path.empty()) {
    if (auto m = read_v1(root, v1_path)) return Answer<CgroupMemory>::ok(*m);
  }
  if (!v2_path.empty() || v1_path.empty()) {
    if (auto m = read_v2(root, v2_path.empty() ? "/" : v2_path))
      return Answer<CgroupMemory>::ok(*m);
  }
  return Answer<CgroupMemory>::fail("no cgroup memory controller found for this process");
}

HostProbeSources system_host_sources(unsigned local_ranks) {
  HostProbeSources s;
  s.meminfo = read_proc_meminfo;
  s.sysinfo = read_sysinfo;
  s.cgroup = read_cgroup;
  if (local_ranks == 0) {
    try {
      local_ranks = runtime_env().local_ranks.value_or(1);
    } catch (...) {
      local_ranks = 1;
    }
  }
  s.local_ranks = local_ranks;
  return s;
}

}  // namespace zeroflat
