// zeroflat._C's checkpoints (checkpoint.h): safetensors and torch files' tensors by name, their
// pieces, and reads into torch tensors.
#include "bind.h"
#include "os_names.h"

namespace zeroflat_python {

void bind_checkpoints(py::module_& m) {
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
}

}  // namespace zeroflat_python
