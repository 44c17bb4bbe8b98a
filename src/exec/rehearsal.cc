// Rehearsals (rehearsal.h): the pattern in and out, verification, the timing rounds.
#include "zeroflat/rehearsal.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>

#include "common/clock.h"
#include "common/pattern.h"
#include "common/thread_pool.h"
#include "device/cpu_device.h"
#include "exec/executor.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

using detail::Clock;
using detail::seconds_since;

// A piece of one tensor: elements [lo, hi) of tensor `tensor`.
struct Piece {
  std::uint64_t tensor;
  std::uint64_t lo;
  std::uint64_t hi;
};

std::vector<Piece> split_tensors(std::span<const TensorRef> tensors) {
  constexpr std::uint64_t kPiece = std::uint64_t{1} << 20;
  std::vector<Piece> out;
  for (std::uint64_t i = 0; i < tensors.size(); ++i) {
    for (std::uint64_t lo = 0; lo < tensors[i].numel; lo += kPiece) {
      out.push_back(Piece{i, lo, std::min(tensors[i].numel, lo + kPiece)});
    }
  }
  return out;
}

// The host threads that do the work: the cpu device's own team, else one of `threads`.
class Team {
 public:
  Team(Device& device, unsigned threads) {
    cpu_ = dynamic_cast<detail::CpuDevice*>(&device);
    if (cpu_ == nullptr) {
      own_ = std::make_unique<detail::CpuDevice>(DeviceOptions{threads});
      cpu_ = own_.get();
    }
  }
  detail::CpuDevice& operator*() { return *cpu_; }

 private:
  std::unique_ptr<detail::CpuDevice> own_;
  detail::CpuDevice* cpu_ = nullptr;
};

// Runs fn(piece) over pieces on the team, handing out pieces dynamically.
template <typename Fn>
void for_pieces(detail::CpuDevice& team, const std::vector<Piece>& pieces, Fn fn) {
  std::atomic<std::size_t> next{0};
  team.parallel([&](unsigned) {
    for (std::size_t k = next++; k < pieces.size(); k = next++) fn(pieces[k]);
  });
}

// Host memory holding a copy of device memory the host cannot read directly (or the device
// memory itself when it can).
class HostMirror {
 public:
  HostMirror(Device& device, const void* src, std::uint64_t bytes) : bytes_(bytes) {
    if (device.host_accessible()) {
      view_ = static_cast<const unsigned char*>(src);
    } else {
      owned_ = detail::host_allocate(bytes);
      device.copy(owned_, src, bytes);
      device.synchronize();
      view_ = static_cast<const unsigned char*>(owned_);
    }
  }
  ~HostMirror() { detail::host_release(owned_, bytes_); }
  HostMirror(const HostMirror&) = delete;
  HostMirror& operator=(const HostMirror&) = delete;
  const unsigned char* data() const { return view_; }

 private:
  std::uint64_t bytes_;
  void* owned_ = nullptr;
  const unsigned char* view_ = nullptr;
};

// An independent reference for the up-cast check: IEEE half to float by arithmetic.
float half_to_float_reference(std::uint16_t h) {
  const int sign = (h >> 15) & 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  double v = 0;
  if (exp == 0) {
    v = std::ldexp(mant / 1024.0, -14);
  } else if (exp == 31) {
    v = mant ? NAN : INFINITY;
  } else {
    v = std::ldexp(1.0 + mant / 1024.0, exp - 15);
  }
  return static_cast<float>(sign ? -v : v);
}

std::uint32_t float_bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

}  // namespace

void fill_pattern_tensors(Device& device, std::span<const TensorRef> params, unsigned threads,
                          const ProgressFn& progress) {
  if (!device.keeps_data()) return;
  auto advance = [&](std::uint64_t n) {
    if (progress) progress(n);
  };
  const std::uint64_t es = params.empty() ? 0 : element_size(params.front().dtype);
  if (device.host_accessible()) {
    Team team(device, threads);
    for_pieces(*team, split_tensors(params), [&](const Piece& p) {
      fill_pattern(static_cast<unsigned char*>(params[p.tensor].data) + p.lo * es,
                   params[p.tensor].dtype, p.tensor, p.lo, p.hi - p.lo);
      advance((p.hi - p.lo) * es);
    });
    return;
  }
  // One tensor at a time through a host buffer of the largest tensor's size.
  std::uint64_t largest = 0;
  for (const TensorRef& t : params) largest = std::max(largest, t.num_bytes());
  void* buf = detail::host_allocate(largest);
  try {
    for (std::uint64_t i = 0; i < params.size(); ++i) {
      fill_pattern(buf, params[i].dtype, i, 0, params[i].numel);
      device.copy(params[i].data, buf, params[i].num_bytes());
      advance(params[i].num_bytes());
    }
    device.synchronize();
  } catch (...) {
    detail::host_release(buf, largest);
    throw;
  }
  detail::host_release(buf, largest);
}

bool tensors_hold_pattern(Device& device, std::span<const TensorRef> params, unsigned threads) {
  for (const TensorRef& t : params) {
    if (t.data == nullptr && t.numel > 0) return false;
  }
  std::atomic<bool> ok{true};
  if (device.host_accessible()) {
    Team team(device, threads);
    for_pieces(*team, split_tensors(params), [&](const Piece& p) {
      const TensorRef& t = params[p.tensor];
      const auto* at = static_cast<const unsigned char*>(t.data) + p.lo * element_size(t.dtype);
      if (match_pattern(at, t.dtype, p.tensor, p.lo, p.hi - p.lo) != p.hi - p.lo) ok = false;
    });
    return ok;
  }
  for (std::uint64_t i = 0; i < params.size() && ok; ++i) {
    HostMirror m(device, params[i].data, params[i].num_bytes());
    if (match_pattern(m.data(), params[i].dtype, i, 0, params[i].numel) != params[i].numel) {
      ok = false;
    }
  }
  return ok;
}

Timing time_rounds(Device& any_device, const FlatGroup& group, const std::vector<Step>& steps,
                   std::uint64_t rank, Communicator* comm, std::uint64_t repeat,
                   double first_seconds) {
  auto* cpu = dynamic_cast<detail::CpuDevice*>(&any_device);
  if (cpu == nullptr) {
    throw InvalidArgument("the timing rounds run on the cpu device, not " + any_device.name());
  }
  detail::CpuDevice& device = *cpu;
  const std::uint64_t flat_bytes = group.layout.flat_bytes();
  Timing t{1e300, first_seconds, 1e300, 1e300};
  // The copy alone and the memcpy ceiling write into one scratch buffer, faulted in first: the
  // flat buffer stays exactly as the flatten left it, which is what --verify checks.
  std::vector<Segment> segments = gather_segments(group.layout, group.views, 0, flat_bytes);
  void* scratch = detail::host_allocate(flat_bytes);
  device.zero_parallel(scratch, flat_bytes);
  for (std::uint64_t r = 0; r < repeat; ++r) {
    auto t0 = Clock::now();
    device.gather(scratch, flat_bytes, segments);
    t.copy_only = std::min(t.copy_only, seconds_since(t0));
    t0 = Clock::now();
    device.memcpy_parallel(scratch, group.flat.data(), flat_bytes);
    t.memcpy = std::min(t.memcpy, seconds_since(t0));
  }
  detail::host_release(scratch, flat_bytes);
  for (std::uint64_t r = 0; r < repeat; ++r) {
    if (r > 0) {  // round 0 is the real run
      // The whole tier again, the views standing in for the originals (nothing is released).
      std::vector<TensorRef> views = group.views;
      Execution again = execute(steps, group.layout, rank, views, device, comm, [] {});
      if (again.outcome == Outcome::kDone) t.end_to_end = std::min(t.end_to_end, again.seconds);
    }
    auto t0 = Clock::now();
    void* fresh = detail::host_allocate(flat_bytes);
    device.memcpy_parallel(fresh, group.flat.data(), flat_bytes);
    t.fresh_memcpy = std::min(t.fresh_memcpy, seconds_since(t0));
    detail::host_release(fresh, flat_bytes);
  }
  return t;
}

void corrupt_byte(Device& device, void* flat, std::uint64_t byte) {
  auto* p = static_cast<unsigned char*>(flat) + byte;
  if (device.host_accessible()) {
    *p ^= 0x01;
    return;
  }
  unsigned char b = 0;
  device.copy(&b, p, 1);
  b ^= 0x01;
  device.copy(p, &b, 1);
  device.synchronize();
}

std::string verify_flat_group(Device& device, const FlatGroup& group,
                              const DeviceBuffer& master_buffer, std::uint64_t rank,
                              unsigned threads, const ProgressFn& progress) {
  Team owned(device, threads);
  detail::CpuDevice& team = *owned;
  const Layout& l = group.layout;
  const std::uint64_t es = l.element_size();
  const DType dtype = l.options().dtype;
  const auto* base = static_cast<const unsigned char*>(group.flat.data());
  // Views: where they point and what they say.
  for (std::uint64_t i = 0; i < group.views.size(); ++i) {
    const TensorRef& v = group.views[i];
    if (v.data != base + l.offsets()[i] * es || v.numel != l.numels()[i] || v.dtype != dtype) {
      return "view of parameter " + std::to_string(i) + " does not point at its layout offset " +
             std::to_string(l.offsets()[i]);
    }
  }
  HostMirror flat_mirror(device, base, l.flat_bytes());
  const unsigned char* flat = flat_mirror.data();
  // Every parameter's bytes in the flat buffer, against the fill pattern.
  std::vector<TensorRef> host_views = group.views;
  for (std::uint64_t i = 0; i < host_views.size(); ++i) {
    host_views[i].data = const_cast<unsigned char*>(flat) + l.offsets()[i] * es;
  }
  std::atomic<bool> bad{false};
  std::string first_bad;
  std::mutex bad_mutex;
  for_pieces(team, split_tensors(host_views), [&](const Piece& p) {
    const auto* at = static_cast<const unsigned char*>(host_views[p.tensor].data) + p.lo * es;
    const std::uint64_t ok = match_pattern(at, dtype, p.tensor, p.lo, p.hi - p.lo);
    if (ok != p.hi - p.lo) {
      std::lock_guard<std::mutex> lock(bad_mutex);
      if (!bad.exchange(true)) {
        first_bad = "flat buffer: parameter " + std::to_string(p.tensor) + " element " +
                    std::to_string(p.lo + ok) + " differs from its original";
      }
    }
    if (progress) progress((p.hi - p.lo) * es);
  });
  if (bad) return first_bad;
  // Every padding byte (interior gaps and the tail) is zero.
  std::uint64_t cursor = 0;
  auto check_zero = [&](std::uint64_t lo, std::uint64_t hi) -> std::string {
    for (std::uint64_t b = lo; b < hi; ++b) {
      if (flat[b] != 0) return "flat buffer: padding byte " + std::to_string(b) + " is not zero";
    }
    return "";
  };
  for (std::uint64_t i : l.order()) {
    const std::uint64_t lo = l.offsets()[i] * es;
    if (std::string e = check_zero(cursor, lo); !e.empty()) return e;
    cursor = std::max(cursor, lo + l.numels()[i] * es);
  }
  if (std::string e = check_zero(cursor, l.flat_bytes()); !e.empty()) return e;
  // The master partition: the up-cast of this rank's partition, padding included.
  if (!master_buffer) return "";
  const std::uint64_t n = l.partition_numel();
  const unsigned char* part = flat + rank * l.partition_bytes();
  HostMirror master_mirror(device, master_buffer.data(), master_buffer.num_bytes());
  const auto* master = reinterpret_cast<const float*>(master_mirror.data());
  const unsigned parts = team.num_threads();
  std::atomic<std::uint64_t> first_master_bad{UINT64_MAX};
  team.parallel([&](unsigned t) {
    detail::Range r = detail::split_range(n, parts, t, 1024);
    for (std::uint64_t k = r.begin; k < r.end; ++k) {
      std::uint32_t want = 0;
      if (dtype == DType::kFP32) {
        std::memcpy(&want, part + k * 4, 4);
      } else {
        std::uint16_t h;
        std::memcpy(&h, part + k * 2, 2);
        want =
            dtype == DType::kBF16 ? std::uint32_t{h} << 16 : float_bits(half_to_float_reference(h));
      }
      if (float_bits(master[k]) != want) {
        std::uint64_t cur = first_master_bad.load();
        while (k < cur && !first_master_bad.compare_exchange_weak(cur, k)) {
        }
        return;
      }
    }
  });
  if (first_master_bad.load() != UINT64_MAX) {
    return "master partition: element " + std::to_string(first_master_bad.load()) +
           " is not the up-cast of the partition";
  }
  return "";
}

}  // namespace zeroflat
