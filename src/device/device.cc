// The Device base: the probes every device has unless it knows better.
#include "zeroflat/device.h"

#include "zeroflat/common.h"

namespace zeroflat {

ProbeResult Device::probe_memory(const ProbeContext&) {
  const MemoryInfo m = memory_info();
  ProbeResult r;
  r.device = name();
  r.available = m.total_bytes > 0;
  r.total_bytes = m.total_bytes;
  r.free_bytes = m.free_bytes;
  r.used = "device accounting";
  r.sources.push_back({"device accounting", r.available, m.total_bytes, m.free_bytes,
                       r.available ? format_bytes(m.allocated_bytes) + " allocated through " +
                                         "this device"
                                   : "the device reports no capacity"});
  return r;
}

ProbeResult Device::probe_host_memory(const ProbeContext& context) {
  return probe_host(system_host_sources(context.local_ranks));
}

}  // namespace zeroflat
