// Reading byte ranges of a checkpoint's files: the reads a rank makes, the files kept open, a
// team of threads that reads and converts, and what the page cache holds. Shared by every
// source that reads tensors out of files.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <exception>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <span>
#include <vector>

#include "common/thread_pool.h"
#include "model/files.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat::detail {

// One contiguous read: src_bytes of file at src, converted from `from`, landing at dst (bytes
// from the start of the range being filled).
struct Read {
  std::uint32_t file = 0;
  std::uint64_t src = 0;
  std::uint64_t src_bytes = 0;
  std::uint64_t dst = 0;
  DType from = DType::kBF16;
};

// Bytes a read fills in a buffer of element size es.
inline std::uint64_t dst_bytes(const Read& r, std::uint64_t es) {
  return r.src_bytes / element_size(r.from) * es;
}

// The reads of [lo, hi) (bytes of the range) cut out of `reads`, dst relative to lo.
std::vector<Read> window(const std::vector<Read>& reads, std::uint64_t lo, std::uint64_t hi,
                         std::uint64_t es);

// The file bytes of the reads.
std::uint64_t source_bytes(const std::vector<Read>& reads);

// The checkpoint's files, opened when first read and kept open a bounded number at a time, so
// that a checkpoint of hundreds of shards loads under the default descriptor limit: a rank opens
// only the files it reads, and at most a few dozen of them at once.
class OpenFiles {
 public:
  explicit OpenFiles(const CheckpointIndex& ck);

  // How the reads to come are read ahead (ZEROFLAT_READ_AHEAD, common.h). Exact (the default):
  // the kernel's read-ahead is off for every file but own_files' (POSIX_FADV_RANDOM), and the
  // Reader asks for exactly the pieces it reads next (POSIX_FADV_WILLNEED): past the end of a
  // run of a rank's bytes the kernel would read the start of another rank's, which that rank
  // reads itself.
  // Kernel: the kernel's read-ahead, off only when `scattered` (many short ranges spread over
  // each file, a range of every tensor). Applies to the files open now and to those opened later.
  void advise_reads(bool scattered);
  // Whether the Reader asks ahead for its pieces (exact read-ahead).
  bool exact() const { return exact_; }
  // Under exact read-ahead, whether file i is read exactly: not one of the files no other rank
  // reads (own_files).
  bool exact(std::uint32_t i) const { return exact_ && !(i < own_.size() && own_[i]); }
  // The files no other rank of the load reads (own[i]; a rank's own optimizer file when a
  // DeepSpeed checkpoint resumes at its world): read with the kernel's read-ahead even under
  // exact read-ahead. Past a run of this rank's bytes it reads only bytes no other rank needs,
  // and it reads into the page cache's large folios, where reads with it off fill single pages
  // (a cold read at about two thirds of the disk's pace on the development machine).
  void own_files(std::vector<bool> own);
  // Under exact read-ahead, for a file read exactly (exact(i)), asks the kernel for exactly
  // bytes [offset, offset + bytes) of file i now (POSIX_FADV_WILLNEED), for a read or a fault to
  // come. Only advice: a file that cannot be opened is left for the read to report.
  void ask_ahead(std::uint32_t i, std::uint64_t offset, std::uint64_t bytes);

  // File i, open; it stays open at least while the returned pointer lives. Throws
  // ResourceExhausted when the system refuses a descriptor, InvalidArgument when the file is
  // gone, not a regular file or shorter than its header says.
  std::shared_ptr<const File> get(std::uint32_t i);
  const std::string& path(std::uint32_t i) const { return ck_.files[i]; }
  const CheckpointIndex& checkpoint() const { return ck_; }

 private:
  const CheckpointIndex& ck_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<const File>> open_;
  std::list<std::uint32_t> lru_;
  std::size_t keep_ = 64;
  bool random_ = false;  // scattered reads, or exact read-ahead (advise_reads)
  std::vector<bool> own_;
  const bool exact_;
  // The read-ahead advice for file i under the current reads.
  void advise(const File& f, std::uint32_t i) const;
  // advise() for every open file (mutex_ held).
  void advise_open() const;
};

// Every file of the checkpoint is there and as long as its header says: checked without opening
// (so without descriptors). Throws InvalidArgument naming the file.
void check_files_present(const CheckpointIndex& ck, const std::vector<bool>& only = {});

// Drops files' pages from the page cache. Dirty pages (a checkpoint just written) are not
// dropped, so they are written back first.
void drop_from_cache(OpenFiles& files, const std::vector<std::uint32_t>& which);
void drop_all_from_cache(OpenFiles& files);

// The fraction of [offset, offset + length) of a file in the page cache now (mincore); 0 when
// the file cannot be mapped.
double resident_fraction(const std::string& file, std::uint64_t offset, std::uint64_t length);

// The fraction of the reads' bytes in the page cache now.
double cached_fraction_of(const CheckpointIndex& ck, const std::vector<Read>& reads);

// Reads and converts pieces on a team of threads. A failure stops the others and is kept.
class Reader {
 public:
  // progress: counts each piece read into `done` (the caller counts what it plans); may be null.
  // read_bytes_per_second: a simulated slow disk (ReadOptions' testing aid; 0: none).
  Reader(OpenFiles& files, DType to, unsigned threads, std::optional<std::uint64_t> fail_after,
         ReadProgress* progress = nullptr, double read_bytes_per_second = 0);

  // Fills dst[0, n) from the reads (dst offsets relative to dst): zeros where no read lands.
  // A failure is kept (failed(), rethrow()), not thrown.
  void fill(unsigned char* dst, std::uint64_t n, const std::vector<Read>& reads);
  // Each destination from its reads (dst offsets relative to it), all in one pass of the team
  // in file order; no gap is zeroed (the reads cover every byte the caller keeps). A failure is
  // kept, as fill's.
  struct Destination {
    unsigned char* dst = nullptr;
    const std::vector<Read>* reads = nullptr;
  };
  void fill_many(std::span<const Destination> destinations);
  // dst[0, n) window by window through a ring of `depth` slots of `window` bytes (slot k % depth
  // holds window k, its gaps zeroed): the team reads several windows at once, each thread the
  // next piece of whatever window is in flight, so that every thread reads while full windows
  // are copied out. Before the first byte of window k lands, open(slot) returns once the slot is
  // free (it waits for the copy of window k - depth); once its last byte has landed, full(k,
  // slot) is called on the thread that read it. A failure is kept, as fill's; open() must then
  // return (it may poll failed()).
  void fill_windows(std::uint64_t n, const std::vector<Read>& reads, std::uint64_t window,
                    unsigned char* ring, std::uint64_t depth,
                    const std::function<void(std::uint64_t slot)>& open,
                    const std::function<void(std::uint64_t k, std::uint64_t slot)>& full);

  // Throws what failed (its type kept: OutOfMemory, ResourceExhausted, Error), naming the file,
  // byte range and tensor.
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }
  bool failed() const { return failed_; }
  std::uint64_t bytes() const { return bytes_; }

 private:
  static constexpr std::uint64_t kPiece = std::uint64_t{8} << 20;
  // A read's part of at most kPiece source bytes, landing at `base` + its dst.
  struct Piece {
    unsigned char* base;
    const Read* read;
    std::uint64_t skip;   // source bytes into the read
    std::uint64_t bytes;  // source bytes
  };
  void add_pieces(unsigned char* base, const std::vector<Read>& reads, std::vector<Piece>& out);
  // The team reads the pieces, in their order.
  void run(const std::vector<Piece>& pieces);
  // Exact read-ahead: with the kernel's own off, the piece a thread will take next is asked
  // for now (each thread one piece ahead of its current one; none past the end).
  void ask_ahead(const std::vector<Piece>& pieces, std::size_t k);
  // One piece, read (and converted) where it lands; false once something failed.
  bool read_piece(const Piece& p, std::vector<unsigned char>& scratch);

  template <typename E>
  void fail(const E& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_.exchange(true)) error_ = std::make_exception_ptr(e);
  }
  bool read_exactly(std::uint32_t file, unsigned char* out, std::uint64_t n, std::uint64_t at);

  OpenFiles& files_;
  DType to_;
  std::uint64_t es_;
  ThreadPool pool_;
  std::optional<std::uint64_t> fail_after_;
  ReadProgress* progress_;
  double read_bytes_per_second_ = 0;
  std::atomic<std::uint64_t> read_so_far_{0};
  std::atomic<std::uint64_t> bytes_{0};
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

// A ring of chunks in `ring` (ring_bytes of pinned host memory, `depth` chunks): the team fills
// window k + 1 of dst[0, n) from the reads while a copier thread moves window k to the device.
// Throws what the reader or the copy failed with; the copier is stopped and joined on every way
// out.
void fill_through_ring(Reader& reader, Device& device, unsigned char* dst, std::uint64_t n,
                       const std::vector<Read>& reads, unsigned char* ring,
                       std::uint64_t ring_bytes, unsigned depth, std::uint64_t es);

// Bytes [offset, offset + bytes) of the file at `path`.
struct PathRange {
  std::string path;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

// Asks the kernel now for every range (POSIX_FADV_WILLNEED), file by file in file order, ranges
// closer than 1 MiB merged: the reads to come find their bytes in flight. Returns the bytes
// asked for. Only advice: a file that cannot be opened is skipped (its read reports it).
std::uint64_t read_ahead(std::vector<PathRange> ranges);

}  // namespace zeroflat::detail
