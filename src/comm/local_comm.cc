// The `local` communicator: ranks as threads of one process, meeting at generation barriers.
#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat {

bool Communicator::gathers_parts(const Device&) const noexcept {
  return false;
}

void Communicator::all_gather_part(void*, std::uint64_t, std::uint64_t, std::uint64_t, Device&) {
  throw Unsupported(name() + ": no all-gather of a part of each slice");
}

struct LocalGroup::State {
  int size;
  std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable cv;
  // Barrier: ranks arrived in the current generation.
  std::uint64_t generation = 0;
  std::vector<bool> arrived;
  // Exchange slots, one per rank, valid between the two barriers of a collective.
  std::vector<void*> buffers;
  std::vector<std::uint64_t> slice_bytes;  // each rank's all-gather slice, 0 when it keeps no data
  std::vector<std::array<std::uint64_t, 2>> parts;  // the part of it gathered: offset, bytes
  std::vector<std::vector<std::uint64_t>> values;
  // Failure: set once, seen by everyone.
  bool failed = false;
  std::string failure;

  // Waits until every rank has arrived (or a failure, or the timeout). Caller holds `lock`.
  void meet(std::unique_lock<std::mutex>& lock, int rank, const char* what) {
    if (failed) throw CommError(failure);
    const std::uint64_t mine = generation;
    arrived[static_cast<std::size_t>(rank)] = true;
    if (std::all_of(arrived.begin(), arrived.end(), [](bool a) { return a; })) {
      std::fill(arrived.begin(), arrived.end(), false);
      ++generation;
      cv.notify_all();
      return;
    }
    const bool done = cv.wait_for(lock, timeout, [&] { return failed || generation != mine; });
    if (failed) throw CommError(failure);
    if (!done) {
      std::string missing;
      for (int r = 0; r < size; ++r) {
        if (!arrived[static_cast<std::size_t>(r)]) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
      }
      failed = true;
      failure = std::string(what) + ": rank " + std::to_string(rank) + " waited " +
                std::to_string(timeout.count()) + " ms for rank(s) " + missing +
                ", which never arrived";
      cv.notify_all();
      throw CommError(failure);
    }
  }
};

namespace {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<LocalGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  std::string name() const override { return "local"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return state_->size; }

  void all_gather_inplace(void* buffer, std::uint64_t slice_bytes, Device& device) override {
    gather(buffer, slice_bytes, 0, slice_bytes, device, "all-gather");
  }

  bool gathers_parts(const Device& device) const noexcept override {
    return device.keeps_data() && device.host_accessible();
  }

  void all_gather_part(void* buffer, std::uint64_t slice_bytes, std::uint64_t offset,
                       std::uint64_t bytes, Device& device) override {
    if (offset > slice_bytes || bytes > slice_bytes - offset) {
      throw InvalidArgument("local all-gather of a part: bytes [" + std::to_string(offset) + ", +" +
                            std::to_string(bytes) + ") are outside a slice of " +
                            std::to_string(slice_bytes));
    }
    gather(buffer, slice_bytes, offset, bytes, device, "all-gather of a part");
  }

  void all_reduce_min(std::span<std::uint64_t> values) override { reduce(values, true); }
  void all_reduce_max(std::span<std::uint64_t> values) override { reduce(values, false); }

  void barrier() override {
    std::unique_lock<std::mutex> lock(state_->mutex);
    state_->meet(lock, rank_, "barrier");
  }

  void abort(const std::string& why) noexcept override {
    try {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (!state_->failed) {
        state_->failed = true;
        state_->failure = "rank " + std::to_string(rank_) + " failed: " + why;
      }
    } catch (...) {
    }
    state_->cv.notify_all();
  }

 private:
  // Bytes [r * slice_bytes + offset, +bytes) of every rank r's buffer into this rank's.
  void gather(void* buffer, std::uint64_t slice_bytes, std::uint64_t offset, std::uint64_t bytes,
              Device& device, const char* what) {
    if (device.keeps_data() && !device.host_accessible()) {
      throw InvalidArgument("local: the all-gather copies host memory, and " + device.name() +
                            " memory is not; use the nccl communicator for it");
    }
    State& s = *state_;
    std::unique_lock<std::mutex> lock(s.mutex);
    const auto me = static_cast<std::size_t>(rank_);
    s.buffers[me] = buffer;
    s.slice_bytes[me] = device.keeps_data() ? slice_bytes : 0;
    s.parts[me] = device.keeps_data() ? std::array<std::uint64_t, 2>{offset, bytes}
                                      : std::array<std::uint64_t, 2>{0, 0};
    s.meet(lock, rank_, what);
    // Every rank's byte counts, before anyone copies: a peer with a shorter buffer would be read
    // past its end. Every rank sees the same counts, so all refuse together.
    const auto [lo, hi] = std::minmax_element(s.slice_bytes.begin(), s.slice_bytes.end());
    if (*lo != *hi) {
      throw InvalidArgument(std::string("local ") + what + ": the ranks passed slices of " +
                            std::to_string(*lo) + " to " + std::to_string(*hi) +
                            " bytes (this rank " + std::to_string(rank_) + ": " +
                            std::to_string(s.slice_bytes[me]) + "); nothing was copied");
    }
    if (std::any_of(s.parts.begin(), s.parts.end(),
                    [&](const auto& p) { return p != s.parts[me]; })) {
      throw InvalidArgument(std::string("local ") + what +
                            ": the ranks passed different parts of their slices; nothing was "
                            "copied");
    }
    // Every buffer is registered; read the peers' parts into this rank's buffer. Nobody writes
    // a part it does not own, so the copies need no lock.
    std::vector<void*> peers = s.buffers;
    lock.unlock();
    if (device.keeps_data()) {
      for (int r = 0; r < s.size; ++r) {
        if (r == rank_) continue;
        const std::uint64_t off = static_cast<std::uint64_t>(r) * slice_bytes + offset;
        std::memcpy(static_cast<unsigned char*>(buffer) + off,
                    static_cast<const unsigned char*>(peers[static_cast<std::size_t>(r)]) + off,
                    bytes);
      }
    }
    lock.lock();
    s.meet(lock, rank_, what);  // nobody leaves while a peer still reads its buffer
  }

  using State = LocalGroup::State;

  void reduce(std::span<std::uint64_t> values, bool min) {
    State& s = *state_;
    std::unique_lock<std::mutex> lock(s.mutex);
    s.values[static_cast<std::size_t>(rank_)].assign(values.begin(), values.end());
    s.meet(lock, rank_, "all-reduce");
    for (int r = 0; r < s.size; ++r) {
      const auto& theirs = s.values[static_cast<std::size_t>(r)];
      if (theirs.size() != values.size()) {
        s.failed = true;
        s.failure = "all-reduce: rank " + std::to_string(r) + " passed " +
                    std::to_string(theirs.size()) + " values, rank " + std::to_string(rank_) + " " +
                    std::to_string(values.size());
        s.cv.notify_all();
        throw CommError(s.failure);
      }
      for (std::size_t i = 0; i < values.size(); ++i) {
        values[i] = min ? std::min(values[i], theirs[i]) : std::max(values[i], theirs[i]);
      }
    }
    s.meet(lock, rank_, "all-reduce");
  }

  std::shared_ptr<State> state_;
  int rank_;
};

}  // namespace

LocalGroup::LocalGroup(int size, std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  if (size < 1)
    throw InvalidArgument("a local group needs at least 1 rank, not " + std::to_string(size));
  state_->size = size;
  state_->timeout = timeout;
  state_->arrived.assign(static_cast<std::size_t>(size), false);
  state_->buffers.assign(static_cast<std::size_t>(size), nullptr);
  state_->slice_bytes.assign(static_cast<std::size_t>(size), 0);
  state_->parts.assign(static_cast<std::size_t>(size), {0, 0});
  state_->values.resize(static_cast<std::size_t>(size));
}

LocalGroup::~LocalGroup() = default;

int LocalGroup::size() const noexcept {
  return state_->size;
}

std::unique_ptr<Communicator> LocalGroup::rank(int r) {
  if (r < 0 || r >= state_->size) {
    throw InvalidArgument("rank " + std::to_string(r) + " is outside the local group of " +
                          std::to_string(state_->size));
  }
  return std::make_unique<LocalCommunicator>(state_, r);
}

}  // namespace zeroflat
