// The executor: runs a step list, agrees with the other ranks at the points of no return, and
// rolls back or recovers forward on failure (see executor.h). Past 700 lines on purpose: the
// steps, the agreements between them and the rollback of each are one state machine; what a
// failure at step k must undo is read beside step k.
#include "exec/executor.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "common/clock.h"
#include "common/convert.h"
#include "common/prefault.h"
#include "zeroflat/common.h"

namespace zeroflat {

std::string_view outcome_name(Outcome outcome) noexcept {
  switch (outcome) {
    case Outcome::kDone:
      return "done";
    case Outcome::kRolledBack:
      return "rolled back";
    case Outcome::kRecovered:
      return "recovered";
    case Outcome::kLost:
      return "lost";
  }
  return "?";
}

namespace {

using detail::Clock;

// What a rank tells the others at an agreement point, as one number so that the maximum over
// ranks keeps the worst news: severity, then the step, then the rank.
constexpr std::uint64_t kFailed = 1;  // a step failed; recovery is still possible
constexpr std::uint64_t kGone = 2;    // a step failed while recovering: data is lost

std::uint64_t encode(std::uint64_t severity, std::size_t step, std::uint64_t rank) {
  return severity << 56 | (std::uint64_t{step} + 1) << 24 | (rank + 1);
}
std::size_t step_of(std::uint64_t code) {
  return static_cast<std::size_t>(((code >> 24) & ((std::uint64_t{1} << 32) - 1)) - 1);
}
int rank_of(std::uint64_t code) {
  return static_cast<int>((code & ((std::uint64_t{1} << 24) - 1)) - 1);
}

bool is_agreement_point(const Step& step) {
  return step.op == Op::kAllGather || step.op == Op::kReleaseOriginals;
}

// An overlapped read's parts: the executor's choice is one per 8 MiB, up to 8 (the last part's
// all-gather is what the overlap leaves to wait for); none smaller than 64 KiB on request (the
// last, a quarter of the others, no smaller than 16 KiB).
constexpr std::uint64_t kAutoPartBytes = std::uint64_t{8} << 20;
constexpr std::uint32_t kAutoParts = 8;
constexpr std::uint64_t kMinPartBytes = std::uint64_t{64} << 10;
constexpr std::uint32_t kMaxParts = 256;
// How far a rank's read runs ahead of the parts' all-gathers: part i is read once part
// i - kReadAhead is gathered (every rank has read it). Ranks that share a storage then read at one
// pace, rather than one finishing early and the gathers, each held by the slowest rank's part,
// piling up after the last read.
constexpr std::uint32_t kReadAhead = 2;

// The read step whose parts can be gathered while the rest is read: a read of this rank's slice
// in place into the flat buffer, followed later by the in-place all-gather of that buffer. The
// same on every rank (it depends on the list's shape only), so that every rank agrees there.
// Lists that release the originals are left alone: their recovery pass may start on either side
// of the read on different ranks (a load's list never releases them: it rolls back).
std::optional<std::size_t> overlap_candidate(const std::vector<Step>& steps, std::uint64_t sb) {
  for (const Step& s : steps) {
    if (s.op == Op::kReleaseOriginals) return std::nullopt;
  }
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const Step& r = steps[k];
    if (r.op != Op::kRead || r.buffer != Buffer::kFlat || r.bytes != sb || sb == 0 ||
        r.flat_offset != r.dst_offset) {
      continue;
    }
    for (std::size_t j = k + 1; j < steps.size(); ++j) {
      const Step& g = steps[j];
      if (g.op == Op::kAllGather) {
        if (g.buffer == Buffer::kFlat && g.source == Buffer::kFlat) return k;
        break;
      }
      if (g.op != Op::kRelease || g.buffer != Buffer::kHostStage) break;
    }
  }
  return std::nullopt;
}

// The read of this rank's slot of the layout into partition master_slot of the flat buffer: what
// ExecuteOptions::master up-casts as its parts arrive. None in a list that releases the
// originals (as overlap_candidate).
std::optional<std::size_t> slot_read(const std::vector<Step>& steps, const Layout& layout,
                                     std::uint64_t slot, std::uint64_t master_slot) {
  const std::uint64_t sb = layout.partition_bytes();
  if (sb == 0) return std::nullopt;
  for (const Step& s : steps) {
    if (s.op == Op::kReleaseOriginals) return std::nullopt;
  }
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const Step& r = steps[k];
    if (r.op == Op::kRead && r.buffer == Buffer::kFlat && r.bytes == sb &&
        r.flat_offset == slot * sb && r.dst_offset == master_slot * sb) {
      return k;
    }
  }
  return std::nullopt;
}

// How one pass over the list ended.
struct PassEnd {
  std::uint64_t agreed = 0;                 // 0: every rank reached the end without failure
  std::size_t stopped_at = 0;               // the agreement point (steps.size() for the end)
  std::optional<std::size_t> local_failed;  // this rank's failed step, if any
  std::string local_error;
  bool comm_broken = false;  // an agreement itself failed: the ranks can no longer talk
  std::string comm_error;
};

class Run {
 public:
  Run(const std::vector<Step>& steps, const Layout& layout, std::uint64_t slot,
      std::span<TensorRef> params, Device& device, Communicator* comm, StepSource& source,
      const ExecuteOptions& options)
      : steps_(steps),
        layout_(layout),
        slot_(slot),
        params_(params),
        device_(device),
        comm_(comm != nullptr && comm->size() > 1 ? comm : nullptr),
        rank_(comm_ != nullptr ? static_cast<std::uint64_t>(comm_->rank()) : slot),
        source_(source),
        options_(options),
        machine_(std::max(device.memory_info().allocated_bytes, source.resident_bytes()),
                 source.resident_bytes()),
        step_seconds_(steps.size(), 0.0),
        overlap_read_(comm_ != nullptr ? overlap_candidate(steps, layout.partition_bytes())
                                       : std::nullopt),
        master_read_(options.master &&
                             builds_master(steps, layout, slot, options.master_slot, device)
                         ? slot_read(steps, layout, slot, options.master_slot)
                         : std::nullopt) {
    originals_.reserve(params.size());
    for (const TensorRef& t : params) originals_.push_back(t.data);
  }

  Execution execute() {
    const auto t0 = Clock::now();
    Execution out;
    PassEnd first = pass(0, /*inject=*/true);
    if (first.agreed == 0 && !first.comm_broken) {
      out.outcome = Outcome::kDone;
    } else if (!machine_.originals_released()) {
      rollback();
      out.outcome = Outcome::kRolledBack;
      out.error = failure_text(first) +
                  "; rolled back: nothing had been released, every buffer the steps allocated "
                  "is freed and every parameter holds what it held before, untouched";
    } else if (first.comm_broken) {
      if (!first.local_failed && first.stopped_at == steps_.size()) {
        // Every step of this rank ran; only the last agreement could not be had.
        out.outcome = Outcome::kRecovered;
        out.error = failure_text(first) +
                    "; this rank finished every step, so its parameters are views into its "
                    "complete flat buffer, but the other ranks could not confirm theirs";
      } else {
        lose();
        out.outcome = Outcome::kLost;
        out.error = failure_text(first) + "; " + lost_text();
      }
    } else {
      // Recover forward: re-run the list from where this rank stopped, without the fault.
      const std::size_t from = first.local_failed.value_or(first.stopped_at);
      PassEnd second = pass(from, /*inject=*/false);
      if (second.agreed == 0 && !second.comm_broken) {
        out.outcome = Outcome::kRecovered;
        out.error = failure_text(first) +
                    "; recovered: the originals had been released, so the rest of the steps ran "
                    "again and every parameter holds its original values as a view into the "
                    "completed flat buffer";
      } else {
        lose();
        out.outcome = Outcome::kLost;
        out.error = failure_text(first) + "; recovery failed too (" + failure_text(second) + "); " +
                    lost_text();
      }
    }
    if (first.agreed != 0) {
      out.failed_step = step_of(first.agreed);
      out.failed_rank = rank_of(first.agreed);
    } else if (first.local_failed) {
      out.failed_step = first.local_failed;
      out.failed_rank = static_cast<int>(rank_);
    }
    if (out.outcome == Outcome::kDone || out.outcome == Outcome::kRecovered) {
      out.group.layout = layout_;
      out.group.flat = adopt_flat();
      out.group.views.assign(params_.begin(), params_.end());
    }
    // Whatever else is still held (a partition or stage left by a failed recovery) goes.
    free_all();
    device_.synchronize();
    const MemoryInfo mem = device_.memory_info();
    out.measured_peak_device_bytes = mem.peak_allocated_bytes;
    out.measured_peak_host_bytes = mem.peak_host_allocated_bytes;
    out.seconds = detail::seconds_since(t0);
    out.step_seconds = step_seconds_;
    out.gather_parts = parts_;
    out.overlapped_gather_seconds = overlapped_seconds_;
    if (master_filled_ &&
        (out.outcome == Outcome::kDone || out.outcome == Outcome::kRecovered)) {
      out.master = std::move(master_);
      out.master_seconds = master_seconds_;
    }
    master_.reset();
    return out;
  }

 private:
  // Runs steps [from, size) and the agreement points among them, then the final agreement.
  PassEnd pass(std::size_t from, bool inject) {
    PassEnd end;
    const std::uint64_t severity = inject ? kFailed : kGone;
    gathered_ = 0;  // a pass that gathers runs the read before it (the recovery pass as well)
    for (std::size_t k = from; k <= steps_.size(); ++k) {
      const bool last = k == steps_.size();
      if (!last && inject && options_.fault_step == k && !end.local_failed) {
        end.local_failed = k;
        end.local_error = "injected fault (--inject-fault " + std::to_string(k) + ")";
      }
      // Before an overlapped read the ranks also agree on its parts: the fewest any asks for.
      const bool parts_point = !last && overlap_read_ == k;
      if (last || parts_point || is_agreement_point(steps_[k])) {
        const std::uint64_t mine =
            end.local_failed ? encode(severity, *end.local_failed, rank_) : 0;
        std::uint64_t agreed = mine;
        if (parts_point) parts_ = 1;
        if (comm_ != nullptr) {
          try {
            std::array<std::uint64_t, 2> v{mine, parts_point ? kMaxParts - wanted_parts() : 0};
            comm_->all_reduce_max(std::span<std::uint64_t>(v.data(), parts_point ? 2 : 1));
            agreed = v[0];
            if (parts_point) parts_ = static_cast<std::uint32_t>(kMaxParts - v[1]);
          } catch (const std::exception& e) {
            end.comm_broken = true;
            end.comm_error = e.what();
            comm_->abort("rank " + std::to_string(rank_) + " lost the others: " + e.what());
          }
        }
        if (end.comm_broken || agreed != 0) {
          end.agreed = agreed;
          end.stopped_at = k;
          return end;
        }
      }
      if (last) break;
      if (end.local_failed) continue;  // to the next agreement point, where the others hear
      if (options_.on_step) options_.on_step(k, steps_[k]);
      const auto t0 = Clock::now();
      try {
        run_step(steps_[k]);
      } catch (const std::exception& e) {
        end.local_failed = k;
        end.local_error = e.what();
        if (comm_ != nullptr && dynamic_cast<const CommError*>(&e) != nullptr) {
          comm_->abort("rank " + std::to_string(rank_) + ": " + e.what());
        }
      }
      step_seconds_[k] = detail::seconds_since(t0);
    }
    end.stopped_at = steps_.size();
    return end;
  }

  void run_step(const Step& s) {
    // A recovery pass runs the release again: the originals are already gone.
    if (s.op == Op::kReleaseOriginals && machine_.originals_released()) return;
    machine_.check(s);
    switch (s.op) {
      case Op::kAllocate:
        ptr(s.buffer) =
            on_host(s.buffer) ? device_.allocate_host(s.bytes) : device_.allocate(s.bytes);
        break;
      case Op::kGather:
      case Op::kRead: {
        const bool gathers = parts_ > 1 && overlap_read_ && &s == &steps_[*overlap_read_];
        if (gathers || (master_read_ && &s == &steps_[*master_read_])) {
          read_overlapped(s, gathers);
          break;
        }
        source_.read(at(s.buffer, s.dst_offset), s.flat_offset, s.bytes,
                     machine_.live(Buffer::kHostStage) ? ptr(Buffer::kHostStage) : nullptr,
                     machine_.size(Buffer::kHostStage));
        break;
      }
      case Op::kCopy:
        device_.copy(at(s.buffer, s.dst_offset), at(s.source, s.src_offset), s.bytes);
        break;
      case Op::kReleaseOriginals:
        source_.release();
        for (std::size_t i = 0; i < params_.size(); ++i) {
          if (params_[i].data == originals_[i]) params_[i].data = nullptr;
        }
        break;
      case Op::kAllGather: {
        const std::uint64_t sb = layout_.partition_bytes();
        auto* flat = static_cast<unsigned char*>(at(s.buffer, 0));
        if (s.source != s.buffer) {
          // This rank's contribution moves into its own slot first; the all-gather is in place.
          device_.copy(flat + slot_ * sb, at(s.source, 0), sb);
        }
        // The other ranks' bytes land in memory never touched: faulted in first, in one call
        // each (prefault_for_write), rather than a fault per page inside the collective.
        if (comm_ != nullptr) prefault_others(flat, sb, gathered_, sb);
        if (comm_ != nullptr && gathered_ > 0) {
          // The parts before gathered_ were gathered while the read went on.
          comm_->all_gather_part(flat, sb, gathered_, sb - gathered_, device_);
        } else if (comm_ != nullptr) {
          comm_->all_gather_inplace(flat, sb, device_);
        }
        gathered_ = 0;
        break;
      }
      case Op::kRepoint: {
        auto* flat = static_cast<unsigned char*>(at(Buffer::kFlat, 0));
        const std::uint64_t es = layout_.element_size();
        for (std::size_t i = 0; i < params_.size(); ++i) {
          params_[i].data = flat + layout_.offsets()[i] * es;
        }
        break;
      }
      case Op::kRelease:
        free_buffer(s.buffer);
        break;
    }
    machine_.apply(s);
  }

  // Faults in bytes [lo, hi) of every other rank's slice of a host buffer, where an all-gather
  // is about to write them.
  void prefault_others(unsigned char* flat, std::uint64_t sb, std::uint64_t lo,
                       std::uint64_t hi) const {
    if (!device_.host_accessible() || hi <= lo) return;
    const auto ranks = static_cast<std::uint64_t>(comm_->size());
    for (std::uint64_t r = 0; r < ranks; ++r) {
      if (r != slot_) detail::prefault_for_write(flat + r * sb + lo, hi - lo);
    }
  }

  // The parts this rank asks for at the overlapped read: 1 where the communicator cannot gather
  // parts on this device.
  std::uint64_t wanted_parts() const {
    return comm_->gathers_parts(device_) ? chosen_parts() : 1;
  }

  // The parts of this rank's slice as options, the environment or the executor's rule choose.
  std::uint64_t chosen_parts() const {
    const std::uint64_t sb = layout_.partition_bytes();
    std::uint64_t n = options_.gather_parts;
    if (n == 0) {
      try {
        n = runtime_env().gather_parts.value_or(0);
      } catch (const InvalidArgument&) {
        n = 0;  // a bad variable is refused where the call began, before any rank moved
      }
    }
    if (n == 0) n = std::min<std::uint64_t>(kAutoParts, sb / kAutoPartBytes);
    n = std::min<std::uint64_t>({n, sb / kMinPartBytes, kMaxParts - 1});
    return std::max<std::uint64_t>(n, 1);
  }

  // The read of this rank's slice in parts, each gathered from a thread of its own while the
  // next is read (gathers: parts_ parts, the all-gather step gathers the last), and, for the
  // master read, each up-cast into the master partition from another thread as it arrives (the
  // parts the read leaves undone are up-cast after it on the device's threads). Every rank
  // gathers parts_ - 1 parts whatever happens to its reads (a rank whose read failed sends what
  // it has, and the agreement at the all-gather step stops every rank before the buffer is
  // used), so that the collectives stay matched; a failed gather stops the reading.
  void read_overlapped(const Step& s, bool gathers) {
    const std::uint64_t sb = s.bytes;
    const std::uint32_t n = gathers ? parts_ : static_cast<std::uint32_t>(chosen_parts());
    // Parts of one size but the last, a quarter of the others: its all-gather is the one the
    // read does not hide.
    // (Computed, not stored: nothing here may fail before the parts' collectives are made.)
    auto at = [sb, n](std::uint32_t i) -> std::uint64_t {
      if (i >= n) return sb;
      if (n == 1) return 0;
      return static_cast<std::uint64_t>(static_cast<double>(sb) * i / (n - 0.75)) &
             ~std::uint64_t{4095};
    };
    auto* flat = static_cast<unsigned char*>(ptr(Buffer::kFlat));
    void* stage = machine_.live(Buffer::kHostStage) ? ptr(Buffer::kHostStage) : nullptr;
    const std::uint64_t stage_bytes = machine_.size(Buffer::kHostStage);
    const unsigned char* mine = flat + s.dst_offset;
    // The master partition's memory, held to the end of the run (a recovery pass that reads
    // again fills the same); none when the device cannot give it (the engine then up-casts
    // after the run, or says why not).
    float* master = nullptr;
    const DType dtype = layout_.options().dtype;
    const std::uint64_t es = layout_.element_size();
    if (master_read_ && &s == &steps_[*master_read_]) {
      master_filled_ = false;
      if (!master_) {
        try {
          master_ = DeviceBuffer(device_, layout_.partition_numel() * 4);
        } catch (const OutOfMemory&) {
          master_.reset();
        }
      }
      if (master_) master = static_cast<float*>(master_.data());
    }
    std::mutex m;
    std::condition_variable cv;
    std::uint32_t read = 0;      // parts read (all of them once a read failed)
    std::uint32_t gathered = 0;  // parts gathered (all of them once a gather failed)
    std::uint32_t next_upcast = 0;  // the first part no thread has taken to up-cast
    bool reading = true;
    bool read_failed = false;
    std::atomic<bool> gather_failed{false};
    std::exception_ptr gather_error;
    std::exception_ptr read_error;
    double gather_seconds = 0;
    double upcast_seconds = 0;
    auto gather = [&] {
      try {
        for (std::uint32_t i = 0; i < n; ++i) {
          // While this rank reads part i, the other ranks' part i is faulted in here (the last
          // part's too, which the all-gather step gathers).
          prefault_others(flat, sb, at(i), at(i + 1));
          if (i + 1 == n) break;
          {
            std::unique_lock<std::mutex> lock(m);
            cv.wait(lock, [&] { return read > i; });
          }
          const auto t0 = Clock::now();
          comm_->all_gather_part(flat, sb, at(i), at(i + 1) - at(i), device_);
          gather_seconds += detail::seconds_since(t0);
          {
            std::lock_guard<std::mutex> lock(m);
            gathered = i + 1;
          }
          cv.notify_all();
        }
      } catch (...) {
        gather_error = std::current_exception();
        gather_failed = true;
      }
      {
        std::lock_guard<std::mutex> lock(m);
        gathered = n;
      }
      cv.notify_all();
    };
    // One part into memory never touched: faulted in a chunk at a time, each just before its
    // values land (one thread; the read and the gathers have the others).
    auto upcast_part = [&](std::uint32_t i) {
      const std::uint64_t e0 = at(i) / es;
      const std::uint64_t count = (at(i + 1) - at(i)) / es;
      detail::prefault_then_write(master + e0, count * 4, [&](std::uint64_t off, std::uint64_t k) {
        detail::upcast_range(master + e0 + off / 4, mine + (e0 + off / 4) * es, dtype, k / 4);
      });
    };
    auto upcaster = [&] {
      for (;;) {
        std::uint32_t i = 0;
        {
          std::unique_lock<std::mutex> lock(m);
          cv.wait(lock, [&] { return read > next_upcast || !reading; });
          if (!reading || read_failed || next_upcast >= n) return;
          i = next_upcast++;
        }
        const auto t0 = Clock::now();
        upcast_part(i);
        std::lock_guard<std::mutex> lock(m);
        upcast_seconds += detail::seconds_since(t0);
      }
    };
    std::thread gatherer;
    std::thread upcasting;
    if (gathers) {
      try {
        gatherer = std::thread(gather);
      } catch (...) {
        // No thread to be had: the same collectives, one after the other, after the read.
      }
    }
    if (master != nullptr) {
      try {
        upcasting = std::thread(upcaster);
      } catch (...) {
        // No thread to be had: every part is up-cast after the read.
      }
    }
    const bool paced = gatherer.joinable();
    for (std::uint32_t i = 0; i < n && !gather_failed; ++i) {
      if (paced && i >= kReadAhead) {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return gathered + kReadAhead > i; });
      }
      try {
        source_.read(flat + s.dst_offset + at(i), s.flat_offset + at(i), at(i + 1) - at(i), stage,
                     stage_bytes);
      } catch (...) {
        read_error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(m);
        read_failed = read_error != nullptr;
        read = read_failed ? n : i + 1;
      }
      cv.notify_all();
      if (read_error) break;
    }
    // The parts no thread has taken yet are up-cast here, on the device's threads.
    std::uint32_t rest = n;
    {
      std::lock_guard<std::mutex> lock(m);
      reading = false;
      if (read == n && !read_error && !gather_failed) rest = next_upcast;
      next_upcast = n;
    }
    cv.notify_all();
    double tail_seconds = 0;
    if (master != nullptr && rest < n) {
      const auto t0 = Clock::now();
      try {
        device_.upcast_to_fp32(master + at(rest) / es, mine + at(rest), dtype,
                               (sb - at(rest)) / es);
      } catch (...) {
        rest = n + 1;  // not built: the engine up-casts after the run
      }
      tail_seconds = detail::seconds_since(t0);
    }
    if (upcasting.joinable()) upcasting.join();
    if (master != nullptr && rest <= n && !read_error && !gather_failed) {
      master_filled_ = true;
      master_seconds_ = upcast_seconds + tail_seconds;
    }
    if (gathers) {
      if (paced) {
        gatherer.join();
      } else {
        {
          std::lock_guard<std::mutex> lock(m);
          read = n;
        }
        gather();
      }
      overlapped_seconds_ = paced ? gather_seconds : 0;
    }
    if (gather_error) std::rethrow_exception(gather_error);
    if (read_error) std::rethrow_exception(read_error);
    if (gathers) gathered_ = at(n - 1);
  }

  void*& ptr(Buffer b) { return ptrs_[static_cast<std::size_t>(b)]; }

  // The machine has checked the range.
  void* at(Buffer b, std::uint64_t offset) { return static_cast<unsigned char*>(ptr(b)) + offset; }

  void free_buffer(Buffer b) {
    if (on_host(b)) {
      device_.release_host(ptr(b), machine_.size(b));
    } else {
      device_.release(ptr(b), machine_.size(b));
    }
    ptr(b) = nullptr;
  }

  // Releases every buffer the steps still hold (after a failure, or the leftovers of a failed
  // recovery).
  void free_all() noexcept {
    for (Buffer b : {Buffer::kFlat, Buffer::kPartition, Buffer::kHostStage}) {
      if (machine_.live(b)) {
        free_buffer(b);
        machine_.apply(Step{Op::kRelease, b});
      }
    }
  }

  // The flat buffer becomes the result's; the executor no longer releases it.
  DeviceBuffer adopt_flat() {
    DeviceBuffer out =
        DeviceBuffer::adopt(device_, ptr(Buffer::kFlat), machine_.size(Buffer::kFlat));
    ptr(Buffer::kFlat) = nullptr;
    machine_.apply(Step{Op::kRelease, Buffer::kFlat});
    return out;
  }

  void rollback() noexcept {
    free_all();
    for (std::size_t i = 0; i < params_.size(); ++i) params_[i].data = originals_[i];
  }

  void lose() noexcept {
    free_all();
    for (TensorRef& t : params_) t.data = nullptr;
  }

  std::string failure_text(const PassEnd& end) const {
    std::string text;
    if (end.agreed != 0) {
      const std::size_t k = step_of(end.agreed);
      const int r = rank_of(end.agreed);
      text = "step " + std::to_string(k) + " (" + steps_[k].describe() + ") failed on rank " +
             std::to_string(r);
      if (end.local_failed == k && static_cast<std::uint64_t>(r) == rank_) {
        text += ": " + end.local_error;
      } else if (end.local_failed) {
        text +=
            " (and step " + std::to_string(*end.local_failed) + " here: " + end.local_error + ")";
      }
    } else if (end.local_failed) {
      const std::size_t k = *end.local_failed;
      text = "step " + std::to_string(k) + " (" + steps_[k].describe() + ") failed on rank " +
             std::to_string(rank_) + ": " + end.local_error;
    }
    if (end.comm_broken) {
      if (!text.empty()) text += "; ";
      text += "the ranks could not agree at " +
              (end.stopped_at < steps_.size() ? "step " + std::to_string(end.stopped_at) + " (" +
                                                    steps_[end.stopped_at].describe() + ")"
                                              : std::string("the end of the list")) +
              ": " + end.comm_error;
    }
    return text;
  }

  std::string lost_text() const {
    const std::uint64_t sb = layout_.partition_bytes();
    return "parameter data is lost: the originals were released and the flat buffer could not "
           "be completed; this rank held layout bytes [" +
           std::to_string(slot_ * sb) + ", " + std::to_string((slot_ + 1) * sb) +
           "), the rest must be reloaded from the checkpoint";
  }

  const std::vector<Step>& steps_;
  const Layout& layout_;
  std::uint64_t slot_;  // this rank's slice of the layout
  std::span<TensorRef> params_;
  Device& device_;
  Communicator* comm_;
  std::uint64_t rank_;  // this rank among comm's (for the others and for messages)
  StepSource& source_;
  const ExecuteOptions& options_;
  std::vector<void*> originals_;
  StepMachine machine_;
  std::array<void*, 5> ptrs_{};
  std::vector<double> step_seconds_;
  // The read whose parts are gathered as they arrive, if the list has one; its agreed parts
  // (1: none), how much of every slice they gathered, and how long that took.
  std::optional<std::size_t> overlap_read_;
  std::uint32_t parts_ = 1;
  // The read whose parts are up-cast into this rank's master partition as they arrive, if the
  // run builds it (ExecuteOptions::master); the partition, once every part of the last read of
  // it is in.
  std::optional<std::size_t> master_read_;
  DeviceBuffer master_;
  bool master_filled_ = false;
  double master_seconds_ = 0;
  std::uint64_t gathered_ = 0;
  double overlapped_seconds_ = 0;
};

}  // namespace

Originals::Originals(const Layout& layout, std::span<const TensorRef> params, Device& device,
                     ReleaseOriginals release_originals)
    : layout_(layout),
      params_(params.begin(), params.end()),
      device_(device),
      release_(std::move(release_originals)) {
  for (const TensorRef& t : params_) bytes_ += t.num_bytes();
}

void Originals::check(std::span<const TensorRef> views, const Layout& layout,
                      const Device& device) const {
  validate_group(views, device, layout.options());
}

void Originals::read(void* dst, std::uint64_t flat_offset, std::uint64_t bytes, void*,
                     std::uint64_t) {
  device_.gather(dst, bytes, gather_segments(layout_, params_, flat_offset, flat_offset + bytes));
}

void Originals::release() noexcept {
  if (release_) release_();
}

bool builds_master(const std::vector<Step>& steps, const Layout& layout, std::uint64_t slot,
                   std::uint64_t master_slot, const Device& device) {
  return device.host_accessible() && device.keeps_data() &&
         slot_read(steps, layout, slot, master_slot).has_value();
}

Execution execute(const std::vector<Step>& steps, const Layout& layout, std::uint64_t slot,
                  std::span<TensorRef> views, Device& device, Communicator* comm,
                  StepSource& source, const ExecuteOptions& options) {
  const std::uint64_t dp = layout.options().dp;
  const bool many = comm != nullptr && comm->size() > 1;
  if (slot >= dp) {
    throw InvalidArgument("slot " + std::to_string(slot) + " is outside the layout's dp " +
                          std::to_string(dp));
  }
  const std::uint64_t ranks = many ? static_cast<std::uint64_t>(comm->size()) : 1;
  const std::uint64_t rank = many ? static_cast<std::uint64_t>(comm->rank()) : 0;
  for (const Step& s : steps) {
    // An all-gather joins the layout's dp ranks, each contributing its own slot.
    if (s.op == Op::kAllGather && (ranks != dp || rank != slot)) {
      throw InvalidArgument(
          "step '" + s.describe() + "' gathers the slices of " + std::to_string(dp) +
          " ranks: it needs a communicator of that size with this rank at slot " +
          std::to_string(slot) +
          (many
               ? ", not " + std::to_string(ranks) + " ranks (this one " + std::to_string(rank) + ")"
               : std::string(", and there is none")));
    }
  }
  if (views.size() != layout.numels().size()) {
    throw InvalidArgument("the layout has " + std::to_string(layout.numels().size()) +
                          " parameters, the group " + std::to_string(views.size()));
  }
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (views[i].numel != layout.numels()[i]) {
      throw InvalidArgument("parameter " + std::to_string(i) + " has " +
                            std::to_string(views[i].numel) + " elements, the layout " +
                            std::to_string(layout.numels()[i]));
    }
  }
  source.check(views, layout, device);
  // The list must make sense on its own (the memory model refuses a malformed one).
  const std::uint64_t original_bytes = source.resident_bytes();
  try {
    (void)simulate(steps, original_bytes, original_bytes, dp);
  } catch (const InternalError& e) {
    throw InvalidArgument(std::string("the step list is malformed: ") + e.what());
  }
  for (const Step& s : steps) {
    if (((s.op == Op::kGather || s.op == Op::kRead) &&
         (s.flat_offset > layout.flat_bytes() || s.bytes > layout.flat_bytes() - s.flat_offset)) ||
        (s.op == Op::kAllGather && s.bytes != layout.flat_bytes())) {
      throw InvalidArgument("step '" + s.describe() + "' does not fit the layout's " +
                            format_bytes(layout.flat_bytes()) + " flat buffer");
    }
  }
  return Run(steps, layout, slot, views, device, comm, source, options).execute();
}

Execution execute(const std::vector<Step>& steps, const Layout& layout, std::uint64_t slot,
                  std::span<TensorRef> params, Device& device, Communicator* comm,
                  const ReleaseOriginals& release_originals, const ExecuteOptions& options) {
  Originals originals(layout, params, device, release_originals);
  return execute(steps, layout, slot, params, device, comm, originals, options);
}

}  // namespace zeroflat
