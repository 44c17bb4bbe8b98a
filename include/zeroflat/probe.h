// Facts about the machine, below both the devices and the planner: the hardware presets
// (accelerators and the nodes they sit in, by name, with the cost model's bandwidths) and the
// free-memory probe (what each source says about a device's memory, and which answer the
// planner uses).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zeroflat {

// --- Hardware presets ----------------------------------------------------------------------------
// Hardware presets: accelerators and the nodes they sit in, by name, with the bandwidths of the
// planner's cost model. A fact table below both the devices (a `sim:h100-80gb` is sized by it)
// and the planner (which costs step lists with it).

// Bandwidths of the cost model, in bytes per second. Copy bandwidths count each byte copied
// once (a copy reads and writes it).
struct Bandwidths {
  double device_copy = 0;    // on the device
  double host_link = 0;      // host <-> device, each direction, pinned
  double allgather_bus = 0;  // NCCL-style bus bandwidth of the all-gather
  double host_copy = 0;      // host memory copies of the whole node, shared by its ranks
  double read = 2e9;         // checkpoint reads of one rank (storage or page cache)
  // The storage every node reads the checkpoint from, shared by all of them (a network file
  // system); 0: each node reads from storage of its own at `read` (not a shared bottleneck).
  double storage = 0;
};

// An accelerator preset (the capacities of docs/planner.md).
struct DevicePreset {
  std::string name;
  std::uint64_t capacity_bytes = 0;
  std::uint64_t host_bytes_per_node = 0;  // host memory of a typical node with 8 of them
  Bandwidths bandwidths;
  bool integrated = false;  // memory shared with the host
};

// Host memory of the node a device known only by its size is assumed to sit in: that of a
// typical 8-accelerator node (`--host SIZE` says otherwise).
inline constexpr std::uint64_t kGenericNodeHostBytes = std::uint64_t{2} << 40;  // 2 TiB

std::vector<DevicePreset> device_presets();
std::optional<DevicePreset> find_preset(std::string_view name);
// A device known only by its size, with conservative bandwidths, in a generic node.
DevicePreset generic_preset(std::uint64_t capacity_bytes);

// --- The free-memory probe -----------------------------------------------------------------------
// The free-memory probe: what each source says about a device's memory, and which answer the
// planner uses. No probe failure ever raises past the probe: each source's error is kept.
// Each Device offers its sources through Device::probe_memory (device.h); the functions here
// decide from whatever sources they are given.
//
// Sources are injectable (plain functions), so tests can play machines zeroflat does not run
// on: a GB10 whose NVML cannot report memory, a MIG slice, a machine without NVML, an
// integrated device, CUDA_VISIBLE_DEVICES holding GPU-/MIG- UUIDs.

// A value, or why there is none.
template <typename T>
struct Answer {
  std::optional<T> value;
  std::string error;  // set when value is empty

  static Answer ok(T v) { return Answer{std::move(v), {}}; }
  static Answer fail(std::string why) { return Answer{std::nullopt, std::move(why)}; }
};

struct MemoryPair {
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;
};

// One source's answer, as the probe reports it.
struct SourceReport {
  std::string source;  // "nvml", "cudaMemGetInfo", "process view", "MemAvailable", ...
  bool ok = false;
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::string detail;  // the error when !ok; otherwise what the number means
};

struct ProbeResult {
  std::string device;      // "cpu", "cuda:0", "sim:80GiB", "host"
  bool available = false;  // false: the device cannot be used here (no GPU, no driver)
  bool integrated = false;  // the device's memory is the host's (cpu, GB10, Jetson)
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;  // what the planner may use on this rank
  std::string used;              // which source free_bytes came from
  std::vector<SourceReport> sources;
  std::vector<std::string> notes;  // adjustments: sharing among ranks, integrated cap, ...
};

// What the caller knows that the probe cannot see for itself.
struct ProbeContext {
  // Ranks sharing this host's memory (and, for the cpu device, the device itself); 0 takes
  // runtime_env()'s count, else 1.
  unsigned local_ranks = 0;
  // Device bytes the framework's caching allocator holds but does not use: free to this
  // process, though no source below the framework can see it (torch's reserved - allocated).
  std::uint64_t framework_cached_free_bytes = 0;
  // Device bytes the framework's allocator holds in all (torch's reserved): this process's, in
  // the process view, besides what the device allocated itself.
  std::uint64_t framework_held_bytes = 0;
};

// --- the host ---------------------------------------------------------------------------------

struct CgroupMemory {
  int version = 2;
  std::optional<std::uint64_t> limit_bytes;  // none: unlimited
  std::uint64_t usage_bytes = 0;
  std::string path;  // the control file read
};

struct HostProbeSources {
  std::function<Answer<MemoryPair>()> meminfo;  // MemTotal, MemAvailable
  // sysinfo(2): totalram, and freeram + bufferram as the free (the page cache the kernel could
  // drop is not counted: a low figure, never a high one). Asked only where meminfo gives no
  // answer (a sandbox that hides or zeroes /proc/meminfo).
  std::function<Answer<MemoryPair>()> sysinfo;
  std::function<Answer<CgroupMemory>()> cgroup;
  unsigned local_ranks = 1;  // ranks sharing this host's memory
};

// /proc/meminfo's MemTotal and MemAvailable.
Answer<MemoryPair> read_proc_meminfo();
// The same from the file's text: no answer where either is missing or MemTotal is 0.
Answer<MemoryPair> parse_meminfo(std::string_view text);
// sysinfo(2)'s figures (HostProbeSources::sysinfo); no answer where it fails or reports no
// memory at all.
Answer<MemoryPair> read_sysinfo();

// The memory limit that applies to a process, from a cgroup mount root ("/sys/fs/cgroup") and
// the text of its /proc/self/cgroup. v1: the memory controller's limit, lowered by
// memory.stat's hierarchical_memory_limit. v2: the leaf's memory.max and every ancestor's up to
// the root; the level with the least room decides. Usage excludes inactive page cache.
Answer<CgroupMemory> read_cgroup_memory(const std::string& root, std::string_view self_cgroup);

// This machine: /proc/meminfo (else sysinfo) and the process's cgroup (v2, else v1). local_ranks 0 takes
// runtime_env()'s count (1 if unknown).
HostProbeSources system_host_sources(unsigned local_ranks = 0);

// Free host memory for this rank: the smaller of MemAvailable and the cgroup's limit - usage,
// divided among the local ranks.
ProbeResult probe_host(const HostProbeSources& sources);

// --- CUDA devices -----------------------------------------------------------------------------

struct CudaDeviceFacts {
  std::string pci_bus_id;  // "0000:1B:00.0", as the CUDA runtime names it
  bool integrated = false;
  std::optional<MemoryPair> mem_get_info;  // cudaMemGetInfo, when it answered
  std::string mem_get_info_error;
};

struct CudaProbeSources {
  // The CUDA runtime's view of device `index` (identity and cudaMemGetInfo).
  std::function<Answer<CudaDeviceFacts>(int index)> cuda;
  // NVML's memory of the device with this PCI bus id (v2 query, then v1).
  std::function<Answer<MemoryPair>(const std::string& pci_bus_id)> nvml;
  // The host's available memory (caps an integrated device).
  std::function<Answer<MemoryPair>()> host;
  std::string visible_devices;                // CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES
  std::string visible_devices_var;            // which of the two it came from
  std::uint64_t process_allocated_bytes = 0;  // what this process holds on the device
  std::uint64_t framework_cached_free_bytes = 0;  // cached by the framework, not in use
};

// This machine: the CUDA runtime and NVML, both loaded with dlopen (zeroflat builds and runs
// where neither exists), once per process; CUDA_VISIBLE_DEVICES as it is now.
CudaProbeSources system_cuda_sources();
// The same sources from the first library of each list that loads (paths or sonames): a test's
// stub library, or an unusual install. A library that does not load, or lacks an entry point,
// makes its source answer with that error.
CudaProbeSources cuda_sources_from(const std::vector<std::string>& cuda_runtime,
                                   const std::vector<std::string>& nvml);

// Free device memory: NVML (whole device, other processes included) unless the device is a MIG
// slice or NVML cannot answer; then cudaMemGetInfo; then total - what this process holds.
// Integrated devices are capped by the host's available memory; the framework's cached-free
// bytes are credited.
ProbeResult probe_cuda(int index, const CudaProbeSources& sources);

}  // namespace zeroflat
