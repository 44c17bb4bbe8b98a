// zeroflat._C: the engine for PyTorch. Memory comes from torch's allocator (CPU, or the CUDA
// caching allocator), copies run on zeroflat's own device of the same kind, collectives go back
// to Python (torch.distributed), and everything else is the library's front door (engine.h):
// probe, agreement, plan, execution, master partition. Only the public API is used here.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <chrono>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "zeroflat/zeroflat.h"

namespace py = pybind11;
namespace zf = zeroflat;
using Json = nlohmann::ordered_json;

namespace {

zf::DType dtype_of(const std::string& name) {
  return zf::parse_dtype(name);
}

// A uint8 tensor over zeroflat's own host memory (2 MiB-aligned, advised for huge pages, fresh:
// its first touch is the gather's, by every thread of the team on its own byte range), freed by
// torch when the last tensor over it goes. torch's allocator would hand out malloc memory that
// glibc reuses, half faulted in with 4 KiB pages, where advising huge pages is slower than not.
at::Tensor host_tensor(std::uint64_t num_bytes) {
  const std::uint64_t n = num_bytes == 0 ? 1 : num_bytes;
  void* p = zf::allocate_host_memory(n);
  return at::from_blob(
      p, {static_cast<std::int64_t>(n)}, [n](void* q) { zf::release_host_memory(q, n); },
      at::TensorOptions().dtype(at::kByte).device(at::kCPU));
}

// Device memory from torch's allocator (on the CPU, tensors over zeroflat's host memory), kept
// alive here until released; everything else (the gather, copies, up-casts, checksums, host
// staging) on zeroflat's device of the same kind.
class TorchDevice final : public zf::Device {
 public:
  TorchDevice(const std::string& device, unsigned threads) : device_(device) {
    const std::string spec = device_.is_cpu() ? "cpu" : "cuda:" + std::to_string(device_.index());
    inner_ = zf::make_device(spec, zf::DeviceOptions{threads});
  }

  std::string name() const override { return inner_->name(); }
  bool host_accessible() const noexcept override { return inner_->host_accessible(); }

  void* allocate(std::uint64_t num_bytes) override {
    at::Tensor t;
    try {
      t = device_.is_cpu() ? host_tensor(num_bytes)
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
  // The inner device's sources, with what torch knows (its cache) passed as sources too.
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

  // The uint8 tensor that owns an allocation (for the flat buffer handed to Python).
  at::Tensor tensor(std::uintptr_t ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = tensors_.find(reinterpret_cast<void*>(ptr));
    if (it == tensors_.end()) throw zf::InvalidArgument("no allocation of this device there");
    return it->second;
  }

 private:
  at::Device device_;
  std::unique_ptr<zf::Device> inner_;
  std::mutex mutex_;
  std::map<void*, at::Tensor> tensors_;
  std::uint64_t bytes_ = 0;  // under mutex_
  std::uint64_t peak_ = 0;
  void add(std::uint64_t n) {  // caller holds mutex_
    bytes_ += n;
    peak_ = std::max(peak_, bytes_);
  }
};

// A communicator whose collectives a Python object runs (torch.distributed). The executor calls
// it with the GIL released; each call takes it back.
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
      throw zf::CommError(std::string("torch.distributed ") + method + ": " + e.what());
    }
  }
  void reduce(const char* op, std::span<std::uint64_t> values) {
    std::vector<std::uint64_t> in(values.begin(), values.end());
    py::gil_scoped_acquire gil;
    std::vector<std::uint64_t> out;
    try {
      out = impl_.attr("all_reduce")(in, op).cast<std::vector<std::uint64_t>>();
    } catch (py::error_already_set& e) {
      throw zf::CommError(std::string("torch.distributed all_reduce: ") + e.what());
    }
    if (out.size() != values.size()) throw zf::CommError("all_reduce returned the wrong count");
    std::copy(out.begin(), out.end(), values.begin());
  }

  py::object impl_;
  int rank_ = 0;
  int size_ = 1;
};

zf::LayoutOptions layout_options(std::uint64_t dp, bool round_robin, std::uint64_t alignment_factor,
                                 const std::string& dtype, std::uint64_t param_align_bytes) {
  zf::LayoutOptions o;
  o.dp = dp;
  o.round_robin = round_robin;
  o.alignment_factor = alignment_factor;
  o.dtype = dtype_of(dtype);
  o.param_align_bytes = param_align_bytes;
  zf::validate(o);
  return o;
}

// Merges a library JSON document into doc.
void merge(Json& doc, const std::string& text) {
  const Json parsed = Json::parse(text);
  for (const auto& [k, v] : parsed.items()) doc[k] = v;
}

// One group through the front door on this rank. Returns a JSON document (the probe, the plan,
// the outcome) and the flat buffer's and the master's uint8 tensors (None when there is none);
// raises ValueError on every rank for a bad group, options that differ, or any rank's
// local_error.
py::tuple flatten(TorchDevice& device, py::object comm_impl,
                  const std::vector<std::uintptr_t>& ptrs,
                  const std::vector<std::vector<std::int64_t>>& shapes, std::uint64_t dp,
                  bool round_robin, std::uint64_t alignment_factor, const std::string& dtype,
                  std::uint64_t param_align_bytes, const std::string& tier,
                  std::optional<std::uint64_t> margin_bytes, bool master, bool check_values,
                  std::uint64_t framework_cached_free_bytes, std::uint64_t framework_held_bytes,
                  const std::vector<std::string>& names, const std::string& must_match,
                  const std::string& local_error, std::optional<std::size_t> fault_step,
                  bool defer_release, const std::function<void()>& release_originals) {
  zf::FlattenOptions o;
  o.local_error = local_error;
  std::vector<zf::TensorRef> params;
  std::uint64_t model_bytes = 0;
  if (local_error.empty()) {
    try {
      o.layout = layout_options(dp, round_robin, alignment_factor, dtype, param_align_bytes);
      o.tier = zf::parse_tier_choice(tier, "tier");
      if (ptrs.size() != shapes.size()) throw zf::InvalidArgument("pointers and shapes differ");
      for (std::size_t i = 0; i < ptrs.size(); ++i) {
        const std::uint64_t numel = zf::shape_numel(shapes[i]);
        params.push_back(zf::TensorRef{reinterpret_cast<void*>(ptrs[i]), numel, shapes[i],
                                       o.layout.dtype, &device});
        model_bytes += numel * zf::element_size(o.layout.dtype);
      }
    } catch (const zf::Error& e) {
      o.local_error = e.what();
      params.clear();
    }
  }
  if (!o.local_error.empty()) o.layout.dp = dp;  // the agreement still needs the group's size
  o.margin_bytes = margin_bytes;
  o.master = master;
  o.check_values = check_values;
  o.probe.framework_cached_free_bytes = framework_cached_free_bytes;
  o.probe.framework_held_bytes = framework_held_bytes;
  o.names = names;
  o.must_match = must_match;
  o.execute.fault_step = fault_step;
  // defer_release: when the originals' release comes after the buffer is complete (the device
  // tier's last step), the caller rebinds every parameter itself right after, which frees them
  // there (as DeepSpeed's own flatten leaves it): this step does not.
  bool complete = false;
  o.execute.on_step = [&](std::size_t, const zf::Step& step) {
    if (step.op == zf::Op::kRepoint) complete = true;
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
  Json doc;
  doc["probe"] = Json::parse(zf::probe_json(r.probe));
  doc["host_probe"] = Json::parse(zf::probe_json(r.host_probe));
  merge(doc, zf::plan_json(r.plan, r.input));
  if (!r.feasible()) {
    doc["outcome"] = "infeasible";
    return py::make_tuple(doc.dump(), py::none(), py::none());
  }
  const zf::Execution& ex = r.execution;
  doc["outcome"] = std::string(zf::outcome_name(ex.outcome));
  doc["error"] = ex.error;
  doc["failed_step"] = ex.failed_step ? Json(*ex.failed_step) : Json();
  doc["failed_rank"] = ex.failed_rank;
  doc["seconds"] = ex.seconds;
  doc["step_seconds"] = ex.step_seconds;
  doc["predicted_peak_device_bytes"] = r.predicted_peak_device_bytes;
  doc["measured_peak_device_bytes"] = ex.measured_peak_device_bytes;
  doc["predicted_host_bytes"] = r.plan.chosen_candidate()->profile.peak_host_bytes;
  doc["host_bytes"] = ex.measured_peak_host_bytes;
  if (r.value_check.bytes_hashed > 0) {
    doc["value_check_seconds"] = r.value_check.seconds;
    doc["value_check_bytes"] = r.value_check.bytes_hashed;
  }
  if (!r.master_error.empty()) doc["master_error"] = r.master_error;
  if (r.master) doc["master_seconds"] = r.master_seconds;
  doc["release_deferred"] = deferred;
  // The buffers' tensors go to Python; the library's handles on them are dropped after.
  auto owned = [&](const zf::DeviceBuffer& b) -> py::object {
    if (!b) return py::none();
    return py::cast(device.tensor(reinterpret_cast<std::uintptr_t>(b.data())));
  };
  return py::make_tuple(doc.dump(), owned(ex.group.flat), owned(r.master));
}

// A checkpoint's group loaded straight into the flat buffer on this rank (loader.h). Returns a
// JSON document (the probe, the load candidate, bytes read, times, peaks) and the flat buffer's
// and the master's uint8 tensors (None when nothing fits); raises ValueError on every rank for a
// bad group or checkpoint, options that differ, or any rank's local_error; RuntimeError on every
// rank when a read fails.
py::tuple load(TorchDevice& device, py::object comm_impl, const zf::CheckpointIndex& ck,
               const std::vector<std::string>& names,
               const std::vector<std::vector<std::int64_t>>& shapes,
               const std::vector<std::vector<std::string>>& sources, std::uint64_t dp,
               bool round_robin, std::uint64_t alignment_factor, const std::string& dtype,
               std::uint64_t param_align_bytes, std::optional<std::uint64_t> margin_bytes,
               bool master, bool cold, unsigned threads, const std::string& must_match,
               const std::string& local_error) {
  zf::LoadOptions o;
  o.local_error = local_error;
  std::vector<zf::LoadParam> params;
  if (local_error.empty()) {
    try {
      o.layout = layout_options(dp, round_robin, alignment_factor, dtype, param_align_bytes);
      if (names.size() != shapes.size() || names.size() != sources.size()) {
        throw zf::InvalidArgument("names, shapes and sources differ in length");
      }
      for (std::size_t i = 0; i < names.size(); ++i) {
        params.push_back(zf::LoadParam{names[i], shapes[i], sources[i]});
      }
    } catch (const zf::Error& e) {
      o.local_error = e.what();
      params.clear();
    }
  }
  if (!o.local_error.empty()) o.layout.dp = dp;
  o.margin_bytes = margin_bytes;
  o.cold = cold;
  o.threads = threads;
  o.must_match = must_match + (master ? ", master" : "");
  std::unique_ptr<PyCommunicator> comm;
  if (!comm_impl.is_none()) comm = std::make_unique<PyCommunicator>(comm_impl);
  zf::LoadResult r;
  zf::DeviceBuffer fp32;
  double master_seconds = 0;
  std::string master_error;
  {
    py::gil_scoped_release nogil;
    r = zf::load_flat_group(ck, params, device, comm.get(), o);
    if (master && r.feasible()) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        fp32 = zf::make_master_partition(device, r.group, comm ? comm->rank() : 0);
      } catch (const zf::OutOfMemory& e) {
        master_error = std::string("the fp32 master partition does not fit: ") + e.what();
      }
      master_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  Json doc;
  doc["probe"] = Json::parse(zf::probe_json(r.probe));
  doc["plan"] = Json::parse(zf::candidate_json(r.plan, true));
  doc["tier"] = "load";
  if (!r.feasible()) {
    doc["outcome"] = "infeasible";
    doc["reason"] = r.plan.why_not;
    return py::make_tuple(doc.dump(), py::none(), py::none());
  }
  doc["outcome"] = "done";
  doc["bytes_read"] = r.bytes_read;
  doc["reads"] = r.reads;
  doc["page_cache"] = r.page_cache;
  doc["cached_fraction"] = r.cached_fraction;
  doc["read_seconds"] = r.read_seconds;
  doc["allgather_seconds"] = r.allgather_seconds;
  doc["seconds"] = r.seconds;
  doc["predicted_peak_device_bytes"] = r.predicted_peak_device_bytes;
  doc["measured_peak_device_bytes"] = r.measured_peak_device_bytes;
  doc["host_bytes"] = r.measured_peak_host_bytes;
  if (fp32) doc["master_seconds"] = master_seconds;
  if (!master_error.empty()) doc["master_error"] = master_error;
  auto owned = [&](const zf::DeviceBuffer& b) -> py::object {
    if (!b) return py::none();
    return py::cast(device.tensor(reinterpret_cast<std::uintptr_t>(b.data())));
  };
  return py::make_tuple(doc.dump(), owned(r.group.flat), owned(fp32));
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
  py::register_exception<zf::ResourceExhausted>(m, "ResourceExhausted", PyExc_RuntimeError);
  // Library errors become Python exceptions of the matching kind.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const zf::InvalidArgument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const zf::OutOfMemory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const zf::Unsupported& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    }
  });
  py::class_<TorchDevice>(m, "TorchDevice")
      .def(py::init<const std::string&, unsigned>(), py::arg("device"), py::arg("threads"))
      .def_property_readonly("name", &TorchDevice::name)
      .def("checksum",
           [](TorchDevice& d, std::uintptr_t ptr, std::uint64_t n) {
             py::gil_scoped_release nogil;
             return d.checksum(reinterpret_cast<const void*>(ptr), n);
           })
      .def("tensor", &TorchDevice::tensor, py::arg("ptr"))
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
  py::class_<zf::CheckpointIndex>(m, "Checkpoint")
      .def(py::init([](const std::string& path) {
             py::gil_scoped_release nogil;
             return zf::open_checkpoint(path);
           }),
           py::arg("path"))
      .def_readonly("path", &zf::CheckpointIndex::path)
      .def_readonly("files", &zf::CheckpointIndex::files)
      // (name, dtype as stored, shape, bytes, zeroflat dtype or None), in natural name order.
      .def("tensors",
           [](const zf::CheckpointIndex& ck) {
             py::list out;
             for (const zf::CheckpointTensor& t : ck.tensors) {
               py::object type = py::none();
               if (t.type) type = py::str(std::string(zf::dtype_name(*t.type)));
               out.append(py::make_tuple(t.name, t.dtype, t.shape, t.bytes, type));
             }
             return out;
           })
      .def("has", [](const zf::CheckpointIndex& ck,
                     const std::string& name) { return ck.find(name) != nullptr; })
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
        std::optional<zf::DType> to;
        for (zf::DType d : {zf::DType::kBF16, zf::DType::kFP16, zf::DType::kFP32}) {
          if (out.scalar_type() == scalar_type_of(d)) to = d;
        }
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
      });
  m.def("load", &load, py::arg("device"), py::arg("comm"), py::arg("checkpoint"), py::arg("names"),
        py::arg("shapes"), py::arg("sources"), py::arg("dp"), py::arg("round_robin"),
        py::arg("alignment_factor"), py::arg("dtype"), py::arg("param_align_bytes"),
        py::arg("margin_bytes"), py::arg("master"), py::arg("cold"), py::arg("threads"),
        py::arg("must_match"), py::arg("local_error"));
  m.def("flatten", &flatten, py::arg("device"), py::arg("comm"), py::arg("ptrs"), py::arg("shapes"),
        py::arg("dp"), py::arg("round_robin"), py::arg("alignment_factor"), py::arg("dtype"),
        py::arg("param_align_bytes"), py::arg("tier"), py::arg("margin_bytes"), py::arg("master"),
        py::arg("check_values"), py::arg("framework_cached_free_bytes"),
        py::arg("framework_held_bytes"), py::arg("names"), py::arg("must_match"),
        py::arg("local_error"), py::arg("fault_step"), py::arg("defer_release"),
        py::arg("release_originals"));
  m.def(
      "layout_json",
      [](const std::vector<std::uint64_t>& numels, std::uint64_t dp, bool round_robin,
         std::uint64_t alignment_factor, const std::string& dtype,
         std::uint64_t param_align_bytes) {
        return zf::Layout::compute(numels, layout_options(dp, round_robin, alignment_factor, dtype,
                                                          param_align_bytes))
            .to_json();
      },
      py::arg("numels"), py::arg("dp"), py::arg("round_robin"), py::arg("alignment_factor"),
      py::arg("dtype"), py::arg("param_align_bytes"));
  m.def(
      "release_layout_json",
      [](const std::vector<std::uint64_t>& numels, const std::vector<bool>& frozen,
         std::uint64_t dp, bool round_robin, std::uint64_t alignment_factor,
         const std::string& dtype, std::uint64_t param_align_bytes, const std::string& release) {
        const zf::ReleaseLayout rl = zf::layout_for_release(
            numels, frozen,
            layout_options(dp, round_robin, alignment_factor, dtype, param_align_bytes),
            zf::deepspeed_rules(release));
        std::ostringstream out;
        rl.write_json(out);
        return out.str();
      },
      py::arg("numels"), py::arg("frozen"), py::arg("dp"), py::arg("round_robin"),
      py::arg("alignment_factor"), py::arg("dtype"), py::arg("param_align_bytes"),
      py::arg("release"));
  m.def("deepspeed_rules", [](const std::string& release) {
    const zf::ReleaseRules r = zf::deepspeed_rules(release);
    py::dict d;
    d["release"] = r.release;
    d["rules"] = r.rules;
    d["tested"] = r.tested;
    d["skips_zero_element"] = r.skips_zero_element;
    d["has_parameter_alignment"] = r.has_parameter_alignment;
    d["padding_on_last_rank"] = r.padding_on_last_rank;
    return d;
  });
  m.attr("tested_deepspeed_releases") = zf::tested_deepspeed_releases();
  m.def("default_threads",
        [](unsigned local_ranks) { return zf::default_num_threads(local_ranks); });
  // Ranks on this host as the launcher says (ZEROFLAT_LOCAL_RANKS, OMPI_COMM_WORLD_LOCAL_SIZE,
  // MPI_LOCALNRANKS, LOCAL_WORLD_SIZE), or None: the one reading of the environment.
  m.def("local_ranks", []() -> std::optional<unsigned> { return zf::runtime_env().local_ranks; });
  m.attr("max_threads") = zf::kMaxThreads;
  m.attr("__version__") = ZEROFLAT_VERSION;
}
