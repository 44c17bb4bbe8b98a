// Wall time for the reports: seconds elapsed on the monotonic clock.
#pragma once

#include <chrono>

namespace zeroflat::detail {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace zeroflat::detail
