// Progress of long phases on stderr: a live percentage on a terminal, start/end lines otherwise;
// a phase that reads files says how far its reads are (bytes, rate, time left) in the library's
// words (common.h), as the Python package's log lines do.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "zeroflat/common.h"

namespace zeroflat::cli {

class Progress {
 public:
  explicit Progress(bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Starts a phase of `total` units (bytes, say); ends any phase still open. With `reads`, the
  // phase reports them until it ends: on a terminal a line redrawn up to 4 times a second, else a
  // line every 10 s (ZEROFLAT_PROGRESS_SECONDS, a positive number up to 1e6, sets it) once the
  // phase has run that long, so that short phases print only their start and end.
  void begin(std::string what, std::uint64_t total,
             std::shared_ptr<const ReadProgress> reads = nullptr);
  // Adds done units; safe to call from any thread.
  void advance(std::uint64_t units);
  // Ends the phase with its duration; returns the seconds it took.
  double end();
  // A one-line note.
  void note(const std::string& line);

 private:
  void draw(bool force);
  void watch();  // the reads' ticker, on its own thread
  std::string reads_line() const;

  bool enabled_;
  bool tty_;
  double interval_ = 10;
  std::string what_;
  std::uint64_t total_ = 0;
  std::atomic<std::uint64_t> done_{0};
  std::atomic<std::int64_t> last_draw_ns_{0};
  std::chrono::steady_clock::time_point start_;
  std::mutex draw_mutex_;
  bool open_ = false;
  std::shared_ptr<const ReadProgress> reads_;
  std::thread ticker_;
  std::mutex tick_mutex_;
  std::condition_variable tick_cv_;
  bool stop_ = false;
};

}  // namespace zeroflat::cli
