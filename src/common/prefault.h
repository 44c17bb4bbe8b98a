// Faulting in fresh memory before it is written.
#pragma once

#include <cstdint>

namespace zeroflat::detail {

// Faults in the pages of [p, p + n) for writing with one call to the kernel
// (MADV_POPULATE_WRITE, Linux 5.14 on), where the stores would take one fault per 4 KiB page:
// 1.5 to 1.7 x faster on the machine measured (docs/performance.md), where the fault itself,
// not the zeroing of the page, is most of a first touch. Only the whole pages inside the range;
// values already there stay. Does nothing where the kernel cannot (the stores then fault the
// pages in as before).
void prefault_for_write(void* p, std::uint64_t n) noexcept;

}  // namespace zeroflat::detail
