// Names of the operating system's (paths, file names) handed to Python as os.fsdecode makes them:
// a byte that is not UTF-8 becomes a surrogate escape, which os.fsencode and open() turn back
// into the same byte. pybind11's std::string caster decodes strictly and would raise instead.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

namespace zeroflat_python {

inline pybind11::str os_name(const std::string& name) {
  PyObject* o = PyUnicode_DecodeFSDefaultAndSize(name.data(), static_cast<Py_ssize_t>(name.size()));
  if (o == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::str>(o);
}

inline pybind11::list os_names(const std::vector<std::string>& names) {
  pybind11::list out;
  for (const std::string& n : names) out.append(os_name(n));
  return out;
}

}  // namespace zeroflat_python
