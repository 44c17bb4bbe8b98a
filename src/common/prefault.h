// Faulting in fresh memory before it is written.
#pragma once

#include <algorithm>
#include <cstdint>

namespace zeroflat::detail {

// Faults in the pages of [p, p + n) for writing with one call to the kernel
// (MADV_POPULATE_WRITE, Linux 5.14 on), where the stores would take one fault per 4 KiB page:
// 1.5 to 1.7 x faster on the machine measured (docs/performance.md), where the fault itself,
// not the zeroing of the page, is most of a first touch. Only the whole pages inside the range;
// values already there stay. Does nothing where the kernel cannot (the stores then fault the
// pages in as before).
void prefault_for_write(void* p, std::uint64_t n) noexcept;

// Whether most of [p, p + n) is memory never touched since it was mapped: of `samples` pages
// spread over it, first to last, more than half are ones the kernel reports as not resident.
// False when it cannot tell or the range holds fewer whole pages than samples. A third of a
// microsecond a sample, where prefault_for_write over pages already there walks the range's
// page table (measured: 8 us for 512 KiB, 33 us for 4 MiB, about a tenth of a copy of them).
bool mostly_untouched(const void* p, std::uint64_t n, unsigned samples = 16) noexcept;

// Fresh memory is faulted in this many bytes at a time, each chunk just before it is written
// (still in the cache when the stores land).
inline constexpr std::uint64_t kPrefaultChunk = std::uint64_t{1} << 20;

// Writes [dst, dst + n) of memory never touched a chunk at a time: faults the chunk in
// (prefault_for_write), then calls write(offset, length) for it, offsets from dst. Chunks are
// kPrefaultChunk bytes (the last one shorter), so a writer of 2-, 4- or 8-byte elements gets
// whole elements wherever n is a whole number of them.
template <typename Write>
void prefault_then_write(void* dst, std::uint64_t n, Write&& write) {
  auto* base = static_cast<unsigned char*>(dst);
  for (std::uint64_t at = 0; at < n; at += kPrefaultChunk) {
    const std::uint64_t k = std::min(kPrefaultChunk, n - at);
    prefault_for_write(base + at, k);
    write(at, k);
  }
}

}  // namespace zeroflat::detail
