// A rank's shards used where they lie in the checkpoint's files (loader.h).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>

#include "common/thread_pool.h"
#include "exec/pipeline.h"
#include "source/checkpoint/files.h"
#include "source/checkpoint/source.h"
#include "zeroflat/common.h"
#include "zeroflat/loader.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22  // Linux 5.14
#endif

namespace zeroflat {
namespace {

// One file's mapping: unmapped when the last range of it goes.
struct FileMapping {
  void* base = MAP_FAILED;
  std::size_t length = 0;
  FileMapping() = default;
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping() {
    if (base != MAP_FAILED) munmap(base, length);
  }
};

// Pages are brought in in pieces of at most this many bytes, each thread taking the next.
constexpr std::uint64_t kMapPiece = 8u << 20;

// Pieces asked for ahead of the one being brought in, under exact read-ahead: the storage
// gets the next reads while the faults of this one are served.
constexpr std::size_t kMapAhead = 2;

// Brings [p, p + n) of a mapping in, from the start of p's page: the page cache's pages mapped,
// the file read where they are not. Without MADV_POPULATE_READ (a kernel before 5.14), each
// page is touched.
void populate_pages(unsigned char* p, std::uint64_t n) {
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t skip = reinterpret_cast<std::uintptr_t>(p) % page;
  if (madvise(p - skip, n + skip, MADV_POPULATE_READ) == 0) return;
  const int err = errno;
  if (err != EINVAL) throw std::system_error(err, std::generic_category());
  volatile unsigned char sink = 0;
  for (std::uint64_t k = 0; k < n; k += page) sink = sink + p[k];
  (void)sink;
}

// Whether every coordinate's shard is one run of the tensor (or none): each dimension a mesh
// dimension of more than one index cuts has only dimensions of size 1 before it. Depends on the
// shape and placements only, so the ranks agree on it.
bool one_run_everywhere(const Shape& shape, std::span<const std::uint64_t> mesh,
                        std::span<const MeshPlacement> placements) {
  for (std::size_t d = 0; d < placements.size() && d < mesh.size(); ++d) {
    if (mesh[d] <= 1 || placements[d].kind != MeshPlacement::Kind::kShard) continue;
    for (std::size_t j = 0; j < placements[d].dim && j < shape.size(); ++j) {
      if (shape[j] != 1) return false;
    }
  }
  return true;
}

}  // namespace

std::vector<std::optional<FileRange>> shard_file_ranges(const CheckpointIndex& ck,
                                                        std::span<const LoadParam> params,
                                                        const ShardSpec& spec, std::uint64_t rank,
                                                        DType dtype) {
  validate(spec, spec.coords.size(), params.size());
  if (rank >= spec.coords.size()) {
    throw InvalidArgument("rank " + std::to_string(rank) + " of " +
                          std::to_string(spec.coords.size()));
  }
  const detail::Sources sources = detail::resolve_all(ck, params);
  std::vector<std::optional<FileRange>> out(params.size());
  const std::uint64_t es = element_size(dtype);
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (sources[p].size() != 1) continue;  // several tensors make it up
    const CheckpointTensor& t = *sources[p].front();
    const bool whole = std::all_of(t.piece_offsets.begin(), t.piece_offsets.end(),
                                   [](std::int64_t o) { return o == 0; }) &&
                       (t.whole_shape.empty() || t.whole_shape == t.shape);
    if (t.type != dtype || !whole || t.offset % es != 0) continue;
    if (!one_run_everywhere(params[p].shape, spec.mesh, spec.placements[p])) continue;
    const LocalShard s =
        local_shard(params[p].shape, spec.mesh, spec.placements[p], spec.coords[rank]);
    if (s.runs.size() > 1) {
      throw Error("parameter '" + params[p].name + "': a shard of " +
                  std::to_string(s.runs.size()) + " runs where one was expected");
    }
    const std::uint64_t first = s.runs.empty() ? 0 : s.runs.front().first;
    out[p] = FileRange{t.file, t.offset + first * es, s.numel * es};
  }
  return out;
}

MappedRanges map_file_ranges(const CheckpointIndex& ck, std::span<const FileRange> ranges,
                             const MapOptions& options) {
  ReadProgress* const progress = options.progress;
  const auto page = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  // Each file's span of pages, every range checked against the file's size first.
  std::map<std::uint32_t, std::pair<std::uint64_t, std::uint64_t>> span;
  std::uint64_t total = 0;
  for (const FileRange& r : ranges) {
    if (r.file >= ck.files.size() || r.offset > ck.file_bytes[r.file] ||
        r.bytes > ck.file_bytes[r.file] - r.offset) {
      throw InvalidArgument(
          (r.file < ck.files.size() ? ck.files[r.file] : "file " + std::to_string(r.file)) +
          ": bytes [" + std::to_string(r.offset) + ", +" + std::to_string(r.bytes) +
          ") are not a range of the file to map");
    }
    if (r.bytes == 0) continue;  // an empty shard: nothing to map
    const std::uint64_t lo = r.offset / page * page;
    const std::uint64_t hi = r.offset + r.bytes;
    auto [it, fresh] = span.try_emplace(r.file, lo, hi);
    if (!fresh) {
      it->second.first = std::min(it->second.first, lo);
      it->second.second = std::max(it->second.second, hi);
    }
    total += r.bytes;
  }
  detail::OpenFiles files(ck);
  // A sole reader keeps the kernel's read-ahead for every file; under exact read-ahead the
  // others are read exactly (OpenFiles::exact).
  if (options.sole_reader) files.own_files(std::vector<bool>(ck.files.size(), true));
  if (options.cold) {
    std::vector<std::uint32_t> which;
    for (const auto& [file, lohi] : span) which.push_back(file);
    detail::drop_from_cache(files, which);
  }
  std::map<std::uint32_t, std::shared_ptr<FileMapping>> maps;
  for (const auto& [file, lohi] : span) {
    // The file whose headers were read, at least as long as they say (checked on opening).
    const std::shared_ptr<const detail::File> f = files.get(file);
    auto m = std::make_shared<FileMapping>();
    m->length = lohi.second - lohi.first;
    m->base = mmap(nullptr, m->length, PROT_READ | PROT_WRITE, MAP_PRIVATE, f->fd(),
                   static_cast<off_t>(lohi.first));
    if (m->base == MAP_FAILED) {
      throw InvalidArgument(ck.files[file] + ": cannot be mapped (" + std::strerror(errno) +
                            "): load with storage 'read'");
    }
    // Past a rank's bytes lie another rank's: no read-around on the faults (see `ask` below).
    if (files.exact(file)) (void)madvise(m->base, m->length, MADV_RANDOM);
    maps.emplace(file, std::move(m));
  }
  MappedRanges out;
  struct Piece {
    unsigned char* p;
    std::uint64_t n;
    std::size_t range;
    std::uint64_t at;  // its first byte's offset in the file
  };
  std::vector<Piece> pieces;
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const FileRange& r = ranges[k];
    if (r.bytes == 0) {
      out.data_.push_back(nullptr);
      out.keep_.emplace_back();
      continue;
    }
    const std::shared_ptr<FileMapping>& m = maps.at(r.file);
    unsigned char* data = static_cast<unsigned char*>(m->base) + (r.offset - span[r.file].first);
    out.data_.push_back(data);
    out.keep_.push_back(m);
    for (std::uint64_t at = 0; at < r.bytes; at += kMapPiece) {
      pieces.push_back({data + at, std::min(kMapPiece, r.bytes - at), k, r.offset + at});
    }
  }
  out.bytes_ = total;
  if (progress != nullptr) progress->planned.fetch_add(total, std::memory_order_relaxed);
  // In file order, so that each file is walked front to back.
  std::sort(pieces.begin(), pieces.end(), [&](const Piece& a, const Piece& b) {
    const FileRange& x = ranges[a.range];
    const FileRange& y = ranges[b.range];
    return x.file != y.file ? x.file < y.file : a.p < b.p;
  });
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stop{false};
  const unsigned wanted = options.threads > 0 ? options.threads : default_num_threads();
  detail::ThreadPool pool(
      static_cast<unsigned>(std::clamp<std::size_t>(pieces.size(), 1, std::max(1u, wanted))));
  // Under exact read-ahead the kernel's read-around is off for the mappings (a fault would read
  // one page at a time: a tenth of the disk's pace on the development machine); each piece's
  // bytes are asked for exactly instead, kMapAhead pieces ahead of the one being brought in.
  // (The files reopen through OpenFiles' bounded set; each mapping holds its own reference to
  // the file checked when it was mapped.)
  const auto ask = [&](std::size_t i) {
    if (i < pieces.size()) files.ask_ahead(ranges[pieces[i].range].file, pieces[i].at, pieces[i].n);
  };
  for (std::size_t i = 0; i < kMapAhead; ++i) ask(i);
  pool.run([&](unsigned) {
    for (std::size_t i = next++; i < pieces.size() && !stop; i = next++) {
      ask(i + kMapAhead);
      const Piece& piece = pieces[i];
      try {
        populate_pages(piece.p, piece.n);
      } catch (const std::system_error& e) {
        stop = true;
        throw Error(ck.files[ranges[piece.range].file] + ": bytes [" + std::to_string(piece.at) +
                    ", +" + std::to_string(piece.n) + ") cannot be read through the mapping (" +
                    e.code().message() + ")");
      }
      if (progress != nullptr) progress->done.fetch_add(piece.n, std::memory_order_relaxed);
    }
  });
  return out;
}

}  // namespace zeroflat
