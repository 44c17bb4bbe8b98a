// A fixed team of host threads that run one function on every member and wait for all of them.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zeroflat::detail {

class ThreadPool {
 public:
  // A team of num_threads members: the calling thread of run() plus num_threads - 1 workers.
  // Throws ResourceExhausted when the system refuses a thread, after stopping and joining the
  // ones already started.
  explicit ThreadPool(unsigned num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const noexcept { return num_threads_; }

  // Calls fn(t) for every t in [0, size()), concurrently, and returns when all have returned.
  // The caller runs t = 0. The first exception thrown by any member is rethrown here after all
  // have finished. Not reentrant: one run() at a time per pool.
  void run(const std::function<void(unsigned)>& fn);

 private:
  void worker(unsigned index);
  void stop_all() noexcept;

  unsigned num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(unsigned)>* task_ = nullptr;
  std::uint64_t generation_ = 0;
  unsigned pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// Starts a thread running body (index names it for the testing hook). Throws what
// std::thread's constructor throws (std::system_error) when the system refuses.
std::thread start_thread(unsigned index, std::function<void()> body);
// Testing aid: called with the index before each thread start_thread makes; it may throw to
// play a system that refuses threads. An empty function removes it. Not thread-safe: set it
// while no thread is being started.
void set_thread_start_hook(std::function<void(unsigned)> hook);

// [begin, end) of part `index` when `total` is split into `parts` nearly equal pieces whose
// boundaries are multiples of `grain` (except the total itself).
struct Range {
  std::uint64_t begin;
  std::uint64_t end;
};
Range split_range(std::uint64_t total, unsigned parts, unsigned index, std::uint64_t grain);

}  // namespace zeroflat::detail
