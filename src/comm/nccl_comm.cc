// The `nccl` communicator: the in-place all-gather with NCCL on a cuda device's stream; the small
// all-reduces and the barrier over the bootstrap communicator that also carried the unique id.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "device/cuda_check.h"
#include "device/cuda_device.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

using Clock = std::chrono::steady_clock;

static_assert(sizeof(ncclUniqueId) == 16 * sizeof(std::uint64_t),
              "the unique id travels as 16 words over the bootstrap's all-reduce");

std::string nccl_text(ncclResult_t r) {
  return std::string(ncclGetErrorString(r)) + " (ncclResult " +
         std::to_string(static_cast<int>(r)) + ")";
}

// Polling without burning a core for long: a small all-gather finishes in microseconds, so the
// first rounds only yield; after that the thread sleeps between looks.
class Backoff {
 public:
  void wait() {
    if (rounds_ < 2000) {
      ++rounds_;
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  int rounds_ = 0;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator& bootstrap, detail::CudaDevice& device,
                   std::chrono::milliseconds timeout)
      : bootstrap_(bootstrap),
        device_(device),
        timeout_(timeout),
        rank_(bootstrap.rank()),
        size_(bootstrap.size()) {
    // Rank 0 makes the id; everyone else contributes zeros, so the maximum is rank 0's id.
    std::array<std::uint64_t, 16> words{};
    ncclUniqueId id{};
    if (rank_ == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) {
        const std::string why = where() + "ncclGetUniqueId failed: " + nccl_text(r);
        bootstrap_.abort(why);
        throw CommError(why);
      }
      std::memcpy(words.data(), &id, sizeof id);
    }
    bootstrap_.all_reduce_max(words);
    std::memcpy(&id, words.data(), sizeof id);

    device_.activate();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every call returns at once; we poll, with a deadline
    const auto deadline = Clock::now() + timeout_;
    ncclComm_t comm = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&comm, size_, id, rank_, &config);
    comm_ = comm;
    if (r != ncclSuccess && r != ncclInProgress) {
      fail("ncclCommInitRankConfig failed: " + nccl_text(r) + last_error());
    }
    wait_ready("ncclCommInitRankConfig", deadline);
  }

  ~NcclCommunicator() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (comm_ == nullptr) return;
    (void)cudaSetDevice(device_.ordinal());
    // Finalize flushes outstanding work without blocking; a peer that never gets there must not
    // hang this destructor, so after the timeout the communicator is aborted instead.
    bool clean = false;
    ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) {
      const auto deadline = Clock::now() + timeout_;
      Backoff backoff;
      ncclResult_t state = ncclInProgress;
      while (ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
             Clock::now() < deadline) {
        backoff.wait();
      }
      clean = state == ncclSuccess;
    }
    if (clean) {
      (void)ncclCommDestroy(comm_);
    } else {
      (void)ncclCommAbort(comm_);
    }
    comm_ = nullptr;
    (void)cudaGetLastError();
  }

  std::string name() const override { return "nccl"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }

  void all_gather_inplace(void* buffer, std::uint64_t slice_bytes, Device& device) override {
    auto* cuda = dynamic_cast<detail::CudaDevice*>(&device);
    if (cuda == nullptr || cuda->ordinal() != device_.ordinal()) {
      throw InvalidArgument(where() + "all_gather_inplace on device '" + device.name() +
                            "': this communicator was made for " + device_.name());
    }
    check_not_aborted();
    // Every rank's byte count, over the bootstrap, before NCCL reads a peer's buffer.
    std::uint64_t counts[2] = {slice_bytes, ~slice_bytes};
    all_reduce_max(counts);
    if (counts[0] != ~counts[1]) {
      throw InvalidArgument(where() + "all_gather_inplace: the ranks passed slices of " +
                            std::to_string(~counts[1]) + " to " + std::to_string(counts[0]) +
                            " bytes; nothing was copied");
    }
    if (slice_bytes == 0) return;
    if (buffer == nullptr) {
      throw InvalidArgument(where() + "all_gather_inplace of " + format_bytes(slice_bytes) +
                            " per rank into a null buffer");
    }
    if (slice_bytes > ~std::uint64_t{0} / static_cast<std::uint64_t>(size_)) {
      throw InvalidArgument(where() + "all_gather_inplace: " + std::to_string(slice_bytes) +
                            " bytes per rank times " + std::to_string(size_) + " ranks overflows");
    }
    cuda->activate();
    cudaStream_t stream = cuda->stream();
    auto* base = static_cast<unsigned char*>(buffer);
    const std::string what = "ncclAllGather of " + format_bytes(slice_bytes) + " per rank";
    const auto deadline = Clock::now() + timeout_;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (comm_ == nullptr) throw CommError(where() + "aborted: " + reason_);
      // In place: NCCL recognizes sendbuff == recvbuff + rank * sendcount.
      const ncclResult_t r = ncclAllGather(base + static_cast<std::uint64_t>(rank_) * slice_bytes,
                                           base, slice_bytes, ncclUint8, comm_, stream);
      if (r != ncclSuccess && r != ncclInProgress) {
        fail_locked(what + " failed: " + nccl_text(r) + last_error());
      }
    }
    wait_ready(what.c_str(), deadline);
    // Queued; now wait for the stream, watching for a peer's failure and the deadline.
    Backoff backoff;
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) {
        (void)cudaGetLastError();
        fail(what + ": the stream failed: " + detail::cuda_error_text(e));
      }
      poll(what.c_str());
      if (Clock::now() > deadline) {
        fail(what + " did not finish within " + std::to_string(timeout_.count()) +
             " ms (has a peer rank failed or stopped calling it?)");
      }
      backoff.wait();
    }
  }

  void all_reduce_min(std::span<std::uint64_t> values) override {
    check_not_aborted();
    bootstrap_.all_reduce_min(values);
  }
  void all_reduce_max(std::span<std::uint64_t> values) override {
    check_not_aborted();
    bootstrap_.all_reduce_max(values);
  }
  void barrier() override {
    check_not_aborted();
    bootstrap_.barrier();
  }

  // Aborts the NCCL communicator (any collective in flight ends) and the bootstrap, through
  // which the other ranks learn the reason.
  void abort(const std::string& why) noexcept override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      abort_locked(why);
    }
    try {
      bootstrap_.abort(why);
    } catch (...) {
      // abort() never throws; the bootstrap's own abort is noexcept too.
    }
  }

 private:
  std::string where() const {
    return "nccl rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ": ";
  }

  // NCCL's own account of the last failure, when it has one.
  std::string last_error() const {
    const char* text = ncclGetLastError(comm_);
    return text != nullptr && text[0] != '\0' ? std::string(": ") + text : std::string();
  }

  void check_not_aborted() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) throw CommError(where() + "aborted: " + reason_);
  }

  // Throws CommError if the communicator has failed or been aborted; returns whether a
  // non-blocking call is still in progress.
  bool poll(const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_ || comm_ == nullptr) throw CommError(where() + "aborted: " + reason_);
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) {
      fail_locked(std::string(what) + ": ncclCommGetAsyncError failed: " + nccl_text(r));
    }
    if (state != ncclSuccess && state != ncclInProgress) {
      fail_locked(std::string(what) + " failed: " + nccl_text(state) + last_error());
    }
    return state == ncclInProgress;
  }

  // Waits until the last non-blocking call has left ncclInProgress.
  void wait_ready(const char* what, Clock::time_point deadline) {
    Backoff backoff;
    while (poll(what)) {
      if (Clock::now() > deadline) {
        fail(std::string(what) + " did not finish within " + std::to_string(timeout_.count()) +
             " ms (has a peer rank failed or stopped calling it?)");
      }
      backoff.wait();
    }
  }

  [[noreturn]] void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_locked(why);
  }

  [[noreturn]] void fail_locked(const std::string& why) {
    const std::string message = where() + why;
    abort_locked(message);
    throw CommError(message);
  }

  void abort_locked(const std::string& why) noexcept {
    if (!aborted_) {
      aborted_ = true;
      reason_ = why;
    }
    if (comm_ != nullptr) {
      (void)cudaSetDevice(device_.ordinal());
      (void)ncclCommAbort(comm_);  // frees the communicator; the handle is dead after this
      comm_ = nullptr;
    }
  }

  Communicator& bootstrap_;
  detail::CudaDevice& device_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int size_;
  std::mutex mutex_;  // comm_, aborted_, reason_: abort() may come from another thread
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
  std::string reason_;
};

}  // namespace

bool have_nccl() noexcept {
  return true;
}

std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap, Device& device,
                                                     std::chrono::milliseconds timeout) {
  auto* cuda = dynamic_cast<detail::CudaDevice*>(&device);
  if (cuda == nullptr) {
    throw InvalidArgument("the nccl communicator needs a cuda device, not '" + device.name() + "'");
  }
  if (timeout.count() <= 0) {
    throw InvalidArgument("the nccl communicator's timeout must be positive, not " +
                          std::to_string(timeout.count()) + " ms");
  }
  return std::make_unique<NcclCommunicator>(bootstrap, *cuda, timeout);
}

}  // namespace zeroflat
