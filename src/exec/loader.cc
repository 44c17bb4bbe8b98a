// The checkpoint loader (loader.h): the checkpoint as a source of the one pipeline (pipeline.h),
// whose kRead step reads this rank's slice straight from the files into the flat buffer (or
// through a ring of pinned chunks).
#include "zeroflat/loader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <thread>

#include "common/clock.h"
#include "common/thread_pool.h"
#include "device/host_kernels.h"
#include "exec/pipeline.h"
#include "model/files.h"
#include "zeroflat/agree.h"
#include "zeroflat/checksum.h"
#include "zeroflat/error.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"
#include "zeroflat/zero3.h"

namespace zeroflat {
namespace {

using detail::Clock;
using detail::seconds_since;

// One contiguous read: src_bytes of file at src, converted from `from`, landing at dst (bytes
// from the start of the range being filled).
struct Read {
  std::uint32_t file = 0;
  std::uint64_t src = 0;
  std::uint64_t src_bytes = 0;
  std::uint64_t dst = 0;
  DType from = DType::kBF16;
};

std::uint64_t dst_bytes(const Read& r, std::uint64_t es) {
  return r.src_bytes / element_size(r.from) * es;
}

// A file shorter than its header says: cut since the headers were read.
InvalidArgument truncated(const CheckpointIndex& ck, std::size_t file, std::uint64_t size) {
  return InvalidArgument(ck.files[file] + " has " + std::to_string(size) +
                         " bytes, but its header says " + std::to_string(ck.file_bytes[file]) +
                         ": truncated since it was opened");
}

// The checkpoint's files, opened when first read and kept open a bounded number at a time, so
// that a checkpoint of hundreds of shards loads under the default descriptor limit: a rank opens
// only the files it reads, and at most kept() of them at once.
class OpenFiles {
 public:
  // scattered: the reads are many ranges spread over each file (ZeRO-3's partitions: a range
  // of every tensor), so the kernel's read-ahead is turned off (POSIX_FADV_RANDOM): past the end
  // of each range it would read the start of another rank's, which that rank reads itself.
  explicit OpenFiles(const CheckpointIndex& ck, bool scattered = false)
      : ck_(ck), open_(ck.files.size()), scattered_(scattered) {
    rlimit lim{};
    std::uint64_t budget = 1024;
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
      budget = lim.rlim_cur;
    }
    keep_ = static_cast<std::size_t>(std::clamp<std::uint64_t>(budget / 8, 4, 64));
  }

  // File i, open; it stays open at least while the returned pointer lives. Throws
  // ResourceExhausted when the system refuses a descriptor, InvalidArgument when the file is
  // gone, not a regular file or shorter than its header says.
  std::shared_ptr<const detail::File> get(std::uint32_t i) {
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
    std::shared_ptr<const detail::File> f;
    try {
      f = std::make_shared<const detail::File>(ck_.files[i]);
    } catch (const InvalidArgument& e) {
      const int err = errno;
      if (err == EMFILE || err == ENFILE) {
        throw ResourceExhausted(ck_.files[i] + ": the system refuses another open file (" +
                                std::strerror(err) + "; " + std::to_string(lru_.size()) +
                                " of the checkpoint's files are open here): raise `ulimit -n`");
      }
      throw;
    }
    if (f->size() < ck_.file_bytes[i]) throw truncated(ck_, i, f->size());
    if (scattered_) (void)posix_fadvise(f->fd(), 0, 0, POSIX_FADV_RANDOM);
    open_[i] = f;
    lru_.push_back(i);
    return f;
  }
  const std::string& path(std::uint32_t i) const { return ck_.files[i]; }

 private:
  const CheckpointIndex& ck_;
  std::mutex mutex_;
  std::vector<std::shared_ptr<const detail::File>> open_;
  std::list<std::uint32_t> lru_;
  std::size_t keep_ = 64;
  bool scattered_ = false;
};

// Every file of the checkpoint is there and as long as its header says: checked without opening
// (so without descriptors), before the ranks agree, so that a missing shard is an error on every
// rank before anything is read.
void check_files_present(const CheckpointIndex& ck) {
  for (std::size_t i = 0; i < ck.files.size(); ++i) {
    struct stat st {};
    if (::stat(ck.files[i].c_str(), &st) != 0) {
      throw InvalidArgument(ck.files[i] + ": " + std::strerror(errno) + " (a file of checkpoint " +
                            ck.path + ", named by its index)");
    }
    if (!S_ISREG(st.st_mode)) {
      throw InvalidArgument(ck.files[i] + " is not a regular file");
    }
    if (static_cast<std::uint64_t>(st.st_size) < ck.file_bytes[i]) {
      throw truncated(ck, i, static_cast<std::uint64_t>(st.st_size));
    }
  }
}

// The tensor whose bytes hold file offset `at` (for messages).
std::string tensor_at(const CheckpointIndex& ck, std::uint32_t file, std::uint64_t at) {
  for (const CheckpointTensor& t : ck.tensors) {
    if (t.file == file && t.offset <= at && at < t.offset + t.bytes) return t.name;
  }
  return "?";
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

// Drops files' pages from the page cache. Dirty pages (a checkpoint just written) are not
// dropped, so they are written back first.
void drop_from_cache(OpenFiles& files, const std::vector<std::uint32_t>& which) {
  for (std::uint32_t f : which) {
    const std::shared_ptr<const detail::File> file = files.get(f);
    (void)fdatasync(file->fd());
    (void)posix_fadvise(file->fd(), 0, 0, POSIX_FADV_DONTNEED);
  }
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

// Reads and converts pieces on a team of threads. A failure stops the others and is kept.
class Reader {
 public:
  Reader(const CheckpointIndex& ck, OpenFiles& files, DType to, unsigned threads,
         std::optional<std::uint64_t> fail_after)
      : ck_(ck),
        files_(files),
        to_(to),
        es_(element_size(to)),
        pool_(threads),
        fail_after_(fail_after) {}

  // Fills dst[0, n) from the reads (dst offsets relative to dst): zeros where no read lands.
  void fill(unsigned char* dst, std::uint64_t n, const std::vector<Read>& reads) {
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
    // Pieces of at most kPiece source bytes, handed out in file order.
    struct Piece {
      const Read* read;
      std::uint64_t skip;   // source bytes into the read
      std::uint64_t bytes;  // source bytes
    };
    std::vector<Piece> pieces;
    for (const Read& r : reads) {
      const std::uint64_t step = kPiece / element_size(r.from) * element_size(r.from);
      for (std::uint64_t s = 0; s < r.src_bytes; s += step) {
        pieces.push_back(Piece{&r, s, std::min(step, r.src_bytes - s)});
      }
    }
    std::atomic<std::size_t> next{0};
    pool_.run([&](unsigned) {
      std::vector<unsigned char> scratch;
      for (std::size_t k = next++; k < pieces.size() && !failed_; k = next++) {
        const Piece& p = pieces[k];
        const Read& r = *p.read;
        const std::uint64_t fes = element_size(r.from);
        unsigned char* out = dst + r.dst + p.skip / fes * es_;
        unsigned char* into = out;
        if (r.from != to_) {
          try {
            scratch.resize(p.bytes);
          } catch (const std::bad_alloc&) {
            fail(OutOfMemory("cannot allocate " + format_bytes(p.bytes) +
                             " of host scratch to convert " + files_.path(r.file)));
            return;
          }
          into = scratch.data();
        }
        if (!read_exactly(r.file, into, p.bytes, r.src + p.skip)) return;
        if (r.from != to_) detail::convert_range(out, to_, into, r.from, p.bytes / fes);
        bytes_ += p.bytes;
      }
    });
  }

  // Throws what failed (its type kept: OutOfMemory, ResourceExhausted, Error).
  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }
  bool failed() const { return failed_; }
  std::uint64_t bytes() const { return bytes_; }

 private:
  static constexpr std::uint64_t kPiece = std::uint64_t{8} << 20;

  template <typename E>
  void fail(const E& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_.exchange(true)) error_ = std::make_exception_ptr(e);
  }

  bool read_exactly(std::uint32_t file, unsigned char* out, std::uint64_t n, std::uint64_t at) {
    const std::string where = " (tensor '" + printable(tensor_at(ck_, file, at)) + "')";
    try {
      if (fail_after_ && read_so_far_.fetch_add(n) + n > *fail_after_) {
        throw Error(files_.path(file) + ": reading bytes [" + std::to_string(at) + ", " +
                    std::to_string(at + n) + ") failed: injected I/O error (testing aid)");
      }
      files_.get(file)->read_at(out, n, at);
      return true;
    } catch (const ResourceExhausted& e) {
      fail(ResourceExhausted(e.what() + where));
    } catch (const std::exception& e) {
      fail(Error(e.what() + where));
    }
    return false;
  }

  const CheckpointIndex& ck_;
  OpenFiles& files_;
  DType to_;
  std::uint64_t es_;
  detail::ThreadPool pool_;
  std::optional<std::uint64_t> fail_after_;
  std::atomic<std::uint64_t> read_so_far_{0};
  std::atomic<std::uint64_t> bytes_{0};
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

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

// The checkpoint tensors of parameter p, in order, checked against its shape (and each against
// its expected shape, when the parameter says). A name the checkpoint lacks goes to `missing`
// (and none is returned).
std::vector<const CheckpointTensor*> resolve(const CheckpointIndex& ck, const LoadParam& p,
                                             std::vector<std::string>& missing) {
  std::vector<std::string> names = p.sources;
  if (names.empty()) names.push_back(p.name);
  if (!p.source_shapes.empty() && p.source_shapes.size() != names.size()) {
    throw InvalidArgument("parameter '" + printable(p.name) + "' names " +
                          std::to_string(names.size()) + " source tensors but " +
                          std::to_string(p.source_shapes.size()) + " expected shapes");
  }
  std::vector<const CheckpointTensor*> out;
  std::uint64_t numel = 0;
  for (std::size_t k = 0; k < names.size(); ++k) {
    const CheckpointTensor* t = ck.find(names[k]);
    if (t == nullptr) {
      missing.push_back(printable(names[k]));
      continue;
    }
    if (!t->type) {
      throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(t->name) + "' is " +
                            printable(t->dtype) + ": the loader reads BF16, F16 and F32");
    }
    if (!p.source_shapes.empty() && t->shape != p.source_shapes[k]) {
      throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(t->name) +
                            "' has shape " + shape_to_string(t->shape) + ", but parameter '" +
                            printable(p.name) + "' takes it as " +
                            shape_to_string(p.source_shapes[k]) +
                            " (a tensor stored transposed or reshaped would load as garbage)");
    }
    out.push_back(t);
    numel += t->numel;
  }
  if (out.size() != names.size()) return {};
  if (out.size() == 1 && out.front()->shape != p.shape) {
    const CheckpointTensor& t = *out.front();
    throw InvalidArgument(ck.files[t.file] + ": tensor '" + printable(t.name) + "' has shape " +
                          shape_to_string(t.shape) + ", but parameter '" + printable(p.name) +
                          "' is " + shape_to_string(p.shape));
  }
  if (numel != shape_numel(p.shape)) {
    throw InvalidArgument("the " + std::to_string(out.size()) + " tensors of parameter '" +
                          printable(p.name) + "' (" + printable(names.front()) + ", ...) hold " +
                          std::to_string(numel) + " elements, but it is " +
                          shape_to_string(p.shape) + " (" + std::to_string(shape_numel(p.shape)) +
                          " elements)");
  }
  return out;
}

// Calls fn(tensor, first element of the tensor, elements, first element of the parameter) for
// each piece of the parameter's elements [lo, lo + n) held by its sources.
template <typename Fn>
void for_pieces(const std::vector<const CheckpointTensor*>& src, std::uint64_t lo, std::uint64_t n,
                Fn fn) {
  std::uint64_t at = 0;
  for (const CheckpointTensor* t : src) {
    const std::uint64_t a = std::max(at, lo);
    const std::uint64_t b = std::min(at + t->numel, lo + n);
    if (a < b) fn(*t, a - at, b - a, a);
    at += t->numel;
    if (at >= lo + n) break;
  }
}

using Sources = std::vector<std::vector<const CheckpointTensor*>>;

// Where each parameter's elements in the layout start within the parameter: 0 for a flat
// buffer, which holds parameters whole; for ZeRO-3's partitions (zero3.h), rank * p of each, or
// its element count when the rank holds none of its data (only padding, never read).
std::vector<std::uint64_t> partition_starts(std::span<const std::uint64_t> numels,
                                            std::uint64_t world, std::uint64_t rank) {
  std::vector<std::uint64_t> out;
  out.reserve(numels.size());
  for (std::uint64_t n : numels) {
    out.push_back(zero3_data_numel(n, world, rank) == 0 ? n
                                                         : rank * zero3_partition_numel(n, world));
  }
  return out;
}

// The file reads that fill layout bytes [lo, hi) (element-aligned), dst relative to lo, in file
// order with neighbours merged: one pread where the bytes follow each other in the file and in
// the buffer. starts: partition_starts, or empty (parameters whole); the layout's elements past
// a parameter's data are padding, not read.
std::vector<Read> reads_for(const Layout& layout, const Sources& sources,
                            std::span<const std::uint64_t> starts, std::uint64_t lo,
                            std::uint64_t hi) {
  const std::uint64_t es = layout.element_size();
  std::vector<Read> reads;
  for (const Fragment& f : layout.fragments_in(lo / es, hi / es)) {
    const std::uint64_t first = f.param_offset + (starts.empty() ? 0 : starts[f.param]);
    for_pieces(sources[f.param], first, f.numel,
               [&](const CheckpointTensor& t, std::uint64_t tensor_first, std::uint64_t n,
                   std::uint64_t param_first) {
                 const std::uint64_t fes = element_size(*t.type);
                 reads.push_back(Read{t.file, t.offset + tensor_first * fes, n * fes,
                                      (f.partition_offset + param_first - first) * es, *t.type});
               });
  }
  std::sort(reads.begin(), reads.end(), [](const Read& a, const Read& b) {
    return a.file != b.file ? a.file < b.file : a.src < b.src;
  });
  std::vector<Read> merged;
  for (const Read& r : reads) {
    if (!merged.empty()) {
      Read& m = merged.back();
      if (m.file == r.file && m.from == r.from && m.src + m.src_bytes == r.src &&
          m.dst + dst_bytes(m, es) == r.dst) {
        m.src_bytes += r.src_bytes;
        continue;
      }
    }
    merged.push_back(r);
  }
  return merged;
}

// What a rank's copy of the checkpoint says, entry by entry (every file's size, then every
// tensor's name, dtype, shape and byte range), as digests the ranks can compare.
std::vector<std::uint64_t> header_digests(const CheckpointIndex& ck) {
  std::vector<std::uint64_t> d;
  d.reserve(ck.files.size() + ck.tensors.size());
  for (std::size_t f = 0; f < ck.files.size(); ++f) {
    const std::string name = ck.files[f].substr(ck.files[f].find_last_of('/') + 1);
    std::string text = name + '\0' + std::to_string(ck.file_bytes[f]);
    d.push_back(checksum_serial(text.data(), text.size()));
  }
  for (const CheckpointTensor& t : ck.tensors) {
    std::string text = t.name + '\0' + t.dtype + '\0' + shape_to_string(t.shape) + '\0' +
                       std::to_string(t.file) + ':' + std::to_string(t.offset) + '+' +
                       std::to_string(t.bytes);
    d.push_back(checksum_serial(text.data(), text.size()));
  }
  return d;
}

std::string describe_entry(const CheckpointIndex& ck, std::size_t k) {
  if (k < ck.files.size()) {
    return "file " + ck.files[k] + " (" + std::to_string(ck.file_bytes[k]) + " bytes here)";
  }
  const CheckpointTensor& t = ck.tensors[k - ck.files.size()];
  return "tensor '" + printable(t.name) + "' of " + ck.files[t.file] + " (here " +
         printable(t.dtype) + " " + shape_to_string(t.shape) + " at bytes [" +
         std::to_string(t.offset) + ", " + std::to_string(t.offset + t.bytes) + "))";
}

// The checkpoint as the pipeline's source.
class CheckpointSource final : public detail::GroupSource {
 public:
  // placement kPartitions: the layout is ZeRO-3's rank buffer, and this source reads rank
  // `rank`'s partitions into it.
  CheckpointSource(const CheckpointIndex& ck, Device& device, const LoadOptions& options,
                   std::uint64_t ring_bytes, detail::Placement placement, std::uint64_t rank)
      : ck_(ck),
        device_(device),
        options_(options),
        ring_bytes_(ring_bytes),
        partitions_(placement == detail::Placement::kPartitions),
        rank_(rank),
        files_(ck, partitions_) {}

  // This rank's own checks, before the ranks agree: every parameter's tensors, the files.
  // Throws InvalidArgument.
  void prepare(std::span<const LoadParam> params, unsigned threads) {
    std::vector<std::string> missing;
    std::vector<std::uint64_t> numels;
    sources_.resize(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      sources_[i] = resolve(ck_, params[i], missing);
      numels.push_back(shape_numel(params[i].shape));
    }
    if (!missing.empty()) {
      if (missing.size() > 8) {
        missing.resize(8);
        missing.push_back("...");
      }
      throw InvalidArgument(ck_.path + " has no tensor named " + join(missing) +
                            " (the checkpoint holds " + std::to_string(ck_.tensors.size()) +
                            " tensors)");
    }
    numels_ = numels;
    if (partitions_) {
      layout_ = zero3_buffer_layout(numels, options_.layout);
      starts_ = partition_starts(numels, options_.layout.dp, rank_);
    } else {
      layout_ = Layout::compute(numels, options_.layout);
    }
    if (device_.keeps_data()) {
      check_files_present(ck_);
      // Before the ranks agree, so that every rank's drop precedes every rank's reads.
      if (options_.cold) {
        std::vector<std::uint32_t> all(ck_.files.size());
        for (std::uint32_t f = 0; f < all.size(); ++f) all[f] = f;
        drop_from_cache(files_, all);
      }
    }
    threads_ = threads;
  }

  std::string must_match() const override {
    std::ostringstream t;
    t << "checkpoint of " << ck_.tensors.size() << " tensors in " << ck_.files.size()
      << " files, ring " << ring_bytes_ << " B, copies check "
      << copy_check_name(options_.copies);
    return t.str();
  }
  std::uint64_t ring_bytes() const override { return ring_bytes_; }

  // The ranks compare their copies' headers: one all-reduce of the whole digest, and only when
  // it differs a second one, entry by entry, to name the first entry that differs.
  void agree(Communicator* comm) override {
    if (comm == nullptr || comm->size() <= 1) return;
    const std::vector<std::uint64_t> mine = header_digests(ck_);
    const std::uint64_t whole = checksum_serial(mine.data(), mine.size() * sizeof(std::uint64_t));
    const std::uint64_t n = mine.size();
    std::array<std::uint64_t, 4> v{whole, ~whole, n, ~n};
    comm->all_reduce_max(v);
    if (v[0] == ~v[1]) return;  // max == min: every rank's headers say the same
    const std::uint64_t fewest = std::min<std::uint64_t>(~v[3], 1u << 24);
    std::vector<std::uint64_t> hi(2 * fewest);
    for (std::uint64_t k = 0; k < fewest; ++k) {
      hi[2 * k] = mine[k];
      hi[2 * k + 1] = ~mine[k];
    }
    comm->all_reduce_max(hi);
    std::uint64_t k = 0;
    while (k < fewest && hi[2 * k] == ~hi[2 * k + 1]) ++k;
    std::string what;
    if (k < fewest) {
      what = describe_entry(ck_, k) + " differs between the ranks' copies";
    } else {
      what = "the copies hold different numbers of files and tensors (" +
             std::to_string(~v[3]) + " to " + std::to_string(v[2]) + "; " +
             std::to_string(n) + " here)";
    }
    throw InvalidArgument("the ranks read different checkpoints at " + ck_.path + ": " + what +
                          "; every rank must read an identical copy");
  }

  void read(void* dst, std::uint64_t flat_offset, std::uint64_t bytes, void* stage,
            std::uint64_t stage_bytes) override {
    const std::uint64_t es = layout_->element_size();
    const std::vector<Read> reads =
        reads_for(*layout_, sources_, starts_, flat_offset, flat_offset + bytes);
    whole_ = !partitions_ && flat_offset == 0 && bytes == layout_->flat_bytes();
    reads_ = reads.size();
    bytes_read_ = 0;
    for (const Read& r : reads) bytes_read_ += r.src_bytes;
    if (!device_.keeps_data()) return;
    cached_fraction_ = cached_fraction_of(ck_, reads);
    const auto t0 = Clock::now();
    Reader reader(ck_, files_, layout_->options().dtype, threads_, options_.fail_after_bytes);
    auto* out = static_cast<unsigned char*>(dst);
    if (stage == nullptr) {
      reader.fill(out, bytes, reads);
    } else {
      through_ring(reader, out, bytes, reads, static_cast<unsigned char*>(stage), stage_bytes,
                   es);
    }
    reader.rethrow();
    read_seconds_ = seconds_since(t0);
  }

  // The copies check: compare what this rank's copy holds in other ranks' slices with what they
  // read from theirs (now in the gathered buffer); where every rank read the whole buffer from
  // its own copy, compare digests of the same ranges.
  void after(const FlatGroup& group, Communicator* comm) override {
    if (comm == nullptr || comm->size() <= 1 || options_.copies == CopyCheck::kOff ||
        !device_.keeps_data()) {
      return;
    }
    if (whole_) {
      compare_digests(group, comm);
      return;
    }
    if (partitions_) {
      compare_partitions(group, comm);
      return;
    }
    const auto t0 = Clock::now();
    const auto rank = static_cast<std::uint64_t>(comm->rank());
    const std::uint64_t sb = layout_->partition_bytes();
    // Windows of each other rank's slice, shifted by this rank so that the ranks look at
    // different places.
    const std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges = check_ranges(rank, rank);
    std::string mismatch;
    try {
      Reader reader(ck_, files_, layout_->options().dtype, threads_, std::nullopt);
      std::vector<unsigned char> mine;
      std::vector<unsigned char> held;
      for (const auto& [lo, hi] : ranges) {
        const std::uint64_t n = hi - lo;
        mine.resize(n);
        const std::vector<Read> reads = reads_for(*layout_, sources_, starts_, lo, hi);
        reader.fill(mine.data(), n, reads);
        reader.rethrow();
        for (const Read& r : reads) copy_check_bytes_ += r.src_bytes;
        const unsigned char* flat = on_host(group, lo, hi, held);
        if (std::memcmp(mine.data(), flat, n) != 0) {
          std::uint64_t k = 0;
          while (mine[k] == flat[k]) ++k;
          mismatch = where(lo + k, lo / sb);
          break;
        }
      }
    } catch (const std::exception& e) {
      mismatch = std::string("the check itself failed: ") + e.what();
    }
    copy_check_seconds_ = seconds_since(t0);
    const int bad = agree_on_failure(comm, !mismatch.empty());
    if (bad < 0) return;
    throw Error(!mismatch.empty()
                    ? "the ranks' copies of " + ck_.path + " hold different bytes: " + mismatch +
                          "; every rank must read an identical copy (nothing was kept)"
                    : "the ranks' copies of " + ck_.path + " hold different bytes: rank " +
                          std::to_string(bad) + " found a difference (its error names the file "
                          "and tensor); every rank must read an identical copy (nothing was "
                          "kept)");
  }

  std::uint64_t bytes_read() const { return bytes_read_; }
  bool read_whole() const { return whole_; }
  std::uint64_t reads() const { return reads_; }
  double cached_fraction() const { return cached_fraction_; }
  double read_seconds() const { return read_seconds_; }
  std::uint64_t copy_check_bytes() const { return copy_check_bytes_; }
  double copy_check_seconds() const { return copy_check_seconds_; }

 private:
  // A ring of chunks in the stage: the team reads window k + 1 while a copier thread moves
  // window k to the device.
  void through_ring(Reader& reader, unsigned char* slice, std::uint64_t sb,
                    const std::vector<Read>& reads, unsigned char* ring, std::uint64_t ring_bytes,
                    std::uint64_t es) {
    const std::uint64_t depth = std::max<unsigned>(1, options_.ring_depth);
    const std::uint64_t chunk = ring_bytes / depth;
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::pair<std::uint64_t, std::uint64_t>> full;  // (chunk slot, window start)
    std::vector<bool> busy(depth, false);
    bool done = false;
    std::string copy_error;
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
            device_.copy(slice + job.second, ring + job.first * chunk,
                         std::min(chunk, sb - job.second));
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
      for (std::uint64_t w = 0, k = 0; w < sb && !reader.failed(); w += chunk, ++k) {
        const std::uint64_t slot = k % depth;
        {
          std::unique_lock<std::mutex> lock(m);
          cv.wait(lock, [&] { return !busy[slot]; });
          busy[slot] = true;
        }
        const std::uint64_t len = std::min(chunk, sb - w);
        reader.fill(ring + slot * chunk, len, window(reads, w, w + len, es));
        {
          std::lock_guard<std::mutex> lock(m);
          full.emplace_back(slot, w);
        }
        cv.notify_all();
      }
    } catch (...) {
      stop_copier();
      throw;
    }
    stop_copier();
    device_.synchronize();
    if (!copy_error.empty()) throw Error("copying to " + device_.name() + ": " + copy_error);
  }

  // The layout ranges [lo, hi) the copies check compares: in every rank's slice but `skip`'s,
  // 16 windows of 64 KiB spread over it (shifted by `shift_rank`), or, when the check is full
  // or the slice small, all of it in pieces of 16 MiB.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> check_ranges(
      std::optional<std::uint64_t> skip, std::uint64_t shift_rank) const {
    constexpr std::uint64_t kWindow = std::uint64_t{64} << 10;
    constexpr std::uint64_t kWindows = 16;
    constexpr std::uint64_t kChunk = std::uint64_t{16} << 20;
    const std::uint64_t sb = layout_->partition_bytes();
    const std::uint64_t es = layout_->element_size();
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
    for (std::uint64_t q = 0; q < layout_->options().dp && sb > 0; ++q) {
      if (q == skip) continue;
      const std::uint64_t base = q * sb;
      if (options_.copies == CopyCheck::kFull || sb <= kWindow * kWindows) {
        for (std::uint64_t a = 0; a < sb; a += kChunk) {
          ranges.emplace_back(base + a, base + std::min(sb, a + kChunk));
        }
        continue;
      }
      const std::uint64_t stride = sb / kWindows / es * es;  // windows start on elements
      const std::uint64_t shift = (shift_rank * 7919 * es) % (stride - kWindow + 1) / es * es;
      for (std::uint64_t w = 0; w < kWindows; ++w) {
        const std::uint64_t lo = base + w * stride + shift;
        ranges.emplace_back(lo, std::min(base + sb, lo + kWindow));
      }
    }
    return ranges;
  }

  // Every rank read the whole buffer from its own copy: the ranks compare digests of the same
  // ranges of their buffers (16 windows of 64 KiB in each rank's slice, or every 16 MiB of the
  // buffer), in one all-reduce, and a second, only on a difference, is not needed: each rank
  // names the first range where its digest is not everyone's.
  void compare_digests(const FlatGroup& group, Communicator* comm) {
    const auto t0 = Clock::now();
    const std::uint64_t sb = layout_->partition_bytes();
    // The same windows of every slice on every rank.
    const std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges =
        check_ranges(std::nullopt, 0);
    std::vector<std::uint64_t> v(2 * ranges.size());
    std::vector<unsigned char> held;
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      const auto [lo, hi] = ranges[k];
      const std::uint64_t d = checksum_serial(on_host(group, lo, hi, held), hi - lo);
      copy_check_bytes_ += hi - lo;
      v[2 * k] = d;
      v[2 * k + 1] = ~d;
    }
    comm->all_reduce_max(v);
    copy_check_seconds_ = seconds_since(t0);
    for (std::size_t k = 0; k < ranges.size(); ++k) {
      if (v[2 * k] != ~v[2 * k + 1]) {
        throw Error("the ranks' copies of " + ck_.path + " hold different bytes: the ranks' " +
                    "buffers differ in layout bytes [" + std::to_string(ranges[k].first) + ", " +
                    std::to_string(ranges[k].second) + "), " +
                    where(ranges[k].first, ranges[k].first / std::max<std::uint64_t>(sb, 1)) +
                    "; every rank must read an identical copy (nothing was kept)");
      }
    }
  }

  // ZeRO-3's partitions: no rank holds another's bytes, so each rank reads from its own copy
  // what the next rank's buffer must hold in the windows of check_ranges (the same on every
  // rank: each buffer has the same layout), and the ranks compare, in one all-reduce, each
  // rank's digests of its buffer with its neighbour's of its copy. A rank whose check itself
  // fails says so in the same all-reduce.
  void compare_partitions(const FlatGroup& group, Communicator* comm) {
    const auto t0 = Clock::now();
    const auto world = static_cast<std::uint64_t>(comm->size());
    const auto rank = static_cast<std::uint64_t>(comm->rank());
    const std::uint64_t peer = (rank + 1) % world;
    const std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges =
        check_ranges(std::nullopt, 0);
    const std::uint64_t k_all = ranges.size();
    // [own digests of every rank][check digests of every rank][failed rank + 1], as (d, ~d).
    std::vector<std::uint64_t> v(4 * world * k_all + 2, 0);
    auto put = [&](std::uint64_t at, std::uint64_t d) {
      v[2 * at] = d;
      v[2 * at + 1] = ~d;
    };
    std::string failure;
    try {
      const std::vector<std::uint64_t> peer_starts = partition_starts(numels_, world, peer);
      Reader reader(ck_, files_, layout_->options().dtype, threads_, std::nullopt);
      std::vector<unsigned char> mine;
      std::vector<unsigned char> held;
      for (std::uint64_t k = 0; k < k_all; ++k) {
        const auto [lo, hi] = ranges[k];
        put(rank * k_all + k, checksum_serial(on_host(group, lo, hi, held), hi - lo));
        mine.resize(hi - lo);
        const std::vector<Read> reads = reads_for(*layout_, sources_, peer_starts, lo, hi);
        reader.fill(mine.data(), hi - lo, reads);
        reader.rethrow();
        for (const Read& r : reads) copy_check_bytes_ += r.src_bytes;
        put(world * k_all + peer * k_all + k, checksum_serial(mine.data(), hi - lo));
      }
    } catch (const std::exception& e) {
      failure = e.what();
      put(2 * world * k_all, rank + 1);
    }
    comm->all_reduce_max(v);
    copy_check_seconds_ = seconds_since(t0);
    if (v[4 * world * k_all] != 0) {
      const std::uint64_t bad = v[4 * world * k_all] - 1;
      throw Error("the check of the ranks' copies of " + ck_.path + " failed on rank " +
                  std::to_string(bad) + (failure.empty() ? "" : ": " + failure) +
                  " (nothing was kept)");
    }
    for (std::uint64_t q = 0; q < world; ++q) {
      for (std::uint64_t k = 0; k < k_all; ++k) {
        if (v[2 * (q * k_all + k)] != v[2 * (world * k_all + q * k_all + k)]) {
          throw Error("the ranks' copies of " + ck_.path + " hold different bytes: rank " +
                      std::to_string(q) + "'s partitions differ from what rank " +
                      std::to_string((q + world - 1) % world) + "'s copy holds for them in " +
                      "buffer bytes [" + std::to_string(ranges[k].first) + ", " +
                      std::to_string(ranges[k].second) + "), " + where(ranges[k].first, q) +
                      "; every rank must read an identical copy (nothing was kept)");
        }
      }
    }
  }

  // Bytes [lo, hi) of the group's buffer where the host can read them: in place, or copied into
  // `held` from a device the host cannot read.
  const unsigned char* on_host(const FlatGroup& group, std::uint64_t lo, std::uint64_t hi,
                               std::vector<unsigned char>& held) {
    const auto* p = static_cast<const unsigned char*>(group.flat.data()) + lo;
    if (device_.host_accessible()) return p;
    held.resize(hi - lo);
    device_.copy(held.data(), p, hi - lo);  // NOLINT: host staging of device bytes
    device_.synchronize();
    return held.data();
  }

  // Layout byte b, which the owner `rank` read, for a message: the parameter, tensor, file and
  // file offset it comes from.
  std::string where(std::uint64_t b, std::uint64_t owner) const {
    const std::uint64_t es = layout_->element_size();
    const std::uint64_t e = b / es;
    const auto& offs = layout_->offsets();
    std::size_t i = static_cast<std::size_t>(
        std::upper_bound(offs.begin(), offs.end(), e) - offs.begin());
    std::string text = "layout byte " + std::to_string(b) + " (read by rank " +
                       std::to_string(owner) + ")";
    // Round-robin layouts do not keep offsets sorted: fall back to a scan.
    for (std::size_t k = 0; k < offs.size(); ++k) {
      if (offs[k] <= e && e < offs[k] + layout_->numels()[k]) {
        i = k + 1;
        break;
      }
    }
    if (i == 0) return text;
    const std::size_t p = i - 1;
    std::uint64_t at = e - offs[p];
    if (partitions_) {
      at += partition_starts(std::span<const std::uint64_t>(numels_).subspan(p, 1),
                             options_.layout.dp, owner)[0];
    }
    for (const CheckpointTensor* t : sources_[p]) {
      if (at < t->numel) {
        const std::uint64_t fb = t->offset + at * element_size(*t->type);
        return text + ", tensor '" + printable(t->name) + "' of " + ck_.files[t->file] +
               " at file byte " + std::to_string(fb);
      }
      at -= t->numel;
    }
    return text;
  }

  const CheckpointIndex& ck_;
  Device& device_;
  const LoadOptions& options_;
  std::uint64_t ring_bytes_;
  bool partitions_;
  std::uint64_t rank_;
  OpenFiles files_;
  Sources sources_;
  std::vector<std::uint64_t> starts_;  // partition_starts of this rank (ZeRO-3), else empty
  std::vector<std::uint64_t> numels_;  // the parameters' elements
  std::optional<Layout> layout_;
  unsigned threads_ = 1;
  std::uint64_t bytes_read_ = 0;
  std::uint64_t reads_ = 0;
  double cached_fraction_ = 0;
  double read_seconds_ = 0;
  std::uint64_t copy_check_bytes_ = 0;
  double copy_check_seconds_ = 0;
  bool whole_ = false;
};

}  // namespace

std::string_view copy_check_name(CopyCheck check) noexcept {
  switch (check) {
    case CopyCheck::kOff:
      return "off";
    case CopyCheck::kSampled:
      return "sampled";
    case CopyCheck::kFull:
      return "full";
  }
  return "?";
}

CopyCheck parse_copy_check(std::string_view text, std::string_view what) {
  for (CopyCheck c : {CopyCheck::kOff, CopyCheck::kSampled, CopyCheck::kFull}) {
    if (text == copy_check_name(c)) return c;
  }
  throw InvalidArgument(std::string(what) + " '" + printable(std::string(text)) +
                        "': expected off, sampled or full");
}

namespace {

// Every parameter's source tensors, and its element count. Throws InvalidArgument naming the
// first tensor the checkpoint lacks.
Sources resolve_all(const CheckpointIndex& ck, std::span<const LoadParam> params,
                    std::vector<std::uint64_t>& numels) {
  Sources sources;
  std::vector<std::string> missing;
  for (const LoadParam& p : params) {
    sources.push_back(resolve(ck, p, missing));
    numels.push_back(shape_numel(p.shape));
  }
  if (!missing.empty()) {
    throw InvalidArgument(ck.path + " has no tensor named '" + missing.front() + "'");
  }
  return sources;
}

std::uint64_t source_bytes(const std::vector<Read>& reads) {
  std::uint64_t bytes = 0;
  for (const Read& r : reads) bytes += r.src_bytes;
  return bytes;
}

}  // namespace

std::uint64_t partition_read_bytes(const CheckpointIndex& ck, std::span<const LoadParam> params,
                                   const LayoutOptions& options, std::uint64_t rank) {
  std::vector<std::uint64_t> numels;
  const Sources sources = resolve_all(ck, params, numels);
  const Layout layout = Layout::compute(numels, options);
  if (rank >= options.dp) {
    throw InvalidArgument("rank " + std::to_string(rank) + " of dp " + std::to_string(options.dp));
  }
  const std::uint64_t sb = layout.partition_bytes();
  return source_bytes(reads_for(layout, sources, {}, rank * sb, (rank + 1) * sb));
}

std::uint64_t partitions_read_bytes(const CheckpointIndex& ck, std::span<const LoadParam> params,
                                    std::uint64_t world, std::uint64_t rank) {
  std::vector<std::uint64_t> numels;
  const Sources sources = resolve_all(ck, params, numels);
  LayoutOptions o;
  o.dp = world;
  const Layout layout = zero3_buffer_layout(numels, o);
  if (rank >= world) {
    throw InvalidArgument("rank " + std::to_string(rank) + " of world " + std::to_string(world));
  }
  return source_bytes(
      reads_for(layout, sources, partition_starts(numels, world, rank), 0, layout.flat_bytes()));
}

void read_checkpoint_tensor(const CheckpointIndex& ck, const std::string& name,
                            std::optional<DType> to, void* dst) {
  const CheckpointTensor* t = ck.find(name);
  if (t == nullptr) {
    throw InvalidArgument(ck.path + " has no tensor named '" + printable(name) + "'");
  }
  if (to && !t->type) {
    throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(name) + "' is " +
                          printable(t->dtype) + ": the loader converts BF16, F16 and F32");
  }
  const detail::File file(ck.files[t->file]);
  if (!to || *to == *t->type) {
    file.read_at(dst, t->bytes, t->offset);
    return;
  }
  std::vector<unsigned char> raw(t->bytes);
  file.read_at(raw.data(), t->bytes, t->offset);
  detail::convert_range(dst, *to, raw.data(), *t->type, t->numel);
}

std::string page_cache_word(double fraction) {
  return fraction < 0.1 ? "cold" : fraction > 0.9 ? "warm" : "partly";
}

double cached_fraction(const std::string& file, std::uint64_t offset, std::uint64_t length) {
  return resident_fraction(file, offset, length);
}

namespace {

// Both front doors: the checkpoint as the pipeline's source, for either placement.
LoadResult load_group(const CheckpointIndex& ck, std::span<const LoadParam> params, Device& device,
                      Communicator* comm, const LoadOptions& options,
                      detail::Placement placement) {
  const auto t_start = Clock::now();
  LoadResult res;
  const bool ring_path = options.through_ring || !device.host_accessible();
  if (ring_path &&
      (options.ring_depth == 0 || options.ring_depth > 64 || options.ring_chunk_bytes < 4096 ||
       options.ring_chunk_bytes > (std::uint64_t{1} << 32))) {
    throw InvalidArgument("a staging ring of " + std::to_string(options.ring_depth) +
                          " chunks of " + format_bytes(options.ring_chunk_bytes) +
                          ": expected 1 to 64 chunks of 4 KiB to 4 GiB");
  }
  const std::uint64_t ring_bytes =
      ring_path ? options.ring_depth * (options.ring_chunk_bytes / 64 * 64) : 0;

  // The group as the pipeline sees it: shapes and dtype, no data yet.
  const DType dtype = options.layout.dtype;
  std::vector<TensorRef> refs;
  std::vector<std::string> names;
  refs.reserve(params.size());
  for (const LoadParam& p : params) {
    refs.push_back(TensorRef{nullptr, shape_numel(p.shape), p.shape, dtype, &device});
    names.push_back("parameter '" + printable(p.name) + "'");
  }

  // --- this rank's own checks of the checkpoint, carried into the agreement ---------------------
  const std::uint64_t rank =
      comm != nullptr && comm->size() > 1 ? static_cast<std::uint64_t>(comm->rank()) : 0;
  CheckpointSource source(ck, device, options, ring_bytes, placement, rank);
  std::string error = options.local_error;
  if (error.empty()) {
    try {
      unsigned local = options.probe.local_ranks;
      if (local == 0) {
        const unsigned ranks = comm != nullptr && comm->size() > 1 ? comm->size() : 1;
        local = runtime_env().local_ranks.value_or(ranks);
      }
      source.prepare(params, options.threads > 0 ? options.threads
                                                 : default_num_threads(std::max(1u, local)));
    } catch (const Error& e) {
      error = e.what();
    }
  }

  FlattenOptions fo;
  fo.layout = options.layout;
  fo.tier = options.read_plan;
  fo.storage_bytes_per_second = options.storage_bytes_per_second;
  fo.margin_bytes = options.margin_bytes;
  fo.master = options.master;
  fo.check_values = false;
  fo.release = options.release;
  fo.must_match = options.must_match;
  fo.probe = options.probe;
  fo.names = std::move(names);
  fo.local_error = std::move(error);
  FlattenResult run = detail::run_pipeline(refs, device, comm, fo, {}, &source, placement);

  res.probe = std::move(run.probe);
  res.host_probe = std::move(run.host_probe);
  res.input = run.input;
  if (const Candidate* c = run.plan.chosen_candidate()) {
    res.plan = *c;
  } else if (!run.plan.candidates.empty()) {
    res.plan = run.plan.candidates.front();
  }
  res.read_plans = run.plan;
  if (!run.feasible()) return res;  // the same verdict on every rank: nothing allocated
  if (!run.complete()) {
    const Execution& ex = run.execution;
    const bool memory = ex.failed_step && *ex.failed_step < res.plan.steps.size() &&
                        res.plan.steps[*ex.failed_step].op == Op::kAllocate;
    if (memory) throw OutOfMemory(ex.error);
    throw Error(ex.error);
  }
  res.bytes_read = source.bytes_read();
  res.reads = source.reads();
  res.cached_fraction = source.cached_fraction();
  res.page_cache = device.keeps_data() ? page_cache_word(res.cached_fraction) : std::string();
  res.read_seconds = source.read_seconds();
  for (std::size_t k = 0; k < res.plan.steps.size(); ++k) {
    if (res.plan.steps[k].op == Op::kAllGather && k < run.execution.step_seconds.size()) {
      res.allgather_seconds += run.execution.step_seconds[k];
    }
  }
  res.copy_check_bytes = source.copy_check_bytes();
  res.copy_check_seconds = source.copy_check_seconds();
  res.predicted_peak_device_bytes = run.predicted_peak_device_bytes;
  res.measured_peak_device_bytes = run.execution.measured_peak_device_bytes;
  res.measured_peak_host_bytes = run.execution.measured_peak_host_bytes;
  res.group = std::move(run.execution.group);
  res.master = std::move(run.master);
  res.master_seconds = run.master_seconds;
  res.master_error = std::move(run.master_error);
  res.seconds = seconds_since(t_start);
  return res;
}

}  // namespace

LoadResult load_flat_group(const CheckpointIndex& ck, std::span<const LoadParam> params,
                           Device& device, Communicator* comm, const LoadOptions& options) {
  return load_group(ck, params, device, comm, options, detail::Placement::kFlatPartitioned);
}

LoadResult load_partitions(const CheckpointIndex& ck, std::span<const LoadParam> params,
                           Device& device, Communicator* comm, const LoadOptions& options) {
  return load_group(ck, params, device, comm, options, detail::Placement::kPartitions);
}

ReadCeiling measure_read_ceiling(const CheckpointIndex& ck, std::uint64_t skip, std::uint64_t bytes,
                                 unsigned threads, bool cold, Device* device) {
  ReadCeiling out;
  // The checkpoint's data bytes (each file from its first tensor on), in file order, as one
  // sequence: [skip, skip + bytes) of it, wrapping around at its end.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> data;  // (start, length) per file
  std::uint64_t total = 0;
  for (std::uint32_t f = 0; f < ck.files.size(); ++f) {
    std::uint64_t start = ck.file_bytes[f];
    for (const CheckpointTensor& t : ck.tensors) {
      if (t.file == f) start = std::min(start, t.offset);
    }
    data.emplace_back(start, ck.file_bytes[f] - start);
    total += ck.file_bytes[f] - start;
  }
  bytes = std::min(bytes, total);
  std::vector<Read> reads;
  std::uint64_t at = total > 0 ? skip % total : 0;
  for (std::uint64_t done = 0; done < bytes;) {
    std::uint64_t base = 0;
    std::uint32_t f = 0;
    while (base + data[f].second <= at) base += data[f++].second;
    const std::uint64_t n = std::min(bytes - done, base + data[f].second - at);
    reads.push_back(Read{f, data[f].first + (at - base), n, done, DType::kBF16});
    done += n;
    at = (at + n) % total;
  }
  out.bytes = bytes;
  OpenFiles files(ck);
  if (cold) {
    std::vector<std::uint32_t> all(ck.files.size());
    for (std::uint32_t f = 0; f < all.size(); ++f) all[f] = f;
    drop_from_cache(files, all);
  }
  out.cached_fraction = cached_fraction_of(ck, reads);
  out.page_cache = page_cache_word(out.cached_fraction);
  const std::uint64_t scratch_bytes = std::max<std::uint64_t>(out.bytes, 1);
  // Fresh memory, as the loader's buffer is: both pay its first touch. For a device the host
  // cannot write, pinned memory, then one copy of it all to the device.
  const bool to_device = device != nullptr && !device->host_accessible() && device->keeps_data();
  void* scratch =
      to_device ? device->allocate_host(scratch_bytes) : allocate_host_memory(scratch_bytes);
  void* on_device = nullptr;
  std::string error;
  try {
    if (to_device) on_device = device->allocate(scratch_bytes);
    Reader reader(ck, files, DType::kBF16, std::max(1u, threads), std::nullopt);
    const auto t0 = Clock::now();
    reader.fill(static_cast<unsigned char*>(scratch), out.bytes, reads);
    if (reader.failed()) {
      try {
        reader.rethrow();
      } catch (const std::exception& e) {
        error = e.what();
      }
    } else if (to_device) {
      device->copy(on_device, scratch, out.bytes);
      device->synchronize();
    }
    out.seconds = seconds_since(t0);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (to_device) {
    device->release(on_device, scratch_bytes);
    device->release_host(scratch, scratch_bytes);
  } else {
    release_host_memory(scratch, scratch_bytes);
  }
  if (!error.empty()) throw Error(error);
  return out;
}

namespace {

// verify_loaded and verify_partitions: parameter i's elements [starts[i], +its layout numel) of
// its tensors read whole (starts empty: all of them, from 0), the layout's elements past its
// data zero, every byte no parameter covers zero, every view at its layout offset.
std::string verify_buffer(const CheckpointIndex& ck, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group,
                          std::span<const std::uint64_t> starts) {
  const Layout& layout = group.layout;
  const DType dtype = layout.options().dtype;
  const std::uint64_t es = element_size(dtype);
  if (params.size() != layout.num_params() || group.views.size() != params.size()) {
    return "the group has " + std::to_string(group.views.size()) + " views for " +
           std::to_string(params.size()) + " parameters";
  }
  if (!device.keeps_data()) return "";
  OpenFiles files(ck);
  // What the device holds, a piece at a time on the host.
  const bool direct = device.host_accessible();
  constexpr std::uint64_t kPiece = std::uint64_t{64} << 20;
  void* stage = direct ? nullptr : device.allocate_host(kPiece);
  struct StageGuard {
    Device& d;
    void* p;
    ~StageGuard() { d.release_host(p, kPiece); }
  } guard{device, stage};
  auto held = [&](std::uint64_t flat_byte, std::uint64_t n) -> const unsigned char* {
    const auto* p = static_cast<const unsigned char*>(group.flat.data()) + flat_byte;
    if (direct) return p;
    device.copy(stage, p, n);
    device.synchronize();
    return static_cast<const unsigned char*>(stage);
  };
  // The bytes of each parameter's data: [offset, offset + data) of the layout, in elements.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  std::vector<unsigned char> whole, want;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const LoadParam& p = params[i];
    std::vector<std::string> missing;
    const std::vector<const CheckpointTensor*> src = resolve(ck, p, missing);
    if (!missing.empty()) return "no tensor '" + missing.front() + "'";
    const std::uint64_t n = shape_numel(p.shape);
    const std::uint64_t first = starts.empty() ? 0 : std::min(starts[i], n);
    const std::uint64_t data = std::min(layout.numels()[i], n - first);
    // The tensors read whole, on their own, and converted on their own.
    want.assign(n * es, 0);
    std::uint64_t filled = 0;
    for (const CheckpointTensor* t : src) {
      whole.resize(t->bytes);
      files.get(t->file)->read_at(whole.data(), t->bytes, t->offset);
      detail::convert_range(want.data() + filled, dtype, whole.data(), *t->type, t->numel);
      filled += t->numel * es;
    }
    const std::string name = src.empty() ? p.name : src.front()->name;
    const std::string file = src.empty() ? std::string("?") : files.path(src.front()->file);
    const std::uint64_t at = layout.offsets()[i] * es;
    for (std::uint64_t done = 0; done < data * es;) {
      const std::uint64_t m = std::min(kPiece, data * es - done);
      const unsigned char* got = held(at + done, m);
      const unsigned char* expected = want.data() + first * es + done;
      if (std::memcmp(got, expected, m) != 0) {
        std::uint64_t k = 0;
        while (got[k] == expected[k]) ++k;
        return "parameter '" + printable(p.name) + "' differs from tensor '" + printable(name) +
               "' of " + file + (src.size() > 1 ? " (or a tensor after it)" : "") +
               " at element " + std::to_string(first + (done + k) / es);
      }
      done += m;
    }
    if (group.views[i].data != static_cast<const unsigned char*>(group.flat.data()) + at) {
      return "parameter '" + printable(p.name) + "' is not a view at its layout offset";
    }
    spans.emplace_back(at, at + data * es);
  }
  // Padding: every byte no parameter's data covers is zero.
  std::sort(spans.begin(), spans.end());
  std::uint64_t gap = 0;
  spans.emplace_back(layout.flat_bytes(), layout.flat_bytes());
  for (const auto& [lo, hi] : spans) {
    for (std::uint64_t b = gap; b < lo;) {
      const std::uint64_t m = std::min(kPiece, lo - b);
      const unsigned char* got = held(b, m);
      for (std::uint64_t k = 0; k < m; ++k) {
        if (got[k] != 0) return "padding byte " + std::to_string(b + k) + " is not zero";
      }
      b += m;
    }
    gap = std::max(gap, hi);
  }
  return "";
}

}  // namespace

std::string verify_loaded(const CheckpointIndex& ck, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group) {
  return verify_buffer(ck, params, device, group, {});
}

std::string verify_partitions(const CheckpointIndex& ck, std::span<const LoadParam> params,
                              Device& device, const FlatGroup& group, std::uint64_t world,
                              std::uint64_t rank) {
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
  LayoutOptions o;
  o.dp = world;
  o.dtype = group.layout.options().dtype;
  if (rank >= world) {
    return "rank " + std::to_string(rank) + " is outside the world of " + std::to_string(world);
  }
  if (group.layout.numels() != zero3_buffer_layout(numels, o).numels()) {
    return "the group is not the ZeRO-3 buffer of these " + std::to_string(params.size()) +
           " parameters on " + std::to_string(world) + " ranks";
  }
  return verify_buffer(ck, params, device, group, partition_starts(numels, world, rank));
}

}  // namespace zeroflat
