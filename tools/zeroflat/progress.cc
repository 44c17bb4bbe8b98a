// Progress lines on stderr.
#include "cli/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace zeroflat::cli {

Progress::Progress(bool enabled) : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0) {
  // The Python package reads the same variable.
  if (const char* s = std::getenv("ZEROFLAT_PROGRESS_SECONDS")) {
    char* end = nullptr;
    const double v = std::strtod(s, &end);
    // At most a million seconds: a longer interval is no line at all during any load, and
    // past about 9.2e9 s a deadline in steady_clock's nanoseconds would wrap into the past.
    if (end != s && *end == '\0' && v > 0 && std::isfinite(v)) interval_ = std::min(v, 1e6);
  }
}

Progress::~Progress() {
  if (open_) end();
}

void Progress::begin(std::string what, std::uint64_t total,
                     std::shared_ptr<const ReadProgress> reads) {
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
  if (reads != nullptr) {
    reads_ = std::move(reads);
    stop_ = false;
    ticker_ = std::thread([this] { watch(); });
  }
}

void Progress::advance(std::uint64_t units) {
  done_.fetch_add(units, std::memory_order_relaxed);
  if (enabled_ && tty_) draw(false);
}

std::string Progress::reads_line() const {
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  return what_ + ": " +
         describe_progress(reads_->done.load(std::memory_order_relaxed), reads_->total(), s);
}

void Progress::watch() {
  const auto period = tty_ ? std::chrono::duration<double>(0.25)
                           : std::chrono::duration<double>(interval_);
  std::unique_lock<std::mutex> lock(tick_mutex_);
  while (!tick_cv_.wait_for(lock, period, [this] { return stop_; })) {
    std::lock_guard<std::mutex> draw(draw_mutex_);
    if (tty_) {
      std::fprintf(stderr, "\r[zeroflat] %s\x1b[K", reads_line().c_str());
      std::fflush(stderr);
    } else {
      std::fprintf(stderr, "[zeroflat] %s\n", reads_line().c_str());
    }
  }
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
  if (ticker_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(tick_mutex_);
      stop_ = true;
    }
    tick_cv_.notify_all();
    ticker_.join();
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  if (enabled_) {
    std::lock_guard<std::mutex> lock(draw_mutex_);
    std::string tail;
    if (reads_ != nullptr && reads_->done.load() > 0) {
      tail = ": " + describe_progress(reads_->done.load(), reads_->total(), seconds);
    }
    if (tty_) {
      std::fprintf(stderr, "\r[zeroflat] %s done in %.2f s%s\x1b[K\n", what_.c_str(), seconds,
                   tail.c_str());
    } else {
      std::fprintf(stderr, "[zeroflat] %s done in %.2f s%s\n", what_.c_str(), seconds,
                   tail.c_str());
    }
  }
  reads_.reset();
  return seconds;
}

void Progress::note(const std::string& line) {
  if (enabled_) std::fprintf(stderr, "[zeroflat] %s\n", line.c_str());
}

}  // namespace zeroflat::cli
