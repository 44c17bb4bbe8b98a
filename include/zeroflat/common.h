// The vocabulary every part of zeroflat speaks: its errors, element types, tensor references,
// sizes and counts as text, the checksum, a rank's read progress, and the process's runtime
// facts (cores, thread counts, and every ZEROFLAT_* variable, read in one place).
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace zeroflat {

// --- Errors --------------------------------------------------------------------------------------
// Exception hierarchy of zeroflat: every failure the library reports is a zeroflat::Error.

// Root of all zeroflat exceptions. what() says what was expected, what was found, and where
// (which parameter, rank or step).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The caller passed a value outside the documented domain. Nothing was touched.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A device or host allocation failed.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// The request is valid but this build or this device cannot serve it.
class Unsupported : public Error {
 public:
  using Error::Error;
};

// The system refused a resource zeroflat needs that is not device memory: a host thread (a
// process or memory limit), a file descriptor. Whatever had been started was stopped first.
class ResourceExhausted : public Error {
 public:
  using Error::Error;
};

// A collective failed or timed out, or a peer rank disappeared.
class CommError : public Error {
 public:
  using Error::Error;
};

// A broken invariant inside zeroflat: a bug, please report it.
class InternalError : public Error {
 public:
  using Error::Error;
};

// The system failed a write, an fsync or a rename (no space, an I/O error, a permission): the
// message names the file and the step; code() is the errno.
class IoError : public Error {
 public:
  IoError(const std::string& what, int code) : Error(what), code_(code) {}
  int code() const noexcept { return code_; }

 private:
  int code_;
};

// --- Element types -------------------------------------------------------------------------------
// Element types of a parameter group and their sizes.

enum class DType : std::uint8_t { kBF16, kFP16, kFP32 };

// Bytes per element: 2 for bf16 and fp16, 4 for fp32.
std::uint32_t element_size(DType dtype) noexcept;

// "bf16", "fp16", "fp32".
std::string_view dtype_name(DType dtype) noexcept;

// Accepts the names above and the aliases "bfloat16", "float16", "half", "float32", "float".
std::optional<DType> try_parse_dtype(std::string_view text) noexcept;

// As try_parse_dtype; throws InvalidArgument naming the text and the accepted names.
DType parse_dtype(std::string_view text);

// Whether wide[0, numel) holds, bit for bit, the fp32 values of the numel elements of `dtype` at
// `narrow` (what up-casting them would write): -0.0 is not 0.0 here, and a NaN matches only the
// up-cast of its own bits. One pass over both, no temporary the size of either.
bool holds_upcast(const float* wide, const void* narrow, DType dtype, std::uint64_t numel) noexcept;

// --- Tensor references ---------------------------------------------------------------------------
// A non-owning reference to a tensor's memory: pointer, element count, shape, dtype, device.

class Device;

using Shape = std::vector<std::int64_t>;

// Product of the dimensions (1 for a scalar shape {}). Throws InvalidArgument on a negative
// dimension or when the product overflows 64 bits.
std::uint64_t shape_numel(std::span<const std::int64_t> shape);

// "[4096, 2048]".
std::string shape_to_string(std::span<const std::int64_t> shape);

// A view of numel contiguous elements of dtype at data, on device. Does not own the memory.
// data may be null only when numel is 0. data may have any alignment that the dtype allows
// (zeroflat never assumes more than element alignment).
struct TensorRef {
  void* data = nullptr;
  std::uint64_t numel = 0;
  Shape shape;
  DType dtype = DType::kBF16;
  Device* device = nullptr;

  std::uint64_t num_bytes() const noexcept;
};

// --- Sizes, counts and text ----------------------------------------------------------------------
// Parsing and printing of sizes, counts and durations as the command line accepts and shows
// them, and text for messages: lists, and names from untrusted files made safe to print.

// Plain bytes ("1048576") or a number with a unit: B, KB/MB/GB/TB/PB/EB (powers of 1000),
// KiB/MiB/GiB/TiB/PiB/EiB (powers of 1024), case-insensitive (every unit format_bytes prints);
// fractions allowed ("1.5GB"). The result must be a whole number of bytes that fits in 64 bits.
// Throws InvalidArgument naming the text.
std::uint64_t parse_size(std::string_view text);
// The same, the error also naming what the size is for (an option: "--margin").
std::uint64_t parse_size(std::string_view text, std::string_view what);

// A non-negative decimal integer that fits in 64 bits; what names the value in the error.
std::uint64_t parse_u64(std::string_view text, std::string_view what);

// "1.43 GB" (powers of 1000, three significant digits) and "1.33 GiB" (powers of 1024).
std::string format_bytes(std::uint64_t num_bytes);
std::string format_bytes_binary(std::uint64_t num_bytes);

// "20,562,192,384".
std::string format_count(std::uint64_t count);

// "50 us", "3.1 ms", "70.83 s": whole microseconds below 1 ms, tenths of a millisecond below
// 1 s, hundredths of a second above.
std::string format_seconds(double seconds);

// "a, b, c".
std::string join(const std::vector<std::string>& items, std::string_view separator = ", ");

// Text from an untrusted source, safe to print on a terminal or in a message: printable ASCII
// only (every other byte becomes '?'), at most max_chars characters, then "...".
std::string printable(std::string_view text, std::size_t max_chars = 80);

// --- The checksum --------------------------------------------------------------------------------
// The zeroflat checksum: a 64-bit hash of a byte range that is independent of thread count and
// device.
//
// Definition: split the bytes into chunks of kChecksumChunkBytes (the last one shorter), hash
// each chunk with XXH3-64 (seed 0), then hash with XXH3-64 (seed 0) the little-endian 8-byte
// total length followed by the little-endian chunk digests. Chunks are independent, so any number
// of threads (or a GPU) computes the same value.

inline constexpr std::uint64_t kChecksumChunkBytes = std::uint64_t{1} << 22;  // 4 MiB

// XXH3-64 of one chunk.
std::uint64_t checksum_chunk(const void* data, std::uint64_t num_bytes) noexcept;

// Combines the chunk digests of a range of total_bytes bytes into its checksum.
std::uint64_t checksum_combine(std::span<const std::uint64_t> chunk_digests,
                               std::uint64_t total_bytes);

// The checksum of a host range, computed on the calling thread.
std::uint64_t checksum_serial(const void* data, std::uint64_t num_bytes);

// 16 lowercase hex digits.
std::string checksum_hex(std::uint64_t checksum);

// --- Read progress -------------------------------------------------------------------------------
// Progress of a rank's reads, for the caller's display: the loader counts, the caller watches
// from another thread, and every display (the CLI's, the Python package's) words it the same way.

// Shared by a load (or several, one after the other: a resume reads many) and whoever watches
// it. Every count only grows; read them from any thread while the load runs.
struct ReadProgress {
  // The caller's own estimate of every byte this rank will read over the loads that share this
  // object (0: unknown). The display's total is the larger of it and `planned`.
  std::atomic<std::uint64_t> expected{0};
  // File bytes the loads have planned so far: each adds its rank's reads when it starts them.
  std::atomic<std::uint64_t> planned{0};
  // File bytes read so far (whole pieces of at most 8 MiB, as each one lands).
  std::atomic<std::uint64_t> done{0};

  std::uint64_t total() const noexcept {
    const std::uint64_t e = expected.load(std::memory_order_relaxed);
    const std::uint64_t p = planned.load(std::memory_order_relaxed);
    return e > p ? e : p;
  }
};

// One progress line, the same words everywhere: "read 1.2 GB of 2.7 GB (44%), 850 MB/s, about
// 2 s left" (rate and time left once anything was read; "of ..." once a total is known).
std::string describe_progress(std::uint64_t done, std::uint64_t total, double seconds);

// --- Runtime facts -------------------------------------------------------------------------------
// Process-wide runtime facts: cores, ranks on this host, thread counts, ZEROFLAT_* variables.
//
// Every environment variable zeroflat reads is read here, once (docs/environment.md lists them).

// The most host threads a rank may be given (ZEROFLAT_NUM_THREADS, --threads).
inline constexpr unsigned kMaxThreads = 1024;

struct RuntimeEnv {
  // ZEROFLAT_NUM_THREADS: host threads per rank, overriding the default.
  std::optional<unsigned> num_threads;
  // ZEROFLAT_LOCAL_RANKS, else the launcher's count of ranks on this host
  // (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, LOCAL_WORLD_SIZE).
  std::optional<unsigned> local_ranks;
  // ZEROFLAT_HOST_MEMORY: where large host buffers come from. "huge": fresh 2 MiB-aligned
  // mappings advised for transparent huge pages; "plain": the same without the advice (a kernel
  // whose THP defrag is "madvise" compacts memory on every fault of an advised buffer); "torch":
  // in the Python binding, torch's own allocator, as DeepSpeed's buffers (the library itself
  // then allocates as "plain"). None: the default of each caller (HostMemory below).
  enum class HostMemory : std::uint8_t { kHuge, kPlain, kTorch };
  std::optional<HostMemory> host_memory;
  // ZEROFLAT_READ_AHEAD: how a checkpoint's files are read ahead. "exact" (the default): the
  // kernel's own read-ahead off (POSIX_FADV_RANDOM) and the reader asking ahead for exactly the
  // pieces it will read next (POSIX_FADV_WILLNEED), so that a rank reads its bytes and no
  // others (the files no other rank of a load reads keep the kernel's read-ahead: there it
  // reads nothing another rank needs); "kernel": the kernel's read-ahead, which reads past the
  // end of each run of a rank's bytes into another rank's (off only for a rank's many short
  // runs).
  enum class ReadAhead : std::uint8_t { kExact, kKernel };
  ReadAhead read_ahead = ReadAhead::kExact;
  // ZEROFLAT_GATHER_PARTS: the most parts a rank's read of its slice is split into, each
  // all-gathered while the next is read (ExecuteOptions::gather_parts; 1: read, then gather).
  std::optional<unsigned> gather_parts;
  // ZEROFLAT_SAVE_IO: how a save writes the staged bytes of its large records. "direct" (the
  // default): each record's whole 4 KiB pages from its staged bytes with O_DIRECT (no copy into
  // the page cache: the disk's DMA reads the staging), its first and last partial pages and
  // every small record through the page cache, and all of it through the page cache where the
  // file system refuses O_DIRECT; "buffered": all of it through the page cache.
  enum class SaveIo : std::uint8_t { kDirect, kBuffered };
  SaveIo save_io = SaveIo::kDirect;
  // ZEROFLAT_TEST_SAVE_FAULT: for tests only, a fault the checkpoint publication acts on
  // ("<step>:<kind>", save.h); empty when unset.
  std::string save_fault;
};

// A HostMemory by its name ("huge", "plain", "torch"); none for any other text.
std::optional<RuntimeEnv::HostMemory> parse_host_memory(const std::string& name);

// The environment as read at first call. Throws InvalidArgument naming the variable when one is
// set to something other than a positive integer (every later call throws the same).
const RuntimeEnv& runtime_env();

// The GPUs this process may see, as the launcher or container runtime wrote them:
// CUDA_VISIBLE_DEVICES, else NVIDIA_VISIBLE_DEVICES (container runtimes often set only that).
// Indices or GPU-/MIG- UUIDs; the probe never parses them as integers.
struct VisibleDevices {
  std::string value;     // empty when neither is set
  std::string variable;  // which of the two it came from
};
VisibleDevices visible_devices();

// The Hugging Face hub cache directory, found as huggingface_hub finds it: HF_HUB_CACHE, else
// HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else
// HOME/.cache/huggingface/hub. Empty when none of them is set. Only read: nothing is downloaded.
std::string hf_hub_cache();

// Cores this process may run on: its CPU affinity mask, capped by its cgroup's CPU quota;
// at least 1.
unsigned available_cores() noexcept;

// Threads each rank uses for host work: ZEROFLAT_NUM_THREADS if set, else the available cores
// divided by the ranks sharing this host (local_ranks if > 0, else runtime_env().local_ranks,
// else 1), at least 1. Ranks on one host then never oversubscribe its cores.
unsigned default_num_threads(unsigned local_ranks = 0);

}  // namespace zeroflat
