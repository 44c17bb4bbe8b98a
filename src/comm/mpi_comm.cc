// The `mpi` communicator: the ranks of MPI_COMM_WORLD, host memory.
//
// Every collective is the non-blocking form (MPI_Iallgather, MPI_Iallreduce, MPI_Ibarrier),
// polled with MPI_Test until it completes or the timeout passes, so that a rank that stops
// answering becomes a CommError here rather than a hang. MPI offers no way to cancel a
// collective, so after a timeout this communicator is unusable: later collectives throw at once.
// The C API only: OpenMPI and MPICH otherwise pull in their C++ bindings, which need a library
// of their own.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"

namespace zeroflat {

bool have_mpi() noexcept {
  return true;
}

namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

// Set once a collective has failed: a peer is gone or stuck, and MPI_Finalize, which waits for
// every rank, would never return. The process then exits without it.
std::atomic<bool> g_broken{false};

// MPI is initialized once per process and finalized at exit (if this code initialized it and
// the job is whole).
void ensure_mpi() {
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    if (rc != MPI_SUCCESS) {
      failure = "MPI_Init_thread failed: " + mpi_error_text(rc);
      return;
    }
    // Errors come back as codes, which become exceptions, instead of aborting the job.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized && !g_broken.load()) MPI_Finalize();
    });
  });
  if (!failure.empty()) throw CommError("mpi: " + failure);
}

// One rank's slice of an all-gather as a single MPI datatype, however large (MPI counts are
// int): whole MiB blocks, then the remainder, resized so that consecutive slices tile (every
// `extent` bytes: the slice's own size, or the slice's where the type is a part of it).
class SliceType {
 public:
  explicit SliceType(std::uint64_t bytes, std::uint64_t extent = 0) {
    constexpr std::uint64_t kBlock = std::uint64_t{1} << 20;
    const std::uint64_t blocks = bytes / kBlock;
    const std::uint64_t rest = bytes % kBlock;
    if (blocks > static_cast<std::uint64_t>(INT32_MAX)) {
      throw InvalidArgument("mpi: a slice of " + format_bytes(bytes) + " is too large");
    }
    MPI_Datatype block = MPI_DATATYPE_NULL;
    MPI_Type_contiguous(static_cast<int>(kBlock), MPI_BYTE, &block);
    int lengths[2] = {static_cast<int>(blocks), static_cast<int>(rest)};
    MPI_Aint displs[2] = {0, static_cast<MPI_Aint>(blocks * kBlock)};
    MPI_Datatype types[2] = {block, MPI_BYTE};
    MPI_Datatype joined = MPI_DATATYPE_NULL;
    MPI_Type_create_struct(2, lengths, displs, types, &joined);
    MPI_Type_create_resized(joined, 0, static_cast<MPI_Aint>(extent > 0 ? extent : bytes), &type_);
    MPI_Type_commit(&type_);
    MPI_Type_free(&joined);
    MPI_Type_free(&block);
  }
  ~SliceType() { MPI_Type_free(&type_); }
  SliceType(const SliceType&) = delete;
  SliceType& operator=(const SliceType&) = delete;
  MPI_Datatype get() const { return type_; }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
};

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::chrono::milliseconds timeout) : timeout_(timeout) {
    ensure_mpi();
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }

  std::string name() const override { return "mpi"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }

  void all_gather_inplace(void* buffer, std::uint64_t slice_bytes, Device& device) override {
    check_usable();
    // Every rank's byte count, before anyone copies: MPI would read a shorter peer's buffer past
    // its end. A device without data (sim, no_data) moves nothing but still meets the others,
    // so that timing and failures behave as in a real run.
    const std::uint64_t mine = device.keeps_data() ? slice_bytes : 0;
    std::uint64_t counts[2] = {mine, ~mine};
    reduce(counts, MPI_MAX);
    if (counts[0] != ~counts[1]) {
      throw InvalidArgument("mpi all-gather: the ranks passed slices of " +
                            std::to_string(~counts[1]) + " to " + std::to_string(counts[0]) +
                            " bytes (this rank " + std::to_string(rank_) + ": " +
                            std::to_string(mine) + "); nothing was copied");
    }
    if (mine == 0) return;
    if (!device.host_accessible()) {
      throw InvalidArgument("mpi: the all-gather moves host memory, and " + device.name() +
                            " memory is not; use the nccl communicator for it");
    }
    SliceType slice(slice_bytes);
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer, 1, slice.get(), MPI_COMM_WORLD,
                         &req),
          "MPI_Iallgather");
    wait(req, "all-gather of " + format_bytes(slice_bytes * static_cast<std::uint64_t>(size_)));
  }

  // A part is gathered from the executor's own thread while this rank's thread reads: only
  // where MPI allows calls from any thread, one at a time (MPI_THREAD_SERIALIZED or better).
  bool gathers_parts(const Device& device) const noexcept override {
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    return level >= MPI_THREAD_SERIALIZED && device.keeps_data() && device.host_accessible();
  }

  void all_gather_part(void* buffer, std::uint64_t slice_bytes, std::uint64_t offset,
                       std::uint64_t bytes, Device& device) override {
    check_usable();
    if (offset > slice_bytes || bytes > slice_bytes - offset) {
      throw InvalidArgument("mpi all-gather of a part: bytes [" + std::to_string(offset) + ", +" +
                            std::to_string(bytes) + ") are outside a slice of " +
                            std::to_string(slice_bytes));
    }
    // The same three numbers on every rank, before anyone copies.
    const bool data = device.keeps_data();
    std::uint64_t v[6] = {data ? slice_bytes : 0, data ? offset : 0, data ? bytes : 0};
    for (int i = 0; i < 3; ++i) v[3 + i] = ~v[i];
    reduce(v, MPI_MAX);
    if (v[0] != ~v[3] || v[1] != ~v[4] || v[2] != ~v[5]) {
      throw InvalidArgument(
          "mpi all-gather of a part: the ranks passed different parts of their "
          "slices; nothing was copied");
    }
    if (!data || bytes == 0) return;
    if (!device.host_accessible()) {
      throw InvalidArgument("mpi: the all-gather moves host memory, and " + device.name() +
                            " memory is not; use the nccl communicator for it");
    }
    // Rank r's part lies at offset + r * slice_bytes: a part-sized type whose extent is a slice.
    SliceType part(bytes, slice_bytes);
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL,
                         static_cast<unsigned char*>(buffer) + offset, 1, part.get(),
                         MPI_COMM_WORLD, &req),
          "MPI_Iallgather");
    wait(req, "all-gather of a part of " + format_bytes(bytes * static_cast<std::uint64_t>(size_)));
  }

  void all_reduce_min(std::span<std::uint64_t> values) override { reduce(values, MPI_MIN); }
  void all_reduce_max(std::span<std::uint64_t> values) override { reduce(values, MPI_MAX); }

  void barrier() override {
    check_usable();
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Ibarrier(MPI_COMM_WORLD, &req), "MPI_Ibarrier");
    wait(req, "barrier");
  }

  void abort(const std::string& why) noexcept override {
    // MPI cannot tell the others without ending the job; they learn it from their timeout.
    if (failure_.empty()) failure_ = "mpi rank " + std::to_string(rank_) + " aborted: " + why;
    g_broken = true;
  }

 private:
  void reduce(std::span<std::uint64_t> values, MPI_Op op) {
    check_usable();
    if (values.size() > static_cast<std::size_t>(INT32_MAX)) {
      throw InvalidArgument("mpi: too many values to reduce");
    }
    MPI_Request req = MPI_REQUEST_NULL;
    check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_UINT64_T,
                         op, MPI_COMM_WORLD, &req),
          "MPI_Iallreduce");
    wait(req, "all-reduce");
  }

  void check_usable() const {
    if (!failure_.empty()) throw CommError(failure_);
  }

  void check(int rc, const char* what) {
    if (rc != MPI_SUCCESS) {
      failure_ =
          "mpi rank " + std::to_string(rank_) + ": " + what + " failed: " + mpi_error_text(rc);
      throw CommError(failure_);
    }
  }

  // Polls req until it completes; a short sleep after the first millisecond keeps a waiting
  // rank from taking a core from the ones still working.
  void wait(MPI_Request& req, const std::string& what) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout_;
    for (;;) {
      int done = 0;
      check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        g_broken = true;
        failure_ = "mpi rank " + std::to_string(rank_) + ": the " + what + " did not finish in " +
                   std::to_string(timeout_.count()) +
                   " ms: another rank failed or stopped answering";
        throw CommError(failure_);
      }
      if (now - start > std::chrono::milliseconds(1)) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  std::chrono::milliseconds timeout_;
  int rank_ = 0;
  int size_ = 1;
  std::string failure_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(std::chrono::milliseconds timeout) {
  return std::make_unique<MpiCommunicator>(timeout);
}

}  // namespace zeroflat
