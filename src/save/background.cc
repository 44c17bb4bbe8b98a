// A save written in the background (save.h): the files, their fsync, this rank's marker; on the
// first rank, the others' markers awaited, then the publication.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/prefault.h"
#include "common/stream_copy.h"
#include "common/thread_pool.h"
#include "save/save_io.h"
#include "zeroflat/save.h"

namespace zeroflat {

// A streamed job's files as they come (BackgroundSave::add_file), taken by the writing thread.
struct detail::SaveQueue {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<std::pair<StagedFile, bool>> files;  // not yet taken, in order; whether `first`
  std::size_t first_pending = 0;  // `first` files not yet written
  bool sealed = false;
  bool cancelled = false;
  bool closed = false;  // the writer has ended: files added now are dropped
  std::vector<SharedPart> parts;

  // The next file to write, into `out`; false once sealed and empty. Throws Error when the
  // save is given up before it is sealed.
  bool next(std::deque<StagedFile>& out, bool& first) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return cancelled || sealed || !files.empty(); });
    if (!files.empty()) {
      out.push_back(std::move(files.front().first));
      first = files.front().second;
      files.pop_front();
      return true;
    }
    if (!sealed) throw Error("the save was given up before it was published: a rank could not take its snapshot");
    return false;
  }
};

namespace {

using Clock = std::chrono::steady_clock;

// Another rank's failure, as that rank recorded it in its marker.
class RankFailed : public Error {
 public:
  RankFailed(int rank, const std::string& why)
      : Error("rank " + std::to_string(rank) + " failed writing its files: " + why), rank_(rank) {}
  int rank() const noexcept { return rank_; }

 private:
  int rank_;
};

std::string marker(const std::string& folder, const char* what, int rank) {
  return folder + "/.zeroflat-" + what + "-" + std::to_string(rank);
}

bool present(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// A small file written whole and made durable.
void write_small(const std::string& path, const std::string& text, const std::string& step) {
  save_io::Fd fd(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, step, 0644);
  save_io::pwrite_all(fd.get(), text.data(), text.size(), 0, step, path);
  if (::fsync(fd.get()) != 0) throw save_io::io_error(step + " (fsync)", path, errno);
  fd.close(step, path);
}

// A marker: written whole under a temporary name, then renamed into place, so that a rank that
// sees it reads all of it (never a file still being written).
void write_marker(const std::string& path, const std::string& text, const std::string& step) {
  const std::string tmp = path + ".tmp";
  write_small(tmp, text, step);
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw save_io::io_error(step + " (rename)", path, errno);
}

std::string read_small(const std::string& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return out;
  char buf[1024];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || out.size() > (1u << 20)) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

// The CRC-32s a rank's done marker reports, one "crc <8 hex digits>" line per shared part.
std::vector<std::uint32_t> parse_marker(const std::string& text, int rank) {
  std::vector<std::uint32_t> out;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    at = end == std::string::npos ? text.size() : end + 1;
    if (line.size() != 12 || !line.starts_with("crc ") ||
        line.find_first_not_of("0123456789abcdef", 4) != std::string::npos) {
      throw Error("rank " + std::to_string(rank) + "'s marker holds '" + printable(line, 40) +
                  "', not a part's CRC");
    }
    out.push_back(static_cast<std::uint32_t>(std::stoul(line.substr(4), nullptr, 16)));
  }
  return out;
}

// Until every other rank's marker is there: the first that failed throws its words. Returns
// each other rank's parts' CRCs.
std::vector<std::vector<std::uint32_t>> await_ranks(const SaveJob& job, const std::string& folder,
                                                    const std::atomic<bool>& cancelled) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(job.timeout_seconds);
  std::vector<std::vector<std::uint32_t>> crcs;
  int next = 1;  // ranks below it have finished
  auto pause = std::chrono::milliseconds(1);
  while (next < job.world) {
    if (cancelled.load(std::memory_order_acquire)) {
      throw Error("the save was given up before it was published: a rank could not start writing");
    }
    const std::string failed = marker(folder, "failed", next);
    if (present(failed)) {
      std::string why = read_small(failed);
      throw RankFailed(next, why.empty() ? std::string("a failure it could not record") : why);
    }
    const std::string done = marker(folder, "done", next);
    if (present(done)) {
      crcs.push_back(parse_marker(read_small(done), next));
      ++next;
      pause = std::chrono::milliseconds(1);
      continue;
    }
    if (Clock::now() > deadline) {
      throw Error("rank " + std::to_string(next) + " did not finish writing its files within " +
                  std::to_string(static_cast<long long>(job.timeout_seconds)) + " s");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  return crcs;
}

void run_job(const SaveJob& job, detail::SaveQueue* queue, std::atomic<std::uint64_t>& written,
             std::atomic<std::size_t>& files_written, const std::atomic<bool>& cancelled, SaveOutcome& out) {
  const std::string folder = job.dir.empty() ? std::string() : job.dir + "/" + job.partial;
  // The files in the order they are written: the job's, then a streamed job's as they come
  // (kept here, where the writers' references to them stay valid).
  std::vector<const StagedFile*> files;
  for (const StagedFile& f : job.files) files.push_back(&f);
  std::deque<StagedFile> streamed;
  std::vector<std::unique_ptr<TorchFileWriter>> writers;
  std::vector<std::size_t> shared;  // files with shared records: finished once the others' are in
  auto mark = Clock::now();
  auto phase = [&mark](double& seconds) {  // the time since the last phase ended, into `seconds`
    const auto now = Clock::now();
    seconds += std::chrono::duration<double>(now - mark).count();
    mark = now;
  };
  auto sync = [&](std::size_t k) {
    save_io::fault_point("sync_files." + std::to_string(k + 1), files[k]->path);
    save_io::fsync_path(files[k]->path, false, "sync_files");
  };
  for (std::size_t k = 0;; ++k) {
    bool first = false;
    if (k == files.size()) {
      if (queue == nullptr || !queue->next(streamed, first)) break;
      files.push_back(&streamed.back());
    }
    save_io::fault_point("write." + std::to_string(k + 1), files[k]->path);
    writers.push_back(std::make_unique<TorchFileWriter>(*files[k]));
    writers.back()->write_data(&written);
    files_written.fetch_add(1, std::memory_order_release);  // its data read: the caller's again
    if (first) {
      std::lock_guard<std::mutex> lock(queue->mutex);
      --queue->first_pending;
    }
    if (writers.back()->shared_records() == 0) {
      writers.back()->finish({});
      out.bytes += writers.back()->bytes_written();
      out.direct_bytes += writers.back()->direct_bytes();
    } else {
      shared.push_back(k);
    }
  }
  if (!shared.empty() && (job.rank != 0 || folder.empty())) {
    throw InvalidArgument("a file with shared records is the first rank's, in a published save");
  }
  std::vector<SharedPart> my_parts = job.shared_parts;
  if (queue != nullptr) {
    std::lock_guard<std::mutex> lock(queue->mutex);
    my_parts.insert(my_parts.end(), queue->parts.begin(), queue->parts.end());
  }
  std::string crcs;
  for (std::size_t k = 0; k < my_parts.size(); ++k) {
    save_io::fault_point("write.part." + std::to_string(k + 1), my_parts[k].path);
    const std::uint32_t crc = write_shared_part(my_parts[k], &written);
    out.bytes += my_parts[k].size;
    char line[16];
    std::snprintf(line, sizeof line, "crc %08x\n", crc);
    crcs += line;
  }
  phase(out.write_seconds);
  for (std::size_t k = 0; k < files.size(); ++k) {
    if (writers[k]->shared_records() == 0) sync(k);
  }
  phase(out.sync_seconds);
  if (folder.empty()) return;
  if (job.rank != 0) {
    const std::string done = marker(folder, "done", job.rank);
    save_io::fault_point("marker", done);
    write_marker(done, crcs, "marker");
    phase(out.wait_seconds);
    return;
  }
  const std::vector<std::vector<std::uint32_t>> parts = await_ranks(job, folder, cancelled);
  phase(out.wait_seconds);
  for (std::size_t k : shared) {
    writers[k]->finish(parts);
    out.bytes += writers[k]->bytes_written();
    out.direct_bytes += writers[k]->direct_bytes();
    sync(k);
  }
  for (int r = 1; r < job.world; ++r) {
    const std::string done = marker(folder, "done", r);
    if (::unlink(done.c_str()) != 0 && errno != ENOENT) throw save_io::io_error("marker (remove)", done, errno);
  }
  sync_tree(folder);
  const Published p = publish_tag(job.dir, job.partial, job.tag);
  out.published = true;
  out.replaced = p.replaced;
  out.exchanged = p.exchanged;
  if (job.save_latest) write_latest(job.dir, job.tag);
  phase(out.publish_seconds);
}

}  // namespace

void stage_copies(const std::vector<StageCopy>& copies, unsigned threads, StageStores stores) {
  std::uint64_t total = 0;
  const StageCopy* largest = nullptr;
  for (const StageCopy& c : copies) {
    total += c.size;
    if (largest == nullptr || c.size > largest->size) largest = &c;
  }
  threads = std::max(1u, std::min<unsigned>(threads, static_cast<unsigned>(total >> 22) + 1));
  // Streaming stores: 0.6 x the time of glibc's memcpy of the same 510 MB into reused staging
  // on the development machine, one process or two at once (docs/performance.md). Into fresh
  // pages they gain nothing: the page faults dominate.
  bool streaming = stores == StageStores::Streaming;
  if (stores == StageStores::Automatic) {
    streaming = largest != nullptr && detail::larger_than_cache(total) &&
                !detail::mostly_untouched(largest->to, largest->size, 3);
  }
  auto copy_part = [&](unsigned t) {
    // Part t of the bytes as if the ranges were one run.
    const detail::Range part = detail::split_range(total, threads, t, 4096);
    std::uint64_t at = 0;
    for (const StageCopy& c : copies) {
      const std::uint64_t begin = std::max(at, part.begin), end = std::min(at + c.size, part.end);
      if (begin < end) {
        detail::copy_bytes(c.to + (begin - at), c.from + (begin - at), end - begin, streaming);
      }
      at += c.size;
      if (at >= part.end) break;
    }
    if (streaming) detail::store_fence();  // before the writer's threads read the staging
  };
  if (threads == 1) {
    copy_part(0);
    return;
  }
  detail::ThreadPool pool(threads);
  pool.run(copy_part);
}

BackgroundSave::~BackgroundSave() {
  if (thread_.joinable()) thread_.join();
}

void BackgroundSave::start(SaveJob job) {
  if (thread_.joinable()) throw Error("a save is still being written: wait() for it first");
  if (job.world < 1 || job.rank < 0 || job.rank >= job.world) {
    throw InvalidArgument("rank " + std::to_string(job.rank) + " of " + std::to_string(job.world));
  }
  if (!job.dir.empty()) (void)partial_tag_name(job.tag);
  std::uint64_t total = 0;
  for (const StagedFile& f : job.files) {
    total += f.pickle.size();
    for (const StagedStorage& s : f.storages) total += s.parts > 1 ? share_range(s.size, s.parts, 0).end : s.size;
  }
  for (const SharedPart& p : job.shared_parts) total += p.size;
  queue_ = job.streamed ? std::make_shared<detail::SaveQueue>() : nullptr;
  job_ = std::move(job);
  outcome_ = SaveOutcome{};
  written_.store(0);
  files_written_.store(0);
  finished_.store(false);
  cancelled_.store(false);
  total_.store(total);
  thread_ = detail::start_thread(0, [this] {
    const auto t0 = Clock::now();
    set_thread_write_priority(job_.priority);
    try {
      run_job(job_, queue_.get(), written_, files_written_, cancelled_, outcome_);
    } catch (const RankFailed& e) {
      outcome_.error = e.what();
      outcome_.failed_rank = e.rank();
    } catch (const IoError& e) {
      outcome_.error = e.what();
      outcome_.error_code = e.code();
    } catch (const std::exception& e) {
      outcome_.error = e.what();
    }
    if (!outcome_.error.empty() && outcome_.failed_rank < 0 && job_.rank != 0 && !job_.dir.empty()) {
      // The first rank is waiting for this one: tell it (best effort; else its timeout does).
      try {
        write_marker(marker(job_.dir + "/" + job_.partial, "failed", job_.rank), outcome_.error,
                     "marker");
      } catch (...) {
      }
    }
    outcome_.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    job_.files.clear();  // the staged bytes may be reused once wait() returns
    if (queue_) {
      std::lock_guard<std::mutex> lock(queue_->mutex);
      queue_->closed = true;
      queue_->files.clear();
      queue_->first_pending = 0;
    }
    finished_.store(true, std::memory_order_release);
  });
}

void BackgroundSave::add_file(StagedFile file, bool first) {
  if (!queue_) throw Error("add_file: the save being written is not a streamed one");
  std::uint64_t bytes = file.pickle.size();
  for (const StagedStorage& s : file.storages) bytes += s.parts > 1 ? share_range(s.size, s.parts, 0).end : s.size;
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    if (queue_->closed) return;
    if (queue_->sealed) throw Error("add_file: the save was sealed");
    queue_->files.emplace_back(std::move(file), first);
    if (first) ++queue_->first_pending;
    total_.fetch_add(bytes, std::memory_order_relaxed);
  }
  queue_->changed.notify_all();
}

void BackgroundSave::seal(std::vector<SharedPart> shared_parts) {
  if (!queue_) throw Error("seal: the save being written is not a streamed one");
  std::uint64_t bytes = 0;
  for (const SharedPart& p : shared_parts) bytes += p.size;
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    if (queue_->closed) return;
    queue_->sealed = true;
    queue_->parts = std::move(shared_parts);
    total_.fetch_add(bytes, std::memory_order_relaxed);
  }
  queue_->changed.notify_all();
}

std::size_t BackgroundSave::pending_first() const {
  if (!queue_) return 0;
  std::lock_guard<std::mutex> lock(queue_->mutex);
  return queue_->first_pending;
}

void BackgroundSave::cancel() noexcept {
  cancelled_.store(true, std::memory_order_release);
  if (queue_) {
    {
      std::lock_guard<std::mutex> lock(queue_->mutex);
      queue_->cancelled = true;
    }
    queue_->changed.notify_all();
  }
}

SaveOutcome BackgroundSave::wait() {
  if (!thread_.joinable()) return SaveOutcome{};
  thread_.join();
  return outcome_;
}

}  // namespace zeroflat
