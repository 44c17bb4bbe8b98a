// The `cpu` device.
#include "device/cpu_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device/host_kernels.h"
#include "zeroflat/common.h"
#include "zeroflat/probe.h"

namespace zeroflat::detail {
namespace {

constexpr std::uint64_t kHugePage = std::uint64_t{2} << 20;
constexpr std::uint64_t kGrain = 64;  // thread ranges start on cache lines

std::uint64_t round_up(std::uint64_t x, std::uint64_t m) {
  return (x + m - 1) / m * m;
}

// Whether fresh mappings are advised for huge pages: as asked, else as ZEROFLAT_HOST_MEMORY
// says (common.h), by default yes (a first touch then costs one fault per 2 MiB).
bool huge_pages_advised(std::optional<bool> asked) {
  if (asked) return *asked;
  const std::optional<RuntimeEnv::HostMemory> m = runtime_env().host_memory;
  return !m || *m == RuntimeEnv::HostMemory::kHuge;
}

}  // namespace

void* host_allocate(std::uint64_t num_bytes, std::optional<bool> huge_pages) {
  auto oom = [&] {
    return OutOfMemory("cpu: cannot allocate " + format_bytes(num_bytes) + " (" +
                       std::to_string(num_bytes) + " bytes) of host memory");
  };
  if (num_bytes < kFreshMappingBytes) {
    // (Small sizes cannot overflow the rounding below.)
    void* p = std::aligned_alloc(kGrain, round_up(num_bytes == 0 ? 1 : num_bytes, kGrain));
    if (p == nullptr) throw oom();
    return p;
  }
  // Checked before rounding: near 2^64 the rounding would wrap to a tiny size.
  if (num_bytes > (std::uint64_t{1} << 62)) throw oom();
  const std::uint64_t size = round_up(num_bytes, kHugePage);
  void* raw =
      mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw oom();
  // Trim to a 2 MiB-aligned window so that every huge page can be used.
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t aligned = round_up(base, kHugePage);
  if (aligned > base) munmap(raw, aligned - base);
  std::uintptr_t tail = base + size + kHugePage - (aligned + size);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + size), tail);
  auto* p = reinterpret_cast<void*>(aligned);
#ifdef MADV_HUGEPAGE
  if (huge_pages_advised(huge_pages)) madvise(p, size, MADV_HUGEPAGE);
#endif
  return p;
}

void host_release(void* ptr, std::uint64_t num_bytes) noexcept {
  if (ptr == nullptr) return;
  if (num_bytes < kFreshMappingBytes) {
    std::free(ptr);
  } else {
    munmap(ptr, round_up(num_bytes, kHugePage));
  }
}

CpuDevice::CpuDevice(const DeviceOptions& options)
    : pool_(options.num_threads > 0 ? options.num_threads : default_num_threads()) {}

void* CpuDevice::allocate(std::uint64_t num_bytes) {
  void* p = host_allocate(num_bytes);
  device_bytes_.add(num_bytes);
  return p;
}

void CpuDevice::release(void* ptr, std::uint64_t num_bytes) noexcept {
  if (ptr == nullptr) return;
  host_release(ptr, num_bytes);
  device_bytes_.sub(num_bytes);
}

void* CpuDevice::allocate_host(std::uint64_t num_bytes) {
  void* p = host_allocate(num_bytes);
  host_bytes_.add(num_bytes);
  return p;
}

void CpuDevice::release_host(void* ptr, std::uint64_t num_bytes) noexcept {
  if (ptr == nullptr) return;
  host_release(ptr, num_bytes);
  host_bytes_.sub(num_bytes);
}

void CpuDevice::copy(void* dst, const void* src, std::uint64_t num_bytes) {
  memcpy_parallel(dst, src, num_bytes);
}

void CpuDevice::parallel(const std::function<void(unsigned)>& fn) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  pool_.run(fn);
}

void CpuDevice::gather(void* dst, std::uint64_t num_bytes, std::span<const Segment> segments) {
  check_gather_segments(dst, num_bytes, segments);
  auto* out = static_cast<unsigned char*>(dst);
  const bool streaming = use_streaming_stores(out, num_bytes);
  const unsigned parts = pool_.size();
  // Split by destination bytes, not by segment: one huge tensor and many tiny ones both keep
  // every thread busy, and each thread writes (and first-touches) one contiguous range.
  // Into memory never touched, each thread faults its range in a chunk at a time, just before
  // writing it (prefault_for_write).
  const bool fresh = !streaming && mostly_untouched(out, num_bytes);
  parallel([&](unsigned t) {
    Range r = split_range(num_bytes, parts, t, kGrain);
    if (fresh) {
      prefault_then_write(out + r.begin, r.end - r.begin, [&](std::uint64_t at, std::uint64_t k) {
        gather_range(out, segments, r.begin + at, r.begin + at + k, false);
      });
    } else {
      gather_range(out, segments, r.begin, r.end, streaming);
    }
    store_fence();
  });
}

void CpuDevice::memcpy_parallel(void* dst, const void* src, std::uint64_t num_bytes) {
  const unsigned parts = pool_.size();
  // Into memory never touched, ordinary stores (see use_streaming_stores); else memcpy's own
  // choice.
  const bool untouched = mostly_untouched(dst, num_bytes);
  parallel([&](unsigned t) {
    Range r = split_range(num_bytes, parts, t, kGrain);
    auto* to = static_cast<unsigned char*>(dst) + r.begin;
    const auto* from = static_cast<const unsigned char*>(src) + r.begin;
    if (untouched) {
      copy_fresh(to, from, r.end - r.begin);
    } else {
      std::memcpy(to, from, r.end - r.begin);
    }
  });
}

void CpuDevice::zero_parallel(void* dst, std::uint64_t num_bytes) {
  const unsigned parts = pool_.size();
  parallel([&](unsigned t) {
    Range r = split_range(num_bytes, parts, t, kGrain);
    std::memset(static_cast<unsigned char*>(dst) + r.begin, 0, r.end - r.begin);
  });
}

void CpuDevice::upcast_to_fp32(float* dst, const void* src, DType dtype, std::uint64_t numel) {
  const unsigned parts = pool_.size();
  const std::uint64_t esize = element_size(dtype);
  const bool fresh = mostly_untouched(dst, numel * 4);
  const auto* from = static_cast<const unsigned char*>(src);
  parallel([&](unsigned t) {
    Range r = split_range(numel, parts, t, 16);
    auto upcast = [&](std::uint64_t at, std::uint64_t n) {  // elements from r.begin
      upcast_range(dst + r.begin + at, from + (r.begin + at) * esize, dtype, n);
    };
    if (fresh) {
      prefault_then_write(dst + r.begin, (r.end - r.begin) * 4,
                          [&](std::uint64_t at, std::uint64_t k) { upcast(at / 4, k / 4); });
    } else {
      upcast(0, r.end - r.begin);
    }
  });
}

std::uint64_t CpuDevice::checksum(const void* ptr, std::uint64_t num_bytes) {
  const std::uint64_t chunks = (num_bytes + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
  std::vector<std::uint64_t> digests(chunks);
  const auto* p = static_cast<const unsigned char*>(ptr);
  const unsigned parts = pool_.size();
  parallel([&](unsigned t) {
    Range r = split_range(chunks, parts, t, 1);
    for (std::uint64_t c = r.begin; c < r.end; ++c) {
      std::uint64_t off = c * kChecksumChunkBytes;
      std::uint64_t n = std::min(kChecksumChunkBytes, num_bytes - off);
      digests[c] = checksum_chunk(p + off, n);
    }
  });
  return checksum_combine(digests, num_bytes);
}

MemoryInfo CpuDevice::memory_info() {
  MemoryInfo info;
  if (Answer<MemoryPair> host = read_proc_meminfo(); host.value) {
    info.total_bytes = host.value->total_bytes;
    info.free_bytes = host.value->free_bytes;
  }
  info.allocated_bytes = device_bytes_.current();
  info.peak_allocated_bytes = device_bytes_.peak();
  info.host_allocated_bytes = host_bytes_.current();
  info.peak_host_allocated_bytes = host_bytes_.peak();
  return info;
}

ProbeResult CpuDevice::probe_memory(const ProbeContext& context) {
  const HostProbeSources sources = system_host_sources(context.local_ranks);
  ProbeResult r = probe_host(sources);
  r.integrated = true;
  if (r.available && sources.local_ranks > 1) {
    r.notes.push_back("the device is the host: this rank's capacity is " +
                      format_bytes(r.total_bytes) + " / " +
                      std::to_string(sources.local_ranks));
    r.total_bytes /= sources.local_ranks;
  }
  return r;
}

}  // namespace zeroflat::detail

namespace zeroflat {

void* allocate_host_memory(std::uint64_t num_bytes, std::optional<bool> huge_pages) {
  return detail::host_allocate(num_bytes, huge_pages);
}

void release_host_memory(void* ptr, std::uint64_t num_bytes) noexcept {
  detail::host_release(ptr, num_bytes);
}

}  // namespace zeroflat
