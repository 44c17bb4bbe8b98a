#include "common/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>

namespace zeroflat::detail {

void prefault_for_write(void* p, std::uint64_t n) noexcept {
#ifdef MADV_POPULATE_WRITE
  // Whether the kernel knows the advice, asked once of a page of our own (a failure on the
  // caller's range, a mapping the kernel cannot populate, says nothing of the next one).
  static const bool supported = [] {
    const long size = sysconf(_SC_PAGESIZE);
    if (size <= 0) return false;
    void* q = mmap(nullptr, static_cast<std::size_t>(size), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (q == MAP_FAILED) return false;
    const bool ok = madvise(q, static_cast<std::size_t>(size), MADV_POPULATE_WRITE) == 0;
    munmap(q, static_cast<std::size_t>(size));
    return ok;
  }();
  if (!supported) return;
  static const long page_size = sysconf(_SC_PAGESIZE);
  const auto page = static_cast<std::uintptr_t>(page_size);
  const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(p) + page - 1) / page * page;
  const std::uintptr_t hi = (reinterpret_cast<std::uintptr_t>(p) + n) / page * page;
  // Whatever it answers: where it could not, the stores fault the pages in.
  if (hi > lo) (void)madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);
#else
  (void)p;
  (void)n;
#endif
}

bool mostly_untouched(const void* p, std::uint64_t n, unsigned samples) noexcept {
  const long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return false;
  const auto page = static_cast<std::uintptr_t>(page_size);
  if (samples < 2) samples = 2;
  const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(p) + page - 1) / page * page;
  const std::uintptr_t hi = (reinterpret_cast<std::uintptr_t>(p) + n) / page * page;
  if (hi <= lo || (hi - lo) / page < samples) return false;
  const std::uintptr_t pages = (hi - lo) / page;
  std::uintptr_t untouched = 0;
  for (std::uintptr_t i = 0; i < samples; ++i) {
    unsigned char resident = 0;
    const std::uintptr_t at = lo + (pages - 1) * i / (samples - 1) * page;
    if (mincore(reinterpret_cast<void*>(at), page, &resident) != 0) return false;
    if ((resident & 1) == 0) ++untouched;
  }
  return untouched * 2 > samples;
}

}  // namespace zeroflat::detail
