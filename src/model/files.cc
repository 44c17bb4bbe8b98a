// Reading untrusted files (files.h).
#include "model/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "zeroflat/common.h"

namespace zeroflat::detail {

void check_path(std::string_view path) {
  const std::size_t nul = path.find('\0');
  if (nul != std::string_view::npos) {
    throw InvalidArgument("path '" + printable(path, 200) + "' holds a NUL byte (byte " +
                          std::to_string(nul) +
                          "): no file name can, so it names no file (expected a path to a file "
                          "or directory)");
  }
}

File::File(const std::string& path) : path_(path) {
  check_path(path);
  // O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd_ < 0) {
    throw InvalidArgument(printable(path, 200) + ": cannot open (" + std::strerror(errno) + ")");
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    throw InvalidArgument(printable(path, 200) + ": not a regular file");
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
}

FileStamp stamp_of(const struct stat& st) {
  FileStamp s;
  s.known = true;
  s.device = static_cast<std::uint64_t>(st.st_dev);
  s.inode = static_cast<std::uint64_t>(st.st_ino);
  s.size = static_cast<std::uint64_t>(st.st_size);
  s.mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
  return s;
}

FileStamp File::stamp() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return {};
  return stamp_of(st);
}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

void File::read_at(void* out, std::uint64_t n, std::uint64_t offset) const {
  auto* p = static_cast<char*>(out);
  std::uint64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, p + done, n - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      throw InvalidArgument(printable(path_, 200) + ": reading bytes [" +
                            std::to_string(offset) + ", " + std::to_string(offset + n) +
                            ") failed: " +
                            (got == 0 ? std::string("the file ends at byte ") +
                                            std::to_string(offset + done)
                                      : std::string(std::strerror(errno))));
    }
    done += static_cast<std::uint64_t>(got);
  }
}

std::string read_small_file(const std::string& path, std::uint64_t max_bytes,
                            std::string_view what) {
  File f(path);
  if (f.size() > max_bytes) {
    throw InvalidArgument(printable(path, 200) + ": " + format_bytes(f.size()) +
                          " is too large for " + std::string(what) + " (at most " +
                          format_bytes(max_bytes) + ")");
  }
  std::string text(f.size(), '\0');
  f.read_at(text.data(), text.size(), 0);
  return text;
}

}  // namespace zeroflat::detail
