// Progress of long phases on stderr: a live percentage on a terminal, start/end lines otherwise.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>

namespace zeroflat::cli {

class Progress {
 public:
  explicit Progress(bool enabled);

  // Starts a phase of `total` units (bytes, say); ends any phase still open.
  void begin(std::string what, std::uint64_t total);
  // Adds done units; safe to call from any thread.
  void advance(std::uint64_t units);
  // Ends the phase with its duration; returns the seconds it took.
  double end();
  // A one-line note.
  void note(const std::string& line);

 private:
  void draw(bool force);

  bool enabled_;
  bool tty_;
  std::string what_;
  std::uint64_t total_ = 0;
  std::atomic<std::uint64_t> done_{0};
  std::atomic<std::int64_t> last_draw_ns_{0};
  std::chrono::steady_clock::time_point start_;
  std::mutex draw_mutex_;
  bool open_ = false;
};

}  // namespace zeroflat::cli
