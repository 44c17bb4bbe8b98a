// Reading untrusted files: regular files only, opened so that nothing can block (a FIFO or a
// device named where a file is expected is refused, not waited on), bounded in size.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "zeroflat/checkpoint.h"

struct stat;

namespace zeroflat::detail {

// A file's identity, size and time as fstat or stat gave them.
FileStamp stamp_of(const struct stat& st);

// Refuses a path holding a NUL byte, which no file name can: the system would see only the
// part before it, and act on (or name in its errors) a file other than the one given. Throws
// InvalidArgument naming the path (made printable) and where the NUL is.
void check_path(std::string_view path);

// An open file descriptor, closed on destruction.
class File {
 public:
  // Opens `path` for reading if it is a regular file (checked on the open descriptor, so a
  // path swapped for a FIFO in between is still refused). Throws InvalidArgument naming the
  // path: missing, unreadable, not a regular file, holding a NUL byte (check_path).
  explicit File(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int fd() const noexcept { return fd_; }
  // What the open file is now (fstat of its descriptor).
  FileStamp stamp() const;
  std::uint64_t size() const noexcept { return size_; }
  const std::string& path() const noexcept { return path_; }
  // Reads exactly n bytes at offset into out. Throws InvalidArgument naming the file and the
  // byte range when the file is shorter or the read fails.
  void read_at(void* out, std::uint64_t n, std::uint64_t offset) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// The whole file as text, at most max_bytes (else InvalidArgument saying it is too large for
// `what`).
std::string read_small_file(const std::string& path, std::uint64_t max_bytes,
                            std::string_view what);

}  // namespace zeroflat::detail
