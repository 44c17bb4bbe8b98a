// Progress of a rank's reads, for the caller's display: the loader counts, the caller watches
// from another thread, and every display (the CLI's, the Python package's) words it the same way.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace zeroflat {

// Shared by a load (or several, one after the other: a resume reads many) and whoever watches
// it. Every count only grows; read them from any thread while the load runs.
struct ReadProgress {
  // The caller's own estimate of every byte this rank will read over the loads that share this
  // object (0: unknown). The display's total is the larger of it and `planned`.
  std::atomic<std::uint64_t> expected{0};
  // File bytes the loads have planned so far: each adds its rank's reads when it starts them.
  std::atomic<std::uint64_t> planned{0};
  // File bytes read so far (whole pieces of at most 8 MiB, as each one lands).
  std::atomic<std::uint64_t> done{0};

  std::uint64_t total() const noexcept {
    const std::uint64_t e = expected.load(std::memory_order_relaxed);
    const std::uint64_t p = planned.load(std::memory_order_relaxed);
    return e > p ? e : p;
  }
};

// One progress line, the same words everywhere: "read 1.2 GB of 2.7 GB (44%), 850 MB/s, about
// 2 s left" (rate and time left once anything was read; "of ..." once a total is known).
std::string describe_progress(std::uint64_t done, std::uint64_t total, double seconds);

}  // namespace zeroflat
