// zeroflat._C: the engine for PyTorch. Memory comes from torch's allocator (CPU, or the CUDA
// caching allocator), copies run on zeroflat's own device of the same kind, collectives go back
// to Python (torch.distributed), and everything else is the library's front doors (engine.h,
// loader.h): probe, agreement, plan, execution, master partition; and DeepSpeed's release rules
// (layout.h). Options cross as the library's own structs (FlattenOptions, LoadOptions, ...,
// made from keyword arguments), errors as zeroflat's exception classes. Only the public API is
// used. This file makes the module: its error classes, then each area's bindings (bind.h lists
// the files, one per area), then the environment.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>

#include "bind.h"

using namespace zeroflat_python;  // NOLINT: the module's own namespace

namespace {

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroflat engine for PyTorch (use the zeroflat package, not this module)";

  // --- errors (common.h) -------------------------------------------------------------------------
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
  errors.io_error = new_error(
      m, "IoError", {errors.error, PyExc_OSError},
      "The system failed a write, an fsync or a rename (no space, an I/O error, a permission); "
      "the message names the file and the step. Also an OSError.");
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
    } catch (const zf::IoError& e) {
      set_error(errors.io_error, e.what());
    } catch (const zf::Error& e) {
      set_error(errors.error, e.what());
    }
  });

  bind_device(m);
  bind_checkpoints(m);
  bind_options(m);
  bind_loads(m);
  bind_deepspeed(m);
  bind_save(m);
  bind_layouts(m);

  // --- the environment --------------------------------------------------------------------------
  m.def("default_threads",
        [](unsigned local_ranks) { return zf::default_num_threads(local_ranks); });
  // Ranks on this host as the launcher says (ZEROFLAT_LOCAL_RANKS, OMPI_COMM_WORLD_LOCAL_SIZE,
  // MPI_LOCALNRANKS, LOCAL_WORLD_SIZE), or None: the one reading of the environment.
  m.def("local_ranks", []() -> std::optional<unsigned> { return zf::runtime_env().local_ranks; });
  m.attr("max_threads") = zf::kMaxThreads;
  m.attr("__version__") = ZEROFLAT_VERSION;
}
