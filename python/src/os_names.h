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

// The other way: text from Python that may quote such a name (an error naming a path), as the
// bytes os.fsencode makes of it; bytes as they are.
inline std::string os_bytes(pybind11::handle text) {
  if (PyBytes_Check(text.ptr())) return pybind11::reinterpret_borrow<pybind11::bytes>(text);
  PyObject* b = PyUnicode_AsEncodedString(text.ptr(), "utf-8", "surrogateescape");
  if (b == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::bytes>(b);
}

inline std::vector<std::string> os_bytes_list(pybind11::handle texts) {
  std::vector<std::string> out;
  for (pybind11::handle t : texts) out.push_back(os_bytes(t));
  return out;
}

}  // namespace zeroflat_python
