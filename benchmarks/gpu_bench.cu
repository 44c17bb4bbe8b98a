// The GPU flatten against its ceilings and peers, measured side by side in one process (see
// docs/performance.md). Each row times zeroflat and the reference way on the same bytes, best of
// a few repetitions after a warm-up, with CUDA events on the device's stream:
//   model      the seed model's tensors (qwen3-30b-a3b at 4 and 32 layers), copy into an
//              allocated flat buffer and end to end (allocation included), against one
//              cudaMemcpyAsync device-to-device of the same bytes; every gather is verified
//   misaligned the same with every source 2 bytes off its 16-byte phase
//   kernel     gather kernel variants (unroll, cache hints) on the 32-layer model, kernel only
//   small      100,000 tensors of 4 KiB against a loop of per-tensor cudaMemcpyAsync
//   staged     gather into pinned host memory and copy back, against pinned D2H + H2D
//   size       one tensor of 1 MiB .. 4 GiB; count: 1 .. 100,000 tensors at 1 GiB
// Prints one JSON document on stdout (progress on stderr); --numels FILE also writes the model
// rows' tensor sizes for benchmarks/torch_cat_bench.py.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "device/cuda_check.h"
#include "device/cuda_device.h"
#include "device/cuda_gather.h"
#include "device/cuda_kernels.cuh"
#include "zeroflat/common.h"
#include "zeroflat/engine.h"
#include "zeroflat/layout.h"
#include "zeroflat/model.h"

namespace zeroflat::bench {
namespace {

#define BENCH_CHECK(call) ZEROFLAT_CUDA_CHECK("gpu_bench", call)

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
constexpr std::uint64_t kGiB = std::uint64_t{1} << 30;

// --- device helpers
// -------------------------------------------------------------------------------

__host__ __device__ inline unsigned char pattern(std::uint64_t i) {
  return static_cast<unsigned char>((i * 0x9E3779B97F4A7C15ull) >> 56);
}

// p[k] = pattern(base + k): each tensor holds the bytes it must have in the flat buffer.
__global__ void fill_kernel(unsigned char* p, std::uint64_t n, std::uint64_t base) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  for (std::uint64_t k = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; k < n; k += stride) {
    p[k] = pattern(base + k);
  }
}

// Counts bytes of flat[0, n) that differ from pattern(i) below data_bytes and from 0 above.
__global__ void verify_kernel(const unsigned char* flat, std::uint64_t n, std::uint64_t data_bytes,
                              unsigned long long* bad) {
  const std::uint64_t stride = std::uint64_t{gridDim.x} * blockDim.x;
  unsigned long long local = 0;
  for (std::uint64_t i = std::uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const unsigned char want = i < data_bytes ? pattern(i) : 0;
    local += flat[i] != want ? 1 : 0;
  }
  if (local != 0) atomicAdd(bad, local);
}

class Events {
 public:
  Events() {
    BENCH_CHECK(cudaEventCreate(&start_));
    BENCH_CHECK(cudaEventCreate(&stop_));
  }
  ~Events() {
    (void)cudaEventDestroy(start_);
    (void)cudaEventDestroy(stop_);
  }
  // Milliseconds from before fn to after it on stream (fn may synchronize itself).
  double time(cudaStream_t stream, const std::function<void()>& fn) {
    BENCH_CHECK(cudaEventRecord(start_, stream));
    fn();
    BENCH_CHECK(cudaEventRecord(stop_, stream));
    BENCH_CHECK(cudaEventSynchronize(stop_));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
};

struct CudaMemory {
  explicit CudaMemory(std::uint64_t n) : bytes(n) { BENCH_CHECK(cudaMalloc(&ptr, n == 0 ? 1 : n)); }
  ~CudaMemory() { (void)cudaFree(ptr); }
  CudaMemory(const CudaMemory&) = delete;
  CudaMemory& operator=(const CudaMemory&) = delete;
  unsigned char* data() const { return static_cast<unsigned char*>(ptr); }
  void* ptr = nullptr;
  std::uint64_t bytes = 0;
};

// --- JSON output
// ----------------------------------------------------------------------------------

struct Row {
  std::string group;  // model, misaligned, kernel, small, staged, size, count
  std::string name;
  std::uint64_t tensors = 0;
  std::uint64_t bytes = 0;
  double zeroflat_ms = 0;   // the zeroflat side
  double reference_ms = 0;  // the ceiling or peer
  std::string reference;    // what the reference is
  std::string target;       // "" when none
  int verified = -1;        // 1 yes, 0 no, -1 not checked
  std::vector<std::pair<std::string, double>> extra;
};

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

std::string to_json(const Row& r) {
  std::ostringstream o;
  o.precision(6);
  o << "{\"group\": \"" << r.group << "\", \"name\": \"" << json_escape(r.name)
    << "\", \"tensors\": " << r.tensors << ", \"bytes\": " << r.bytes
    << ", \"zeroflat_ms\": " << r.zeroflat_ms << ", \"reference_ms\": " << r.reference_ms
    << ", \"reference\": \"" << json_escape(r.reference)
    << "\", \"ratio\": " << (r.zeroflat_ms > 0 ? r.reference_ms / r.zeroflat_ms : 0.0)
    << ", \"target\": \"" << json_escape(r.target)
    << "\", \"verified\": " << (r.verified < 0 ? "null" : (r.verified ? "true" : "false"));
  for (const auto& [k, v] : r.extra) o << ", \"" << k << "\": " << v;
  o << "}";
  return o.str();
}

// --- the workload
// -----------------------------------------------------------------------------------

// Tensors of the given byte sizes in one arena, each at a 512-byte boundary (as the caching
// allocators place them) plus `shift`, filled so that tensor i holds pattern(flat offset + k).
struct Workload {
  std::vector<std::uint64_t> numels;  // bf16 elements
  Layout layout;
  std::unique_ptr<CudaMemory> arena;
  std::vector<TensorRef> params;
  std::vector<Segment> segments;
  std::uint64_t data_bytes = 0;  // bytes of parameters (contiguous at the start of flat)
  bool contiguous = true;        // flat offsets follow the input order without gaps
};

Workload make_workload(detail::CudaDevice& dev, std::vector<std::uint64_t> numels, std::uint64_t dp,
                       std::uint64_t shift) {
  Workload w;
  w.numels = std::move(numels);
  LayoutOptions options;
  options.dp = dp;
  w.layout = Layout::compute(w.numels, options);
  std::vector<std::uint64_t> at(w.numels.size());
  std::uint64_t end = 0;
  for (std::size_t i = 0; i < w.numels.size(); ++i) {
    at[i] = (end + 16 + 511) / 512 * 512;
    end = at[i] + w.numels[i] * 2;
  }
  w.arena = std::make_unique<CudaMemory>(end + 512);
  std::uint64_t expect = 0;
  for (std::size_t i = 0; i < w.numels.size(); ++i) {
    unsigned char* p = w.arena->data() + at[i] + shift;
    const std::uint64_t bytes = w.numels[i] * 2;
    const std::uint64_t flat_off = w.layout.offsets()[i] * 2;
    if (flat_off != expect) w.contiguous = false;
    expect += bytes;
    if (bytes > 0) {
      const unsigned blocks = static_cast<unsigned>(
          std::min<std::uint64_t>((bytes + 255) / 256, std::uint64_t{dev.gather_blocks()} * 4));
      fill_kernel<<<blocks, 256, 0, dev.stream()>>>(p, bytes, flat_off);
    }
    w.params.push_back(
        TensorRef{p, w.numels[i], {static_cast<std::int64_t>(w.numels[i])}, DType::kBF16, &dev});
  }
  BENCH_CHECK(cudaGetLastError());
  BENCH_CHECK(cudaStreamSynchronize(dev.stream()));
  w.data_bytes = expect;
  w.segments = gather_segments(w.layout, w.params, 0, w.layout.flat_bytes());
  return w;
}

int verify(detail::CudaDevice& dev, const Workload& w, const void* flat) {
  if (!w.contiguous) return -1;
  CudaMemory bad(sizeof(unsigned long long));
  BENCH_CHECK(cudaMemsetAsync(bad.ptr, 0, sizeof(unsigned long long), dev.stream()));
  verify_kernel<<<dev.gather_blocks() * 2, 256, 0, dev.stream()>>>(
      static_cast<const unsigned char*>(flat), w.layout.flat_bytes(), w.data_bytes,
      static_cast<unsigned long long*>(bad.ptr));
  BENCH_CHECK(cudaGetLastError());
  unsigned long long count = 0;
  BENCH_CHECK(cudaMemcpyAsync(&count, bad.ptr, sizeof count, cudaMemcpyDeviceToHost, dev.stream()));
  BENCH_CHECK(cudaStreamSynchronize(dev.stream()));
  if (count != 0) std::fprintf(stderr, "  VERIFY FAILED: %llu bytes differ\n", count);
  return count == 0 ? 1 : 0;
}

// Best of reps, after one warm-up call.
double best_of(int reps, const std::function<double()>& once) {
  (void)once();
  double best = 1e300;
  for (int i = 0; i < reps; ++i) best = std::min(best, once());
  return best;
}

// A gather kernel variant, launched on a prepared plan; times the kernel alone.
struct Variant {
  const char* name;
  void (*kernel)(const detail::gather::Plan);
};

template <int kU, bool kStreaming>
Variant variant(const char* name) {
  return Variant{name, &detail::gather_kernel<kU, kStreaming>};
}

double time_variant(detail::CudaDevice& dev, const Variant& v, const Workload& w, void* flat,
                    Events& ev, int reps) {
  int sms = 0;
  int per_sm = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.ordinal()));
  BENCH_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, v.kernel, static_cast<int>(detail::gather::kThreads), 0));
  const std::uint64_t n = w.layout.flat_bytes();
  const auto g = detail::gather::make_geometry(
      n, w.segments.size(), static_cast<std::uint64_t>(std::max(1, sms * per_sm)));
  std::vector<std::uint64_t> table(g.max_table_bytes / 8 + 2);
  const std::uint64_t used = detail::gather::build_table(table.data(), g, n, w.segments);
  CudaMemory d_table(used);
  BENCH_CHECK(cudaMemcpy(d_table.ptr, table.data(), used, cudaMemcpyHostToDevice));
  detail::gather::Plan plan;
  plan.dst = static_cast<unsigned char*>(flat);
  plan.num_bytes = n;
  plan.tile_bytes = g.tile_bytes;
  plan.num_tiles = g.num_tiles;
  plan.tile_first = static_cast<const std::uint64_t*>(d_table.ptr);
  plan.runs = reinterpret_cast<const detail::gather::Run*>(d_table.data() + g.runs_offset);
  return best_of(reps, [&] {
    return ev.time(dev.stream(), [&] {
      v.kernel<<<static_cast<unsigned>(g.num_blocks), detail::gather::kThreads, 0, dev.stream()>>>(
          plan);
      BENCH_CHECK(cudaGetLastError());
    });
  });
}

class Bench {
 public:
  explicit Bench(detail::CudaDevice& dev) : dev_(dev) {}

  std::vector<Row> rows;

  // Keeps a row, and shows it at once: a later failure must not lose the rows measured so far.
  void add(const Row& r) {
    rows.push_back(r);
    std::fprintf(stderr, "  %s\n", to_json(r).c_str());
  }

  double d2d(void* dst, const void* src, std::uint64_t n) {
    return ev_.time(dev_.stream(), [&] {
      BENCH_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, dev_.stream()));
    });
  }
  double gather(void* dst, const Workload& w) {
    return ev_.time(dev_.stream(), [&] { dev_.gather(dst, w.layout.flat_bytes(), w.segments); });
  }

  // The gather into flat against the D2D ceiling of the same bytes, alternating, best of reps;
  // then verified, with the library kernel's own time.
  Row copy_row(const std::string& group, const std::string& name, const Workload& w, void* flat,
               int reps, const std::string& target) {
    const std::uint64_t n = w.layout.flat_bytes();
    Row r;
    r.group = group;
    r.name = name;
    r.tensors = w.params.size();
    r.bytes = n;
    r.reference = "cudaMemcpyAsync D2D of one buffer";
    r.target = target;
    double best_g = 1e300;
    double best_m = 1e300;
    (void)gather(flat, w);
    (void)d2d(flat, w.arena->ptr, n);
    for (int i = 0; i < reps; ++i) {
      best_m = std::min(best_m, d2d(flat, w.arena->ptr, n));
      best_g = std::min(best_g, gather(flat, w));
    }
    r.zeroflat_ms = best_g;
    r.reference_ms = best_m;
    r.verified = verify(dev_, w, flat);
    const Variant lib = variant<detail::gather::kUnroll, false>("library");
    r.extra.push_back({"kernel_ms", time_variant(dev_, lib, w, flat, ev_, reps)});
    return r;
  }

  // Copy into an allocated flat buffer, alternating with the D2D ceiling; then end to end.
  void model_rows(const std::string& name, const std::string& group, Workload& w, int reps,
                  bool end_to_end, bool variants) {
    const std::uint64_t n = w.layout.flat_bytes();
    std::fprintf(stderr, "%s: %zu tensors, %s\n", name.c_str(), w.params.size(),
                 format_bytes(n).c_str());
    Row r;
    {
      DeviceBuffer flat(dev_, n);
      r = copy_row(group, name, w, flat.data(), reps,
                   group == "model" && n >= kGiB ? ">= 0.90" : "");
      const double best_m = r.reference_ms;
      add(r);
      if (variants) {
        const Variant all[] = {variant<2, false>("unroll 2"), variant<4, false>("unroll 4"),
                               variant<8, false>("unroll 8"),
                               variant<4, true>("unroll 4, streaming"),
                               variant<8, true>("unroll 8, streaming")};
        for (const Variant& v : all) {
          Row k;
          k.group = "kernel";
          k.name = name + ": " + v.name;
          k.tensors = r.tensors;
          k.bytes = n;
          k.zeroflat_ms = time_variant(dev_, v, w, flat.data(), ev_, reps);
          k.reference_ms = best_m;
          k.reference = r.reference;
          k.verified = verify(dev_, w, flat.data());
          add(k);
        }
      }
    }
    if (!end_to_end) return;
    // End to end: allocation of the flat buffer (the device's cudaMallocAsync) plus the gather,
    // against allocation plus one D2D copy. Each repetition releases the buffer first, so every
    // allocation maps fresh memory.
    Row e = r;
    e.name = name + ", end to end";
    e.reference = "allocate + cudaMemcpyAsync D2D";
    e.target = name.find("32 layers") != std::string::npos ? "< 25 ms" : "";
    e.extra.clear();
    const LayoutOptions options = w.layout.options();
    double alloc_best = 1e300;
    e.zeroflat_ms = best_of(reps, [&] {
      std::unique_ptr<FlatGroup> g;
      const double ms = ev_.time(dev_.stream(), [&] {
        g = std::make_unique<FlatGroup>(flatten_group(dev_, w.params, options));
      });
      e.verified = verify(dev_, w, g->flat.data());
      return ms;
    });
    e.reference_ms = best_of(reps, [&] {
      DeviceBuffer flat;
      const double ms = ev_.time(dev_.stream(), [&] {
        flat = DeviceBuffer(dev_, n);
        BENCH_CHECK(
            cudaMemcpyAsync(flat.data(), w.arena->ptr, n, cudaMemcpyDeviceToDevice, dev_.stream()));
      });
      return ms;
    });
    (void)best_of(reps, [&] {
      DeviceBuffer flat;
      const double ms = ev_.time(dev_.stream(), [&] { flat = DeviceBuffer(dev_, n); });
      alloc_best = std::min(alloc_best, ms);
      return ms;
    });
    e.extra.push_back({"allocate_ms", alloc_best});
    add(e);
  }

  void small_rows(std::uint64_t count, std::uint64_t tensor_bytes, int reps) {
    std::fprintf(stderr, "small: %llu tensors of %llu bytes\n",
                 static_cast<unsigned long long>(count),
                 static_cast<unsigned long long>(tensor_bytes));
    Workload w = make_workload(dev_, std::vector<std::uint64_t>(count, tensor_bytes / 2), 1, 0);
    const std::uint64_t n = w.layout.flat_bytes();
    DeviceBuffer flat(dev_, n);
    Row r;
    r.group = "small";
    r.name = std::to_string(count) + " tensors of " + format_bytes_binary(tensor_bytes);
    r.tensors = count;
    r.bytes = n;
    r.reference = "loop of per-tensor cudaMemcpyAsync";
    r.target = ">= 10";
    r.zeroflat_ms = best_of(reps, [&] { return gather(flat.data(), w); });
    r.verified = verify(dev_, w, flat.data());
    auto* out = static_cast<unsigned char*>(flat.data());
    r.reference_ms = best_of(std::max(1, reps / 2), [&] {
      return ev_.time(dev_.stream(), [&] {
        for (const Segment& s : w.segments) {
          BENCH_CHECK(cudaMemcpyAsync(out + s.dst_offset, s.src, s.num_bytes,
                                      cudaMemcpyDeviceToDevice, dev_.stream()));
        }
      });
    });
    r.extra.push_back({"d2d_ms", best_of(reps, [&] { return d2d(out, w.arena->ptr, n); })});
    add(r);
  }

  void staged_rows(const std::string& name, Workload& w, int reps) {
    const std::uint64_t n = w.layout.flat_bytes();
    std::fprintf(stderr, "staged: %s\n", format_bytes(n).c_str());
    DeviceBuffer flat(dev_, n);
    void* host = dev_.allocate_host(n);
    Row r;
    r.group = "staged";
    r.name = name + ": gather to pinned host, copy back";
    r.tensors = w.params.size();
    r.bytes = n;
    r.reference = "pinned cudaMemcpyAsync D2H + H2D";
    r.target = ">= 0.8";
    const double out_ms = best_of(reps, [&] { return gather(host, w); });
    const double back_ms = best_of(
        reps, [&] { return ev_.time(dev_.stream(), [&] { dev_.copy(flat.data(), host, n); }); });
    r.verified = verify(dev_, w, flat.data());
    const double d2h_ms = best_of(reps, [&] {
      return ev_.time(dev_.stream(), [&] {
        BENCH_CHECK(cudaMemcpyAsync(host, w.arena->ptr, n, cudaMemcpyDeviceToHost, dev_.stream()));
      });
    });
    const double h2d_ms = best_of(reps, [&] {
      return ev_.time(dev_.stream(), [&] {
        BENCH_CHECK(cudaMemcpyAsync(flat.data(), host, n, cudaMemcpyHostToDevice, dev_.stream()));
      });
    });
    r.zeroflat_ms = out_ms + back_ms;
    r.reference_ms = d2h_ms + h2d_ms;
    r.extra = {{"gather_to_host_ms", out_ms},
               {"copy_back_ms", back_ms},
               {"d2h_ms", d2h_ms},
               {"h2d_ms", h2d_ms}};
    add(r);
    dev_.release_host(host, n);
  }

  void size_row(const std::string& group, const std::string& name,
                std::vector<std::uint64_t> numels, int reps) {
    Workload w = make_workload(dev_, std::move(numels), 1, 0);
    const std::uint64_t n = w.layout.flat_bytes();
    DeviceBuffer flat(dev_, n);
    add(copy_row(group, name, w, flat.data(), reps, n >= kGiB ? ">= 0.90" : ""));
  }

 private:
  detail::CudaDevice& dev_;
  Events ev_;
};

std::vector<std::uint64_t> model_numels(std::uint64_t layers) {
  ModelOverrides o;
  o.layers = layers;
  return catalog_model("qwen3-30b-a3b", o).numels();
}

std::string numels_json(const std::vector<std::uint64_t>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(v[i]);
  }
  out += ']';
  return out;
}

int run(int argc, char** argv) {
  std::string numels_path;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--numels" && i + 1 < argc) {
      numels_path = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: gpu_bench [--quick] [--numels FILE]\n");
      return 2;
    }
  }
  std::unique_ptr<Device> owner = detail::make_cuda_device("cuda:0", {});
  auto& dev = static_cast<detail::CudaDevice&>(*owner);
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, dev.ordinal()));
  const MemoryInfo mem = dev.memory_info();
  std::fprintf(stderr, "%s: %s, %d SMs, %s free of %s, gather grid %u blocks\n", dev.name().c_str(),
               prop.name, prop.multiProcessorCount, format_bytes(mem.free_bytes).c_str(),
               format_bytes(mem.total_bytes).c_str(), dev.gather_blocks());

  const int reps = quick ? 2 : 5;
  Bench bench(dev);
  // The full 32-layer model needs its tensors and the flat buffer at once (2 x 41 GB); on a
  // smaller GPU the largest layer count that fits stands in, and says so.
  auto model_bytes = [](std::uint64_t layers) {
    std::uint64_t numel = 0;
    for (std::uint64_t x : model_numels(layers)) numel += x;
    return 2 * numel;
  };
  std::uint64_t big_layers = quick ? 2 : 32;
  while (big_layers > 1 && 2 * model_bytes(big_layers) + 2 * kGiB > mem.free_bytes) {
    big_layers = big_layers * 3 / 4;
  }
  const std::uint64_t small_layers = std::min<std::uint64_t>(4, big_layers);
  std::string numels_doc = "{";
  for (std::uint64_t layers : {small_layers, big_layers}) {
    std::vector<std::uint64_t> numels = model_numels(layers);
    numels_doc += std::string(numels_doc.size() > 1 ? ", " : "") + "\"qwen3-30b-a3b, " +
                  std::to_string(layers) + " layers\": " + numels_json(numels);
    Workload w = make_workload(dev, numels, 8, 0);
    const std::string name = "qwen3-30b-a3b, " + std::to_string(layers) + " layers";
    bench.model_rows(name, "model", w, reps, true, layers == big_layers);
    if (layers == small_layers) {
      bench.staged_rows(name, w, std::max(1, reps / 2));
      w = Workload{};
      Workload shifted = make_workload(dev, numels, 8, 2);
      bench.model_rows(name + ", sources 2 bytes off", "misaligned", shifted, reps, false, false);
    }
    if (small_layers == big_layers) break;
  }
  numels_doc += "}";

  bench.small_rows(quick ? 10'000 : 100'000, 4096, reps);
  for (std::uint64_t size : {kMiB, 16 * kMiB, 256 * kMiB, kGiB, 4 * kGiB}) {
    if (quick && size > 256 * kMiB) break;
    bench.size_row("size", "one tensor of " + format_bytes_binary(size), {size / 2},
                   size < 256 * kMiB ? 20 : reps);
  }
  const std::uint64_t total = quick ? 256 * kMiB : kGiB;
  for (std::uint64_t count : {1, 10, 100, 1000, 10'000, 100'000}) {
    const std::uint64_t each = total / count / 2;  // bf16 elements: odd byte offsets appear
    bench.size_row("count", std::to_string(count) + " tensors, " + format_bytes_binary(total),
                   std::vector<std::uint64_t>(count, each), reps);
  }

  std::printf(
      "{\"device\": \"%s\", \"card\": \"%s\", \"sms\": %d, \"gather_blocks\": %u, "
      "\"rows\": [\n",
      dev.name().c_str(), json_escape(prop.name).c_str(), prop.multiProcessorCount,
      dev.gather_blocks());
  for (std::size_t i = 0; i < bench.rows.size(); ++i) {
    std::printf("  %s%s\n", to_json(bench.rows[i]).c_str(), i + 1 < bench.rows.size() ? "," : "");
  }
  std::printf("]}\n");
  if (!numels_path.empty()) {
    if (FILE* f = std::fopen(numels_path.c_str(), "w")) {
      std::fputs(numels_doc.c_str(), f);
      std::fclose(f);
    }
  }
  for (const Row& r : bench.rows) {
    if (r.verified == 0) return 1;
  }
  return 0;
}

}  // namespace
}  // namespace zeroflat::bench

int main(int argc, char** argv) {
  try {
    return zeroflat::bench::run(argc, argv);
  } catch (const std::exception& e) {
    std::printf("{\"error\": \"%s\"}\n", zeroflat::bench::json_escape(e.what()).c_str());
    std::fprintf(stderr, "gpu_bench: %s\n", e.what());
    return 1;
  }
}
