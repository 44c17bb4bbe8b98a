// zeroflat._C: the engine for PyTorch. Memory comes from torch's allocator (CPU, or the CUDA
// caching allocator), copies run on zeroflat's own device of the same kind, collectives go back
// to Python (torch.distributed), and the planner and executor are the library's.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "device/accounting.h"
#include "zeroflat/comm.h"
#include "zeroflat/config.h"
#include "zeroflat/device.h"
#include "zeroflat/error.h"
#include "zeroflat/executor.h"
#include "zeroflat/layout.h"
#include "zeroflat/plan.h"
#include "zeroflat/plan_json.h"
#include "zeroflat/probe.h"
#include "zeroflat/runtime.h"

namespace py = pybind11;
namespace zf = zeroflat;
using Json = nlohmann::ordered_json;

namespace {

zf::DType dtype_of(const std::string& name) {
  return zf::parse_dtype(name);
}

// Device memory from torch's allocator, kept alive here until released; everything else (the
// gather, copies, up-casts, checksums, host staging) on zeroflat's device of the same kind.
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
      t = at::empty({static_cast<std::int64_t>(num_bytes == 0 ? 1 : num_bytes)},
                    at::TensorOptions().dtype(at::kByte).device(device_));
    } catch (const c10::Error& e) {
      throw zf::OutOfMemory(name() + ": torch could not allocate " + std::to_string(num_bytes) +
                            " bytes: " + e.what_without_backtrace());
    }
    void* p = t.data_ptr();
    std::lock_guard<std::mutex> lock(mutex_);
    tensors_[p] = std::move(t);
    bytes_.add(num_bytes);
    return p;
  }
  void release(void* ptr, std::uint64_t num_bytes) noexcept override {
    if (ptr == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (tensors_.erase(ptr) > 0) bytes_.sub(num_bytes);
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
    info.allocated_bytes = bytes_.current();
    info.peak_allocated_bytes = bytes_.peak();
    return info;
  }
  void synchronize() override { inner_->synchronize(); }

  // The group's original parameters are torch's, not this device's: they are counted while the
  // steps run (from before the first step until the release), so that the device's peak is the
  // memory model's, originals included.
  void count_originals(std::uint64_t bytes) { bytes_.add(bytes); }
  void uncount_originals(std::uint64_t bytes) { bytes_.sub(bytes); }

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
  zf::detail::ByteCounter bytes_;
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

// Plans and runs one group on this rank. Returns a JSON document (the plan, the outcome, the
// flat buffer's address) for the Python layer; raises only for bad input.
py::tuple flatten(TorchDevice& device, py::object comm_impl, std::uint64_t rank,
                  const std::vector<std::uintptr_t>& ptrs, const std::vector<std::uint64_t>& numels,
                  std::uint64_t dp, bool round_robin, std::uint64_t alignment_factor,
                  const std::string& dtype, std::uint64_t param_align_bytes,
                  std::uint64_t capacity_bytes, std::uint64_t free_bytes,
                  std::optional<std::uint64_t> margin_bytes, std::uint64_t host_free_bytes,
                  std::uint64_t local_ranks, bool integrated, const std::string& tier,
                  std::optional<std::size_t> fault_step,
                  const std::function<void()>& release_originals) {
  const zf::LayoutOptions options =
      layout_options(dp, round_robin, alignment_factor, dtype, param_align_bytes);
  if (ptrs.size() != numels.size()) throw zf::InvalidArgument("pointers and numels differ");
  const zf::Layout layout = zf::Layout::compute(numels, options);
  std::vector<zf::TensorRef> params;
  std::uint64_t model_bytes = 0;
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    params.push_back(zf::TensorRef{reinterpret_cast<void*>(ptrs[i]),
                                   numels[i],
                                   {static_cast<std::int64_t>(numels[i])},
                                   options.dtype,
                                   &device});
    model_bytes += numels[i] * zf::element_size(options.dtype);
  }
  std::unique_ptr<PyCommunicator> comm;
  if (!comm_impl.is_none()) comm = std::make_unique<PyCommunicator>(comm_impl);

  zf::PlanInput in;
  in.layout = layout;
  in.original_bytes = model_bytes;
  in.capacity_bytes = capacity_bytes;
  in.free_bytes = free_bytes;
  in.margin_bytes = margin_bytes.value_or(zf::default_margin(capacity_bytes));
  in.host_free_bytes = host_free_bytes;
  in.rank = rank;
  in.local_ranks = local_ranks;
  in.integrated = integrated && tier == "auto";
  in.bandwidths = zf::generic_preset(capacity_bytes).bandwidths;
  if (tier != "auto") {
    in.forced = zf::try_parse_tier(tier);
    if (!in.forced) {
      throw zf::InvalidArgument("tier '" + tier +
                                "': expected auto, device, sharded, staged or host");
    }
  }
  const zf::Plan plan = zf::plan_group(in);
  Json doc = zeroflat::cli::plan_json(plan, in);
  const zf::Candidate* chosen = plan.chosen_candidate();
  if (chosen == nullptr) {
    doc["outcome"] = "infeasible";
    return py::make_tuple(doc.dump(), py::none());
  }
  device.count_originals(model_bytes);
  const std::uint64_t resident = device.memory_info().allocated_bytes;
  bool released = false;
  zf::ExecuteOptions opts;
  opts.fault_step = fault_step;
  zf::Execution ex;
  {
    py::gil_scoped_release nogil;
    ex = zf::execute(
        chosen->steps, layout, rank, params, device, comm.get(),
        [&] {
          py::gil_scoped_acquire gil;
          release_originals();
          device.uncount_originals(model_bytes);
          released = true;
        },
        opts);
  }
  if (!released) device.uncount_originals(model_bytes);
  doc["outcome"] = std::string(zf::outcome_name(ex.outcome));
  doc["error"] = ex.error;
  doc["failed_step"] = ex.failed_step ? Json(*ex.failed_step) : Json();
  doc["failed_rank"] = ex.failed_rank;
  doc["seconds"] = ex.seconds;
  doc["step_seconds"] = ex.step_seconds;
  doc["predicted_peak_device_bytes"] =
      zf::simulate(chosen->steps, resident, model_bytes, dp).peak_device_bytes;
  doc["measured_peak_device_bytes"] = ex.measured_peak_device_bytes;
  doc["predicted_host_bytes"] = chosen->profile.peak_host_bytes;
  doc["host_bytes"] = ex.measured_peak_host_bytes;
  // The flat buffer's tensor goes to Python; the executor's handle on it is dropped after.
  py::object flat = py::none();
  if (ex.group.flat) {
    flat = py::cast(device.tensor(reinterpret_cast<std::uintptr_t>(ex.group.flat.data())));
  }
  return py::make_tuple(doc.dump(), flat);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroflat engine for PyTorch (use the zeroflat package, not this module)";
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
      .def("allocated_bytes", [](TorchDevice& d) { return d.memory_info().allocated_bytes; });
  m.def("flatten", &flatten, py::arg("device"), py::arg("comm"), py::arg("rank"), py::arg("ptrs"),
        py::arg("numels"), py::arg("dp"), py::arg("round_robin"), py::arg("alignment_factor"),
        py::arg("dtype"), py::arg("param_align_bytes"), py::arg("capacity_bytes"),
        py::arg("free_bytes"), py::arg("margin_bytes"), py::arg("host_free_bytes"),
        py::arg("local_ranks"), py::arg("integrated"), py::arg("tier"), py::arg("fault_step"),
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
  m.def("host_memory", [] {
    const zf::ProbeResult r = zf::probe_host(zf::system_host_sources());
    return py::make_tuple(r.total_bytes, r.free_bytes, r.used);
  });
  m.def("default_threads",
        [](unsigned local_ranks) { return zf::default_num_threads(local_ranks); });
  // Ranks on this host as the launcher says (ZEROFLAT_LOCAL_RANKS, OMPI_COMM_WORLD_LOCAL_SIZE,
  // MPI_LOCALNRANKS, LOCAL_WORLD_SIZE), or None: the one reading of the environment.
  m.def("local_ranks", []() -> std::optional<unsigned> { return zf::runtime_env().local_ranks; });
  m.attr("__version__") = ZEROFLAT_VERSION;
}
