// zeroflat._C: the engine for PyTorch. Memory comes from torch's allocator (CPU, or the CUDA
// caching allocator), copies run on zeroflat's own device of the same kind, collectives go back
// to Python (torch.distributed), and everything else is the library's front doors (engine.h,
// loader.h): probe, agreement, plan, execution, master partition; and DeepSpeed's release rules
// (release.h). Options cross as the library's own structs (FlattenOptions, LoadOptions, ...,
// made from keyword arguments), errors as zeroflat's exception classes. Only the public API is
// used here.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "zeroflat/zeroflat.h"
#include "os_names.h"

namespace py = pybind11;
namespace zf = zeroflat;
using zeroflat_python::os_name;
using zeroflat_python::os_bytes;
using zeroflat_python::os_bytes_list;
using zeroflat_python::os_names;

void bind_deepspeed(py::module_& m);  // bind_deepspeed.cc

namespace {

zf::DType dtype_of(const std::string& name) {
  return zf::parse_dtype(name);
}

// A uint8 tensor over zeroflat's own host memory (fresh 2 MiB-aligned mappings: its first touch
// is the gather's, by every thread of the team on its own byte range), freed by torch when the
// last tensor over it goes. Not advised for huge pages unless ZEROFLAT_HOST_MEMORY=huge: in
// fresh processes under DeepSpeed (benchmarks/deepspeed_init_bench.py, docs/performance.md)
// the advice made initialize slower than DeepSpeed's own at one rank, where the kernel compacts
// memory on the advised buffer's faults; ZEROFLAT_HOST_MEMORY=torch takes torch's allocator.

// `fallback`: where they come from when ZEROFLAT_HOST_MEMORY does not say (none: plain).
at::Tensor host_tensor(std::uint64_t num_bytes,
                       std::optional<zf::RuntimeEnv::HostMemory> fallback = std::nullopt) {
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

// --- errors -------------------------------------------------------------------------------------

// The Python classes of zeroflat's errors (error.h), made once at import. Each kind is also the
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
};
PyErrors errors;

PyObject* new_error(py::module_& m, const char* name, std::initializer_list<PyObject*> bases,
                    const char* doc) {
  py::tuple b(bases.size());
  std::size_t i = 0;
  for (PyObject* base : bases) b[i++] = py::reinterpret_borrow<py::object>(base);
  const std::string full = std::string("zeroflat.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(full.c_str(), doc, b.ptr(), nullptr);
  if (type == nullptr) throw py::error_already_set();
  m.attr(name) = py::reinterpret_borrow<py::object>(type);
  return type;  // the module keeps a reference; this one lives as long as the process
}

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

// --- options ------------------------------------------------------------------------------------

// An options struct made from keyword arguments (an unknown name is an AttributeError).
template <typename T>
T from_kwargs(const py::kwargs& kwargs) {
  py::object o = py::cast(T{});
  for (const auto& [key, value] : kwargs) o.attr(key) = value;
  return o.cast<T>();
}

py::object parse_json(const std::string& text) {
  return py::module_::import("json").attr("loads")(text);
}

py::dict rules_dict(const zf::ReleaseRules& r) {
  py::dict d;
  d["release"] = r.release;
  d["rules"] = r.rules;
  d["tested"] = r.tested;
  d["skips_zero_element"] = r.skips_zero_element;
  d["has_parameter_alignment"] = r.has_parameter_alignment;
  d["padding_on_last_rank"] = r.padding_on_last_rank;
  d["checks_accelerator_memory"] = r.checks_accelerator_memory;
  return d;
}

// The buffer's uint8 tensor (the library's handle on it is dropped with the result), or None.
py::object owned(TorchDevice& device, const zf::DeviceBuffer& b) {
  if (!b) return py::none();
  return py::cast(device.tensor(reinterpret_cast<std::uintptr_t>(b.data())));
}

// The layout a result's steps filled, as Python takes it: what a caller needs to place its
// parameters (each one's offset and elements, the buffer's and a partition's elements), not the
// ranks' bookkeeping (zeroflat.layout() has that).
py::dict layout_dict(const zf::Layout& l) {
  py::dict d;
  d["dp"] = l.options().dp;
  d["alignment"] = l.alignment();
  d["dtype"] = std::string(zf::dtype_name(l.options().dtype));
  d["numel"] = l.numel();
  d["padding"] = l.padding();
  d["flat_numel"] = l.flat_numel();
  d["flat_bytes"] = l.flat_bytes();
  d["partition_numel"] = l.partition_numel();
  d["partition_bytes"] = l.partition_bytes();
  d["order"] = l.order();
  d["offsets"] = l.offsets();
  d["numels"] = l.numels();
  return d;
}

// A front door's result for Python: (report, buffer, master, layout): the library's document of
// this rank (report.h), the buffer's and the master's uint8 tensors (None when nothing fits, or
// without a master), and the layout the steps filled (layout_dict).
py::tuple result_tuple(TorchDevice& device, const zf::FlattenResult& r, py::object report) {
  py::dict layout = layout_dict(r.complete() ? r.group().layout : r.input.layout);
  if (!r.feasible()) return py::make_tuple(report, py::none(), py::none(), layout);
  return py::make_tuple(report, owned(device, r.group().flat), owned(device, r.master), layout);
}

// One group through the front door on this rank (engine.h). Returns the report (a dict: the
// probe, the plan, the outcome) and the flat buffer's and the master's uint8 tensors (None when
// there is none). Raises InvalidArgument on every rank for a bad group, options that differ, or
// any rank's local_error.
py::tuple flatten(TorchDevice& device, py::object comm_impl,
                  const std::vector<std::uintptr_t>& ptrs,
                  const std::vector<std::vector<std::int64_t>>& shapes, zf::FlattenOptions o,
                  const std::function<void()>& release_originals, bool defer_release) {
  std::vector<zf::TensorRef> params;
  std::uint64_t model_bytes = 0;
  if (o.local_error.empty()) {
    try {
      zf::validate(o.layout);
      if (ptrs.size() != shapes.size()) {
        throw zf::InvalidArgument(std::to_string(ptrs.size()) + " pointers for " +
                                  std::to_string(shapes.size()) + " shapes");
      }
      for (std::size_t i = 0; i < ptrs.size(); ++i) {
        const std::uint64_t numel = zf::shape_numel(shapes[i]);
        params.push_back(zf::TensorRef{reinterpret_cast<void*>(ptrs[i]), numel, shapes[i],
                                       o.layout.dtype, &device});
        model_bytes += numel * zf::element_size(o.layout.dtype);
      }
    } catch (const zf::Error& e) {
      o.local_error = e.what();
      params.clear();
      model_bytes = 0;
    }
  }
  // defer_release: when the originals' release comes after the buffer is complete (the device
  // tier's last step), the caller rebinds every parameter itself right after, which frees them
  // there (as DeepSpeed's own flatten leaves it): this step does not.
  bool complete = false;
  auto on_step = o.execute.on_step;
  o.execute.on_step = [&](std::size_t k, const zf::Step& step) {
    if (step.op == zf::Op::kRepoint) complete = true;
    if (on_step) on_step(k, step);
  };
  bool deferred = false;
  std::unique_ptr<PyCommunicator> comm;
  if (!comm_impl.is_none()) comm = std::make_unique<PyCommunicator>(comm_impl);

  device.count_originals(model_bytes);
  bool released = false;
  zf::FlattenResult r;
  {
    py::gil_scoped_release nogil;
    try {
      r = zf::flatten_param_group(params, device, comm.get(), o, [&] {
        device.uncount_originals(model_bytes);
        released = true;
        if (defer_release && complete) {
          deferred = true;
          return;
        }
        py::gil_scoped_acquire gil;
        release_originals();
      });
    } catch (...) {
      if (!released) device.uncount_originals(model_bytes);
      throw;
    }
  }
  if (!released) device.uncount_originals(model_bytes);
  // The library's document of this rank's flatten (report.h), and what only the binding knows.
  py::object report = parse_json(zf::result_json(r));
  report["release_deferred"] = deferred;
  return result_tuple(device, r, report);
}

// One of the loader's doors (loader.h): load_flat_group or load_partitions.
using LoadDoor =
    std::function<zf::FlattenResult(const zf::CheckpointIndex&, std::span<const zf::LoadParam>,
                                     zf::Device&, zf::Communicator*, const zf::FlattenOptions&)>;

// A checkpoint's group loaded on this rank through `door`: (report, buffer, master, layout) as
// flatten returns them. `checkpoint` None: this rank could not open it (its local_error says
// why). Raises InvalidArgument on every rank for a bad group or checkpoint, options that differ,
// or any rank's local_error; Error on every rank when a read fails.
py::tuple load_through(const LoadDoor& door, TorchDevice& device, py::object comm_impl,
                       py::object checkpoint, std::vector<zf::LoadParam> params,
                       zf::FlattenOptions o) {
  static const zf::CheckpointIndex kNone;
  const zf::CheckpointIndex& ck =
      checkpoint.is_none() ? kNone : checkpoint.cast<const zf::CheckpointIndex&>();
  if (o.local_error.empty()) {
    try {
      zf::validate(o.layout);
      if (checkpoint.is_none()) throw zf::InvalidArgument("no checkpoint");
    } catch (const zf::Error& e) {
      o.local_error = e.what();
    }
  }
  if (!o.local_error.empty()) params.clear();
  std::unique_ptr<PyCommunicator> comm;
  if (!comm_impl.is_none()) comm = std::make_unique<PyCommunicator>(comm_impl);
  zf::FlattenResult r;
  {
    py::gil_scoped_release nogil;
    r = door(ck, params, device, comm.get(), o);
  }
  return result_tuple(device, r, parse_json(zf::result_json(r)));
}

// The whole flat buffer on every rank (load_flat_group).
py::tuple load(TorchDevice& device, py::object comm_impl, py::object checkpoint,
               std::vector<zf::LoadParam> params, zf::FlattenOptions o) {
  return load_through(&zf::load_flat_group, device, std::move(comm_impl), std::move(checkpoint),
                      std::move(params), std::move(o));
}

// ZeRO-3: this rank's own partition of every parameter, back to back in the order of params
// (load_partitions; options.layout.dp = the ranks of comm); the layout's offsets and numels are
// the partitions'. The master, when asked, is the buffer's fp32 copy.
py::tuple load_partitions(TorchDevice& device, py::object comm_impl, py::object checkpoint,
                          std::vector<zf::LoadParam> params, zf::FlattenOptions o) {
  return load_through(&zf::load_partitions, device, std::move(comm_impl), std::move(checkpoint),
                      std::move(params), std::move(o));
}

// ZeRO-1/2's optimizer partition alone: this rank's slice of the flat layout (load_slice); the
// buffer tensor holds partition_bytes.
py::tuple load_slice(TorchDevice& device, py::object comm_impl, py::object checkpoint,
                     std::vector<zf::LoadParam> params, zf::FlattenOptions o) {
  return load_through(&zf::load_slice, device, std::move(comm_impl), std::move(checkpoint),
                      std::move(params), std::move(o));
}

// DTensor placements as torch prints them ("Shard(0)", "Replicate()"), per parameter.
std::vector<std::vector<zf::MeshPlacement>> placements_of(
    const std::vector<std::vector<std::string>>& texts) {
  std::vector<std::vector<zf::MeshPlacement>> out;
  for (const auto& per : texts) {
    out.emplace_back();
    for (const std::string& t : per) out.back().push_back(zf::parse_placement(t));
  }
  return out;
}

// DTensor shards: this rank's local shard of every parameter, padded, back to back in the order
// of params (load_shards); mesh, coords (per rank of comm) and placements (per parameter, as
// torch prints them) make the spec. A spec that does not parse is this rank's local error.
py::tuple load_shards(TorchDevice& device, py::object comm_impl, py::object checkpoint,
                      std::vector<zf::LoadParam> params, zf::FlattenOptions o,
                      std::vector<std::uint64_t> mesh,
                      std::vector<std::vector<std::uint64_t>> coords,
                      const std::vector<std::vector<std::string>>& placements) {
  zf::ShardSpec spec{std::move(mesh), std::move(coords), {}};
  if (o.local_error.empty()) {
    try {
      spec.placements = placements_of(placements);
    } catch (const zf::Error& e) {
      o.local_error = e.what();
    }
  }
  if (!o.local_error.empty()) spec.placements.assign(params.size(), {});
  return load_through(
      [&spec](const zf::CheckpointIndex& ck, std::span<const zf::LoadParam> ps, zf::Device& d,
              zf::Communicator* c, const zf::FlattenOptions& opts) {
        return zf::load_shards(ck, ps, spec, d, c, opts);
      },
      device, std::move(comm_impl), std::move(checkpoint), std::move(params), std::move(o));
}

// The file bytes rank `rank` reads for its shards (shards_read_bytes).
std::uint64_t shards_read_bytes(const zf::CheckpointIndex& ck,
                                const std::vector<zf::LoadParam>& params,
                                std::vector<std::uint64_t> mesh,
                                std::vector<std::vector<std::uint64_t>> coords,
                                const std::vector<std::vector<std::string>>& placements,
                                std::uint64_t rank) {
  const zf::ShardSpec spec{std::move(mesh), std::move(coords), placements_of(placements)};
  return zf::shards_read_bytes(ck, params, spec, rank);
}

// This rank's shards that lie in the checkpoint's files as they are (mapped.h's
// shard_file_ranges): per parameter, (file, offset, bytes), or None where it must be read.
py::list shard_file_ranges(const zf::CheckpointIndex& ck, const std::vector<zf::LoadParam>& params,
                           std::vector<std::uint64_t> mesh,
                           std::vector<std::vector<std::uint64_t>> coords,
                           const std::vector<std::vector<std::string>>& placements,
                           std::uint64_t rank, const std::string& dtype) {
  const zf::ShardSpec spec{std::move(mesh), std::move(coords), placements_of(placements)};
  const auto where = zf::shard_file_ranges(ck, params, spec, rank, zf::parse_dtype(dtype));
  py::list out;
  for (const auto& r : where) {
    if (r) {
      out.append(py::make_tuple(r->file, r->offset, r->bytes));
    } else {
      out.append(py::none());
    }
  }
  return out;
}

// The ranges (file, offset, bytes) mapped privately and brought in (map_file_ranges): a uint8
// tensor over each, which keeps its mapping alive.
py::list map_file_ranges(const zf::CheckpointIndex& ck,
                         const std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>>&
                             ranges,
                         unsigned threads, const std::shared_ptr<zf::ReadProgress>& progress,
                         bool sole_reader, bool cold) {
  std::vector<zf::FileRange> rs;
  for (const auto& [file, offset, bytes] : ranges) rs.push_back({file, offset, bytes});
  zf::MappedRanges mapped;
  {
    py::gil_scoped_release nogil;
    mapped = zf::map_file_ranges(ck, rs, {threads, progress.get(), sole_reader, cold});
  }
  py::list out;
  for (std::size_t k = 0; k < rs.size(); ++k) {
    if (rs[k].bytes == 0) {  // an empty shard
      out.append(torch::empty({0}, torch::TensorOptions().dtype(torch::kUInt8)));
      continue;
    }
    std::shared_ptr<const void> keep = mapped.keep(k);
    out.append(torch::from_blob(
        mapped.data(k), {static_cast<std::int64_t>(rs[k].bytes)},
        [keep](void*) mutable { keep.reset(); }, torch::TensorOptions().dtype(torch::kUInt8)));
  }
  return out;
}

// The shard mesh coordinate `coord` holds of a tensor of shape `shape` (dtensor.h): its local
// shape, global offsets, elements, padded elements and the number of runs it reads.
py::dict local_shard(const zf::Shape& shape, const std::vector<std::uint64_t>& mesh,
                     const std::vector<std::string>& placements,
                     const std::vector<std::uint64_t>& coord) {
  std::vector<zf::MeshPlacement> pl;
  for (const std::string& t : placements) pl.push_back(zf::parse_placement(t));
  const zf::LocalShard s = zf::local_shard(shape, mesh, pl, coord);
  py::dict d;
  d["shape"] = s.shape;
  d["offsets"] = s.offsets;
  d["numel"] = s.numel;
  d["padded_numel"] = s.padded_numel;
  d["runs"] = s.runs.size();
  return d;
}

// The ZeRO-3 layout of optimizer groups (zero3.h) seen from `rank`: per parameter (flat over the
// groups) its numel, partition_numel, padding (p * W - n) and offset in the rank buffer; the
// buffer's elements; the sub-groups; this rank's groups_padding and elements of data.
py::dict zero3_layout(const std::vector<std::vector<std::uint64_t>>& groups, std::uint64_t world,
                      std::uint64_t sub_group_size, std::uint64_t rank) {
  const zf::Zero3Layout l =
      zf::Zero3Layout::compute(groups, zf::Zero3Options{world, sub_group_size, zf::DType::kBF16});
  std::vector<std::uint64_t> paddings;
  for (std::uint64_t i = 0; i < l.num_params(); ++i) paddings.push_back(l.padding(i));
  py::list subs;
  for (const zf::Zero3SubGroup& g : l.sub_groups()) {
    py::dict d;
    d["group"] = g.group;
    d["params"] = std::vector<std::uint64_t>{g.first_param, g.num_params};
    d["offset"] = g.offset;
    d["numel"] = g.numel;
    subs.append(d);
  }
  py::dict out;
  out["world"] = world;
  out["sub_group_size"] = sub_group_size;
  out["rank"] = rank;
  out["numels"] = l.numels();
  out["groups"] = l.groups();
  out["partition_numels"] = l.partition_numels();
  out["paddings"] = paddings;
  out["offsets"] = l.offsets();
  out["buffer_numel"] = l.buffer_numel();
  out["sub_groups"] = subs;
  out["groups_padding"] = l.groups_padding(rank);
  out["data_numel"] = l.data_numel(rank);
  return out;
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroflat engine for PyTorch (use the zeroflat package, not this module)";

  // --- errors (error.h) -------------------------------------------------------------------------
  errors.error = new_error(m, "Error", {PyExc_RuntimeError},
                           "Root of zeroflat's errors (a RuntimeError): the message says what was "
                           "expected, what was found, and which parameter, rank or step.");
  errors.invalid_argument = new_error(
      m, "InvalidArgument", {errors.error, PyExc_ValueError},
      "A value outside the documented domain, or ranks that passed different ones; nothing was "
      "touched. Also a ValueError.");
  errors.out_of_memory = new_error(m, "OutOfMemory", {errors.error, PyExc_MemoryError},
                                   "A device or host allocation failed. Also a MemoryError.");
  errors.unsupported = new_error(
      m, "Unsupported", {errors.error, PyExc_NotImplementedError},
      "Valid, but this build or this device cannot serve it. Also a NotImplementedError.");
  errors.resource_exhausted = new_error(
      m, "ResourceExhausted", {errors.error},
      "The system refused a host thread or a file (a process or memory limit): ask for fewer "
      "threads.");
  errors.comm_error = new_error(
      m, "CommError", {errors.error},
      "A collective failed or timed out, or a peer rank disappeared; the error of the process "
      "group, when there is one, is its __cause__.");
  errors.internal_error = new_error(m, "InternalError", {errors.error},
                                    "A broken invariant inside zeroflat: a bug, please report it.");
  // A message is set from its bytes decoded leniently: one that quotes bytes of a file that
  // are not UTF-8 keeps its words (the bytes as \xNN), where PyErr_SetString would leave the
  // exception with no message at all.
  static const auto set_error = [](PyObject* type, const char* what) {
    PyObject* text = PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)),
                                          "backslashreplace");
    if (text == nullptr) {
      PyErr_Clear();
      PyErr_SetString(type, "(the error's message could not be decoded)");
      return;
    }
    PyErr_SetObject(type, text);
    Py_DECREF(text);
  };
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const zf::InvalidArgument& e) {
      set_error(errors.invalid_argument, e.what());
    } catch (const zf::OutOfMemory& e) {
      set_error(errors.out_of_memory, e.what());
    } catch (const zf::Unsupported& e) {
      set_error(errors.unsupported, e.what());
    } catch (const zf::ResourceExhausted& e) {
      set_error(errors.resource_exhausted, e.what());
    } catch (const zf::CommError& e) {
      set_error(errors.comm_error, e.what());
    } catch (const zf::InternalError& e) {
      set_error(errors.internal_error, e.what());
    } catch (const zf::Error& e) {
      set_error(errors.error, e.what());
    }
  });

  // --- the device -------------------------------------------------------------------------------
  py::class_<TorchDevice>(m, "TorchDevice")
      .def(py::init<const std::string&, unsigned, std::optional<std::string>>(),
           py::arg("device"), py::arg("threads"), py::arg("host_memory") = py::none())
      .def_property_readonly("name", &TorchDevice::name)
      .def("checksum",
           [](TorchDevice& d, std::uintptr_t ptr, std::uint64_t n) {
             py::gil_scoped_release nogil;
             return d.checksum(reinterpret_cast<const void*>(ptr), n);
           })
      .def("tensor", &TorchDevice::tensor, py::arg("ptr"))
      .def("adopt", &TorchDevice::adopt, py::arg("tensor"))
      .def("allocated_bytes", [](TorchDevice& d) { return d.memory_info().allocated_bytes; })
      // Host conversions at the engine's speed: a fresh buffer of zeroflat's host memory (huge
      // pages), first touched by the team that writes it. Contiguous CPU tensors only.
      .def("upcast",
           [](TorchDevice& d, const at::Tensor& src) {
             check_host_source(src, "upcast");
             if (src.scalar_type() != at::kBFloat16 && src.scalar_type() != at::kHalf) {
               throw zf::InvalidArgument("upcast: a bfloat16 or float16 tensor, not " +
                                         std::string(c10::toString(src.scalar_type())));
             }
             const std::uint64_t n = static_cast<std::uint64_t>(src.numel());
             at::Tensor out = host_tensor(n * 4);
             const zf::DType dtype =
                 src.scalar_type() == at::kBFloat16 ? zf::DType::kBF16 : zf::DType::kFP16;
             {
               py::gil_scoped_release nogil;
               d.upcast_to_fp32(static_cast<float*>(out.data_ptr()), src.data_ptr(), dtype, n);
             }
             return out.narrow(0, 0, static_cast<std::int64_t>(n * 4));
           })
      // n bytes of zeros that no page of has been touched: a fresh mapping of zeroflat's host
      // memory reads as zeros, and its pages are faulted in only where something writes them
      // (torch.zeros writes every byte first). torch's zeros where the memory is torch's or
      // too small for a mapping of its own.
      .def("zeros",
           [](TorchDevice&, std::uint64_t n) {
             if (n < zf::kFreshMappingBytes ||
                 zf::runtime_env().host_memory == zf::RuntimeEnv::HostMemory::kTorch) {
               return at::zeros({static_cast<std::int64_t>(n)},
                                at::TensorOptions().dtype(at::kByte).device(at::kCPU));
             }
             return host_tensor(n).narrow(0, 0, static_cast<std::int64_t>(n));
           })
      .def("clone", [](TorchDevice& d, const at::Tensor& src) {
        check_host_source(src, "clone");
        const std::uint64_t n = static_cast<std::uint64_t>(src.numel()) * src.element_size();
        at::Tensor out = host_tensor(n);
        {
          py::gil_scoped_release nogil;
          d.copy(out.data_ptr(), src.data_ptr(), n);
        }
        return out.narrow(0, 0, static_cast<std::int64_t>(n));
      });

  // Whether `wide` (float32) holds, bit for bit, the up-cast of `narrow` (bfloat16, float16 or
  // float32) element for element (dtype.h's holds_upcast): one pass, no temporary. Contiguous CPU
  // tensors of as many elements.
  m.def(
      "holds_upcast",
      [](const at::Tensor& wide, const at::Tensor& narrow) {
        check_host_source(wide, "holds_upcast");
        check_host_source(narrow, "holds_upcast");
        const std::optional<zf::DType> dtype = dtype_of(narrow.scalar_type());
        if (wide.scalar_type() != at::kFloat || !dtype) {
          throw zf::InvalidArgument(
              "holds_upcast: a float32 tensor and a bfloat16, float16 or float32 one, not " +
              std::string(c10::toString(wide.scalar_type())) + " and " +
              std::string(c10::toString(narrow.scalar_type())));
        }
        if (wide.numel() != narrow.numel()) {
          throw zf::InvalidArgument("holds_upcast: " + std::to_string(wide.numel()) + " and " +
                                    std::to_string(narrow.numel()) + " elements");
        }
        py::gil_scoped_release nogil;
        return zf::holds_upcast(static_cast<const float*>(wide.data_ptr()), narrow.data_ptr(),
                                *dtype, static_cast<std::uint64_t>(wide.numel()));
      },
      py::arg("wide"), py::arg("narrow"));

  // --- checkpoints (checkpoint.h) ---------------------------------------------------------------
  py::class_<zf::CheckpointTensor>(m, "CheckpointTensor")
      .def_readonly("name", &zf::CheckpointTensor::name)
      .def_readonly("dtype", &zf::CheckpointTensor::dtype)  // as stored: "BF16", "I64", ...
      // zeroflat's name of the dtype ("bf16") when the loader converts from it, else None.
      .def_property_readonly("type",
                             [](const zf::CheckpointTensor& t) -> std::optional<std::string> {
                               if (!t.type) return std::nullopt;
                               return std::string(zf::dtype_name(*t.type));
                             })
      .def_readonly("shape", &zf::CheckpointTensor::shape)
      .def_readonly("numel", &zf::CheckpointTensor::numel)
      .def_readonly("bytes", &zf::CheckpointTensor::bytes)
      .def_readonly("file", &zf::CheckpointTensor::file)  // index into the checkpoint's files
      // Where the tensor starts in its whole and the whole's shape (a checkpoint opened with
      // pieces, checkpoint.h): the origin and its own shape for a tensor stored whole.
      .def_property_readonly("offsets",
                             [](const zf::CheckpointTensor& t) {
                               return t.piece_offsets.empty() ? zf::Shape(t.shape.size(), 0)
                                                              : t.piece_offsets;
                             })
      .def_property_readonly("whole",
                             [](const zf::CheckpointTensor& t) {
                               return t.whole_shape.empty() ? t.shape : t.whole_shape;
                             })
      .def("__repr__", [](const zf::CheckpointTensor& t) {
        return "CheckpointTensor('" + t.name + "', " + t.dtype + ", " +
               zf::shape_to_string(t.shape) + ")";
      });
  py::class_<zf::CheckpointIndex>(m, "Checkpoint")
      // pieces: accept tensors saved in pieces (CheckpointOptions::pieces), each an entry.
      .def(py::init([](const std::string& path, bool pieces) {
             py::gil_scoped_release nogil;
             return zf::open_checkpoint(path, {.pieces = pieces});
           }),
           py::arg("path"), py::arg("pieces") = false)
      .def_property_readonly("path", [](const zf::CheckpointIndex& c) { return os_name(c.path); })
      .def_property_readonly("files",
                             [](const zf::CheckpointIndex& c) { return os_names(c.files); })
      // What ranks compare before they read it together (checkpoint_header_digest): an int.
      .def("header_digest",
           [](const zf::CheckpointIndex& ck) { return zf::checkpoint_header_digest(ck); })
      // Every tensor, in natural name order.
      .def("tensors", [](const zf::CheckpointIndex& ck) { return ck.tensors; })
      .def("has", [](const zf::CheckpointIndex& ck,
                     const std::string& name) { return ck.find(name) != nullptr; })
      .def(
          "find",
          [](const zf::CheckpointIndex& ck, const std::string& name) -> py::object {
            const zf::CheckpointTensor* t = ck.find(name);
            return t == nullptr ? py::none() : py::cast(*t);
          },
          py::arg("name"))
      // The pieces [(name, offsets)] as a Checkpoint whose tensor i, named "#<i>" (12 digits),
      // is piece i (checkpoint_pieces).
      .def(
          "pieces",
          [](const zf::CheckpointIndex& ck,
             const std::vector<std::pair<std::string, zf::Shape>>& refs) {
            std::vector<zf::PieceRef> r;
            r.reserve(refs.size());
            for (const auto& [name, offsets] : refs) r.push_back({name, offsets});
            py::gil_scoped_release nogil;
            return zf::checkpoint_pieces(ck, r);
          },
          py::arg("refs"))
      // Every file its tensors lie in still the one its headers were read from
      // (check_checkpoint_files): what a reader checks before the ranks agree.
      .def("check_files",
           [](const zf::CheckpointIndex& ck) {
             py::gil_scoped_release nogil;
             zf::check_checkpoint_files(ck);
           })
      // Tensor `name` read whole into `out` (a contiguous CPU tensor of its element count):
      // converted to out's dtype as torch rounds when that is bf16, fp16 or fp32, else its
      // bytes as stored (out must then have exactly as many bytes).
      .def("read", [](const zf::CheckpointIndex& ck, const std::string& name, at::Tensor out) {
        const zf::CheckpointTensor* t = ck.find(name);
        if (t == nullptr)
          throw zf::InvalidArgument(ck.path + " has no tensor named '" + name + "'");
        if (!out.is_cpu() || !out.is_contiguous()) {
          throw zf::InvalidArgument("read: out must be a contiguous CPU tensor");
        }
        const std::optional<zf::DType> to = dtype_of(out.scalar_type());
        const std::uint64_t want = to ? t->numel * zf::element_size(*to) : t->bytes;
        if (static_cast<std::uint64_t>(out.numel()) * out.element_size() != want ||
            (to && static_cast<std::uint64_t>(out.numel()) != t->numel)) {
          throw zf::InvalidArgument("read: tensor '" + name + "' needs " + std::to_string(want) +
                                    " bytes in out, which has " +
                                    std::to_string(out.numel() * out.element_size()));
        }
        void* dst = out.data_ptr();
        py::gil_scoped_release nogil;
        zf::read_checkpoint_tensor(ck, name, to, dst);
      })
      // Boxes of tensors (name, offsets, sizes, out: a contiguous CPU bf16/fp16/fp32 tensor of
      // the box's elements), each read and converted into its out (read_checkpoint_boxes;
      // sole_reader: no other rank reads the files); the file bytes read.
      .def(
          "read_boxes",
          [](const zf::CheckpointIndex& ck, const py::list& boxes, unsigned threads,
             bool sole_reader) {
            std::vector<zf::BoxRead> reads;
            std::vector<at::Tensor> keep;
            for (const py::handle& item : boxes) {
              const auto box = item.cast<py::tuple>();
              if (box.size() != 4) {
                throw zf::InvalidArgument("read_boxes: each box is (name, offsets, sizes, out)");
              }
              zf::BoxRead r;
              r.name = box[0].cast<std::string>();
              r.offsets = box[1].cast<std::vector<std::uint64_t>>();
              r.sizes = box[2].cast<std::vector<std::uint64_t>>();
              at::Tensor out = box[3].cast<at::Tensor>();
              const std::optional<zf::DType> to = dtype_of(out.scalar_type());
              std::uint64_t n = 1;
              for (std::uint64_t x : r.sizes) n *= x;
              if (!to || !out.is_cpu() || !out.is_contiguous() ||
                  static_cast<std::uint64_t>(out.numel()) != n) {
                throw zf::InvalidArgument("read_boxes: tensor '" + zf::printable(r.name) +
                                          "' needs a contiguous CPU bf16, fp16 or fp32 tensor of " +
                                          std::to_string(n) + " elements");
              }
              r.to = *to;
              r.dst = out.data_ptr();
              keep.push_back(std::move(out));
              reads.push_back(std::move(r));
            }
            py::gil_scoped_release nogil;
            return zf::read_checkpoint_boxes(ck, reads, threads, sole_reader);
          },
          py::arg("boxes"), py::arg("threads") = 0, py::arg("sole_reader") = false);

  // --- options ----------------------------------------------------------------------------------
  py::class_<zf::LayoutOptions>(m, "LayoutOptions")
      .def(py::init([](const py::kwargs& kw) { return from_kwargs<zf::LayoutOptions>(kw); }))
      .def_readwrite("dp", &zf::LayoutOptions::dp)
      .def_readwrite("round_robin", &zf::LayoutOptions::round_robin)
      .def_readwrite("alignment_factor", &zf::LayoutOptions::alignment_factor)
      .def_readwrite("param_align_bytes", &zf::LayoutOptions::param_align_bytes)
      .def_property(
          "dtype", [](const zf::LayoutOptions& o) { return std::string(zf::dtype_name(o.dtype)); },
          [](zf::LayoutOptions& o, const std::string& d) { o.dtype = zf::parse_dtype(d); })
      .def("validate", [](const zf::LayoutOptions& o) { zf::validate(o); });
  // A rank's read progress (progress.h), shared with the loads that count it; its counts are
  // read while a load runs on another thread (the loads release the GIL).
  py::class_<zf::ReadProgress, std::shared_ptr<zf::ReadProgress>>(m, "ReadProgress")
      .def(py::init<>())
      .def_property(
          "expected", [](const zf::ReadProgress& p) { return p.expected.load(); },
          [](zf::ReadProgress& p, std::uint64_t v) { p.expected = v; })
      .def_property_readonly("planned", [](const zf::ReadProgress& p) { return p.planned.load(); })
      .def_property_readonly("done", [](const zf::ReadProgress& p) { return p.done.load(); })
      .def_property_readonly("total", &zf::ReadProgress::total);
  m.def("describe_progress", &zf::describe_progress, py::arg("done"), py::arg("total"),
        py::arg("seconds"));
  // The probe's context and the fault injection are flattened into the options (the
  // framework's cache, the step that fails).
  py::class_<zf::FlattenOptions>(m, "FlattenOptions")
      .def(py::init([](const py::kwargs& kw) { return from_kwargs<zf::FlattenOptions>(kw); }))
      .def_readwrite("layout", &zf::FlattenOptions::layout)
      .def_property(
          "tier",
          [](const zf::FlattenOptions& o) -> std::string {
            return o.tier ? std::string(zf::tier_name(*o.tier)) : "auto";
          },
          [](zf::FlattenOptions& o, const std::string& t) {
            o.tier = zf::parse_tier_choice(t, "tier");
          })
      .def_readwrite("margin_bytes", &zf::FlattenOptions::margin_bytes)
      .def_readwrite("master", &zf::FlattenOptions::master)
      .def_readwrite("check_values", &zf::FlattenOptions::check_values)
      .def_readwrite("release", &zf::FlattenOptions::release)
      // Text the ranks compare, and this rank's own error: either may quote a path whose name
      // is not UTF-8 (os.fsdecode's surrogate escapes), taken as its bytes.
      .def_property(
          "must_match", [](const zf::FlattenOptions& o) { return os_names(o.must_match); },
          [](zf::FlattenOptions& o, py::iterable v) { o.must_match = os_bytes_list(v); })
      .def_readwrite("expected_offsets", &zf::FlattenOptions::expected_offsets)
      .def_readwrite("expected_flat_numel", &zf::FlattenOptions::expected_flat_numel)
      .def_readwrite("names", &zf::FlattenOptions::names)
      .def_property(
          "local_error", [](const zf::FlattenOptions& o) { return os_name(o.local_error); },
          [](zf::FlattenOptions& o, py::handle v) { o.local_error = os_bytes(v); })
      .def_property(
          "framework_cached_free_bytes",
          [](const zf::FlattenOptions& o) { return o.probe.framework_cached_free_bytes; },
          [](zf::FlattenOptions& o, std::uint64_t v) { o.probe.framework_cached_free_bytes = v; })
      .def_property(
          "framework_held_bytes",
          [](const zf::FlattenOptions& o) { return o.probe.framework_held_bytes; },
          [](zf::FlattenOptions& o, std::uint64_t v) { o.probe.framework_held_bytes = v; })
      .def_property(
          "fault_step", [](const zf::FlattenOptions& o) { return o.execute.fault_step; },
          [](zf::FlattenOptions& o, std::optional<std::size_t> v) { o.execute.fault_step = v; })
      .def_readwrite("storage_bytes_per_second", &zf::FlattenOptions::storage_bytes_per_second)
      // The read options (engine.h: ReadOptions), flattened into the options.
      .def_property(
          "cold", [](const zf::FlattenOptions& o) { return o.read.cold; },
          [](zf::FlattenOptions& o, bool v) { o.read.cold = v; })
      .def_property(
          "threads", [](const zf::FlattenOptions& o) { return o.read.threads; },
          [](zf::FlattenOptions& o, unsigned v) { o.read.threads = v; })
      .def_property(
          "through_ring", [](const zf::FlattenOptions& o) { return o.read.through_ring; },
          [](zf::FlattenOptions& o, bool v) { o.read.through_ring = v; })
      .def_property(
          "progress", [](const zf::FlattenOptions& o) { return o.read.progress; },
          [](zf::FlattenOptions& o, std::shared_ptr<zf::ReadProgress> v) {
            o.read.progress = std::move(v);
          })
      .def_property(
          "fail_after_bytes", [](const zf::FlattenOptions& o) { return o.read.fail_after_bytes; },
          [](zf::FlattenOptions& o, std::optional<std::uint64_t> v) {
            o.read.fail_after_bytes = v;
          })
      // The read plan by name (None or "auto": the cost model's choice), as `tier`.
      .def_property(
          "read_plan",
          [](const zf::FlattenOptions& o) -> std::optional<std::string> {
            if (!o.tier) return std::nullopt;
            return std::string(zf::tier_name(*o.tier));
          },
          [](zf::FlattenOptions& o, const std::optional<std::string>& name) {
            o.tier.reset();
            if (!name || *name == "auto") return;
            for (zf::Tier t : {zf::Tier::kLoad, zf::Tier::kLoadWhole, zf::Tier::kLoadPartitions}) {
              if (*name == zf::tier_name(t)) o.tier = t;
            }
            if (!o.tier) {
              throw zf::InvalidArgument(
                  "read_plan '" + *name +
                  "': expected None, 'auto', 'load', 'load-whole' or 'load-partitions'");
            }
          })
      // The copies check by name ("sampled", "full", "off").
      .def_property(
          "copies",
          [](const zf::FlattenOptions& o) {
            return std::string(zf::copy_check_name(o.read.copies));
          },
          [](zf::FlattenOptions& o, const std::string& name) {
            o.read.copies = zf::parse_copy_check(name, "copies");
          });
  py::class_<zf::LoadParam>(m, "LoadParam")
      .def(py::init([](const py::kwargs& kw) { return from_kwargs<zf::LoadParam>(kw); }))
      .def_readwrite("name", &zf::LoadParam::name)
      .def_readwrite("shape", &zf::LoadParam::shape)
      .def_readwrite("sources", &zf::LoadParam::sources)
      .def_readwrite("source_shapes", &zf::LoadParam::source_shapes);

  // --- the two doors (engine.h, loader.h) -------------------------------------------------------
  m.def("flatten", &flatten, py::arg("device"), py::arg("comm"), py::arg("ptrs"), py::arg("shapes"),
        py::arg("options"), py::kw_only(), py::arg("release_originals"),
        py::arg("defer_release") = false);
  m.def("load", &load, py::arg("device"), py::arg("comm"), py::arg("checkpoint"), py::arg("params"),
        py::arg("options"));
  m.def("load_partitions", &load_partitions, py::arg("device"), py::arg("comm"),
        py::arg("checkpoint"), py::arg("params"), py::arg("options"));
  m.def("load_shards", &load_shards, py::arg("device"), py::arg("comm"), py::arg("checkpoint"),
        py::arg("params"), py::arg("options"), py::arg("mesh"), py::arg("coords"),
        py::arg("placements"));
  m.def("shards_read_bytes", &shards_read_bytes, py::arg("checkpoint"), py::arg("params"),
        py::arg("mesh"), py::arg("coords"), py::arg("placements"), py::arg("rank"));
  m.def("shard_file_ranges", &shard_file_ranges, py::arg("checkpoint"), py::arg("params"),
        py::arg("mesh"), py::arg("coords"), py::arg("placements"), py::arg("rank"),
        py::arg("dtype"));
  m.def("map_file_ranges", &map_file_ranges, py::arg("checkpoint"), py::arg("ranges"),
        py::arg("threads") = 0, py::arg("progress") = nullptr, py::arg("sole_reader") = false,
        py::arg("cold") = false);
  m.def("local_shard", &local_shard, py::arg("shape"), py::arg("mesh"), py::arg("placements"),
        py::arg("coord"));
  m.def("load_slice", &load_slice, py::arg("device"), py::arg("comm"), py::arg("checkpoint"),
        py::arg("params"), py::arg("options"));
  bind_deepspeed(m);
  // --- layouts and DeepSpeed's release rules (layout.h, release.h) -----------------------------
  m.def(
      "layout_json",
      [](const std::vector<std::uint64_t>& numels, const zf::LayoutOptions& options) {
        zf::validate(options);
        return parse_json(zf::Layout::compute(numels, options).to_json());
      },
      py::arg("numels"), py::arg("options"));
  py::class_<zf::ReleaseRules>(m, "ReleaseRules")
      .def_readonly("release", &zf::ReleaseRules::release)
      .def_readonly("rules", &zf::ReleaseRules::rules)
      .def_readonly("tested", &zf::ReleaseRules::tested)
      .def_readonly("skips_zero_element", &zf::ReleaseRules::skips_zero_element)
      .def_readonly("has_parameter_alignment", &zf::ReleaseRules::has_parameter_alignment)
      .def_readonly("padding_on_last_rank", &zf::ReleaseRules::padding_on_last_rank)
      .def_readonly("checks_accelerator_memory", &zf::ReleaseRules::checks_accelerator_memory)
      .def("to_dict", &rules_dict)
      .def("__repr__", [](const zf::ReleaseRules& r) {
        return "ReleaseRules(release='" + r.release + "', rules='" + r.rules + "')";
      });
  m.def("deepspeed_rules", &zf::deepspeed_rules, py::arg("release"));
  m.def("default_deepspeed_rules", &zf::default_deepspeed_rules,
        py::arg("installed_version") = std::string_view{});
  m.def(
      "select_for_release",
      [](const std::vector<std::uint64_t>& numels, const std::vector<bool>& frozen,
         const zf::ReleaseRules& rules) {
        const zf::ReleaseSelection s = zf::select_for_release(numels, frozen, rules);
        py::list left_out;
        for (const auto& [i, why] : s.left_out) {
          left_out.append(py::make_tuple(i, std::string(zf::left_out_name(why))));
        }
        return py::make_tuple(s.kept, left_out);
      },
      py::arg("numels"), py::arg("frozen"), py::arg("rules"));
  m.def("check_release_options", &zf::check_release_options, py::arg("options"), py::arg("rules"));
  m.def(
      "release_layout_json",
      [](const std::vector<std::uint64_t>& numels, const std::vector<bool>& frozen,
         const zf::LayoutOptions& options, const zf::ReleaseRules& rules) {
        zf::validate(options);
        std::ostringstream out;
        zf::layout_for_release(numels, frozen, options, rules).write_json(out);
        return parse_json(out.str());
      },
      py::arg("numels"), py::arg("frozen"), py::arg("options"), py::arg("rules"));
  m.attr("tested_deepspeed_releases") = zf::tested_deepspeed_releases();
  m.def("zero3_layout", &zero3_layout, py::arg("groups"), py::arg("world"),
        py::arg("sub_group_size"), py::arg("rank"));

  // --- the environment --------------------------------------------------------------------------
  m.def("default_threads",
        [](unsigned local_ranks) { return zf::default_num_threads(local_ranks); });
  // Ranks on this host as the launcher says (ZEROFLAT_LOCAL_RANKS, OMPI_COMM_WORLD_LOCAL_SIZE,
  // MPI_LOCALNRANKS, LOCAL_WORLD_SIZE), or None: the one reading of the environment.
  m.def("local_ranks", []() -> std::optional<unsigned> { return zf::runtime_env().local_ranks; });
  m.attr("max_threads") = zf::kMaxThreads;
  m.attr("__version__") = ZEROFLAT_VERSION;
}
