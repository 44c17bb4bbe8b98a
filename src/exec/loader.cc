// The checkpoint loader (loader.h): this rank's partition read straight from the files into the
// flat buffer (or through a ring of pinned chunks), then one all-gather.
#include "zeroflat/loader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "common/clock.h"
#include "common/thread_pool.h"
#include "device/host_kernels.h"
#include "model/files.h"
#include "zeroflat/agree.h"
#include "zeroflat/error.h"
#include "zeroflat/runtime.h"
#include "zeroflat/size.h"

namespace zeroflat {
namespace {

using detail::Clock;
using detail::seconds_since;

// One contiguous read: src_bytes of file at src, converted from `from`, landing at dst (bytes
// from the start of this rank's slice).
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

// The files of the checkpoint, opened once (regular files only, never blocking).
class Files {
 public:
  // Opens every file of the checkpoint; one shorter than its header says (truncated since the
  // headers were read) is InvalidArgument, before anything is read.
  explicit Files(const CheckpointIndex& ck) {
    for (std::size_t i = 0; i < ck.files.size(); ++i) {
      files_.push_back(std::make_unique<detail::File>(ck.files[i]));
      if (files_.back()->size() < ck.file_bytes[i]) {
        throw InvalidArgument(ck.files[i] + " has " + std::to_string(files_.back()->size()) +
                              " bytes, but its header says " + std::to_string(ck.file_bytes[i]) +
                              ": truncated since it was opened");
      }
    }
  }
  const detail::File& operator[](std::uint32_t i) const { return *files_[i]; }
  std::size_t size() const { return files_.size(); }

 private:
  std::vector<std::unique_ptr<detail::File>> files_;
};

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

// Drops the files' pages from the page cache. Dirty pages (a checkpoint just written) are not
// dropped, so they are written back first.
void drop_from_cache(const Files& files) {
  for (std::size_t f = 0; f < files.size(); ++f) {
    const int fd = files[static_cast<std::uint32_t>(f)].fd();
    (void)fdatasync(fd);
    (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  }
}

// Reads and converts pieces on a team of threads. A failure stops the others and is kept.
class Reader {
 public:
  Reader(const CheckpointIndex& ck, const Files& files, DType to, unsigned threads,
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
          scratch.resize(p.bytes);
          into = scratch.data();
        }
        if (!read_exactly(r.file, into, p.bytes, r.src + p.skip)) return;
        if (r.from != to_) detail::convert_range(out, to_, into, r.from, p.bytes / fes);
        bytes_ += p.bytes;
      }
    });
  }

  bool failed() const { return failed_; }
  const std::string& error() const { return error_; }
  std::uint64_t bytes() const { return bytes_; }

 private:
  static constexpr std::uint64_t kPiece = std::uint64_t{8} << 20;

  bool read_exactly(std::uint32_t file, unsigned char* out, std::uint64_t n, std::uint64_t at) {
    try {
      if (fail_after_ && read_so_far_.fetch_add(n) + n > *fail_after_) {
        throw Error(files_[file].path() + ": reading bytes [" + std::to_string(at) + ", " +
                    std::to_string(at + n) + ") failed: injected I/O error (testing aid)");
      }
      files_[file].read_at(out, n, at);
      return true;
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failed_.exchange(true)) {
        error_ = std::string(e.what()) + " (tensor '" + printable(tensor_at(ck_, file, at)) + "')";
      }
      return false;
    }
  }

  const CheckpointIndex& ck_;
  const Files& files_;
  DType to_;
  std::uint64_t es_;
  detail::ThreadPool pool_;
  std::optional<std::uint64_t> fail_after_;
  std::atomic<std::uint64_t> read_so_far_{0};
  std::atomic<std::uint64_t> bytes_{0};
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::string error_;
};

// The reads of [lo, hi) (bytes of the slice) cut out of `reads`, dst relative to lo.
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

// The checkpoint tensors of parameter p, in order, checked against its shape. A name the
// checkpoint lacks goes to `missing` (and none is returned).
std::vector<const CheckpointTensor*> resolve(const CheckpointIndex& ck, const LoadParam& p,
                                             std::vector<std::string>& missing) {
  std::vector<std::string> names = p.sources;
  if (names.empty()) names.push_back(p.name);
  std::vector<const CheckpointTensor*> out;
  std::uint64_t numel = 0;
  for (const std::string& name : names) {
    const CheckpointTensor* t = ck.find(name);
    if (t == nullptr) {
      missing.push_back(printable(name));
      continue;
    }
    if (!t->type) {
      throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(t->name) + "' is " +
                            printable(t->dtype) + ": the loader reads BF16, F16 and F32");
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

std::string options_text(const LoadOptions& o, const CheckpointIndex& ck, const Device& device,
                         std::uint64_t ring) {
  const LayoutOptions& l = o.layout;
  std::ostringstream t;
  t << "dp " << l.dp << ", alignment factor " << l.alignment_factor << ", round-robin "
    << (l.round_robin ? "on" : "off") << ", dtype " << dtype_name(l.dtype)
    << ", parameter alignment " << l.param_align_bytes << " B, margin ";
  if (o.margin_bytes) {
    t << *o.margin_bytes;
  } else {
    t << "default";
  }
  t << ", ring " << ring << " B, device " << device.name().substr(0, device.name().find(':'))
    << (device.keeps_data() ? "" : " without data") << "; checkpoint of " << ck.tensors.size()
    << " tensors in " << ck.files.size() << " files of";
  for (std::uint64_t b : ck.file_bytes) t << ' ' << b;
  if (!o.must_match.empty()) t << "; " << o.must_match;
  return t.str();
}

}  // namespace

std::uint64_t partition_read_bytes(const CheckpointIndex& ck, std::span<const LoadParam> params,
                                   const LayoutOptions& options, std::uint64_t rank) {
  std::vector<std::uint64_t> numels;
  std::vector<std::vector<const CheckpointTensor*>> sources;
  std::vector<std::string> missing;
  for (const LoadParam& p : params) {
    sources.push_back(resolve(ck, p, missing));
    numels.push_back(shape_numel(p.shape));
  }
  if (!missing.empty()) {
    throw InvalidArgument(ck.path + " has no tensor named '" + missing.front() + "'");
  }
  const Layout layout = Layout::compute(numels, options);
  if (rank >= options.dp) {
    throw InvalidArgument("rank " + std::to_string(rank) + " of dp " + std::to_string(options.dp));
  }
  std::uint64_t bytes = 0;
  for (const Fragment& f : layout.fragments_in(rank * layout.partition_numel(),
                                               (rank + 1) * layout.partition_numel())) {
    for_pieces(sources[f.param], f.param_offset, f.numel,
               [&](const CheckpointTensor& t, std::uint64_t, std::uint64_t n, std::uint64_t) {
                 bytes += n * element_size(*t.type);
               });
  }
  return bytes;
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

LoadResult load_flat_group(const CheckpointIndex& ck, std::span<const LoadParam> params,
                           Device& device, Communicator* comm, const LoadOptions& options) {
  const auto t_start = Clock::now();
  LoadResult res;
  Communicator* group = comm != nullptr && comm->size() > 1 ? comm : nullptr;
  const std::uint64_t ranks = group ? static_cast<std::uint64_t>(group->size()) : 1;
  const std::uint64_t rank = group ? static_cast<std::uint64_t>(group->rank()) : 0;
  const DType dtype = options.layout.dtype;
  const std::uint64_t es = element_size(dtype);
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

  // --- this rank's own checks, kept until the ranks agree -------------------------------------
  std::string error;
  std::optional<Layout> layout;
  std::vector<std::vector<const CheckpointTensor*>> sources(params.size());
  std::vector<TensorRef> refs;
  std::unique_ptr<Files> files;
  ProbeContext context = options.probe;
  try {
    if (!options.local_error.empty()) throw InvalidArgument(options.local_error);
    if (options.layout.dp != ranks) {
      throw InvalidArgument("the layout is for dp " + std::to_string(options.layout.dp) + ", but " +
                            std::to_string(ranks) + " rank(s) load: dp must be their number");
    }
    std::vector<std::string> missing;
    std::vector<std::uint64_t> numels;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const LoadParam& p = params[i];
      sources[i] = resolve(ck, p, missing);
      numels.push_back(shape_numel(p.shape));
      refs.push_back(TensorRef{nullptr, numels.back(), p.shape, dtype, &device});
    }
    if (!missing.empty()) {
      if (missing.size() > 8) {
        missing.resize(8);
        missing.push_back("...");
      }
      throw InvalidArgument(ck.path + " has no tensor named " + join(missing) +
                            " (the checkpoint holds " + std::to_string(ck.tensors.size()) +
                            " tensors)");
    }
    layout = Layout::compute(numels, options.layout);
    if (device.keeps_data()) {
      files = std::make_unique<Files>(ck);
      if (options.cold) drop_from_cache(*files);
    }
    if (context.local_ranks == 0) {
      context.local_ranks = runtime_env().local_ranks.value_or(static_cast<unsigned>(ranks));
    }
  } catch (const Error& e) {
    error = e.what();
    refs.clear();
  }
  if (context.local_ranks == 0) context.local_ranks = 1;

  // --- probe and agree ------------------------------------------------------------------------
  res.probe = device.probe_memory(context);
  const ProbeResult host = device.probe_host_memory(context);
  AgreementInput ai;
  ai.options = options_text(options, ck, device, ring_bytes);
  ai.params = refs;
  ai.capacity_bytes = res.probe.total_bytes;
  ai.free_bytes = std::min(res.probe.free_bytes, res.probe.total_bytes);
  ai.host_free_bytes = host.available ? host.free_bytes : 0;
  ai.integrated = res.probe.integrated;
  ai.error = error.empty() && !res.probe.available
                 ? device.name() + ": no free-memory source could answer"
                 : error;
  const Agreement agreed = agree(ai, group);

  // --- plan -----------------------------------------------------------------------------------
  PlanFacts facts = plan_facts(agreed, context.local_ranks);
  facts.bandwidths = device.hardware().value_or(generic_preset(agreed.capacity_bytes)).bandwidths;
  res.input = make_plan_input(*layout, 0, facts, rank, std::nullopt, options.margin_bytes);
  res.plan = plan_load(res.input, ring_bytes);
  if (!res.plan.feasible) return res;  // the same verdict on every rank: nothing allocated

  // --- this rank's reads ------------------------------------------------------------------------
  const std::uint64_t sb = layout->partition_bytes();
  std::vector<Read> reads;
  for (const Fragment& f : layout->fragments_in(rank * layout->partition_numel(),
                                                (rank + 1) * layout->partition_numel())) {
    for_pieces(
        sources[f.param], f.param_offset, f.numel,
        [&](const CheckpointTensor& t, std::uint64_t first, std::uint64_t n,
            std::uint64_t param_first) {
          const std::uint64_t fes = element_size(*t.type);
          reads.push_back(Read{t.file, t.offset + first * fes, n * fes,
                               (f.partition_offset + param_first - f.param_offset) * es, *t.type});
        });
  }
  // In file order, neighbours merged: one pread where the bytes follow each other in the file
  // and in the buffer.
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
  res.reads = merged.size();
  for (const Read& r : merged) res.bytes_read += r.src_bytes;

  // --- the steps, on the machine the planner simulated ---------------------------------------
  const std::uint64_t resident = device.memory_info().allocated_bytes;
  res.predicted_peak_device_bytes =
      simulate(res.plan.steps, resident, 0, layout->options().dp).peak_device_bytes;
  StepMachine machine(resident, 0);
  DeviceBuffer flat;
  void* ring = nullptr;
  std::string failure;
  const unsigned threads = options.threads > 0
                               ? options.threads
                               : default_num_threads(static_cast<unsigned>(context.local_ranks));
  try {
    for (const Step& s : res.plan.steps) {
      machine.check(s);
      if (s.op == Op::kAllocate && s.buffer == Buffer::kFlat) {
        flat = DeviceBuffer(device, s.bytes);
      } else if (s.op == Op::kAllocate) {
        ring = device.allocate_host(s.bytes);
      } else if (s.op == Op::kRelease) {
        device.release_host(ring, machine.size(Buffer::kHostStage));
        ring = nullptr;
      } else if (s.op == Op::kRead && device.keeps_data()) {
        std::uint64_t cached = 0;
        for (const Read& r : merged) {
          cached +=
              static_cast<std::uint64_t>(resident_fraction(ck.files[r.file], r.src, r.src_bytes) *
                                         static_cast<double>(r.src_bytes));
        }
        res.cached_fraction =
            res.bytes_read ? static_cast<double>(cached) / static_cast<double>(res.bytes_read) : 1;
        res.page_cache = page_cache_word(res.cached_fraction);
        const auto t0 = Clock::now();
        Reader reader(ck, *files, dtype, threads, options.fail_after_bytes);
        auto* slice = static_cast<unsigned char*>(flat.data()) + s.dst_offset;
        if (!ring_path) {
          reader.fill(slice, sb, merged);
        } else {
          // A ring of chunks: the team reads window k + 1 while a copier thread moves window k
          // to the device.
          const std::uint64_t depth = std::max<unsigned>(1, options.ring_depth);
          const std::uint64_t chunk = machine.size(Buffer::kHostStage) / depth;
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
                  device.copy(slice + job.second,
                              static_cast<unsigned char*>(ring) + job.first * chunk,
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
          for (std::uint64_t w = 0, k = 0; w < sb && !reader.failed(); w += chunk, ++k) {
            const std::uint64_t slot = k % depth;
            {
              std::unique_lock<std::mutex> lock(m);
              cv.wait(lock, [&] { return !busy[slot]; });
              busy[slot] = true;
            }
            const std::uint64_t len = std::min(chunk, sb - w);
            reader.fill(static_cast<unsigned char*>(ring) + slot * chunk, len,
                        window(merged, w, w + len, es));
            {
              std::lock_guard<std::mutex> lock(m);
              full.emplace_back(slot, w);
            }
            cv.notify_all();
          }
          {
            std::lock_guard<std::mutex> lock(m);
            done = true;
          }
          cv.notify_all();
          copier.join();
          device.synchronize();
          if (!copy_error.empty()) throw Error("copying to " + device.name() + ": " + copy_error);
        }
        if (reader.failed()) throw Error(reader.error());
        res.read_seconds = seconds_since(t0);
      } else if (s.op == Op::kAllGather) {
        break;  // after the ranks agree that every read succeeded
      }
      machine.apply(s);
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Every rank learns of any rank's failure here, and none keeps a half-built buffer.
  const int bad = agree_on_failure(group, !failure.empty());
  if (bad >= 0) {
    if (ring != nullptr) device.release_host(ring, machine.size(Buffer::kHostStage));
    flat.reset();
    throw Error(!failure.empty() ? failure
                                 : "rank " + std::to_string(bad) +
                                       " could not read its part of the checkpoint (its own "
                                       "error says which file, tensor and bytes); nothing was "
                                       "kept");
  }
  // --- all-gather, views ------------------------------------------------------------------------
  const auto t_gather = Clock::now();
  if (group != nullptr) group->all_gather_inplace(flat.data(), sb, device);
  res.allgather_seconds = seconds_since(t_gather);
  res.group.layout = *layout;
  auto* base = static_cast<unsigned char*>(flat.data());
  for (std::size_t i = 0; i < refs.size(); ++i) {
    TensorRef v = refs[i];
    v.data = base + layout->offsets()[i] * es;
    res.group.views.push_back(std::move(v));
  }
  res.group.flat = std::move(flat);
  device.synchronize();
  const MemoryInfo mem = device.memory_info();
  res.measured_peak_device_bytes = mem.peak_allocated_bytes;
  res.measured_peak_host_bytes = mem.peak_host_allocated_bytes;
  res.seconds = seconds_since(t_start);
  return res;
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
  Files files(ck);
  if (cold) drop_from_cache(files);
  std::uint64_t cached = 0;
  for (const Read& r : reads) {
    cached += static_cast<std::uint64_t>(resident_fraction(ck.files[r.file], r.src, r.src_bytes) *
                                         static_cast<double>(r.src_bytes));
  }
  out.cached_fraction =
      out.bytes ? static_cast<double>(cached) / static_cast<double>(out.bytes) : 1.0;
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
      error = reader.error();
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

std::string verify_loaded(const CheckpointIndex& ck, std::span<const LoadParam> params,
                          Device& device, const FlatGroup& group) {
  const Layout& layout = group.layout;
  const DType dtype = layout.options().dtype;
  const std::uint64_t es = element_size(dtype);
  if (params.size() != layout.num_params() || group.views.size() != params.size()) {
    return "the group has " + std::to_string(group.views.size()) + " views for " +
           std::to_string(params.size()) + " parameters";
  }
  if (!device.keeps_data()) return "";
  const Files files(ck);
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
  std::vector<unsigned char> whole, want;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const LoadParam& p = params[i];
    std::vector<std::string> missing;
    const std::vector<const CheckpointTensor*> src = resolve(ck, p, missing);
    if (!missing.empty()) return "no tensor '" + missing.front() + "'";
    // The tensors read whole, on their own, and converted on their own.
    want.assign(shape_numel(p.shape) * es, 0);
    std::uint64_t filled = 0;
    for (const CheckpointTensor* t : src) {
      whole.resize(t->bytes);
      files[t->file].read_at(whole.data(), t->bytes, t->offset);
      detail::convert_range(want.data() + filled, dtype, whole.data(), *t->type, t->numel);
      filled += t->numel * es;
    }
    const std::string name = src.empty() ? p.name : src.front()->name;
    const std::string file = src.empty() ? std::string("?") : files[src.front()->file].path();
    const std::uint64_t at = layout.offsets()[i] * es;
    for (std::uint64_t done = 0; done < want.size();) {
      const std::uint64_t n = std::min(kPiece, want.size() - done);
      const unsigned char* got = held(at + done, n);
      if (std::memcmp(got, want.data() + done, n) != 0) {
        std::uint64_t k = 0;
        while (got[k] == want[done + k]) ++k;
        return "parameter '" + printable(p.name) + "' differs from tensor '" + printable(name) +
               "' of " + file + (src.size() > 1 ? " (or a tensor after it)" : "") + " at element " +
               std::to_string((done + k) / es);
      }
      done += n;
    }
    if (group.views[i].data != static_cast<const unsigned char*>(group.flat.data()) + at) {
      return "parameter '" + printable(p.name) + "' is not a view at its layout offset";
    }
  }
  // Padding: every byte no parameter covers is zero.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (std::size_t i = 0; i < params.size(); ++i) {
    spans.emplace_back(layout.offsets()[i] * es, (layout.offsets()[i] + layout.numels()[i]) * es);
  }
  std::sort(spans.begin(), spans.end());
  std::uint64_t gap = 0;
  spans.emplace_back(layout.flat_bytes(), layout.flat_bytes());
  for (const auto& [lo, hi] : spans) {
    for (std::uint64_t b = gap; b < lo;) {
      const std::uint64_t n = std::min(kPiece, lo - b);
      const unsigned char* got = held(b, n);
      for (std::uint64_t k = 0; k < n; ++k) {
        if (got[k] != 0) return "padding byte " + std::to_string(b + k) + " is not zero";
      }
      b += n;
    }
    gap = std::max(gap, hi);
  }
  return "";
}

}  // namespace zeroflat
