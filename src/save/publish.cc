// Publishing a checkpoint (save.h): durable files, one rename to make a tag visible, `latest`
// replaced last. Every step checks the test fault hook first.
#include "zeroflat/save.h"

#include "save/save_io.h"

#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>
#include <optional>
#include <string_view>

#include <dirent.h>
#include <fcntl.h>
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
  remove_tree(dir + "/" + partial);
}

int remove_partials(const std::string& dir) {
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
      fault_point("publish.remove", aside);
      remove_tree(aside);
      return out;
    } else {
      throw io_error("publish (exchange)", to, errno);
    }
  }
  fault_point("publish.fsync", dir);
  fsync_path(dir, true, "publish (fsync of the folder)");
  if (out.exchanged) {
    // The old checkpoint now lies under the partial name.
    fault_point("publish.remove", from);
    remove_tree(from);
  }
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
