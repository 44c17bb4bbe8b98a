// What the files of zeroflat._C share: the device over torch's allocator (TorchDevice), the
// communicator over torch.distributed (PyCommunicator), zeroflat's Python error classes, the
// conversions between torch's and zeroflat's types, and each bound area's entry point. The module
// is cut along the library's areas, one file each: binding.cc (the module, errors, the
// environment), bind_device.cc, bind_checkpoint.cc (checkpoint.h), bind_options.cc,
// bind_loads.cc (the front doors: engine.h, loader.h, dtensor.h), bind_layouts.cc
// (layout.h), bind_deepspeed.cc (DeepSpeed and DCP checkpoints, the resume), bind_save.cc
// (save.h: publishing a checkpoint).
// Only the public API is used, and, in bind_deepspeed.cc, the library's private torch.save
// reader, whose saved states the binding makes Python values of.
#pragma once

#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/zeroflat.h"

namespace zeroflat_python {

namespace py = pybind11;
namespace zf = zeroflat;

// A uint8 tensor over zeroflat's own host memory (fresh 2 MiB-aligned mappings: its first touch
// is the gather's, by every thread of the team on its own byte range), freed by torch when the
// last tensor over it goes. Not advised for huge pages unless ZEROFLAT_HOST_MEMORY=huge: in
// fresh processes under DeepSpeed (benchmarks/deepspeed_init_bench.py, docs/performance.md)
// the advice made initialize slower than DeepSpeed's own at one rank, where the kernel compacts
// memory on the advised buffer's faults; ZEROFLAT_HOST_MEMORY=torch takes torch's allocator.

// `fallback`: where they come from when ZEROFLAT_HOST_MEMORY does not say (none: plain).
at::Tensor host_tensor(std::uint64_t num_bytes,
                       std::optional<zf::RuntimeEnv::HostMemory> fallback = std::nullopt);

// Device memory from torch's allocator (on the CPU, tensors over zeroflat's host memory), kept
// alive here until released; everything else (the gather, copies, up-casts, checksums, host
// staging) on zeroflat's device of the same kind.
class TorchDevice final : public zf::Device {
 public:
  // host_memory: where this device's host buffers come from unless ZEROFLAT_HOST_MEMORY says
  // ("torch": torch's allocator, which hands back memory the process already has, as
  // DeepSpeed's own tensors; "plain", "huge"); none: plain.
  TorchDevice(const std::string& device, unsigned threads,
              std::optional<std::string> host_memory = std::nullopt)
      : device_(device) {
    if (host_memory) {
      host_memory_ = zf::parse_host_memory(*host_memory);
      if (!host_memory_) {
        throw zf::InvalidArgument("host_memory '" + *host_memory +
                                  "': expected torch, plain or huge (none: the environment's)");
      }
    }
    const std::string spec = device_.is_cpu() ? "cpu" : "cuda:" + std::to_string(device_.index());
    inner_ = zf::make_device(spec, zf::DeviceOptions{threads});
  }

  std::string name() const override { return inner_->name(); }
  bool host_accessible() const noexcept override { return inner_->host_accessible(); }

  void* allocate(std::uint64_t num_bytes) override {
    {
      // A buffer the caller lent (adopt) serves the first allocation of exactly its size.
      std::lock_guard<std::mutex> lock(mutex_);
      if (adopted_.defined() && static_cast<std::uint64_t>(adopted_.nbytes()) == num_bytes &&
          num_bytes > 0) {
        at::Tensor t = std::move(adopted_);
        adopted_ = at::Tensor();
        void* p = t.data_ptr();
        tensors_[p] = std::move(t);
        add(num_bytes);
        return p;
      }
    }
    at::Tensor t;
    try {
      t = device_.is_cpu() ? host_tensor(num_bytes, host_memory_)
                           : at::empty({static_cast<std::int64_t>(num_bytes == 0 ? 1 : num_bytes)},
                                       at::TensorOptions().dtype(at::kByte).device(device_));
    } catch (const c10::Error& e) {
      throw zf::OutOfMemory(name() + ": torch could not allocate " + std::to_string(num_bytes) +
                            " bytes: " + e.what_without_backtrace());
    }
    void* p = t.data_ptr();
    std::lock_guard<std::mutex> lock(mutex_);
    tensors_[p] = std::move(t);
    add(num_bytes);
    return p;
  }
  void release(void* ptr, std::uint64_t num_bytes) noexcept override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (tensors_.erase(ptr) > 0) bytes_ -= num_bytes;
  }
  void* allocate_host(std::uint64_t num_bytes) override { return inner_->allocate_host(num_bytes); }
  void release_host(void* ptr, std::uint64_t num_bytes) noexcept override {
    inner_->release_host(ptr, num_bytes);
  }
  void copy(void* dst, const void* src, std::uint64_t num_bytes) override {
    inner_->copy(dst, src, num_bytes);
  }
  void gather(void* dst, std::uint64_t num_bytes, std::span<const zf::Segment> segments) override {
    inner_->gather(dst, num_bytes, segments);
  }
  void upcast_to_fp32(float* dst, const void* src, zf::DType dtype, std::uint64_t numel) override {
    inner_->upcast_to_fp32(dst, src, dtype, numel);
  }
  std::uint64_t checksum(const void* ptr, std::uint64_t num_bytes) override {
    return inner_->checksum(ptr, num_bytes);
  }
  zf::MemoryInfo memory_info() override {
    zf::MemoryInfo info = inner_->memory_info();
    std::lock_guard<std::mutex> lock(mutex_);
    info.allocated_bytes = bytes_;
    info.peak_allocated_bytes = peak_;
    return info;
  }
  // The inner device's sources; what torch knows (its allocator's cached-but-free bytes) comes
  // in the context, which the Python package fills for every front door (framework_memory).
  zf::ProbeResult probe_memory(const zf::ProbeContext& context) override {
    return inner_->probe_memory(context);
  }
  zf::ProbeResult probe_host_memory(const zf::ProbeContext& context) override {
    return inner_->probe_host_memory(context);
  }
  std::optional<zf::DevicePreset> hardware() const override { return inner_->hardware(); }
  void synchronize() override { inner_->synchronize(); }

  // The group's original parameters are torch's, not this device's: they are counted while the
  // steps run (from before the first step until the release), so that the device's peak is the
  // memory model's, originals included.
  void count_originals(std::uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    add(bytes);
  }
  void uncount_originals(std::uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    bytes_ -= bytes;
  }

  // The caller's own memory for the next allocation of exactly its bytes (a contiguous tensor on
  // this device; a load then reads straight into it, with no buffer of its own), or none. Whether
  // it was taken: the buffer the load hands back is over the same memory.
  void adopt(std::optional<at::Tensor> t) {
    at::Tensor flat;
    if (t) {
      if (!t->is_contiguous() || t->device() != device_) {
        throw zf::InvalidArgument("adopt: expected a contiguous tensor on " + device_.str());
      }
      flat = t->reshape({-1}).view(at::kByte);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    adopted_ = std::move(flat);
  }

  // The uint8 tensor that owns an allocation (for the flat buffer handed to Python).
  at::Tensor tensor(std::uintptr_t ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = tensors_.find(reinterpret_cast<void*>(ptr));
    if (it == tensors_.end()) throw zf::InvalidArgument("no allocation of this device there");
    return it->second;
  }

 private:
  at::Device device_;
  std::optional<zf::RuntimeEnv::HostMemory> host_memory_;
  std::unique_ptr<zf::Device> inner_;
  std::mutex mutex_;
  std::map<void*, at::Tensor> tensors_;
  at::Tensor adopted_;       // under mutex_
  std::uint64_t bytes_ = 0;  // under mutex_
  std::uint64_t peak_ = 0;
  void add(std::uint64_t n) {  // caller holds mutex_
    bytes_ += n;
    peak_ = std::max(peak_, bytes_);
  }
};

// The Python classes of zeroflat's errors (common.h), made once at import. Each kind is also the
// built-in exception a Python caller would expect for it, so `except ValueError` still catches an
// InvalidArgument; the root is a RuntimeError, as every library error was before it had a class.
struct PyErrors {
  PyObject* error = nullptr;
  PyObject* invalid_argument = nullptr;
  PyObject* out_of_memory = nullptr;
  PyObject* unsupported = nullptr;
  PyObject* resource_exhausted = nullptr;
  PyObject* comm_error = nullptr;
  PyObject* internal_error = nullptr;
  PyObject* io_error = nullptr;
};
extern PyErrors errors;  // bind_support.cc; made by binding.cc at import

// A communicator whose collectives a Python object runs (torch.distributed). The executor calls
// it with the GIL released; each call takes it back. A Python exception in a collective becomes
// a CommError with its message (the Python side words it: which collective, which rank is
// presumably gone), and the exception itself is kept on the Python object (its `failure`), so
// that the error Python finally raises can chain it.
class PyCommunicator final : public zf::Communicator {
 public:
  explicit PyCommunicator(py::object impl) : impl_(std::move(impl)) {
    py::gil_scoped_acquire gil;
    rank_ = impl_.attr("rank").cast<int>();
    size_ = impl_.attr("size").cast<int>();
  }
  ~PyCommunicator() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }
  std::string name() const override { return "torch.distributed"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }

  void all_gather_inplace(void* buffer, std::uint64_t slice_bytes, zf::Device&) override {
    call("all_gather_inplace", reinterpret_cast<std::uintptr_t>(buffer), slice_bytes);
  }
  // Host memory only: the parts of a buffer on a cuda device are gathered whole, as before.
  bool gathers_parts(const zf::Device& device) const noexcept override {
    return device.keeps_data() && device.host_accessible();
  }
  void all_gather_part(void* buffer, std::uint64_t slice_bytes, std::uint64_t offset,
                       std::uint64_t bytes, zf::Device&) override {
    call("all_gather_part", reinterpret_cast<std::uintptr_t>(buffer), slice_bytes, offset, bytes);
  }
  void all_reduce_min(std::span<std::uint64_t> values) override { reduce("min", values); }
  void all_reduce_max(std::span<std::uint64_t> values) override { reduce("max", values); }
  void barrier() override { call("barrier"); }
  void abort(const std::string& why) noexcept override {
    try {
      py::gil_scoped_acquire gil;
      impl_.attr("abort")(why);
    } catch (...) {  // an abort never throws
    }
  }

 private:
  template <typename... Args>
  py::object call(const char* method, Args... args) {
    py::gil_scoped_acquire gil;
    try {
      return impl_.attr(method)(args...);
    } catch (py::error_already_set& e) {
      rethrow(method, e);
    }
  }
  // A collective the ranks called with arguments that do not agree (the Python side checked,
  // on every rank, before anything moved) is the caller's InvalidArgument, as from the library's
  // own communicators; anything else a CommError.
  [[noreturn]] static void rethrow(const char* method, py::error_already_set& e) {
    if (errors.invalid_argument != nullptr && e.matches(errors.invalid_argument)) {
      throw zf::InvalidArgument(std::string("torch.distributed ") + method + ": " +
                                std::string(py::str(e.value())));
    }
    throw zf::CommError(message(method, e));
  }
  void reduce(const char* op, std::span<std::uint64_t> values) {
    std::vector<std::uint64_t> in(values.begin(), values.end());
    std::vector<std::uint64_t> out;
    {
      py::gil_scoped_acquire gil;
      try {
        out = impl_.attr("all_reduce")(in, op).cast<std::vector<std::uint64_t>>();
      } catch (py::error_already_set& e) {
        rethrow("all_reduce", e);
      }
    }
    if (out.size() != values.size()) {
      throw zf::CommError("torch.distributed all_reduce returned " + std::to_string(out.size()) +
                          " values for " + std::to_string(values.size()));
    }
    std::copy(out.begin(), out.end(), values.begin());
  }
  // The exception's own words when the Python side raised zeroflat's CommError, else its type
  // and message. Called with the GIL held.
  static std::string message(const char* method, py::error_already_set& e) {
    const std::string text = py::str(e.value());
    if (errors.comm_error != nullptr && e.matches(errors.comm_error)) return text;
    return std::string("torch.distributed ") + method + ": " +
           std::string(py::str(e.type().attr("__name__"))) + ": " + text;
  }

  py::object impl_;
  int rank_ = 0;
  int size_ = 1;
};

// An options struct made from keyword arguments (an unknown name is an AttributeError).
template <typename T>
T from_kwargs(const py::kwargs& kwargs) {
  py::object o = py::cast(T{});
  for (const auto& [key, value] : kwargs) o.attr(key) = value;
  return o.cast<T>();
}

// A JSON document of the library's as Python values (json.loads).
py::object parse_json(const std::string& text);

// torch's scalar type of zeroflat's element type, and back (bf16, fp16, fp32; none for another).
at::ScalarType scalar_type_of(zf::DType d);
std::optional<zf::DType> dtype_of(at::ScalarType t);

// What upcast and clone read: the tensor's bytes from data_ptr(), so it must be a dense host
// tensor.
void check_host_source(const at::Tensor& src, const char* what);

// Each bound area: its classes and functions added to the module, in the order binding.cc calls
// them (a class is bound before the functions that take it).
void bind_device(py::module_& m);       // bind_device.cc
void bind_checkpoints(py::module_& m);  // bind_checkpoint.cc
void bind_options(py::module_& m);      // bind_options.cc
void bind_loads(py::module_& m);        // bind_loads.cc
void bind_deepspeed(py::module_& m);    // bind_deepspeed.cc
void bind_layouts(py::module_& m);      // bind_layouts.cc
void bind_save(py::module_& m);         // bind_save.cc

}  // namespace zeroflat_python
