// Communicators: how the ranks that share a parameter group talk. Each has an in-place
// all-gather, a small all-reduce (the ranks' agreement on free memory), a barrier, and a
// timeout: a rank that fails or disappears becomes a CommError on the others, not a hang.
//
// Threads: a Communicator belongs to one rank and is not for concurrent use: its collectives
// must be called from one thread at a time (they are ordered, and every rank must call them in
// the same order), though not always the same thread (the executor's overlapped read gathers
// from a thread of its own while the rank's own thread reads). abort() is the exception: any
// thread may call it at any time.
//
// Backends: `local` (ranks as threads in one process, for tests and rehearsals), `mpi` (rank and
// size from the MPI launcher; host memory), `nccl` (device memory of a cuda device; the unique
// id travels over another communicator, usually the MPI one).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace zeroflat {

class Device;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual std::string name() const = 0;
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;

  // In place: buffer holds size() * slice_bytes bytes on device, and this rank's slice
  // [rank() * slice_bytes, +slice_bytes) is its contribution. On return every slice holds its
  // owner's contribution. Every rank must call it with the same slice_bytes. A device whose
  // memory the host cannot touch (a sim device without data) moves no bytes. Throws CommError
  // on a timeout or a failed peer, naming the ranks.
  virtual void all_gather_inplace(void* buffer, std::uint64_t slice_bytes, Device& device) = 0;

  // The same for one part of every slice: bytes [r * slice_bytes + offset, +bytes) of rank r's
  // slice into every rank's buffer at the same place, offset + bytes <= slice_bytes. Every rank
  // passes the same three numbers. Only where gathers_parts() is true for `device` (the executor
  // then gathers what a rank has read while it reads the rest); the default throws Unsupported.
  virtual bool gathers_parts(const Device& device) const noexcept;
  virtual void all_gather_part(void* buffer, std::uint64_t slice_bytes, std::uint64_t offset,
                               std::uint64_t bytes, Device& device);

  // values[i] becomes the minimum (maximum) of values[i] over all ranks. Every rank passes the
  // same number of values. Throws CommError.
  virtual void all_reduce_min(std::span<std::uint64_t> values) = 0;
  virtual void all_reduce_max(std::span<std::uint64_t> values) = 0;

  // Returns when every rank has called it. Throws CommError.
  virtual void barrier() = 0;

  // This rank has failed: every collective on every rank, waiting or later, throws CommError
  // with this reason. Never throws.
  virtual void abort(const std::string& why) noexcept = 0;
};

// `size` ranks as threads of one process. Each thread takes its own communicator with rank(r);
// collectives wait at most `timeout` for the others.
class LocalGroup {
 public:
  LocalGroup(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int size() const noexcept;
  // The communicator of rank r (0 <= r < size), valid while the group lives. Throws
  // InvalidArgument for a rank outside the group.
  std::unique_ptr<Communicator> rank(int r);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// True when this build has the backend (see `zeroflat --version` and docs/environment.md).
bool have_mpi() noexcept;
bool have_nccl() noexcept;

// The ranks of MPI_COMM_WORLD, as the launcher (mpirun) set them up. Initializes MPI on first
// use and finalizes it at exit. Collectives are non-blocking underneath and polled, so a peer
// that stops answering for `timeout` becomes a CommError, not a hang. Throws Unsupported when
// this build has no MPI, CommError when MPI cannot start.
std::unique_ptr<Communicator> make_mpi_communicator(
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

// An NCCL communicator over the same ranks as `bootstrap` (rank 0 makes the unique id and
// hands it to the others through bootstrap), for buffers on `device`, which must be a cuda
// device and outlive the communicator. all_gather_inplace runs ncclAllGather in place on the
// device's stream; the small all-reduces and the barrier go over bootstrap. A collective that
// does not finish within `timeout`, or an asynchronous NCCL error, aborts the NCCL
// communicator and throws CommError. abort() aborts the NCCL communicator and bootstrap too (the
// others can only hear of it there). One rank per GPU; a timeout must be positive (else
// InvalidArgument). Throws Unsupported when this build has no NCCL.
std::unique_ptr<Communicator> make_nccl_communicator(
    Communicator& bootstrap, Device& device,
    std::chrono::milliseconds timeout = std::chrono::seconds(60));

}  // namespace zeroflat
