// The ranks' copies compared in what they took outside a load (loader.h's check_taken_copies):
// the same rule as a load's check of its own reads (copies.cc), over byte ranges of the files
// and values read whole instead of a layout.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>

#include "model/files.h"
#include "zeroflat/agree.h"
#include "zeroflat/common.h"
#include "zeroflat/loader.h"

namespace zeroflat {
// Named, not anonymous: a unity build puts this file beside others with helpers of these names.
namespace taken_ranges {

constexpr std::uint64_t kWindow = std::uint64_t{64} << 10;
constexpr std::uint64_t kWindows = 16;
constexpr std::uint64_t kChunk = std::uint64_t{16} << 20;

using Span = std::pair<std::uint64_t, std::uint64_t>;

// The windows [lo, hi) of rank q's bytes, its ranges laid end to end (total bytes).
std::vector<Span> windows_of(std::uint64_t total, std::uint64_t q, CopyCheck mode) {
  std::vector<Span> out;
  if (mode == CopyCheck::kFull || total <= kWindow * kWindows) {
    for (std::uint64_t a = 0; a < total; a += kChunk) out.emplace_back(a, std::min(total, a + kChunk));
    return out;
  }
  // Spread over the bytes, shifted by the rank so that ranks taking the same bytes are sampled
  // in different places.
  const std::uint64_t stride = total / kWindows;
  const std::uint64_t shift = (q * 7919) % (stride - kWindow + 1);
  for (std::uint64_t w = 0; w < kWindows; ++w) {
    out.emplace_back(w * stride + shift, w * stride + shift + kWindow);
  }
  return out;
}

// The pieces of [lo, hi) of ranges laid end to end: (range, start in it, end in it).
struct Piece {
  std::size_t range;
  std::uint64_t begin;
  std::uint64_t end;
};
std::vector<Piece> pieces_of(const std::vector<FileRange>& ranges, std::uint64_t lo,
                             std::uint64_t hi) {
  std::vector<Piece> out;
  std::uint64_t at = 0;
  for (std::size_t k = 0; k < ranges.size() && at < hi; ++k) {
    const std::uint64_t a = std::max(lo, at);
    const std::uint64_t b = std::min(hi, at + ranges[k].bytes);
    if (a < b) out.push_back({k, a - at, b - at});
    at += ranges[k].bytes;
  }
  return out;
}

std::uint64_t total_of(const std::vector<FileRange>& ranges) {
  std::uint64_t n = 0;
  for (const FileRange& r : ranges) n += r.bytes;
  return n;
}

}  // namespace taken_ranges

std::uint64_t check_taken_copies(const CheckpointIndex& ck, const TakenBytes& taken,
                                 Communicator& comm, CopyCheck mode) {
  using taken_ranges::Piece, taken_ranges::pieces_of, taken_ranges::Span, taken_ranges::total_of;
  using taken_ranges::windows_of;
  const auto world = static_cast<std::uint64_t>(comm.size());
  const auto me = static_cast<std::uint64_t>(comm.rank());
  if (world <= 1 || mode == CopyCheck::kOff) return 0;
  if (taken.ranges.size() != world || taken.what.size() != world ||
      taken.mine.size() != taken.ranges[me].size() ||
      taken.value_names.size() != taken.values.size()) {
    throw InvalidArgument("check_taken_copies: expected the ranges of each of the " +
                          std::to_string(world) + " ranks, their names, this rank's bytes of " +
                          "its own and one name per value");
  }
  for (std::uint64_t q = 0; q < world; ++q) {
    if (taken.what[q].size() != taken.ranges[q].size()) {
      throw InvalidArgument("check_taken_copies: rank " + std::to_string(q) + "'s ranges and " +
                            "their names differ in number");
    }
    for (const FileRange& r : taken.ranges[q]) {
      if (r.file >= ck.files.size() || r.offset > ck.file_bytes[r.file] ||
          r.bytes > ck.file_bytes[r.file] - r.offset) {
        throw InvalidArgument("check_taken_copies: a range of rank " + std::to_string(q) +
                              " lies outside the checkpoint's files");
      }
    }
  }
  std::vector<std::vector<Span>> windows(world);
  std::uint64_t most = 0;
  for (std::uint64_t q = 0; q < world; ++q) {
    windows[q] = windows_of(total_of(taken.ranges[q]), q, mode);
    most = std::max<std::uint64_t>(most, windows[q].size());
  }
  const std::uint64_t nvalues = taken.values.size();
  // 1. Each rank's digests of its windows, in its own row, and of the values (min and max over
  //    the ranks: equal when every rank holds the same).
  std::vector<std::uint64_t> own(world * most, 0);
  std::vector<unsigned char> staged;
  auto digest = [&](const std::vector<Piece>& pieces, auto&& bytes_of) {
    std::uint64_t n = 0;
    for (const Piece& p : pieces) n += p.end - p.begin;
    staged.resize(n);
    std::uint64_t at = 0;
    for (const Piece& p : pieces) {
      bytes_of(p, staged.data() + at);
      at += p.end - p.begin;
    }
    return checksum_serial(staged.data(), n);
  };
  const std::vector<FileRange>& mine = taken.ranges[me];
  for (std::size_t k = 0; k < windows[me].size(); ++k) {
    const auto [lo, hi] = windows[me][k];
    own[me * most + k] = digest(pieces_of(mine, lo, hi), [&](const Piece& p, unsigned char* out) {
      std::memcpy(out, taken.mine[p.range] + p.begin, p.end - p.begin);
    });
  }
  std::vector<std::uint64_t> low(nvalues), high(nvalues);
  for (std::uint64_t j = 0; j < nvalues; ++j) {
    low[j] = high[j] = checksum_serial(taken.values[j].data(), taken.values[j].size());
  }
  comm.all_reduce_max(own);
  if (nvalues > 0) {
    comm.all_reduce_min(low);
    comm.all_reduce_max(high);
  }
  // 2. The other ranks' windows as this rank's copy holds them.
  std::string found;
  std::uint64_t read = 0;
  try {
    std::map<std::uint32_t, std::unique_ptr<detail::File>> files;
    auto file = [&](std::uint32_t f) -> const detail::File& {
      auto& slot = files[f];
      if (!slot) slot = std::make_unique<detail::File>(ck.files[f]);
      return *slot;
    };
    for (std::uint64_t q = 0; q < world && found.empty(); ++q) {
      if (q == me) continue;
      const std::vector<FileRange>& theirs = taken.ranges[q];
      for (std::size_t k = 0; k < windows[q].size(); ++k) {
        const auto [lo, hi] = windows[q][k];
        const std::vector<Piece> pieces = pieces_of(theirs, lo, hi);
        const std::uint64_t d = digest(pieces, [&](const Piece& p, unsigned char* out) {
          const FileRange& r = theirs[p.range];
          file(r.file).read_at(out, p.end - p.begin, r.offset + p.begin);
          read += p.end - p.begin;
        });
        if (d != own[q * most + k]) {
          const Piece& p = pieces.front();
          const FileRange& r = theirs[p.range];
          found = "rank " + std::to_string(q) + " used " + std::to_string(hi - lo) +
                  " bytes from its copy, starting at byte " + std::to_string(r.offset + p.begin) +
                  " of " + printable(ck.files[r.file], 200) + " (parameter '" +
                  printable(taken.what[q][p.range], 200) + "'), and this rank's copy (rank " +
                  std::to_string(me) + ") holds other bytes somewhere in them";
          break;
        }
      }
    }
    for (std::uint64_t j = 0; j < nvalues && found.empty(); ++j) {
      if (low[j] != high[j]) {
        found = printable(taken.value_names[j], 200) + " as the ranks read it from their " +
                "copies differs between them";
      }
    }
  } catch (const std::exception& e) {
    found = "the check itself failed on rank " + std::to_string(me) + ": " + e.what();
  }
  // 3. Every rank's verdict.
  const int bad = agree_on_failure(&comm, !found.empty());
  if (bad < 0) return read;
  throw InvalidArgument("the ranks' copies of " + printable(ck.path, 200) +
                        " hold different bytes: " +
                        (!found.empty() ? found
                                        : "rank " + std::to_string(bad) +
                                              " found a difference (its error names the file "
                                              "and the bytes)") +
                        "; every rank must read an identical copy (nothing of any model was "
                        "changed)");
}

}  // namespace zeroflat
