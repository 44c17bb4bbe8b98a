// Publishing a checkpoint (save.h): what the drop-in's save_checkpoint calls around DeepSpeed's
// own writes. The fsyncs and renames run without the GIL.
#include "bind.h"
#include "zeroflat/save.h"

namespace zeroflat_python {

void bind_save(py::module_& m) {
  m.def("partial_tag_name", &zf::partial_tag_name, py::arg("tag"));
  m.def(
      "remove_partial",
      [](const std::string& dir, const std::string& partial) {
        py::gil_scoped_release nogil;
        zf::remove_partial(dir, partial);
      },
      py::arg("dir"), py::arg("partial"));
  m.def(
      "sync_files",
      [](const std::vector<std::string>& paths) {
        py::gil_scoped_release nogil;
        zf::sync_files(paths);
      },
      py::arg("paths"));
  m.def(
      "sync_tree",
      [](const std::string& dir) {
        py::gil_scoped_release nogil;
        zf::sync_tree(dir);
      },
      py::arg("dir"));
  // (replaced, exchanged): whether a tag of that name was there, and whether it was swapped out
  // in one atomic rename.
  m.def(
      "publish_tag",
      [](const std::string& dir, const std::string& partial, const std::string& tag) {
        zf::Published p;
        {
          py::gil_scoped_release nogil;
          p = zf::publish_tag(dir, partial, tag);
        }
        return py::make_tuple(p.replaced, p.exchanged);
      },
      py::arg("dir"), py::arg("partial"), py::arg("tag"));
  m.def(
      "write_latest",
      [](const std::string& dir, const std::string& tag) {
        py::gil_scoped_release nogil;
        zf::write_latest(dir, tag);
      },
      py::arg("dir"), py::arg("tag"));
  m.def("save_step", &zf::save_step, py::arg("step"), py::arg("path"));
  m.def("set_save_fault_for_testing", &zf::set_save_fault_for_testing, py::arg("spec"));
}

}  // namespace zeroflat_python
