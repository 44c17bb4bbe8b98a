// Copies with streaming (non-temporal) stores: below the devices, because a save's snapshot
// (src/save) copies with them too. device/host_kernels.h builds its gathers on them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zeroflat::detail {

// A cache line: what streaming stores write whole.
inline constexpr std::size_t kStreamLine = 64;
// Below this many bytes a copy or a fill uses ordinary stores: the streaming body would be a few
// lines at most, and the head and tail use ordinary stores anyway.
inline constexpr std::size_t kStreamMinBytes = 256;

// Copies n bytes. With streaming = true, 64-byte-aligned destination lines are written with
// non-temporal stores (no read-for-ownership, no cache pollution): the right choice when the
// destination is far larger than the caches. The caller must issue store_fence() before another
// thread reads the destination.
void copy_bytes(void* dst, const void* src, std::size_t n, bool streaming) noexcept;

// Streams n bytes of whole lines: dst 64-byte aligned, n a multiple of 64 (AVX where the CPU has
// it). Needs store_fence() as copy_bytes does.
void stream_lines(unsigned char* dst, const unsigned char* src, std::size_t n) noexcept;

// Orders this thread's streaming stores before its later stores (sfence on x86).
void store_fence() noexcept;

// Whether num_bytes written in a row are past the cache this CPU can count on
// (cache_share_bytes of the running machine, read once; at least 4 MiB).
bool larger_than_cache(std::uint64_t num_bytes) noexcept;

// The cache this CPU can count on, from the sysfs tree at cpu_dir (as
// /sys/devices/system/cpu/cpu0): over its data and unified caches of level 2 and up, the least
// of a cache's size over the number of CPUs that share it; 0 where the tree does not say.
std::uint64_t cache_share_bytes(const char* cpu_dir) noexcept;

}  // namespace zeroflat::detail
