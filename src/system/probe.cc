// The probe's decisions, on whatever sources it is given.
#include "zeroflat/probe.h"

#include <algorithm>
#include <exception>
#include <string>

#include "zeroflat/common.h"

namespace zeroflat {
namespace {

// Calls a source; an exception from it becomes its error, never the caller's.
template <typename T, typename Fn>
Answer<T> ask(const Fn& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return Answer<T>::fail(e.what());
  } catch (...) {
    return Answer<T>::fail("unknown error");
  }
}

}  // namespace

ProbeResult probe_host(const HostProbeSources& s) {
  ProbeResult r;
  r.device = "cpu";
  // A source of total and free memory: recorded, and used when it answers.
  const auto take = [&r](const char* name, const Answer<MemoryPair>& a, const char* what) {
    if (!a.value) {
      r.sources.push_back({name, false, 0, 0, a.error});
      return false;
    }
    r.sources.push_back({name, true, a.value->total_bytes, a.value->free_bytes, what});
    r.available = true;
    r.total_bytes = a.value->total_bytes;
    r.free_bytes = a.value->free_bytes;
    r.used = name;
    return true;
  };
  const Answer<MemoryPair> mem =
      s.meminfo ? ask<MemoryPair>(s.meminfo) : Answer<MemoryPair>::fail("no such source");
  if (!take("MemAvailable", mem,
            "/proc/meminfo: memory available to new allocations without swapping") &&
      s.sysinfo) {
    take("sysinfo", ask<MemoryPair>(s.sysinfo),
         "sysinfo(2): free and buffer memory (the page cache not counted)");
  }
  Answer<CgroupMemory> cg =
      s.cgroup ? ask<CgroupMemory>(s.cgroup) : Answer<CgroupMemory>::fail("no such source");
  const std::string cg_name = "cgroup";
  if (cg.value && cg.value->limit_bytes) {
    const std::uint64_t limit = *cg.value->limit_bytes;
    const std::uint64_t room = limit > cg.value->usage_bytes ? limit - cg.value->usage_bytes : 0;
    r.sources.push_back({"cgroup v" + std::to_string(cg.value->version), true, limit, room,
                         cg.value->path + ": limit " + format_bytes(limit) + ", in use " +
                             format_bytes(cg.value->usage_bytes)});
    if (!r.available || room < r.free_bytes) {
      r.free_bytes = room;
      r.total_bytes = r.available ? std::min(r.total_bytes, limit) : limit;
      r.used = "cgroup v" + std::to_string(cg.value->version);
      r.available = true;
    }
  } else if (cg.value) {
    r.sources.push_back({"cgroup v" + std::to_string(cg.value->version), true, 0, 0,
                         cg.value->path + ": no memory limit"});
  } else {
    r.sources.push_back({cg_name, false, 0, 0, cg.error});
  }
  const unsigned ranks = s.local_ranks > 0 ? s.local_ranks : 1;
  if (r.available && ranks > 1) {
    r.notes.push_back("shared among " + std::to_string(ranks) + " ranks on this host: " +
                      format_bytes(r.free_bytes) + " / " + std::to_string(ranks));
    r.free_bytes /= ranks;
  }
  if (!r.available) r.notes.push_back("no source could tell the host's free memory");
  return r;
}

ProbeResult probe_cuda(int index, const CudaProbeSources& s) {
  ProbeResult r;
  r.device = "cuda:" + std::to_string(index);
  Answer<CudaDeviceFacts> facts =
      s.cuda ? ask<CudaDeviceFacts>([&] { return s.cuda(index); })
             : Answer<CudaDeviceFacts>::fail("no CUDA runtime in this build");
  if (!facts.value) {
    r.sources.push_back({"CUDA runtime", false, 0, 0, facts.error});
    r.notes.push_back("no usable GPU: " + facts.error);
    return r;
  }
  const CudaDeviceFacts& f = *facts.value;
  r.available = true;
  r.integrated = f.integrated;

  // 1. NVML sees the whole device, other processes included, but on a MIG slice its device
  //    numbers are the parent GPU's, which would be wrong for this process.
  const bool mig = s.visible_devices.find("MIG-") != std::string::npos;
  const std::string visible_var =
      s.visible_devices_var.empty() ? "CUDA_VISIBLE_DEVICES" : s.visible_devices_var;
  bool have = false;
  if (mig) {
    r.sources.push_back({"nvml", false, 0, 0,
                         "skipped: " + visible_var +
                             " names a MIG slice, and NVML's device numbers would be the whole "
                             "GPU's"});
  } else {
    Answer<MemoryPair> nv = s.nvml ? ask<MemoryPair>([&] { return s.nvml(f.pci_bus_id); })
                                   : Answer<MemoryPair>::fail("NVML not available");
    // A total that disagrees with CUDA's means NVML sees something larger than this process's
    // device (a MIG slice the environment did not name): its numbers would be wrong.
    const bool scoped = nv.value && f.mem_get_info &&
                        (nv.value->total_bytes > f.mem_get_info->total_bytes / 100 * 101 ||
                         f.mem_get_info->total_bytes > nv.value->total_bytes / 100 * 101);
    if (scoped) {
      r.sources.push_back({"nvml", false, nv.value->total_bytes, nv.value->free_bytes,
                           "not used: its total differs from cudaMemGetInfo's, so it describes "
                           "more than this device (a MIG slice?)"});
    } else if (nv.value) {
      r.sources.push_back({"nvml", true, nv.value->total_bytes, nv.value->free_bytes,
                           "device " + f.pci_bus_id + ": whole device, all processes"});
      r.total_bytes = nv.value->total_bytes;
      r.free_bytes = nv.value->free_bytes;
      r.used = "nvml";
      have = true;
    } else {
      r.sources.push_back({"nvml", false, 0, 0, nv.error});
    }
  }
  // 2. cudaMemGetInfo: device-wide (MIG-scoped on a slice).
  if (f.mem_get_info) {
    r.sources.push_back({"cudaMemGetInfo", true, f.mem_get_info->total_bytes,
                         f.mem_get_info->free_bytes, "this device as CUDA sees it"});
    if (!have) {
      r.total_bytes = f.mem_get_info->total_bytes;
      r.free_bytes = f.mem_get_info->free_bytes;
      r.used = "cudaMemGetInfo";
      have = true;
    }
  } else {
    r.sources.push_back({"cudaMemGetInfo", false, 0, 0, f.mem_get_info_error});
  }
  // 3. The process's own view: what it does not hold itself.
  if (r.total_bytes > 0 || f.mem_get_info) {
    const std::uint64_t total = r.total_bytes > 0 ? r.total_bytes : f.mem_get_info->total_bytes;
    const std::uint64_t mine = std::min(s.process_allocated_bytes, total);
    r.sources.push_back({"process view", true, total, total - mine,
                         "total - " + format_bytes(mine) + " held by this process"});
    if (!have) {
      r.total_bytes = total;
      r.free_bytes = total - mine;
      r.used = "process view";
      have = true;
    }
  } else {
    r.sources.push_back({"process view", false, 0, 0, "no source knows the device's total"});
  }
  if (!have) {
    r.available = false;
    r.notes.push_back("no source could tell the device's free memory");
    return r;
  }
  // 4. Integrated devices share the host's memory: the host's available memory caps them.
  if (f.integrated) {
    Answer<MemoryPair> host =
        s.host ? ask<MemoryPair>(s.host) : Answer<MemoryPair>::fail("no such source");
    if (host.value) {
      r.sources.push_back({"host MemAvailable", true, host.value->total_bytes,
                           host.value->free_bytes, "integrated device: memory is the host's"});
      if (host.value->free_bytes < r.free_bytes) {
        r.notes.push_back("integrated device: capped by the host's available memory (" +
                          format_bytes(host.value->free_bytes) + ")");
        r.free_bytes = host.value->free_bytes;
        r.used += " capped by host MemAvailable";
      }
    } else {
      r.sources.push_back({"host MemAvailable", false, 0, 0, host.error});
    }
  }
  // 5. Memory the framework's caching allocator holds but does not use is free to this process.
  if (s.framework_cached_free_bytes > 0) {
    r.notes.push_back("credited " + format_bytes(s.framework_cached_free_bytes) +
                      " cached by the framework's allocator but not in use");
    r.free_bytes = std::min(r.total_bytes, r.free_bytes + s.framework_cached_free_bytes);
  }
  return r;
}

}  // namespace zeroflat
