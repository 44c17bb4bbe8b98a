// The check that the ranks' copies of a checkpoint hold the same bytes (FlattenOptions'
// read.copies), after every rank has read its share from its own copy.
//
// One rule for every read plan and placement: each rank digests windows of the bytes it read
// (its own read ranges, as its placement places them) and the ranks exchange those digests in
// one all-reduce; then each rank digests the same windows as its own copy holds them for that
// rank (taken from its own buffer where it read those bytes itself, the same way, else read
// again from its copy) and compares. A difference is named by the rank that finds it (the
// window's parameter, tensor, file and byte), and one more all-reduce makes it every rank's
// error: a buffer mixed from copies that differ is never handed back.
#include <map>

#include "common/clock.h"
#include "source/checkpoint/source.h"
#include "zeroflat/agree.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {

std::vector<std::pair<std::uint64_t, std::uint64_t>> CheckpointSource::check_windows(
    std::uint64_t q) const {
  constexpr std::uint64_t kWindow = std::uint64_t{64} << 10;
  constexpr std::uint64_t kWindows = 16;
  constexpr std::uint64_t kChunk = std::uint64_t{16} << 20;
  const std::uint64_t es = layout_->element_size();
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const auto& [lo, hi] : read_ranges(q)) {
    const std::uint64_t n = hi - lo;
    if (options_.read.copies == CopyCheck::kFull || n <= kWindow * kWindows) {
      for (std::uint64_t a = 0; a < n; a += kChunk) {
        out.emplace_back(lo + a, lo + std::min(n, a + kChunk));
      }
      continue;
    }
    // Windows start on elements, spread over the range, shifted by the reader's rank so that
    // ranks reading the same bytes are sampled in different places.
    const std::uint64_t stride = n / kWindows / es * es;
    const std::uint64_t shift = (q * 7919 * es) % (stride - kWindow + 1) / es * es;
    for (std::uint64_t w = 0; w < kWindows; ++w) {
      const std::uint64_t a = lo + w * stride + shift;
      out.emplace_back(a, std::min(hi, a + kWindow));
    }
  }
  return out;
}

void CheckpointSource::after(const FlatGroup&, Communicator* comm) {
  if (comm == nullptr || comm->size() <= 1 || options_.read.copies == CopyCheck::kOff ||
      !device_.keeps_data()) {
    return;
  }
  const auto t0 = Clock::now();
  const auto world = static_cast<std::uint64_t>(comm->size());
  const auto me = static_cast<std::uint64_t>(comm->rank());
  const Layout& layout = *layout_;
  // Layout bytes [lo, hi), which this rank read itself, where the host can read them: in the
  // buffer where its read put them (a slice-only buffer starts at its slice).
  std::vector<unsigned char> held;
  auto buffer = [&](std::uint64_t lo, std::uint64_t hi) -> const unsigned char* {
    const unsigned char* p = nullptr;
    for (const ReadRange& r : read_) {
      if (r.lo <= lo && hi <= r.hi) p = r.dst + (lo - r.lo);
    }
    if (p == nullptr) throw InternalError("layout bytes outside this rank's reads were asked for");
    if (device_.host_accessible()) return p;
    held.resize(hi - lo);
    device_.copy(held.data(), p, hi - lo);  // NOLINT: host staging of device bytes
    device_.synchronize();
    return held.data();
  };
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> windows(world);
  std::uint64_t most = 0;
  for (std::uint64_t q = 0; q < world; ++q) {
    windows[q] = check_windows(q);
    most = std::max<std::uint64_t>(most, windows[q].size());
  }
  // 1. What each rank read, as digests of its windows: only the owner writes its row.
  std::vector<std::uint64_t> own(world * most, 0);
  std::map<std::pair<std::uint64_t, std::uint64_t>, std::uint64_t> from_buffer;
  for (std::size_t k = 0; k < windows[me].size(); ++k) {
    const auto [lo, hi] = windows[me][k];
    own[me * most + k] = checksum_serial(buffer(lo, hi), hi - lo);
    from_buffer[{lo, hi}] = own[me * most + k];
    report_.copy_check_bytes += hi - lo;
  }
  comm->all_reduce_max(own);
  // 2. The same windows as this rank's copy holds them for every other rank.
  std::string mismatch;
  try {
    Reader reader(files_, layout.options().dtype, threads_, std::nullopt);
    std::vector<unsigned char> mine;
    const auto covered = [&](std::uint64_t lo, std::uint64_t hi) {
      for (const ReadRange& r : read_) {
        if (r.lo <= lo && hi <= r.hi) return true;
      }
      return false;
    };
    for (std::uint64_t q = 0; q < world && mismatch.empty(); ++q) {
      if (q == me) continue;
      const SourceRuns runs = placement_->runs(numels_, world, q);
      const bool same_view = runs == runs_;
      for (std::size_t k = 0; k < windows[q].size(); ++k) {
        const auto [lo, hi] = windows[q][k];
        std::uint64_t d = 0;
        if (same_view && covered(lo, hi)) {
          auto it = from_buffer.find({lo, hi});
          if (it == from_buffer.end()) {
            it = from_buffer.emplace(std::pair{lo, hi}, checksum_serial(buffer(lo, hi), hi - lo))
                     .first;
          }
          d = it->second;
        } else {
          mine.resize(hi - lo);
          const std::vector<Read> reads = reads_for(layout, sources_, runs, lo, hi);
          reader.fill(mine.data(), hi - lo, reads);
          reader.rethrow();
          report_.copy_check_bytes += source_bytes(reads);
          report_.copy_check_read_bytes += source_bytes(reads);
          d = checksum_serial(mine.data(), hi - lo);
        }
        if (d != own[q * most + k]) {
          mismatch = "rank " + std::to_string(q) + " read layout bytes [" + std::to_string(lo) +
                     ", " + std::to_string(hi) + ") from its copy, and this rank's copy (rank " +
                     std::to_string(me) + ") holds other bytes somewhere in them (they start at " +
                     where(lo, q) + ")";
          break;
        }
      }
    }
  } catch (const std::exception& e) {
    mismatch =
        std::string("the check itself failed on rank ") + std::to_string(me) + ": " + e.what();
  }
  report_.copy_check_seconds = seconds_since(t0);
  // 3. Every rank's verdict.
  const int bad = agree_on_failure(comm, !mismatch.empty());
  if (bad < 0) return;
  throw Error("the ranks' copies of " + ck_.path + " hold different bytes: " +
              (!mismatch.empty() ? mismatch
                                 : "rank " + std::to_string(bad) +
                                       " found a difference (its error names the file and "
                                       "tensor)") +
              "; every rank must read an identical copy (nothing was kept)");
}

}  // namespace zeroflat::detail
