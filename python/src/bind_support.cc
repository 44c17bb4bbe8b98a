// The shared parts of zeroflat._C (bind.h): host memory as torch tensors, the error classes'
// slots, type conversions.
#include "bind.h"

namespace zeroflat_python {

PyErrors errors;

// A uint8 tensor over zeroflat's own host memory (fresh 2 MiB-aligned mappings: its first touch
// is the gather's, by every thread of the team on its own byte range), freed by torch when the
// last tensor over it goes. Not advised for huge pages unless ZEROFLAT_HOST_MEMORY=huge: in
// fresh processes under DeepSpeed (benchmarks/deepspeed_init_bench.py, docs/performance.md)
// the advice made initialize slower than DeepSpeed's own at one rank, where the kernel compacts
// memory on the advised buffer's faults; ZEROFLAT_HOST_MEMORY=torch takes torch's allocator.

// `fallback`: where they come from when ZEROFLAT_HOST_MEMORY does not say (none: plain).
at::Tensor host_tensor(std::uint64_t num_bytes,
                       std::optional<zf::RuntimeEnv::HostMemory> fallback) {
  const std::uint64_t n = num_bytes == 0 ? 1 : num_bytes;
  const std::optional<zf::RuntimeEnv::HostMemory> m =
      zf::runtime_env().host_memory ? zf::runtime_env().host_memory : fallback;
  if (m == zf::RuntimeEnv::HostMemory::kTorch) {
    return at::empty({static_cast<std::int64_t>(n)},
                     at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  }
  void* p = zf::allocate_host_memory(n, m == zf::RuntimeEnv::HostMemory::kHuge);
  return at::from_blob(
      p, {static_cast<std::int64_t>(n)}, [n](void* q) { zf::release_host_memory(q, n); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

py::object parse_json(const std::string& text) {
  return py::module_::import("json").attr("loads")(text);
}

at::ScalarType scalar_type_of(zf::DType d) {
  switch (d) {
    case zf::DType::kBF16:
      return at::kBFloat16;
    case zf::DType::kFP16:
      return at::kHalf;
    case zf::DType::kFP32:
      return at::kFloat;
  }
  return at::kByte;
}

// zeroflat's element type of a torch tensor's (bf16, fp16, fp32), or none for any other.
std::optional<zf::DType> dtype_of(at::ScalarType t) {
  for (zf::DType d : {zf::DType::kBF16, zf::DType::kFP16, zf::DType::kFP32}) {
    if (t == scalar_type_of(d)) return d;
  }
  return std::nullopt;
}

// What upcast and clone read: the tensor's bytes from data_ptr(), so it must be a dense host
// tensor.
void check_host_source(const at::Tensor& src, const char* what) {
  if (!src.device().is_cpu() || !src.is_contiguous() || src.is_sparse()) {
    throw zf::InvalidArgument(std::string(what) + ": a contiguous CPU tensor, not " +
                              src.toString() + " on " + src.device().str());
  }
}

}  // namespace zeroflat_python
