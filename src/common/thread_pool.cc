// The host thread team.
#include "common/thread_pool.h"

#include <string>

#include "zeroflat/common.h"

namespace zeroflat::detail {

ThreadPool::ThreadPool(unsigned num_threads) : num_threads_(num_threads > 0 ? num_threads : 1) {
  workers_.reserve(num_threads_ - 1);
  for (unsigned i = 1; i < num_threads_; ++i) {
    try {
      workers_.emplace_back(start_thread(i, [this, i] { worker(i); }));
    } catch (const std::exception& e) {
      // The threads already started are stopped and joined: never a hang, never an abort.
      stop_all();
      throw ResourceExhausted("cannot start host thread " + std::to_string(i + 1) + " of " +
                              std::to_string(num_threads_) + ": " + e.what() +
                              " (a limit on processes or memory? ask for fewer threads: "
                              "--threads, ZEROFLAT_NUM_THREADS)");
    }
  }
}

ThreadPool::~ThreadPool() {
  stop_all();
}

void ThreadPool::stop_all() noexcept {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

namespace {
std::function<void(unsigned)> g_start_hook;  // testing aid (set_thread_start_hook)
}  // namespace

void set_thread_start_hook(std::function<void(unsigned)> hook) {
  g_start_hook = std::move(hook);
}

std::thread start_thread(unsigned index, std::function<void()> body) {
  if (g_start_hook) g_start_hook(index);
  return std::thread(std::move(body));
}

void ThreadPool::run(const std::function<void(unsigned)>& fn) {
  if (num_threads_ == 1) {
    fn(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &fn;
    pending_ = num_threads_ - 1;
    error_ = nullptr;
    ++generation_;
  }
  start_cv_.notify_all();
  std::exception_ptr mine;
  try {
    fn(0);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return pending_ == 0; });
  task_ = nullptr;
  if (mine) std::rethrow_exception(mine);
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker(unsigned index) {
  std::uint64_t seen = 0;
  for (;;) {
    const std::function<void(unsigned)>* task = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      task = task_;
    }
    std::exception_ptr error;
    try {
      (*task)(index);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

Range split_range(std::uint64_t total, unsigned parts, unsigned index, std::uint64_t grain) {
  if (grain == 0) grain = 1;
  std::uint64_t units = (total + grain - 1) / grain;
  std::uint64_t base = units / parts;
  std::uint64_t extra = units % parts;
  std::uint64_t begin_units = index * base + (index < extra ? index : extra);
  std::uint64_t count = base + (index < extra ? 1 : 0);
  std::uint64_t begin = begin_units * grain;
  std::uint64_t end = (begin_units + count) * grain;
  if (begin > total) begin = total;
  if (end > total) end = total;
  return {begin, end};
}

}  // namespace zeroflat::detail
