// Process-wide runtime facts: cores, ranks on this host, thread counts, ZEROFLAT_* variables.
//
// Every environment variable zeroflat reads is read here, once (docs/environment.md lists them).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace zeroflat {

// The most host threads a rank may be given (ZEROFLAT_NUM_THREADS, --threads).
inline constexpr unsigned kMaxThreads = 1024;

struct RuntimeEnv {
  // ZEROFLAT_NUM_THREADS: host threads per rank, overriding the default.
  std::optional<unsigned> num_threads;
  // ZEROFLAT_LOCAL_RANKS, else the launcher's count of ranks on this host
  // (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, LOCAL_WORLD_SIZE).
  std::optional<unsigned> local_ranks;
  // ZEROFLAT_HOST_MEMORY: where large host buffers come from. "huge": fresh 2 MiB-aligned
  // mappings advised for transparent huge pages; "plain": the same without the advice (a kernel
  // whose THP defrag is "madvise" compacts memory on every fault of an advised buffer); "torch":
  // in the Python binding, torch's own allocator, as DeepSpeed's buffers (the library itself
  // then allocates as "plain"). None: the default of each caller (HostMemory below).
  enum class HostMemory : std::uint8_t { kHuge, kPlain, kTorch };
  std::optional<HostMemory> host_memory;
  // ZEROFLAT_READ_AHEAD: how a checkpoint's files are read ahead. "exact" (the default): the
  // kernel's own read-ahead off (POSIX_FADV_RANDOM) and the reader asking ahead for exactly the
  // pieces it will read next (POSIX_FADV_WILLNEED), so that a rank reads its bytes and no
  // others (the files no other rank of a load reads keep the kernel's read-ahead: there it
  // reads nothing another rank needs); "kernel": the kernel's read-ahead, which reads past the
  // end of each run of a rank's bytes into another rank's (off only for a rank's many short
  // runs).
  enum class ReadAhead : std::uint8_t { kExact, kKernel };
  ReadAhead read_ahead = ReadAhead::kExact;
  // ZEROFLAT_GATHER_PARTS: the most parts a rank's read of its slice is split into, each
  // all-gathered while the next is read (ExecuteOptions::gather_parts; 1: read, then gather).
  std::optional<unsigned> gather_parts;
};

// A HostMemory by its name ("huge", "plain", "torch"); none for any other text.
std::optional<RuntimeEnv::HostMemory> parse_host_memory(const std::string& name);

// The environment as read at first call. Throws InvalidArgument naming the variable when one is
// set to something other than a positive integer (every later call throws the same).
const RuntimeEnv& runtime_env();

// The GPUs this process may see, as the launcher or container runtime wrote them:
// CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES (container runtimes often set only that).
// Indices or GPU-/MIG- UUIDs; the probe never parses them as integers.
struct VisibleDevices {
  std::string value;     // empty when neither is set
  std::string variable;  // which of the two it came from
};
VisibleDevices visible_devices();

// The Hugging Face hub cache directory, found as huggingface_hub finds it: HF_HUB_CACHE, else
// HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else
// HOME/.cache/huggingface/hub. Empty when none of them is set. Only read: nothing is downloaded.
std::string hf_hub_cache();

// Cores this process may run on: its CPU affinity mask, capped by its cgroup's CPU quota;
// at least 1.
unsigned available_cores() noexcept;

// Threads each rank uses for host work: ZEROFLAT_NUM_THREADS if set, else the available cores
// divided by the ranks sharing this host (local_ranks if > 0, else runtime_env().local_ranks,
// else 1), at least 1. Ranks on one host then never oversubscribe its cores.
unsigned default_num_threads(unsigned local_ranks = 0);

}  // namespace zeroflat
