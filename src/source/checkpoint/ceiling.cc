// The read ceiling: the same files' bytes read sequentially with the same threads (loader.h).
#include <algorithm>

#include "common/clock.h"
#include "source/checkpoint/files.h"
#include "zeroflat/common.h"
#include "zeroflat/loader.h"

namespace zeroflat {

using detail::Read;

ReadCeiling measure_read_ceiling(const CheckpointIndex& ck, std::uint64_t skip, std::uint64_t bytes,
                                 unsigned threads, bool cold, Device* device) {
  ReadCeiling out;
  // The checkpoint's data bytes (each file from its first tensor on), in file order, as one
  // sequence: [skip, skip + bytes) of it, wrapping around at its end.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> data;  // (start, length) per file
  std::uint64_t total = 0;
  for (std::uint32_t f = 0; f < ck.files.size(); ++f) {
    std::uint64_t start = ck.file_bytes[f];
    for (const CheckpointTensor& t : ck.tensors) {
      if (t.file == f) start = std::min(start, t.offset);
    }
    data.emplace_back(start, ck.file_bytes[f] - start);
    total += ck.file_bytes[f] - start;
  }
  bytes = std::min(bytes, total);
  std::vector<Read> reads;
  std::uint64_t at = total > 0 ? skip % total : 0;
  for (std::uint64_t done = 0; done < bytes;) {
    std::uint64_t base = 0;
    std::uint32_t f = 0;
    while (base + data[f].second <= at) base += data[f++].second;
    const std::uint64_t n = std::min(bytes - done, base + data[f].second - at);
    reads.push_back(Read{f, data[f].first + (at - base), n, done, DType::kBF16});
    done += n;
    at = (at + n) % total;
  }
  out.bytes = bytes;
  detail::OpenFiles files(ck);
  if (cold) {
    detail::drop_all_from_cache(files);
  }
  out.cached_fraction = detail::cached_fraction_of(ck, reads);
  out.page_cache = page_cache_word(out.cached_fraction);
  const std::uint64_t scratch_bytes = std::max<std::uint64_t>(out.bytes, 1);
  // Fresh memory, as the loader's buffer is: both pay its first touch. For a device the host
  // cannot write, pinned memory, then one copy of it all to the device.
  const bool to_device = device != nullptr && !device->host_accessible() && device->keeps_data();
  void* scratch =
      to_device ? device->allocate_host(scratch_bytes) : allocate_host_memory(scratch_bytes);
  void* on_device = nullptr;
  std::string error;
  try {
    if (to_device) on_device = device->allocate(scratch_bytes);
    detail::Reader reader(files, DType::kBF16, std::max(1u, threads), std::nullopt);
    const auto t0 = detail::Clock::now();
    reader.fill(static_cast<unsigned char*>(scratch), out.bytes, reads);
    if (reader.failed()) {
      try {
        reader.rethrow();
      } catch (const std::exception& e) {
        error = e.what();
      }
    } else if (to_device) {
      device->copy(on_device, scratch, out.bytes);
      device->synchronize();
    }
    out.seconds = detail::seconds_since(t0);
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (to_device) {
    device->release(on_device, scratch_bytes);
    device->release_host(scratch, scratch_bytes);
  } else {
    release_host_memory(scratch, scratch_bytes);
  }
  if (!error.empty()) throw Error(error);
  return out;
}

}  // namespace zeroflat
