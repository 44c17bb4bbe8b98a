// zeroflat._C's device (TorchDevice: torch's memory, zeroflat's copies) and the host conversions
// at the engine's speed.
#include "bind.h"
#include "os_names.h"

namespace zeroflat_python {

void bind_device(py::module_& m) {
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
  // float32) element for element (common.h's holds_upcast): one pass, no temporary. Contiguous CPU
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
}

}  // namespace zeroflat_python
