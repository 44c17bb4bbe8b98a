// Publishing a checkpoint (save.h): durable files, one rename to make a tag visible, `latest`
// replaced last. Every step checks the test fault hook first.
#include "zeroflat/save.h"

#include "common/thread_pool.h"
#include "save/save_io.h"

#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace zeroflat {
namespace {

using save_io::Fd;
using save_io::fault_point;
using save_io::fsync_path;
using save_io::io_error;

constexpr std::string_view kPartialPrefix = ".zeroflat-partial-";
constexpr std::string_view kOldPrefix = ".zeroflat-old-";

bool exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// Everything under `path` (not following links), then `path`; absent is done.
void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw io_error("remove (stat)", path, errno);
  }
  if (S_ISDIR(st.st_mode)) {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) throw io_error("remove (opendir)", path, errno);
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) {
      const std::string_view n(e->d_name);
      if (n != "." && n != "..") names.emplace_back(n);
    }
    ::closedir(d);
    for (const std::string& n : names) remove_tree(path + "/" + n);
    if (::rmdir(path.c_str()) != 0 && errno != ENOENT) throw io_error("remove", path, errno);
    return;
  }
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw io_error("remove", path, errno);
}

void sync_tree_at(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) throw io_error("sync_tree (opendir)", path, errno);
  std::vector<std::pair<std::string, bool>> entries;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view n(e->d_name);
    if (n == "." || n == "..") continue;
    struct stat st {};
    const std::string child = path + "/" + std::string(n);
    if (::lstat(child.c_str(), &st) != 0) {
      const int code = errno;
      ::closedir(d);
      throw io_error("sync_tree (stat)", child, code);
    }
    if (S_ISDIR(st.st_mode) || S_ISREG(st.st_mode)) entries.emplace_back(child, S_ISDIR(st.st_mode));
  }
  ::closedir(d);
  for (const auto& [child, directory] : entries) {
    if (directory) sync_tree_at(child);
    else fsync_path(child, false, "sync_tree");
  }
  fsync_path(path, true, "sync_tree");
}

// The folders that publications replaced, removed by one detached thread after publish_tag has
// returned (a 540 MB checkpoint's unlink takes about 0.1 s here: not the save's time). A removal
// that fails leaves its folder to the next clean-up, which tries again and raises if it still
// fails. Across fork(), the child starts with nothing pending (the parent removes them).
class Retired {
 public:
  static Retired& get() {
    static Retired* one = [] {
      auto* r = new Retired();  // never destroyed; the process's exit waits for its thread
      ::pthread_atfork([] { get().mutex_.lock(); }, [] { get().mutex_.unlock(); },
                       [] {
                         Retired& c = get();
                         c.todo_.clear();
                         c.failed_.clear();
                         c.running_ = false;
                         c.mutex_.unlock();
                       });
      std::atexit([] { get().wait(); });
      return r;
    }();
    return *one;
  }

  void add(std::string path) {
    std::unique_lock<std::mutex> lock(mutex_);
    todo_.push_back(std::move(path));
    if (running_) return;
    running_ = true;
    try {
      detail::start_thread(0, [this] { work(); }).detach();
    } catch (const std::system_error&) {  // no thread to be had: removed here, as before
      lock.unlock();
      work();
    }
  }

  // Every folder added so far removed or given up on; returns those given up on (each once).
  std::vector<std::string> wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return !running_; });
    return std::exchange(failed_, {});
  }

  // A folder given up on again: for the next wait().
  void keep(std::string path) {
    std::lock_guard<std::mutex> lock(mutex_);
    failed_.push_back(std::move(path));
  }

  static void remove_retired(const std::string& path) {
    fault_point("publish.remove", path);
    remove_tree(path);
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!todo_.empty()) {
      const std::string path = std::move(todo_.front());
      todo_.pop_front();
      lock.unlock();
      bool ok = true;
      try {
        remove_retired(path);
      } catch (...) {
        ok = false;
      }
      lock.lock();
      if (!ok) failed_.push_back(path);
    }
    running_ = false;
    idle_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable idle_;
  std::deque<std::string> todo_;
  std::vector<std::string> failed_;
  bool running_ = false;
};

}  // namespace

void finish_removals() {
  Retired& retired = Retired::get();
  std::exception_ptr first;
  for (std::string& path : retired.wait()) {
    try {
      Retired::remove_retired(path);
    } catch (...) {
      if (!first) first = std::current_exception();
      retired.keep(std::move(path));
    }
  }
  if (first) std::rethrow_exception(first);
}

namespace {

int rename_exchange(const std::string& a, const std::string& b) {
#if defined(SYS_renameat2)
  constexpr unsigned kExchange = 1u << 1;  // RENAME_EXCHANGE
  return static_cast<int>(::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), kExchange));
#else
  errno = ENOSYS;
  return -1;
#endif
}

}  // namespace

void save_step(const std::string& step, const std::string& path) { (void)fault_point(step, path); }

std::string partial_tag_name(const std::string& tag) {
  if (tag.empty() || tag == "." || tag == ".." || tag.find('/') != std::string::npos ||
      tag.find('\0') != std::string::npos || tag.starts_with(".zeroflat-")) {
    throw InvalidArgument("tag '" + printable(tag, 200) +
                          "': a checkpoint's tag is a plain folder name (not empty, '.' or '..', "
                          "without '/', not starting with '.zeroflat-')");
  }
  return std::string(kPartialPrefix) + tag;
}

void remove_partial(const std::string& dir, const std::string& partial) {
  if (!partial.starts_with(kPartialPrefix)) {
    throw InvalidArgument("'" + printable(partial, 200) + "' is not a partial tag's folder");
  }
  finish_removals();
  remove_tree(dir + "/" + partial);
}

int remove_partials(const std::string& dir) {
  finish_removals();
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    if (errno == ENOENT) return 0;
    throw io_error("remove (opendir)", dir, errno);
  }
  std::vector<std::string> found;
  while (const dirent* e = ::readdir(d)) {
    const std::string_view n(e->d_name);
    if (n.starts_with(kPartialPrefix)) found.emplace_back(n);
  }
  ::closedir(d);
  for (const std::string& n : found) remove_tree(dir + "/" + n);
  return static_cast<int>(found.size());
}

void sync_files(const std::vector<std::string>& paths) {
  for (std::size_t i = 0; i < paths.size(); ++i) {
    fault_point("sync_files." + std::to_string(i + 1), paths[i]);
    fsync_path(paths[i], false, "sync_files");
  }
}

void sync_tree(const std::string& dir) {
  fault_point("sync_tree", dir);
  sync_tree_at(dir);
}

Published publish_tag(const std::string& dir, const std::string& partial, const std::string& tag) {
  (void)partial_tag_name(tag);
  finish_removals();
  const std::string from = dir + "/" + partial, to = dir + "/" + tag;
  Published out;
  if (!exists(to)) {
    fault_point("publish.rename", to);
    if (::rename(from.c_str(), to.c_str()) != 0) throw io_error("publish (rename)", to, errno);
  } else {
    out.replaced = true;
    // One atomic swap: at every moment `tag` is a whole checkpoint, the old or the new.
    int swapped = -1;
    if (fault_point("publish.exchange", to)) {
      errno = EINVAL;
    } else {
      swapped = rename_exchange(from, to);
    }
    if (swapped == 0) {
      out.exchanged = true;
    } else if (errno == ENOSYS || errno == EINVAL || errno == ENOTSUP) {
      // No exchange here: the old aside, then the new in (between the two, no `tag`).
      const std::string aside = dir + "/" + std::string(kOldPrefix) + tag;
      remove_tree(aside);
      fault_point("publish.aside", to);
      if (::rename(to.c_str(), aside.c_str()) != 0) throw io_error("publish (rename aside)", to, errno);
      fault_point("publish.rename", to);
      if (::rename(from.c_str(), to.c_str()) != 0) {
        const int code = errno;
        (void)::rename(aside.c_str(), to.c_str());  // the old one back
        throw io_error("publish (rename)", to, code);
      }
      fault_point("publish.fsync", dir);
      fsync_path(dir, true, "publish (fsync of the folder)");
      Retired::get().add(aside);
      return out;
    } else {
      throw io_error("publish (exchange)", to, errno);
    }
  }
  fault_point("publish.fsync", dir);
  fsync_path(dir, true, "publish (fsync of the folder)");
  // The old checkpoint now lies under the partial name, out of sight: removed after this returns.
  if (out.exchanged) Retired::get().add(from);
  return out;
}

void write_latest(const std::string& dir, const std::string& tag) {
  (void)partial_tag_name(tag);
  const std::string tmp = dir + "/latest.tmp", latest = dir + "/latest";
  {
    fault_point("latest.write", tmp);
    Fd fd(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW, "latest (write)", 0644);
    std::size_t done = 0;
    while (done < tag.size()) {
      const ssize_t n = ::write(fd.get(), tag.data() + done, tag.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw io_error("latest (write)", tmp, errno);
      done += static_cast<std::size_t>(n);
    }
    fault_point("latest.fsync", tmp);
    if (::fsync(fd.get()) != 0) throw io_error("latest (fsync)", tmp, errno);
    fd.close("latest (write)", tmp);
  }
  fault_point("latest.rename", latest);
  if (::rename(tmp.c_str(), latest.c_str()) != 0) throw io_error("latest (rename)", latest, errno);
  fault_point("latest.fsync_dir", dir);
  fsync_path(dir, true, "latest (fsync of the folder)");
}

}  // namespace zeroflat
