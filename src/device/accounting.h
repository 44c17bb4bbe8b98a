// Byte counters of a device backend: what is allocated now and the high-water mark, safe to
// update from several threads.
#pragma once

#include <atomic>
#include <cstdint>

namespace zeroflat::detail {

class ByteCounter {
 public:
  // Adds n and raises the peak to the new total.
  void add(std::uint64_t n) noexcept {
    const std::uint64_t now = current_.fetch_add(n) + n;
    raise_peak(now);
  }
  // Adds n only if the total stays at or below limit; returns whether it did.
  bool try_add(std::uint64_t n, std::uint64_t limit) noexcept {
    std::uint64_t now = current_.load();
    do {
      if (n > limit || now > limit - n) return false;
    } while (!current_.compare_exchange_weak(now, now + n));
    raise_peak(now + n);
    return true;
  }
  void sub(std::uint64_t n) noexcept { current_.fetch_sub(n); }
  std::uint64_t current() const noexcept { return current_.load(); }
  std::uint64_t peak() const noexcept { return peak_.load(); }

 private:
  void raise_peak(std::uint64_t now) noexcept {
    std::uint64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }
  std::atomic<std::uint64_t> current_{0};
  std::atomic<std::uint64_t> peak_{0};
};

}  // namespace zeroflat::detail
