// The `cuda:N` device.
#include <cuda_runtime.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <vector>

#include "device/cuda_check.h"
#include "device/cuda_device.h"
#include "device/cuda_gather.h"
#include "device/cuda_kernels.cuh"
#include "device/host_kernels.h"
#include "zeroflat/common.h"

#define ZEROFLAT_CHECK(call) ZEROFLAT_CUDA_CHECK(name_, call)

namespace zeroflat::detail {
namespace {

// Host bytes the checksum keeps in flight per window (two windows: one copying, one hashing).
constexpr std::uint64_t kChecksumWindowBytes = 16 * kChecksumChunkBytes;
constexpr std::uint64_t kMinTableBytes = std::uint64_t{64} << 10;

std::string bytes_text(std::uint64_t num_bytes) {
  return format_bytes(num_bytes) + " (" + std::to_string(num_bytes) + " bytes)";
}

std::string pointer_text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

bool ranges_overlap(const void* a, std::uint64_t a_bytes, const void* b, std::uint64_t b_bytes) {
  const auto a0 = reinterpret_cast<std::uintptr_t>(a);
  const auto b0 = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

// Pinned host memory for the duration of one call.
class PinnedBuffer {
 public:
  PinnedBuffer(const std::string& device, std::uint64_t num_bytes) {
    const cudaError_t err = cudaHostAlloc(&ptr_, num_bytes, cudaHostAllocDefault);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw OutOfMemory(device + ": cannot allocate " + bytes_text(num_bytes) +
                        " of pinned host memory for a checksum");
    }
    if (err != cudaSuccess) {
      throw_cuda_error(err, device, "cudaHostAlloc", __FILE__, __LINE__);
    }
  }
  ~PinnedBuffer() {
    if (ptr_ != nullptr) (void)cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  unsigned char* data() const noexcept { return static_cast<unsigned char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};

class Event {
 public:
  explicit Event(const std::string& device) {
    ZEROFLAT_CUDA_CHECK(device, cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~Event() {
    if (event_ != nullptr) (void)cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const noexcept { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

int parse_cuda_spec(std::string_view spec) {
  if (spec == "cuda") return 0;
  auto bad = [&] {
    return InvalidArgument("device '" + printable(spec) +
                           "': expected cuda or cuda:N with N a GPU index (0, 1, ...)");
  };
  constexpr std::string_view kPrefix = "cuda:";
  if (spec.substr(0, kPrefix.size()) != kPrefix) throw bad();
  const std::string_view index = spec.substr(kPrefix.size());
  if (index.empty() || index.size() > 4 ||
      !std::all_of(index.begin(), index.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    throw bad();
  }
  int ordinal = 0;
  std::from_chars(index.data(), index.data() + index.size(), ordinal);
  return ordinal;
}

}  // namespace

CudaDevice::CudaDevice(int ordinal, const DeviceOptions& options)
    : ordinal_(ordinal),
      name_("cuda:" + std::to_string(ordinal)),
      pool_(options.num_threads > 0 ? options.num_threads : default_num_threads()) {
  activate();
  cudaStream_t stream = nullptr;
  ZEROFLAT_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
  try {
    int pools = 0;
    ZEROFLAT_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ordinal_));
    use_pool_ = pools != 0;
    int sms = 0;
    ZEROFLAT_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal_));
    int per_sm = 0;
    ZEROFLAT_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, gather_kernel<gather::kUnroll, false>, static_cast<int>(gather::kThreads), 0));
    gather_blocks_ = static_cast<unsigned>(std::max(1, sms) * std::max(1, per_sm));
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    ZEROFLAT_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    total_bytes_ = total_bytes;
  } catch (...) {
    (void)cudaStreamDestroy(stream);
    throw;
  }
}

CudaDevice::~CudaDevice() {
  if (cudaSetDevice(ordinal_) == cudaSuccess) {
    (void)cudaStreamSynchronize(stream_);
    if (table_device_ != nullptr) (void)cudaFree(table_device_);
    if (table_host_ != nullptr) (void)cudaFreeHost(table_host_);
    (void)cudaStreamDestroy(stream_);
  }
  (void)cudaGetLastError();
}

void CudaDevice::activate() const {
  ZEROFLAT_CHECK(cudaSetDevice(ordinal_));
}

void* CudaDevice::allocate(std::uint64_t num_bytes) {
  auto oom = [&](const std::string& why) {
    return OutOfMemory(name_ + ": cannot allocate " + bytes_text(num_bytes) +
                       " of device memory: " + why);
  };
  // Refused before CUDA sees it: a size near 2^64 is not worth a driver round trip.
  if (num_bytes > total_bytes_) {
    throw oom("more than the GPU's " + format_bytes(total_bytes_));
  }
  activate();
  void* p = nullptr;
  const std::size_t size = num_bytes == 0 ? 1 : num_bytes;
  const cudaError_t err = use_pool_ ? cudaMallocAsync(&p, size, stream_) : cudaMalloc(&p, size);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    std::string why = cuda_error_text(err);
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      why += ", " + format_bytes(free_bytes) + " free of " + format_bytes(total_bytes);
    }
    (void)cudaGetLastError();
    throw oom(why);
  }
  if (err != cudaSuccess) {
    throw_cuda_error(err, name_, use_pool_ ? "cudaMallocAsync" : "cudaMalloc", __FILE__, __LINE__);
  }
  if (reinterpret_cast<std::uintptr_t>(p) % 64 != 0) {
    release(p, 0);
    throw InternalError(name_ + ": CUDA returned " + pointer_text(p) +
                        ", not aligned to 64 bytes as allocate() promises");
  }
  device_bytes_.add(num_bytes);
  return p;
}

void CudaDevice::release(void* ptr, std::uint64_t num_bytes) noexcept {
  if (ptr == nullptr) return;
  if (cudaSetDevice(ordinal_) == cudaSuccess) {
    if (use_pool_) {
      // The synchronize hands the memory back to the GPU now (the pool keeps nothing above its
      // release threshold, 0), so other allocators and memory_info() see it free on return.
      if (cudaFreeAsync(ptr, stream_) == cudaSuccess) (void)cudaStreamSynchronize(stream_);
    } else {
      (void)cudaFree(ptr);
    }
  }
  (void)cudaGetLastError();
  device_bytes_.sub(num_bytes);
}

void* CudaDevice::allocate_host(std::uint64_t num_bytes) {
  activate();
  void* p = nullptr;
  const std::size_t size = num_bytes == 0 ? 1 : num_bytes;
  const cudaError_t err = cudaHostAlloc(&p, size, cudaHostAllocMapped | cudaHostAllocPortable);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw OutOfMemory(name_ + ": cannot allocate " + bytes_text(num_bytes) +
                      " of pinned host memory: " + cuda_error_text(err));
  }
  if (err != cudaSuccess) throw_cuda_error(err, name_, "cudaHostAlloc", __FILE__, __LINE__);
  host_bytes_.add(num_bytes);
  return p;
}

void CudaDevice::release_host(void* ptr, std::uint64_t num_bytes) noexcept {
  if (ptr == nullptr) return;
  if (cudaSetDevice(ordinal_) == cudaSuccess) (void)cudaFreeHost(ptr);
  (void)cudaGetLastError();
  host_bytes_.sub(num_bytes);
}

void CudaDevice::copy(void* dst, const void* src, std::uint64_t num_bytes) {
  if (num_bytes == 0) return;
  if (dst == nullptr || src == nullptr) {
    throw InvalidArgument(name_ + ": copy of " + bytes_text(num_bytes) + " with a null " +
                          (dst == nullptr ? "destination" : "source"));
  }
  if (ranges_overlap(dst, num_bytes, src, num_bytes)) {
    throw InvalidArgument(name_ + ": copy of " + bytes_text(num_bytes) + " from " +
                          pointer_text(src) + " to " + pointer_text(dst) + ": the ranges overlap");
  }
  activate();
  ZEROFLAT_CHECK(cudaMemcpyAsync(dst, src, num_bytes, cudaMemcpyDefault, stream_));
  ZEROFLAT_CHECK(cudaStreamSynchronize(stream_));
}

unsigned char* CudaDevice::kernel_destination(void* dst, std::uint64_t num_bytes) const {
  const std::string what =
      name_ + ": gather destination " + pointer_text(dst) + " (" + bytes_text(num_bytes) + ")";
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, dst);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw InvalidArgument(what + ": CUDA does not know this pointer: " + cuda_error_text(err));
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != ordinal_) {
        throw InvalidArgument(what + " is memory of cuda:" + std::to_string(attr.device));
      }
      return static_cast<unsigned char*>(dst);
    case cudaMemoryTypeManaged:
      return static_cast<unsigned char*>(dst);
    case cudaMemoryTypeHost:
      if (attr.devicePointer == nullptr) {
        throw InvalidArgument(what +
                              " is pinned host memory the GPU cannot address (not mapped): "
                              "take staging memory from allocate_host()");
      }
      return static_cast<unsigned char*>(attr.devicePointer);
    default:
      throw InvalidArgument(what +
                            " is pageable host memory, which the GPU cannot write: take "
                            "staging memory from allocate_host()");
  }
}

void CudaDevice::check_readable(const void* src, std::size_t index) const {
  const std::string what =
      name_ + ": gather segment " + std::to_string(index) + " source " + pointer_text(src);
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, src);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw InvalidArgument(what + ": CUDA does not know this pointer: " + cuda_error_text(err));
  }
  const bool ok = (attr.type == cudaMemoryTypeDevice && attr.device == ordinal_) ||
                  attr.type == cudaMemoryTypeManaged ||
                  (attr.type == cudaMemoryTypeHost && attr.devicePointer == src);
  if (!ok) {
    throw InvalidArgument(what + " is not memory of this GPU (" +
                          (attr.type == cudaMemoryTypeDevice
                               ? "it is cuda:" + std::to_string(attr.device) + "'s"
                               : std::string("it is host memory the GPU cannot read")) +
                          ")");
  }
}

void CudaDevice::reserve_table(std::uint64_t num_bytes) {
  if (num_bytes <= table_capacity_) return;
  const std::uint64_t capacity = std::max({num_bytes, 2 * table_capacity_, kMinTableBytes});
  (void)cudaStreamSynchronize(stream_);
  if (table_device_ != nullptr) (void)cudaFree(table_device_);
  if (table_host_ != nullptr) (void)cudaFreeHost(table_host_);
  table_device_ = nullptr;
  table_host_ = nullptr;
  table_capacity_ = 0;
  const std::string what = "the gather's table of " + bytes_text(capacity);
  cudaError_t err = cudaHostAlloc(&table_host_, capacity, cudaHostAllocDefault);
  if (err == cudaSuccess) {
    err = cudaMalloc(&table_device_, capacity);
    if (err != cudaSuccess) {
      (void)cudaFreeHost(table_host_);
      table_host_ = nullptr;
    }
  } else {
    table_host_ = nullptr;
  }
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    throw OutOfMemory(name_ + ": cannot allocate " + what);
  }
  if (err != cudaSuccess) throw_cuda_error(err, name_, what.c_str(), __FILE__, __LINE__);
  table_capacity_ = capacity;
}

void CudaDevice::gather(void* dst, std::uint64_t num_bytes, std::span<const Segment> segments) {
  check_gather_segments(dst, num_bytes, segments);
  if (num_bytes == 0) return;
  activate();
  unsigned char* const out = kernel_destination(dst, num_bytes);
  // A kernel that reads a pointer the GPU cannot address kills the whole CUDA context, so the
  // cheap part of the source check is worth it: a group handed over from the wrong device is
  // caught by its first tensor.
  const auto first = std::find_if(segments.begin(), segments.end(),
                                  [](const Segment& s) { return s.num_bytes > 0; });
  if (first != segments.end()) {
    check_readable(first->src, static_cast<std::size_t>(first - segments.begin()));
    const auto last = std::find_if(segments.rbegin(), segments.rend(),
                                   [](const Segment& s) { return s.num_bytes > 0; });
    if (&*last != &*first) {
      check_readable(last->src, static_cast<std::size_t>(segments.rend() - last - 1));
    }
  }

  std::lock_guard<std::mutex> lock(gather_mutex_);
  const gather::Geometry g = gather::make_geometry(num_bytes, segments.size(), gather_blocks_);
  reserve_table(g.max_table_bytes);
  const std::uint64_t used = gather::build_table(table_host_, g, num_bytes, segments);
  ZEROFLAT_CHECK(
      cudaMemcpyAsync(table_device_, table_host_, used, cudaMemcpyHostToDevice, stream_));
  gather::Plan plan;
  plan.dst = out;
  plan.num_bytes = num_bytes;
  plan.tile_bytes = g.tile_bytes;
  plan.num_tiles = g.num_tiles;
  plan.tile_first = static_cast<const std::uint64_t*>(table_device_);
  plan.runs = reinterpret_cast<const gather::Run*>(
      static_cast<const unsigned char*>(table_device_) + g.runs_offset);
  gather_kernel<gather::kUnroll, false>
      <<<static_cast<unsigned>(g.num_blocks), gather::kThreads, 0, stream_>>>(plan);
  ZEROFLAT_CHECK(cudaGetLastError());
  // Returning only when the bytes are in place keeps the contract simple: the sources may be
  // released and a host destination read as soon as gather() returns.
  ZEROFLAT_CHECK(cudaStreamSynchronize(stream_));
}

void CudaDevice::upcast_to_fp32(float* dst, const void* src, DType dtype, std::uint64_t numel) {
  if (numel == 0) return;
  const std::uint64_t esize = element_size(dtype);
  if (dst == nullptr || src == nullptr) {
    throw InvalidArgument(name_ + ": up-cast of " + std::to_string(numel) +
                          " elements with a null " + (dst == nullptr ? "destination" : "source"));
  }
  if (numel > (~std::uint64_t{0}) / 4 || ranges_overlap(dst, numel * 4, src, numel * esize)) {
    throw InvalidArgument(name_ + ": up-cast of " + std::to_string(numel) +
                          " elements: the destination overlaps the source");
  }
  // A misaligned element access would kill the CUDA context; refuse it here instead.
  if (reinterpret_cast<std::uintptr_t>(src) % esize != 0 ||
      reinterpret_cast<std::uintptr_t>(dst) % 4 != 0) {
    throw InvalidArgument(name_ + ": up-cast from " + pointer_text(src) + " (" +
                          std::string(dtype_name(dtype)) + ") to " + pointer_text(dst) +
                          " (fp32): pointers must be aligned to their element size");
  }
  activate();
  constexpr unsigned kBlock = 256;
  const std::uint64_t wanted = gather::ceil_div(numel, kBlock);
  const unsigned blocks =
      static_cast<unsigned>(std::min<std::uint64_t>(wanted, std::uint64_t{gather_blocks_} * 4));
  switch (dtype) {
    case DType::kBF16:
      upcast_kernel<kUpcastBF16><<<blocks, kBlock, 0, stream_>>>(dst, src, numel);
      break;
    case DType::kFP16:
      upcast_kernel<kUpcastFP16><<<blocks, kBlock, 0, stream_>>>(dst, src, numel);
      break;
    case DType::kFP32:
      upcast_kernel<kUpcastFP32><<<blocks, kBlock, 0, stream_>>>(dst, src, numel);
      break;
  }
  ZEROFLAT_CHECK(cudaGetLastError());
  ZEROFLAT_CHECK(cudaStreamSynchronize(stream_));
}

std::uint64_t CudaDevice::checksum(const void* ptr, std::uint64_t num_bytes) {
  const std::uint64_t chunks = gather::ceil_div(num_bytes, kChecksumChunkBytes);
  std::vector<std::uint64_t> digests(chunks);
  if (num_bytes > 0) {
    if (ptr == nullptr) {
      throw InvalidArgument(name_ + ": checksum of " + bytes_text(num_bytes) + " at null");
    }
    activate();
    const auto* p = static_cast<const unsigned char*>(ptr);
    const std::uint64_t window = std::min(kChecksumWindowBytes, chunks * kChecksumChunkBytes);
    const std::uint64_t windows = gather::ceil_div(num_bytes, window);
    PinnedBuffer buffers[2] = {PinnedBuffer(name_, window),
                               PinnedBuffer(name_, windows > 1 ? window : 1)};
    Event done[2] = {Event(name_), Event(name_)};
    auto issue = [&](std::uint64_t w) {
      const std::uint64_t off = w * window;
      const std::uint64_t len = std::min(window, num_bytes - off);
      ZEROFLAT_CHECK(
          cudaMemcpyAsync(buffers[w % 2].data(), p + off, len, cudaMemcpyDefault, stream_));
      ZEROFLAT_CHECK(cudaEventRecord(done[w % 2].get(), stream_));
    };
    try {
      issue(0);
      for (std::uint64_t w = 0; w < windows; ++w) {
        // The other buffer was hashed in the previous round: refill it while this one hashes.
        if (w + 1 < windows) issue(w + 1);
        ZEROFLAT_CHECK(cudaEventSynchronize(done[w % 2].get()));
        const unsigned char* host = buffers[w % 2].data();
        const std::uint64_t off = w * window;
        const std::uint64_t len = std::min(window, num_bytes - off);
        const std::uint64_t first_chunk = off / kChecksumChunkBytes;
        const std::uint64_t count = gather::ceil_div(len, kChecksumChunkBytes);
        std::lock_guard<std::mutex> lock(pool_mutex_);
        pool_.run([&](unsigned t) {
          const Range r = split_range(count, pool_.size(), t, 1);
          for (std::uint64_t c = r.begin; c < r.end; ++c) {
            const std::uint64_t at = c * kChecksumChunkBytes;
            digests[first_chunk + c] =
                checksum_chunk(host + at, std::min(kChecksumChunkBytes, len - at));
          }
        });
      }
    } catch (...) {
      // No copy may still be writing a buffer when it is freed.
      (void)cudaStreamSynchronize(stream_);
      throw;
    }
  }
  return checksum_combine(digests, num_bytes);
}

MemoryInfo CudaDevice::memory_info() {
  activate();
  ZEROFLAT_CHECK(cudaStreamSynchronize(stream_));
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  ZEROFLAT_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  MemoryInfo info;
  info.total_bytes = total_bytes;
  info.free_bytes = free_bytes;
  info.allocated_bytes = device_bytes_.current();
  info.peak_allocated_bytes = device_bytes_.peak();
  info.host_allocated_bytes = host_bytes_.current();
  info.peak_host_allocated_bytes = host_bytes_.peak();
  return info;
}

ProbeResult CudaDevice::probe_memory(const ProbeContext& context) {
  CudaProbeSources sources = system_cuda_sources();
  sources.process_allocated_bytes = device_bytes_.current() + context.framework_held_bytes;
  sources.framework_cached_free_bytes = context.framework_cached_free_bytes;
  return probe_cuda(ordinal_, sources);
}

void CudaDevice::synchronize() {
  activate();
  ZEROFLAT_CHECK(cudaStreamSynchronize(stream_));
}

std::unique_ptr<Device> make_cuda_device(std::string_view spec, const DeviceOptions& options) {
  const int ordinal = parse_cuda_spec(spec);
  const std::string name = "cuda:" + std::to_string(ordinal);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw Unsupported(name + ": no usable GPU: cudaGetDeviceCount failed: " + cuda_error_text(err));
  }
  if (count <= 0) {
    throw Unsupported(name +
                      ": no usable GPU: the CUDA runtime sees none (is CUDA_VISIBLE_DEVICES "
                      "empty?)");
  }
  if (ordinal >= count) {
    throw InvalidArgument("device '" + printable(spec) + "': this process sees " +
                          std::to_string(count) + (count == 1 ? " GPU" : " GPUs") +
                          ", cuda:0 to cuda:" + std::to_string(count - 1));
  }
  return std::make_unique<CudaDevice>(ordinal, options);
}

}  // namespace zeroflat::detail
