// Publishing a checkpoint (save.h): what the drop-in's save_checkpoint calls around DeepSpeed's
// own writes. The fsyncs and renames run without the GIL.
#include "bind.h"
#include "zeroflat/probe.h"
#include "zeroflat/save.h"

namespace zeroflat_python {
namespace {

// (path, pickle bytes, [(key, address, size)]) from Python: the addresses are of staged memory
// the Python side keeps alive until the save is waited for.
zf::StagedFile staged_file_from(const py::tuple& t) {
  zf::StagedFile f;
  f.path = t[0].cast<std::string>();
  f.pickle = t[1].cast<std::string>();
  for (const py::handle& s : t[2].cast<py::list>()) {
    const py::tuple st = s.cast<py::tuple>();
    zf::StagedStorage storage;
    storage.key = st[0].cast<std::string>();
    storage.data = reinterpret_cast<const std::byte*>(st[1].cast<std::uintptr_t>());
    storage.size = st[2].cast<std::uint64_t>();
    if (st.size() > 3) storage.parts = st[3].cast<unsigned>();
    f.storages.push_back(std::move(storage));
  }
  return f;
}

// [(path, offset, address, size)] -> another rank's parts of the first rank's shared records.
std::vector<zf::SharedPart> shared_parts_from(const py::list& parts) {
  std::vector<zf::SharedPart> out;
  for (const py::handle& h : parts) {
    const py::tuple t = h.cast<py::tuple>();
    zf::SharedPart part;
    part.path = t[0].cast<std::string>();
    part.offset = t[1].cast<std::uint64_t>();
    part.data = reinterpret_cast<const std::byte*>(t[2].cast<std::uintptr_t>());
    part.size = t[3].cast<std::uint64_t>();
    out.push_back(std::move(part));
  }
  return out;
}

py::dict save_outcome_dict(const zf::SaveOutcome& o) {
  py::dict d;
  d["error"] = o.error;
  d["error_code"] = o.error_code;
  d["failed_rank"] = o.failed_rank;
  d["published"] = o.published;
  d["replaced"] = o.replaced;
  d["exchanged"] = o.exchanged;
  d["bytes"] = o.bytes;
  d["direct_bytes"] = o.direct_bytes;
  d["seconds"] = o.seconds;
  d["phases"] = py::dict(py::arg("write") = o.write_seconds, py::arg("sync") = o.sync_seconds,
                         py::arg("wait") = o.wait_seconds, py::arg("publish") = o.publish_seconds);
  return d;
}

}  // namespace

void bind_save(py::module_& m) {
  m.def(
      "stage_copies",
      [](const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::uint64_t>>& copies,
         unsigned threads) {
        std::vector<zf::StageCopy> c;
        c.reserve(copies.size());
        for (const auto& [to, from, size] : copies) {
          c.push_back({reinterpret_cast<std::byte*>(to), reinterpret_cast<const std::byte*>(from), size});
        }
        py::gil_scoped_release nogil;
        zf::stage_copies(c, threads);
      },
      py::arg("copies"), py::arg("threads"));
  m.def(
      "write_torch_file",
      [](const py::tuple& file) {
        zf::StagedFile f = staged_file_from(file);
        py::gil_scoped_release nogil;
        return zf::write_torch_file(f);
      },
      py::arg("file"));
  // items: [(bytes, None)] for a bytes item, [(pickle, [(key, address, size)])] for a torch.save
  // archive of staged storages (alive until it returns). Returns [(offset, length)].
  m.def(
      "write_appended",
      [](const std::string& path, const py::list& items, bool sync, const std::string& priority) {
        const zf::WritePriority p = zf::parse_write_priority(priority);
        std::vector<zf::StagedFile> archives;
        std::vector<std::string> raw;
        archives.reserve(items.size());
        raw.reserve(items.size());
        std::vector<zf::AppendedItem> out;
        for (const py::handle& h : items) {
          const py::tuple t = h.cast<py::tuple>();
          if (t.size() != 2) throw zf::InvalidArgument("write_appended: each item is (bytes, records or None)");
          zf::AppendedItem item;
          if (t[1].is_none()) {
            raw.push_back(t[0].cast<std::string>());
            item.data = reinterpret_cast<const std::byte*>(raw.back().data());
            item.size = raw.back().size();
          } else {
            archives.push_back(staged_file_from(py::make_tuple("archive", t[0], t[1])));
            item.archive = &archives.back();
          }
          out.push_back(item);
        }
        std::vector<zf::ItemSpan> spans;
        {
          py::gil_scoped_release nogil;
          spans = zf::write_appended(path, out, sync, p);
        }
        py::list result;
        for (const zf::ItemSpan& s : spans) result.append(py::make_tuple(s.offset, s.length));
        return result;
      },
      py::arg("path"), py::arg("items"), py::arg("sync"), py::arg("priority"));
  // Free host memory for this rank (the probe's: MemAvailable and the cgroup's room, shared
  // among the ranks on this host): what a save's staging may take.
  m.def("host_free_bytes", [] {
    py::gil_scoped_release nogil;
    return zf::probe_host(zf::system_host_sources()).free_bytes;
  });
  m.def(
      "share_range",
      [](std::uint64_t size, unsigned parts, unsigned k) {
        if (parts == 0 || k >= parts) throw zf::InvalidArgument("part " + std::to_string(k) + " of " + std::to_string(parts));
        const zf::ShareRange r = zf::share_range(size, parts, k);
        return py::make_tuple(r.begin, r.end);
      },
      py::arg("size"), py::arg("parts"), py::arg("k"));
  m.def(
      "torch_file_data_offsets",
      [](const py::tuple& file) {
        return zf::torch_file_data_offsets(staged_file_from(file));
      },
      py::arg("file"));
  // Direct writes (save.h): the page size the staged bytes of a large record are placed at the
  // same place within as the record's data in its file, and how large a record must be.
  m.attr("SAVE_DIRECT_ALIGN") = zf::kDirectAlign;
  m.attr("SAVE_DIRECT_MIN_BYTES") = zf::kDirectMinBytes;
  m.def("save_direct_io", [] { return zf::runtime_env().save_io == zf::RuntimeEnv::SaveIo::kDirect; });
  m.def(
      "crc32",
      [](const py::bytes& data, std::uint32_t crc) {
        const std::string_view v(data);
        return zf::crc32(crc, v.data(), v.size());
      },
      py::arg("data"), py::arg("crc") = 0);
  m.def("crc32_combine", &zf::crc32_combine, py::arg("first"), py::arg("second"),
        py::arg("second_bytes"));
  py::class_<zf::BackgroundSave>(m, "BackgroundSave")
      .def(py::init<>())
      .def(
          "start",
          [](zf::BackgroundSave& self, const std::string& dir, const std::string& partial,
             const std::string& tag, int rank, int world, bool save_latest, const std::string& priority,
             double timeout_seconds, const py::list& files, const py::list& parts, bool streamed) {
            zf::SaveJob job;
            job.dir = dir;
            job.partial = partial;
            job.tag = tag;
            job.rank = rank;
            job.world = world;
            job.save_latest = save_latest;
            job.priority = zf::parse_write_priority(priority);
            job.timeout_seconds = timeout_seconds;
            for (const py::handle& f : files) job.files.push_back(staged_file_from(f.cast<py::tuple>()));
            job.shared_parts = shared_parts_from(parts);
            job.streamed = streamed;
            self.start(std::move(job));
          },
          py::arg("dir"), py::arg("partial"), py::arg("tag"), py::arg("rank"), py::arg("world"),
          py::arg("save_latest"), py::arg("priority"), py::arg("timeout_seconds"),
          py::arg("files"), py::arg("parts") = py::list(), py::arg("streamed") = false)
      // A streamed save's next file (path, pickle, [(key, address, size, parts)]): its staged
      // bytes alive and unchanged until files_written passes it; first: written before the
      // files not yet begun (one written from the caller's tensors: wait for pending_first).
      .def(
          "add_file",
          [](zf::BackgroundSave& self, const py::tuple& file, bool first) {
            self.add_file(staged_file_from(file), first);
          },
          py::arg("file"), py::arg("first") = false)
      .def(
          "seal", [](zf::BackgroundSave& self, const py::list& parts) { self.seal(shared_parts_from(parts)); },
          py::arg("parts") = py::list())
      .def_property_readonly("pending_first", &zf::BackgroundSave::pending_first)
      .def("cancel", &zf::BackgroundSave::cancel)
      .def("wait",
           [](zf::BackgroundSave& self) {
             zf::SaveOutcome o;
             {
               py::gil_scoped_release nogil;
               o = self.wait();
             }
             return save_outcome_dict(o);
           })
      .def_property_readonly("finished", &zf::BackgroundSave::finished)
      .def_property_readonly("bytes_written", &zf::BackgroundSave::bytes_written)
      .def_property_readonly("bytes_total", &zf::BackgroundSave::bytes_total)
      .def_property_readonly("files_written", &zf::BackgroundSave::files_written);
  m.def("partial_tag_name", &zf::partial_tag_name, py::arg("tag"));
  m.def(
      "remove_partial",
      [](const std::string& dir, const std::string& partial) {
        py::gil_scoped_release nogil;
        zf::remove_partial(dir, partial);
      },
      py::arg("dir"), py::arg("partial"));
  m.def(
      "remove_partials",
      [](const std::string& dir) {
        py::gil_scoped_release nogil;
        return zf::remove_partials(dir);
      },
      py::arg("dir"));
  m.def("finish_removals", [] {
    py::gil_scoped_release nogil;
    zf::finish_removals();
  });
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
