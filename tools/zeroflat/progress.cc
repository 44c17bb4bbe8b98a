// Progress lines on stderr.
#include "cli/progress.h"

#include <unistd.h>

#include <cstdio>

namespace zeroflat::cli {

Progress::Progress(bool enabled) : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::begin(std::string what, std::uint64_t total) {
  if (open_) end();
  what_ = std::move(what);
  total_ = total;
  done_ = 0;
  last_draw_ns_ = 0;
  start_ = std::chrono::steady_clock::now();
  open_ = true;
  if (!enabled_) return;
  if (tty_) {
    draw(true);
  } else {
    std::fprintf(stderr, "[zeroflat] %s ...\n", what_.c_str());
  }
}

void Progress::advance(std::uint64_t units) {
  done_.fetch_add(units, std::memory_order_relaxed);
  if (enabled_ && tty_) draw(false);
}

void Progress::draw(bool force) {
  const auto now = std::chrono::steady_clock::now();
  const std::int64_t ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(now - start_).count();
  std::int64_t last = last_draw_ns_.load(std::memory_order_relaxed);
  if (!force && ns - last < 100'000'000) return;  // at most 10 redraws a second
  if (!last_draw_ns_.compare_exchange_strong(last, ns)) return;
  std::unique_lock<std::mutex> lock(draw_mutex_, std::try_to_lock);
  if (!lock.owns_lock()) return;
  double pct =
      total_ > 0 ? 100.0 * static_cast<double>(done_.load()) / static_cast<double>(total_) : 0.0;
  std::fprintf(stderr, "\r[zeroflat] %s %5.1f%%", what_.c_str(), pct > 100 ? 100.0 : pct);
  std::fflush(stderr);
}

double Progress::end() {
  if (!open_) return 0.0;
  open_ = false;
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (enabled_) {
    std::lock_guard<std::mutex> lock(draw_mutex_);
    if (tty_) {
      std::fprintf(stderr, "\r[zeroflat] %s done in %.2f s\x1b[K\n", what_.c_str(), seconds);
    } else {
      std::fprintf(stderr, "[zeroflat] %s done in %.2f s\n", what_.c_str(), seconds);
    }
  }
  return seconds;
}

void Progress::note(const std::string& line) {
  if (enabled_) std::fprintf(stderr, "[zeroflat] %s\n", line.c_str());
}

}  // namespace zeroflat::cli
