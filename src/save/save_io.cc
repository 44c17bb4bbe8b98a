// What the pieces of a save share (save_io.h).
#include "save/save_io.h"

#include <algorithm>
#include <chrono>
#include <thread>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>
#include <optional>
#include <string_view>

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "zeroflat/save.h"

namespace zeroflat {
namespace {

std::mutex fault_mutex;
std::optional<std::string> fault_override;

}  // namespace

WritePriority parse_write_priority(const std::string& name) {
  if (name == "idle") return WritePriority::kIdle;
  if (name == "low") return WritePriority::kLow;
  if (name == "normal") return WritePriority::kNormal;
  throw InvalidArgument("a writer's priority is idle, low or normal, not '" + printable(name, 40) + "'");
}

void set_thread_write_priority(WritePriority p) noexcept {
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  if (p == WritePriority::kIdle) {
    sched_param param{};
    if (::sched_setscheduler(0, SCHED_IDLE, &param) == 0) return;
    p = WritePriority::kLow;  // a system without it: 10 nicer
  }
  if (p == WritePriority::kLow) {
    errno = 0;
    const int now = ::getpriority(PRIO_PROCESS, tid);
    if (errno == 0) (void)::setpriority(PRIO_PROCESS, tid, std::min(19, now + 10));
  }
}

void set_save_fault_for_testing(std::optional<std::string> spec) {
  std::lock_guard<std::mutex> lock(fault_mutex);
  fault_override = std::move(spec);
}

namespace save_io {

IoError io_error(const std::string& step, const std::string& path, int code) {
  std::string out(1, '\'');  // appended, not "'" + ...: g++ 12 warns falsely (-Wrestrict) there
  out += printable(path, 200);
  out += "': ";
  out += step;
  out += " failed: ";
  out += std::strerror(code);
  return IoError(out, code);
}

bool fault_point(const std::string& step, const std::string& path) {
  std::string spec;
  {
    std::lock_guard<std::mutex> lock(fault_mutex);
    spec = fault_override ? *fault_override : runtime_env().save_fault;
  }
  if (spec.empty()) return false;
  const std::string_view s(spec);
  const std::size_t colon = s.rfind(':');
  if (colon == std::string_view::npos || s.substr(0, colon) != step) return false;
  const std::string_view kind = s.substr(colon + 1);
  if (kind == "kill") {
    ::kill(::getpid(), SIGKILL);
    ::pause();
  }
  if (kind == "delay") {  // a slow step (half a second), for the tests of progress and waits
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    return false;
  }
  if (kind == "eio") throw io_error(step + " (an injected fault)", path, EIO);
  if (kind == "enospc") throw io_error(step + " (an injected fault)", path, ENOSPC);
  return kind == "unsupported";
}

Fd::Fd(const std::string& path, int flags, const std::string& step, mode_t mode)
    : fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)) {
  if (fd_ < 0) throw io_error(step + " (open)", path, errno);
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

void Fd::close(const std::string& step, const std::string& path) {
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw io_error(step + " (close)", path, errno);
}

void fsync_path(const std::string& path, bool directory, const std::string& step) {
  Fd fd(path, (directory ? O_DIRECTORY : 0) | O_RDONLY | O_NOFOLLOW, step);
  if (::fsync(fd.get()) != 0) throw io_error(step, path, errno);
}

void pwrite_all(int fd, const void* data, std::uint64_t n, std::uint64_t offset,
                const std::string& step, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(n, 1u << 30));
    const ssize_t got = ::pwrite(fd, p, want, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw io_error(step, path, errno);
    if (got == 0) throw io_error(step, path, EIO);
    p += got;
    offset += static_cast<std::uint64_t>(got);
    n -= static_cast<std::uint64_t>(got);
  }
}

}  // namespace save_io
}  // namespace zeroflat
