// zeroflat._C's front doors: a group flattened (engine.h), loaded from a checkpoint by the one
// load of loader.h for any placement (whole, a slice, ZeRO-3 partitions, DTensor shards), the
// shards that lie in the files as they are (loader.h), and a shard's extent (dtensor.h). Each
// releases the GIL while the library runs.
#include <functional>
#include <tuple>

#include "bind.h"
#include "os_names.h"

namespace zeroflat_python {
namespace {

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

// A load's placement as Python gives it (zeroflat._C.LoadPlacement): the kind by name and, for
// shards, the mesh, each rank's coordinate and each parameter's placements as torch prints them,
// parsed where they are used (a load's parse error is this rank's local error).
struct PyPlacement {
  std::string kind = "flat";
  std::vector<std::uint64_t> mesh;
  std::vector<std::vector<std::uint64_t>> coords;
  std::vector<std::vector<std::string>> placements;

  zf::LoadPlacement parse() const {
    zf::LoadPlacement p;
    p.kind = zf::parse_load_placement(kind, "placement");
    if (p.kind == zf::LoadPlacement::Kind::kShards) {
      p.shards = zf::ShardSpec{mesh, coords, placements_of(placements)};
    } else if (!mesh.empty() || !coords.empty() || !placements.empty()) {
      throw zf::InvalidArgument("placement '" + kind + "' takes no mesh, coords or placements");
    }
    return p;
  }
};

// A checkpoint's group loaded on this rank as `placement` says (loader.h's load): (report,
// buffer, master, layout) as flatten returns them. `checkpoint` None: this rank could not open
// it (its local_error says why); a placement that does not parse is this rank's local error too.
// Raises InvalidArgument on every rank for a bad group, checkpoint or placement, options that
// differ, or any rank's local_error; Error on every rank when a read fails.
py::tuple load(TorchDevice& device, py::object comm_impl, py::object checkpoint,
               std::vector<zf::LoadParam> params, zf::FlattenOptions o,
               const PyPlacement& placement) {
  static const zf::CheckpointIndex kNone;
  const zf::CheckpointIndex& ck =
      checkpoint.is_none() ? kNone : checkpoint.cast<const zf::CheckpointIndex&>();
  zf::LoadPlacement where;
  if (o.local_error.empty()) {
    try {
      zf::validate(o.layout);
      where = placement.parse();
      if (checkpoint.is_none()) throw zf::InvalidArgument("no checkpoint");
    } catch (const zf::Error& e) {
      o.local_error = e.what();
    }
  }
  if (!o.local_error.empty()) {
    params.clear();
    // The kind as given, so that the ranks compare the same placement's options; no parameter.
    try {
      where.kind = zf::parse_load_placement(placement.kind, "placement");
    } catch (const zf::Error&) {
      where.kind = zf::LoadPlacement::Kind::kFlat;
    }
    where.shards = zf::ShardSpec{placement.mesh, placement.coords, {}};
  }
  std::unique_ptr<PyCommunicator> comm;
  if (!comm_impl.is_none()) comm = std::make_unique<PyCommunicator>(comm_impl);
  zf::FlattenResult r;
  {
    py::gil_scoped_release nogil;
    r = zf::load(ck, params, where, device, comm.get(), o);
  }
  return result_tuple(device, r, parse_json(zf::result_json(r)));
}

// This rank's shards that lie in the checkpoint's files as they are (loader.h's
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
py::list map_file_ranges(
    const zf::CheckpointIndex& ck,
    const std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint64_t>>& ranges,
    unsigned threads, const std::shared_ptr<zf::ReadProgress>& progress, bool sole_reader,
    bool cold) {
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

// The ranks' copies compared in what they took outside a load (loader.h's check_taken_copies):
// `ranges` per rank, (file, offset, bytes, name) of each range it took, in the same order on
// every rank; `mine` this rank's bytes of its own (host tensors); `values` (name, host tensor)
// read whole. Returns the file bytes this rank read to compare. Collective.
std::uint64_t check_taken_copies(
    const zf::CheckpointIndex& ck, py::object comm_impl,
    const std::vector<std::vector<std::tuple<std::uint32_t, std::uint64_t, std::uint64_t,
                                             std::string>>>& ranges,
    const std::vector<torch::Tensor>& mine,
    const std::vector<std::pair<std::string, torch::Tensor>>& values, const std::string& copies) {
  const zf::CopyCheck mode = zf::parse_copy_check(copies, "copies");
  auto bytes_of = [](const torch::Tensor& t, const std::string& what) {
    if (!t.device().is_cpu() || !t.is_contiguous()) {
      throw zf::InvalidArgument("check_taken_copies: " + what +
                                " must be a contiguous host tensor");
    }
    return std::span<const unsigned char>(static_cast<const unsigned char*>(t.data_ptr()),
                                          static_cast<std::size_t>(t.nbytes()));
  };
  zf::TakenBytes taken;
  for (const auto& rank : ranges) {
    taken.ranges.emplace_back();
    taken.what.emplace_back();
    for (const auto& [file, offset, bytes, name] : rank) {
      taken.ranges.back().push_back({file, offset, bytes});
      taken.what.back().push_back(name);
    }
  }
  for (const torch::Tensor& t : mine) taken.mine.push_back(bytes_of(t, "a range's bytes").data());
  for (const auto& [name, t] : values) {
    taken.value_names.push_back(name);
    taken.values.push_back(bytes_of(t, "value '" + name + "'"));
  }
  if (comm_impl.is_none()) return 0;
  PyCommunicator comm(comm_impl);
  py::gil_scoped_release nogil;
  return zf::check_taken_copies(ck, taken, comm, mode);
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

}  // namespace

void bind_loads(py::module_& m) {
  m.def("flatten", &flatten, py::arg("device"), py::arg("comm"), py::arg("ptrs"), py::arg("shapes"),
        py::arg("options"), py::kw_only(), py::arg("release_originals"),
        py::arg("defer_release") = false);
  // A load's placement (loader.h's LoadPlacement): "flat", "slice", "partitions", or "shards"
  // with the mesh, each rank's coordinate and each parameter's placements.
  py::class_<PyPlacement>(m, "LoadPlacement")
      .def(py::init([](const std::string& kind, std::vector<std::uint64_t> mesh,
                       std::vector<std::vector<std::uint64_t>> coords,
                       std::vector<std::vector<std::string>> placements) {
             return PyPlacement{kind, std::move(mesh), std::move(coords), std::move(placements)};
           }),
           py::arg("kind"), py::kw_only(), py::arg("mesh") = std::vector<std::uint64_t>{},
           py::arg("coords") = std::vector<std::vector<std::uint64_t>>{},
           py::arg("placements") = std::vector<std::vector<std::string>>{})
      .def_readonly("kind", &PyPlacement::kind)
      .def_readonly("mesh", &PyPlacement::mesh)
      .def_readonly("coords", &PyPlacement::coords)
      .def_readonly("placements", &PyPlacement::placements)
      .def("check", [](const PyPlacement& p) { p.parse(); })
      .def("__repr__", [](const PyPlacement& p) { return "LoadPlacement('" + p.kind + "')"; });
  // The one load, for every placement.
  m.def("load", &load, py::arg("device"), py::arg("comm"), py::arg("checkpoint"), py::arg("params"),
        py::arg("options"), py::arg("placement"));
  // The file bytes rank `rank` reads for its buffer (load_read_bytes; layout.dp: the world).
  m.def(
      "load_read_bytes",
      [](const zf::CheckpointIndex& ck, const std::vector<zf::LoadParam>& params,
         const PyPlacement& placement, const zf::LayoutOptions& layout, std::uint64_t rank) {
        return zf::load_read_bytes(ck, params, placement.parse(), layout, rank);
      },
      py::arg("checkpoint"), py::arg("params"), py::arg("placement"), py::arg("layout"),
      py::arg("rank"));
  m.def("shard_file_ranges", &shard_file_ranges, py::arg("checkpoint"), py::arg("params"),
        py::arg("mesh"), py::arg("coords"), py::arg("placements"), py::arg("rank"),
        py::arg("dtype"));
  m.def("map_file_ranges", &map_file_ranges, py::arg("checkpoint"), py::arg("ranges"),
        py::arg("threads") = 0, py::arg("progress") = nullptr, py::arg("sole_reader") = false,
        py::arg("cold") = false);
  m.def("check_taken_copies", &check_taken_copies, py::arg("checkpoint"), py::arg("comm"),
        py::arg("ranges"), py::arg("mine"), py::arg("values"), py::arg("copies"));
  m.def("local_shard", &local_shard, py::arg("shape"), py::arg("mesh"), py::arg("placements"),
        py::arg("coord"));
}

}  // namespace zeroflat_python
