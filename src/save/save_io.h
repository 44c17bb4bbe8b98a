// What the pieces of a save share (internal): errors that name the file and the step, the test
// fault hook of save.h, and file descriptors that close themselves.
#pragma once

#include <cstdint>
#include <string>

#include <fcntl.h>
#include <sys/types.h>

#include "zeroflat/common.h"

namespace zeroflat::save_io {

// "'<path>': <step> failed: <strerror(code)>", as an IoError carrying `code`.
IoError io_error(const std::string& step, const std::string& path, int code);

// The test fault hook (save.h): acts when ZEROFLAT_TEST_SAVE_FAULT (or
// set_save_fault_for_testing) names `step`: "kill" SIGKILLs the process, "eio" and "enospc"
// throw IoError. True for kind "unsupported": the step is to act as if the file system did not
// have what it asks for.
bool fault_point(const std::string& step, const std::string& path);

class Fd {
 public:
  Fd(const std::string& path, int flags, const std::string& step, mode_t mode = 0);
  ~Fd();
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes, throwing IoError (step, path) when close reports an error (a write-back failure).
  void close(const std::string& step, const std::string& path);

 private:
  int fd_;
};

// fsync of a file or a folder, opened without following a link.
void fsync_path(const std::string& path, bool directory, const std::string& step);

// Writes all n bytes at `offset` (pwrite, retried on EINTR and short writes).
void pwrite_all(int fd, const void* data, std::uint64_t n, std::uint64_t offset,
                const std::string& step, const std::string& path);

}  // namespace zeroflat::save_io
