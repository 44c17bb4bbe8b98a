// Reading byte ranges of a checkpoint's files (files.h).
#include "source/checkpoint/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <new>
#include <thread>

#include "common/convert.h"
#include "common/prefault.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {
namespace {

// A file shorter than its header says: cut since the headers were read.
InvalidArgument truncated(const CheckpointIndex& ck, std::size_t file, std::uint64_t size) {
  return InvalidArgument(ck.files[file] + " has " + std::to_string(size) +
                         " bytes, but its header says " + std::to_string(ck.file_bytes[file]) +
                         ": truncated since it was opened");
}

// A file that is not the one whose headers were read: another identity, size or time.
void check_stamp(const CheckpointIndex& ck, std::size_t file, const FileStamp& now) {
  if (file >= ck.stamps.size() || !ck.stamps[file].known || !now.known) return;
  const FileStamp& then = ck.stamps[file];
  if (then.device == now.device && then.inode == now.inode && then.size == now.size &&
      then.mtime_ns == now.mtime_ns) {
    return;
  }
  const std::string what =
      then.device != now.device || then.inode != now.inode
          ? "another file now (replaced since it was opened)"
      : then.size != now.size
          ? std::string(now.size > then.size ? "grown" : "truncated") +
                " since it was opened (now " + std::to_string(now.size) + " bytes, " +
                std::to_string(then.size) + " then)"
          : "modified since it was opened";
  throw InvalidArgument(ck.files[file] + " is " + what +
                        ": its headers describe another file; nothing of it is read");
}

// The tensor whose bytes hold file offset `at` (for messages).
std::string tensor_at(const CheckpointIndex& ck, std::uint32_t file, std::uint64_t at) {
  for (const CheckpointTensor& t : ck.tensors) {
    if (t.file == file && t.offset <= at && at < t.offset + t.bytes) return t.name;
  }
  return "?";
}

}  // namespace

// The reads of [lo, hi) (bytes of the range) cut out of `reads`, dst relative to lo.
std::vector<Read> window(const std::vector<Read>& reads, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t es) {
  std::vector<Read> out;
  for (const Read& r : reads) {
    const std::uint64_t d0 = r.dst;
    const std::uint64_t d1 = r.dst + dst_bytes(r, es);
    const std::uint64_t a = std::max(d0, lo);
    const std::uint64_t b = std::min(d1, hi);
    if (a >= b) continue;
    const std::uint64_t fes = element_size(r.from);
    Read w = r;
    w.src = r.src + (a - d0) / es * fes;
    w.src_bytes = (b - a) / es * fes;
    w.dst = a - lo;
    out.push_back(w);
  }
  return out;
}

double resident_fraction(const std::string& file, std::uint64_t offset, std::uint64_t length) {
  if (length == 0) return 1.0;
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return 0.0;
  const auto page = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  const std::uint64_t lo = offset / page * page;
  const std::uint64_t hi = offset + length;
  void* map = mmap(nullptr, hi - lo, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(lo));
  ::close(fd);
  if (map == MAP_FAILED) return 0.0;
  std::vector<unsigned char> resident((hi - lo + page - 1) / page);
  double fraction = 0.0;
  if (mincore(map, hi - lo, resident.data()) == 0) {
    std::uint64_t in = 0;
    for (unsigned char r : resident) in += r & 1;
    fraction = static_cast<double>(in) / static_cast<double>(resident.size());
  }
  munmap(map, hi - lo);
  return fraction;
}

std::uint64_t source_bytes(const std::vector<Read>& reads) {
  std::uint64_t bytes = 0;
  for (const Read& r : reads) bytes += r.src_bytes;
  return bytes;
}

OpenFiles::OpenFiles(const CheckpointIndex& ck)
    : ck_(ck),
      open_(ck.files.size()),
      exact_(runtime_env().read_ahead == RuntimeEnv::ReadAhead::kExact) {
  rlimit lim{};
  std::uint64_t budget = 1024;
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    budget = lim.rlim_cur;
  }
  keep_ = static_cast<std::size_t>(std::clamp<std::uint64_t>(budget / 8, 4, 64));
}

void OpenFiles::advise(const File& f, std::uint32_t i) const {
  const bool own = i < own_.size() && own_[i];
  (void)posix_fadvise(f.fd(), 0, 0,
                      random_ && !(own && exact_) ? POSIX_FADV_RANDOM : POSIX_FADV_NORMAL);
}

void OpenFiles::advise_open() const {
  for (std::uint32_t i = 0; i < open_.size(); ++i) {
    if (open_[i]) advise(*open_[i], i);
  }
}

void OpenFiles::advise_reads(bool scattered) {
  const bool random = exact_ || scattered;
  std::lock_guard<std::mutex> lock(mutex_);
  if (random == random_) return;
  random_ = random;
  advise_open();
}

void OpenFiles::own_files(std::vector<bool> own) {
  std::lock_guard<std::mutex> lock(mutex_);
  own_ = std::move(own);
  advise_open();
}

void OpenFiles::ask_ahead(std::uint32_t i, std::uint64_t offset, std::uint64_t bytes) {
  if (!exact(i)) return;  // the kernel's read-ahead reads it
  try {
    (void)posix_fadvise(get(i)->fd(), static_cast<off_t>(offset), static_cast<off_t>(bytes),
                        POSIX_FADV_WILLNEED);
  } catch (const std::exception&) {
    // Only advice: the read itself reports what is wrong with the file.
  }
}

std::shared_ptr<const File> OpenFiles::get(std::uint32_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_[i]) {
    lru_.remove(i);
    lru_.push_back(i);
    return open_[i];
  }
  // Close the least recently used files nobody is reading.
  for (auto it = lru_.begin(); it != lru_.end() && lru_.size() >= keep_;) {
    if (open_[*it].use_count() == 1) {
      open_[*it].reset();
      it = lru_.erase(it);
    } else {
      ++it;
    }
  }
  std::shared_ptr<const File> f;
  try {
    f = std::make_shared<const File>(ck_.files[i]);
  } catch (const InvalidArgument& e) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) {
      throw ResourceExhausted(ck_.files[i] + ": the system refuses another open file (" +
                              std::strerror(err) + "; " + std::to_string(lru_.size()) +
                              " of the checkpoint's files are open here): raise `ulimit -n`");
    }
    throw;
  }
  check_stamp(ck_, i, f->stamp());
  if (f->size() < ck_.file_bytes[i]) throw truncated(ck_, i, f->size());
  if (random_) advise(*f, i);
  open_[i] = f;
  lru_.push_back(i);
  return f;
}

// Every file of the checkpoint is there and as long as its header says: checked without opening
// (so without descriptors), before the ranks agree, so that a missing shard is an error on every
// rank before anything is read.
void check_files_present(const CheckpointIndex& ck, const std::vector<bool>& only) {
  for (std::size_t i = 0; i < ck.files.size(); ++i) {
    if (!only.empty() && (i >= only.size() || !only[i])) continue;
    struct stat st {};
    if (::stat(ck.files[i].c_str(), &st) != 0) {
      throw InvalidArgument(ck.files[i] + ": " + std::strerror(errno) + " (a file of checkpoint " +
                            ck.path + ", named by its index)");
    }
    if (!S_ISREG(st.st_mode)) {
      throw InvalidArgument(ck.files[i] + " is not a regular file");
    }
    check_stamp(ck, i, stamp_of(st));
    if (static_cast<std::uint64_t>(st.st_size) < ck.file_bytes[i]) {
      throw truncated(ck, i, static_cast<std::uint64_t>(st.st_size));
    }
  }
}

// Drops files' pages from the page cache. Dirty pages (a checkpoint just written) are not
// dropped, so they are written back first.
void drop_from_cache(OpenFiles& files, const std::vector<std::uint32_t>& which) {
  for (std::uint32_t f : which) {
    const std::shared_ptr<const File> file = files.get(f);
    (void)fdatasync(file->fd());
    (void)posix_fadvise(file->fd(), 0, 0, POSIX_FADV_DONTNEED);
  }
}

void drop_all_from_cache(OpenFiles& files) {
  std::vector<std::uint32_t> all(files.checkpoint().files.size());
  for (std::uint32_t f = 0; f < all.size(); ++f) all[f] = f;
  drop_from_cache(files, all);
}

// The fraction of the reads' bytes in the page cache now.
double cached_fraction_of(const CheckpointIndex& ck, const std::vector<Read>& reads) {
  std::uint64_t cached = 0;
  std::uint64_t total = 0;
  for (const Read& r : reads) {
    cached += static_cast<std::uint64_t>(resident_fraction(ck.files[r.file], r.src, r.src_bytes) *
                                         static_cast<double>(r.src_bytes));
    total += r.src_bytes;
  }
  return total ? static_cast<double>(cached) / static_cast<double>(total) : 1.0;
}

Reader::Reader(OpenFiles& files, DType to, unsigned threads,
               std::optional<std::uint64_t> fail_after, ReadProgress* progress,
               double read_bytes_per_second)
    : files_(files),
      to_(to),
      es_(element_size(to)),
      pool_(threads),
      fail_after_(fail_after),
      progress_(progress),
      read_bytes_per_second_(read_bytes_per_second) {}

void Reader::fill(unsigned char* dst, std::uint64_t n, const std::vector<Read>& reads) {
  // The gaps first (padding between and after parameters).
  std::vector<std::pair<std::uint64_t, std::uint64_t>> covered;
  for (const Read& r : reads) covered.emplace_back(r.dst, r.dst + dst_bytes(r, es_));
  std::sort(covered.begin(), covered.end());
  std::uint64_t at = 0;
  for (const auto& [lo, hi] : covered) {
    if (lo > at) std::memset(dst + at, 0, lo - at);
    at = std::max(at, hi);
  }
  if (n > at) std::memset(dst + at, 0, n - at);
  std::vector<Piece> pieces;
  add_pieces(dst, reads, pieces);
  run(pieces);
}

void Reader::fill_many(std::span<const Destination> destinations) {
  std::vector<Piece> pieces;
  for (const Destination& d : destinations) add_pieces(d.dst, *d.reads, pieces);
  std::stable_sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.read->file != b.read->file ? a.read->file < b.read->file
                                        : a.read->src + a.skip < b.read->src + b.skip;
  });
  run(pieces);
}

void Reader::add_pieces(unsigned char* base, const std::vector<Read>& reads,
                        std::vector<Piece>& out) {
  // Pieces of at most kPiece source bytes, in the reads' (file) order.
  for (const Read& r : reads) {
    const std::uint64_t step = kPiece / element_size(r.from) * element_size(r.from);
    for (std::uint64_t s = 0; s < r.src_bytes; s += step) {
      out.push_back(Piece{base, &r, s, std::min(step, r.src_bytes - s)});
    }
  }
}

void Reader::run(const std::vector<Piece>& pieces) {
  // Exact read-ahead: with the kernel's own off, the pieces a thread will take next are asked
  // for now (each thread one piece ahead of its current one), so the disk always has the next
  // reads queued and never a byte outside them.
  const std::size_t ahead = files_.exact() ? pool_.size() : 0;
  for (std::size_t k = 0; k < ahead; ++k) ask_ahead(pieces, k);
  std::atomic<std::size_t> next{0};
  pool_.run([&](unsigned) {
    std::vector<unsigned char> scratch;
    for (std::size_t k = next++; k < pieces.size() && !failed_; k = next++) {
      if (ahead > 0) ask_ahead(pieces, k + ahead);
      if (!read_piece(pieces[k], scratch)) return;
    }
  });
}

void Reader::ask_ahead(const std::vector<Piece>& pieces, std::size_t k) {
  if (k >= pieces.size() || pieces[k].read == nullptr) return;
  const Piece& p = pieces[k];
  files_.ask_ahead(p.read->file, p.read->src + p.skip, p.bytes);
}

bool Reader::read_piece(const Piece& p, std::vector<unsigned char>& scratch) {
  const auto t0 = std::chrono::steady_clock::now();
  const Read& r = *p.read;
  const std::uint64_t fes = element_size(r.from);
  unsigned char* out = p.base + r.dst + p.skip / fes * es_;
  unsigned char* into = out;
  if (r.from != to_) {
    try {
      scratch.resize(p.bytes);
    } catch (const std::bad_alloc&) {
      fail(OutOfMemory("cannot allocate " + format_bytes(p.bytes) +
                       " of host scratch to convert " + files_.path(r.file)));
      return false;
    }
    into = scratch.data();
  }
  // The kernel copies into pages it faults in one by one; faulted in first, in one call, they
  // cost less (prefault_for_write). Only where they are not there yet (three pages sampled, a
  // microsecond): over resident pages (a reload into a reused buffer, the conversion scratch
  // after its first piece) the call would cost a tenth of the read's copy for nothing.
  if (mostly_untouched(into, p.bytes, 3)) prefault_for_write(into, p.bytes);
  if (!read_exactly(r.file, into, p.bytes, r.src + p.skip)) return false;
  if (r.from != to_) convert_range(out, to_, into, r.from, p.bytes / fes);
  bytes_ += p.bytes;
  if (progress_ != nullptr) progress_->done.fetch_add(p.bytes, std::memory_order_relaxed);
  if (read_bytes_per_second_ > 0) {  // the simulated slow disk: this piece's time at its pace
    std::this_thread::sleep_until(
        t0 + std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(
                 static_cast<double>(p.bytes) / read_bytes_per_second_)));
  }
  return true;
}

void Reader::fill_windows(std::uint64_t n, const std::vector<Read>& reads, std::uint64_t window,
                          unsigned char* ring, std::uint64_t depth,
                          const std::function<void(std::uint64_t)>& open,
                          const std::function<void(std::uint64_t, std::uint64_t)>& full) {
  // Every window's reads and pieces up front (window k's pieces land in slot k % depth), in
  // window order: the team takes them in that order, so window k's pieces are all taken before
  // any of window k + depth's, whose opening waits for window k's copy: no thread waits for a
  // window that a waiting thread would have to read.
  const std::uint64_t windows = window == 0 ? 0 : (n + window - 1) / window;
  std::vector<std::vector<Read>> in_window(windows);
  std::vector<Piece> pieces;
  std::vector<std::uint64_t> window_of;  // of each piece
  for (std::uint64_t k = 0; k < windows; ++k) {
    const std::uint64_t lo = k * window, hi = std::min(n, lo + window);
    in_window[k] = detail::window(reads, lo, hi, es_);
    const std::size_t before = pieces.size();
    add_pieces(ring + (k % depth) * window, in_window[k], pieces);
    if (pieces.size() == before) pieces.push_back(Piece{ring + (k % depth) * window, nullptr, 0, 0});
    window_of.resize(pieces.size(), k);
  }
  std::vector<std::atomic<std::size_t>> left(windows);
  for (std::uint64_t k = 0; k < windows; ++k) left[k] = 0;
  for (const std::uint64_t k : window_of) ++left[k];
  std::vector<std::once_flag> opened(windows);
  const std::size_t ahead = files_.exact() ? pool_.size() : 0;
  for (std::size_t k = 0; k < ahead; ++k) ask_ahead(pieces, k);
  std::atomic<std::size_t> next{0};
  pool_.run([&](unsigned) {
    std::vector<unsigned char> scratch;
    for (std::size_t i = next++; i < pieces.size() && !failed_; i = next++) {
      if (ahead > 0) ask_ahead(pieces, i + ahead);
      const std::uint64_t k = window_of[i];
      const std::uint64_t slot = k % depth;
      std::call_once(opened[k], [&] {
        open(slot);
        if (failed_) return;
        // The window's gaps (padding between and after parameters) zeroed in its slot.
        const std::uint64_t len = std::min(window, n - k * window);
        std::vector<std::pair<std::uint64_t, std::uint64_t>> covered;
        for (const Read& r : in_window[k]) covered.emplace_back(r.dst, r.dst + dst_bytes(r, es_));
        std::sort(covered.begin(), covered.end());
        unsigned char* base = ring + slot * window;
        std::uint64_t at = 0;
        for (const auto& [lo, hi] : covered) {
          if (lo > at) std::memset(base + at, 0, lo - at);
          at = std::max(at, hi);
        }
        if (len > at) std::memset(base + at, 0, len - at);
      });
      if (failed_) return;
      if (pieces[i].read != nullptr && !read_piece(pieces[i], scratch)) return;
      if (left[k].fetch_sub(1) == 1) full(k, slot);
    }
  });
}

bool Reader::read_exactly(std::uint32_t file, unsigned char* out, std::uint64_t n,
                          std::uint64_t at) {
  // Which tensor, only when something failed (a scan of every tensor).
  auto where = [&] {
    return " (tensor '" + printable(tensor_at(files_.checkpoint(), file, at)) + "')";
  };
  try {
    if (fail_after_ && read_so_far_.fetch_add(n) + n > *fail_after_) {
      throw Error(files_.path(file) + ": reading bytes [" + std::to_string(at) + ", " +
                  std::to_string(at + n) + ") failed: injected I/O error (testing aid)");
    }
    files_.get(file)->read_at(out, n, at);
    return true;
  } catch (const ResourceExhausted& e) {
    fail(ResourceExhausted(e.what() + where()));
  } catch (const std::exception& e) {
    fail(Error(e.what() + where()));
  }
  return false;
}

void fill_through_ring(Reader& reader, Device& device, unsigned char* dst, std::uint64_t n,
                       const std::vector<Read>& reads, unsigned char* ring,
                       std::uint64_t ring_bytes, unsigned depth_option, std::uint64_t es) {
  const std::uint64_t depth = std::max<unsigned>(1, depth_option);
  const std::uint64_t chunk = ring_bytes / depth;
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::pair<std::uint64_t, std::uint64_t>> full;  // (chunk slot, window start)
  std::vector<bool> busy(depth, false);
  bool done = false;
  std::string copy_error;
  // One copier: each full window to the device as soon as it is complete, in whatever order
  // the windows complete, while the team goes on reading the next ones into the other slots.
  std::thread copier([&] {
    for (;;) {
      std::pair<std::uint64_t, std::uint64_t> job;
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return done || !full.empty(); });
        if (full.empty()) return;
        job = full.front();
        full.pop_front();
      }
      try {
        if (copy_error.empty()) {
          device.copy(dst + job.second, ring + job.first * chunk, std::min(chunk, n - job.second));
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(m);
        copy_error = e.what();
      }
      {
        std::lock_guard<std::mutex> lock(m);
        busy[job.first] = false;
      }
      cv.notify_all();
    }
  });
  // The copier is stopped and joined on every way out, a throw included: a thread left
  // joinable would end the process.
  const auto stop_copier = [&] {
    {
      std::lock_guard<std::mutex> lock(m);
      done = true;
    }
    cv.notify_all();
    copier.join();
  };
  try {
    (void)es;
    reader.fill_windows(
        n, reads, chunk, ring, depth,
        [&](std::uint64_t slot) {
          // A slot is free once the copy of the window before in it is done; a failed read
          // (the window before never completes) or copy ends the wait.
          std::unique_lock<std::mutex> lock(m);
          while (busy[slot] && !reader.failed() && copy_error.empty()) {
            cv.wait_for(lock, std::chrono::milliseconds(20));
          }
          busy[slot] = true;
        },
        [&](std::uint64_t k, std::uint64_t slot) {
          {
            std::lock_guard<std::mutex> lock(m);
            full.emplace_back(slot, k * chunk);
          }
          cv.notify_all();
        });
  } catch (...) {
    stop_copier();
    throw;
  }
  stop_copier();
  device.synchronize();
  if (!copy_error.empty()) throw Error("copying to " + device.name() + ": " + copy_error);
}

std::uint64_t read_ahead(std::vector<PathRange> ranges) {
  constexpr std::uint64_t kGap = std::uint64_t{1} << 20;
  std::sort(ranges.begin(), ranges.end(), [](const PathRange& a, const PathRange& b) {
    return a.path != b.path ? a.path < b.path : a.offset < b.offset;
  });
  std::uint64_t asked = 0;
  for (std::size_t k = 0; k < ranges.size();) {
    const std::string& path = ranges[k].path;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    std::size_t next = k;
    while (next < ranges.size() && ranges[next].path == path) ++next;
    for (std::size_t i = k; i < next && fd >= 0;) {
      const std::uint64_t lo = ranges[i].offset;
      std::uint64_t hi = lo + ranges[i].bytes;
      for (++i; i < next && ranges[i].offset <= hi + kGap; ++i) {
        hi = std::max(hi, ranges[i].offset + ranges[i].bytes);
      }
      if (hi > lo && posix_fadvise(fd, static_cast<off_t>(lo), static_cast<off_t>(hi - lo),
                                   POSIX_FADV_WILLNEED) == 0) {
        asked += hi - lo;
      }
    }
    if (fd >= 0) ::close(fd);
    k = next;
  }
  return asked;
}

}  // namespace zeroflat::detail
