// zeroflat._C's DeepSpeed checkpoints: torch.save files read without running them (the
// library's private reader, model/torch_file.h) and DeepSpeed checkpoint folders
// (deepspeed_checkpoint.h), as Python values. A saved state's small values (steps, a scheduler's
// numbers, a loss scaler) become Python objects here, tensors among them read from their bytes;
// instances of the classes a checkpoint may name come as dicts for the caller to rebuild from
// its own classes. Besides the public API, only the reader and the checkpoints' saved states
// (source/saved_state.h) are used here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <filesystem>
#include <string>
#include <vector>

#include "model/torch_file.h"
#include "source/saved_state.h"
#include "zeroflat/common.h"
#include "zeroflat/dcp_checkpoint.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/resume.h"
#include "bind.h"
#include "os_names.h"

namespace zeroflat_python {
namespace {

at::ScalarType scalar_type_named(const std::string& name, const std::string& where) {
  static const std::pair<const char*, at::ScalarType> kTypes[] = {
      {"bf16", at::kBFloat16}, {"fp16", at::kHalf},     {"fp32", at::kFloat},
      {"float64", at::kDouble}, {"int64", at::kLong},    {"int32", at::kInt},
      {"int16", at::kShort},   {"int8", at::kChar},     {"uint8", at::kByte},
      {"bool", at::kBool},     {"complex64", at::kComplexFloat},
      {"complex128", at::kComplexDouble}};
  for (const auto& [n, t] : kTypes) {
    if (name == n) return t;
  }
  throw zf::InvalidArgument(where + ": a tensor of dtype " + name + " has no torch type here");
}

// One value of a saved state as a Python object: containers as Python's, tensors read from
// their bytes, and the few values that name code made here, each only as its row of the
// reader's allow-list says (torch_global_of: the row the reader resolved, never text of the
// file): a dtype as itself, an enum member by its checked name, torch.device from its checked
// arguments, an instance of an allowed class by __new__ and its saved attributes (none of the
// class's code runs). A dict of the file is a dict, whatever its keys.
// The bytes the tensors of one value may take in memory: the file's own size and 64 MiB more.
// An expanded tensor (stride 0) yields more elements than its file holds; a state of many of
// them could otherwise ask for any amount of memory.
struct Budget {
  std::uint64_t left;
  explicit Budget(const zf::TorchFile& f) : left(f.file_bytes + (std::uint64_t{64} << 20)) {}
};

py::object to_python(const zf::TorchFile& f, const zf::TorchValue& v, Budget& budget) {
  using K = zf::TorchKind;
  switch (v.kind) {
    case K::kNone:
      return py::none();
    case K::kBool:
      return py::bool_(v.boolean);
    case K::kInt:
      return py::int_(v.integer);
    case K::kFloat:
      return py::float_(v.real);
    case K::kString:
      return py::str(v.text);
    case K::kBytes:
      return py::bytes(v.text);
    case K::kList:
    case K::kTuple: {
      py::list items;
      for (const zf::TorchValue& x : v.items) items.append(to_python(f, x, budget));
      if (v.text == "set") return py::set(items);
      if (v.text == "frozenset") return py::module_::import("builtins").attr("frozenset")(items);
      if (v.text == "torch.Size") return py::module_::import("torch").attr("Size")(items);
      if (v.kind == K::kTuple) return py::tuple(items);
      return std::move(items);
    }
    case K::kDict: {
      py::object d = v.text == "collections.OrderedDict"
                         ? py::module_::import("collections").attr("OrderedDict")()
                         : py::dict();
      for (const auto& [key, value] : v.entries) d[to_python(f, key, budget)] = to_python(f, value, budget);
      return d;
    }
    case K::kTensor: {
      const zf::TorchTensor& t = f.tensors.at(static_cast<std::size_t>(v.integer));
      const std::vector<unsigned char> bytes = zf::read_torch_tensor(f, t, budget.left);
      budget.left -= bytes.size();
      std::vector<std::int64_t> shape(t.shape.begin(), t.shape.end());
      at::Tensor out = at::empty(shape, at::TensorOptions().dtype(scalar_type_named(
                                            t.dtype, f.path + ": tensor '" + t.path + "'")));
      if (!bytes.empty()) std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
      return py::cast(out);
    }
    case K::kObject:
    case K::kEnum:
    case K::kGlobal: {
      const zf::TorchGlobal* g = zf::torch_global_of(v);
      if (g == nullptr) {
        throw zf::InvalidArgument(f.path + ": a " + std::string(zf::torch_kind_name(v.kind)) +
                                  " '" + v.text + "' that names no row of the allow-list");
      }
      py::object named = py::module_::import(g->module.c_str()).attr(g->name.c_str());
      switch (g->make) {
        case zf::TorchMake::kGlobal:
          return named;
        case zf::TorchMake::kMember:
          return named.attr(std::string(v.member()).c_str());
        case zf::TorchMake::kCall: {
          py::list args;
          for (const zf::TorchValue& x : v.items) args.append(to_python(f, x, budget));
          return named(*py::tuple(args));
        }
        case zf::TorchMake::kInstance: {
          py::list args;
          for (const zf::TorchValue& x : v.items) args.append(to_python(f, x, budget));
          py::object obj = named.attr("__new__")(named, *py::tuple(args));
          if (!v.entries.empty()) {
            py::dict state;
            for (const auto& [key, value] : v.entries) {
              if (key.kind != K::kString) {
                throw zf::InvalidArgument(f.path + ": an attribute of a saved " + g->name +
                                          " is named by a " +
                                          std::string(zf::torch_kind_name(key.kind)));
              }
              state[py::str(key.text)] = to_python(f, value, budget);
            }
            obj.attr("__dict__").attr("update")(state);
          }
          return obj;
        }
        case zf::TorchMake::kNever:
          break;
      }
      throw zf::InvalidArgument(f.path + ": '" + v.text + "' is never made as a value");
    }
    case K::kStorage:
      break;
  }
  throw zf::InvalidArgument(f.path + ": a storage saved as a value is not read here");
}

py::list params_of(const zf::DeepSpeedGroup& g) {
  py::list out;
  for (const zf::DeepSpeedParam& p : g.params) {
    out.append(py::make_tuple(p.name, p.shape, p.numel, p.offset));
  }
  return out;
}

}  // namespace

namespace {

std::optional<zf::DType> dtype_or_none(const std::optional<std::string>& name, const char* what) {
  if (!name) return std::nullopt;
  const std::optional<zf::DType> t = zf::try_parse_dtype(*name);
  if (!t) throw zf::InvalidArgument(std::string(what) + " '" + *name + "': expected bf16, fp16 or fp32");
  return t;
}

std::string placement_name(const zf::LoadPlacement& p) {
  return std::string(zf::load_placement_name(p.kind));
}

// A DCP item's path in the nested state dict (planner_data) as a tuple of str and int, or None.
py::object dcp_planner_path(const zf::DcpItem& it) {
  if (it.path.empty()) return py::none();
  py::list parts;
  for (const zf::DcpPathPart& p : it.path) {
    parts.append(p.is_index ? py::object(py::int_(p.index)) : py::str(p.key));
  }
  return py::tuple(parts);
}

}  // namespace

void bind_deepspeed(py::module_& m) {
  // The resume's plan (resume.h): what every rank keeps and where it comes from. The caller hands
  // in the running engine's groups and layout choices; Python computes no layout of its own.
  py::class_<zf::ResumeBuffer>(m, "ResumeBuffer")
      .def_readonly("target", &zf::ResumeBuffer::target)
      .def_readonly("group", &zf::ResumeBuffer::group)
      .def_property_readonly("placement",
                             [](const zf::ResumeBuffer& b) { return placement_name(b.placement); })
      .def_readonly("layout", &zf::ResumeBuffer::layout)
      .def_readonly("numels", &zf::ResumeBuffer::numels)
      .def_property_readonly(
          "index", [](const zf::ResumeBuffer& b) -> const zf::CheckpointIndex& { return b.source.index; },
          py::return_value_policy::reference_internal)
      .def_property_readonly("params",
                             [](const zf::ResumeBuffer& b) { return b.source.params; });
  // A tensor the resume reads whole (resume.h's ResumeSmall): its file and place in that file's
  // state, which DeepSpeedCheckpoint.value(file, path) makes.
  py::class_<zf::ResumeSmall>(m, "ResumeSmall")
      .def_readonly("target", &zf::ResumeSmall::target)
      .def_readonly("group", &zf::ResumeSmall::group)
      .def_readonly("name", &zf::ResumeSmall::name)
      .def_property_readonly("file", [](const zf::ResumeSmall& s) { return s.tensor.file; })
      .def_property_readonly("path", [](const zf::ResumeSmall& s) { return s.tensor.path; })
      .def_property_readonly("bytes", [](const zf::ResumeSmall& s) { return s.tensor.bytes; });
  py::class_<zf::ResumePlan>(m, "ResumePlan")
      .def_readonly("stage", &zf::ResumePlan::stage)
      .def_readonly("world", &zf::ResumePlan::world)
      .def_readonly("targets", &zf::ResumePlan::targets)
      .def_readonly("buffers", &zf::ResumePlan::buffers, py::return_value_policy::reference_internal)
      .def_readonly("small", &zf::ResumePlan::small)
      .def_readonly("left_out", &zf::ResumePlan::left_out)
      .def_readonly("params", &zf::ResumePlan::params)
      // This rank's figures: (kept_bytes, share_bytes, read_bytes) over its buffers, from the
      // reads the loader issues.
      .def("rank_bytes", [](const zf::ResumePlan& plan, std::uint64_t rank) {
        zf::ResumeRank r;
        {
          py::gil_scoped_release nogil;
          r = zf::resume_rank(plan, rank);
        }
        return py::make_tuple(r.kept_bytes, r.share_bytes, r.read_bytes);
      })
      // Every byte this rank's buffers read, asked of the kernel at once in file order
      // (resume_read_ahead), from the same figures as rank_bytes: (bytes asked for, read_bytes).
      .def("read_ahead", [](const zf::ResumePlan& plan, std::uint64_t rank) {
        py::gil_scoped_release nogil;
        const zf::ResumeRank r = zf::resume_rank(plan, rank);
        return std::make_pair(zf::resume_read_ahead(plan, r), r.read_bytes);
      });
  m.def(
      "plan_resume",
      [](const zf::DeepSpeedCheckpoint& ck, std::uint64_t world, int stage,
         std::optional<std::vector<std::string>> states, bool module_weights,
         std::vector<std::vector<std::string>> groups,
         std::vector<std::vector<std::uint64_t>> group_numels, bool buffer_per_group,
         std::vector<std::string> frozen, std::vector<std::uint64_t> frozen_numels, std::optional<std::string> frozen_dtype,
         std::optional<std::vector<std::string>> buffers,
         std::optional<bool> round_robin, std::optional<bool> parameter_alignment,
         std::uint64_t alignment_factor, std::optional<std::string> weights_dtype) {
        zf::ResumeOptions o;
        o.world = world;
        o.stage = stage;
        o.states = std::move(states);
        o.module_weights = module_weights;
        o.groups = std::move(groups);
        o.group_numels = std::move(group_numels);
        o.buffer_per_group = buffer_per_group;
        o.frozen = std::move(frozen);
        o.frozen_numels = std::move(frozen_numels);
        o.frozen_dtype = dtype_or_none(frozen_dtype, "frozen_dtype");
        o.buffers = std::move(buffers);
        o.round_robin = round_robin;
        o.parameter_alignment = parameter_alignment;
        o.alignment_factor = alignment_factor;
        o.weights_dtype = dtype_or_none(weights_dtype, "weights_dtype");
        py::gil_scoped_release nogil;
        return zf::plan_resume(ck, o);
      },
      py::arg("checkpoint"), py::kw_only(), py::arg("world"), py::arg("stage") = 0,
      py::arg("states") = py::none(), py::arg("module_weights") = false,
      py::arg("groups") = std::vector<std::vector<std::string>>{},
      py::arg("group_numels") = std::vector<std::vector<std::uint64_t>>{},
      py::arg("buffer_per_group") = false,
      py::arg("frozen") = std::vector<std::string>{},
      py::arg("frozen_numels") = std::vector<std::uint64_t>{},
      py::arg("frozen_dtype") = py::none(), py::arg("buffers") = py::none(),
      py::arg("round_robin") = py::none(),
      py::arg("parameter_alignment") = py::none(), py::arg("alignment_factor") = 2,
      py::arg("weights_dtype") = py::none());

  // The reader's allow-list, the one list of what a file may name (model/torch_file.h), as
  // (module, name, how a value of it is made, what the reader lets it do, why it is listed,
  // where a file may name it).
  m.def("allowed_globals", [] {
    py::list out;
    for (const zf::TorchGlobal& g : zf::torch_globals()) {
      const char* make = g.make == zf::TorchMake::kGlobal     ? "global"
                         : g.make == zf::TorchMake::kMember   ? "member"
                         : g.make == zf::TorchMake::kCall     ? "call"
                         : g.make == zf::TorchMake::kInstance ? "instance"
                                                              : "never";
      out.append(py::make_tuple(g.module, g.name, make, g.does, g.reason, g.files));
    }
    return out;
  });
  py::class_<zf::TorchFile>(m, "TorchFile")
      .def(py::init([](const std::string& path) {
             py::gil_scoped_release nogil;
             return zf::read_torch_file(path);
           }),
           py::arg("path"))
      .def_property_readonly("path", [](const zf::TorchFile& f) { return os_name(f.path); })
      .def_readonly("file_bytes", &zf::TorchFile::file_bytes)
      .def_readonly("globals", &zf::TorchFile::globals)
      .def("has", [](const zf::TorchFile& f, const std::string& path) {
        return f.find(path) != nullptr;
      })
      // The value at `path` ("" the whole state) as a Python object (see to_python).
      .def(
          "value",
          [](const zf::TorchFile& f, const std::string& path) {
            Budget budget(f);
            return to_python(f, f.at(path), budget);
          },
          py::arg("path") = "");

  // A DCP folder (dcp_checkpoint.h): its index as plain values, its chunks as a Checkpoint of
  // tensors for read_boxes, its bytes items as values made as TorchFile.value makes them.
  py::class_<zf::DcpCheckpoint>(m, "DcpCheckpoint")
      .def(py::init([](const std::string& dir, const std::string& index) {
             py::gil_scoped_release nogil;
             return zf::open_dcp_checkpoint(dir, index);
           }),
           py::arg("path"), py::arg("index") = ".metadata")
      .def_property_readonly("path", [](const zf::DcpCheckpoint& c) { return os_name(c.dir); })
      .def_readonly("version", &zf::DcpCheckpoint::version)
      // The save's StorageMeta as (checkpoint_id, save_id, modules), or None.
      .def_property_readonly("storage_meta",
                             [](const zf::DcpCheckpoint& c) -> py::object {
                               if (!c.storage_meta) return py::none();
                               return py::make_tuple(c.checkpoint_id, c.save_id, c.modules);
                             })
      .def_property_readonly("files",
                             [](const zf::DcpCheckpoint& c) { return os_names(c.files); })
      .def_readonly("file_bytes", &zf::DcpCheckpoint::file_bytes)
      // Every item: (fqn, is_bytes, dtype, size, requires_grad, [(offsets, sizes, length,
      // relative path, offset)], planner path or None); dtype is torch's name ("" for bytes
      // items); each chunk's archive is bytes [offset, offset + length) of the file at its
      // path relative to the folder.
      .def("items",
           [](const zf::DcpCheckpoint& ck) {
             py::list out;
             for (const zf::DcpItem& it : ck.items) {
               py::list chunks;
               for (const zf::DcpChunk& c : it.chunks) {
                 chunks.append(py::make_tuple(
                     c.offsets, c.sizes, c.length,
                     os_name(std::filesystem::path(ck.files[c.file]).filename().string()),
                     c.offset));
               }
               out.append(py::make_tuple(it.fqn, it.is_bytes, it.dtype, it.size, it.requires_grad,
                                         chunks, dcp_planner_path(it)));
             }
             return out;
           })
      // DCP's own records of every item, for read_metadata: [(fqn, is_bytes, dtype, size,
      // requires_grad, [ChunkStorageMetadata], planner path or None)], and into `storage`
      // MetadataIndex(fqn, offsets, index) -> _StorageInfo(relative path, offset, length) for
      // each chunk and bytes item. The classes are DCP's, handed in by dcp.py: nothing from the
      // file chooses one. ChunkStorageMetadata and MetadataIndex are made as unpickling makes
      // them (the class's __new__, then its fields set), which is most of the time a large
      // index takes; one torch.Size of the offsets serves the chunk and its key, one str each
      // file's name.
      .def(
          "records",
          [](const zf::DcpCheckpoint& ck, py::handle size_cls, py::handle chunk_cls,
             py::handle index_cls, py::handle info_cls, py::dict storage) {
            auto make = [](py::handle cls, std::initializer_list<std::pair<const char*, py::handle>> fields) {
              PyTypeObject* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
              py::object o = py::reinterpret_steal<py::object>(
                  PyBaseObject_Type.tp_new(type, py::tuple().ptr(), nullptr));
              if (!o) throw py::error_already_set();
              py::dict d = o.attr("__dict__");
              for (const auto& [name, value] : fields) d[name] = value;
              return o;
            };
            auto dims = [&](const std::vector<std::uint64_t>& v) {
              py::tuple t(v.size());
              for (std::size_t i = 0; i < v.size(); ++i) t[i] = py::int_(v[i]);
              return size_cls(t);
            };
            std::vector<py::str> names;
            names.reserve(ck.files.size());
            for (const std::string& f : ck.files) {
              names.push_back(os_name(std::filesystem::path(f).filename().string()));
            }
            py::list out;
            for (const zf::DcpItem& it : ck.items) {
              py::str fqn(it.fqn);
              py::list chunks;
              for (std::size_t i = 0; i < it.chunks.size(); ++i) {
                const zf::DcpChunk& c = it.chunks[i];
                py::object info = info_cls(names[c.file], c.offset, c.length);
                if (it.is_bytes) {
                  storage[make(index_cls, {{"fqn", fqn}, {"offset", py::none()}, {"index", py::none()}})] = info;
                  continue;
                }
                py::object offsets = dims(c.offsets);
                chunks.append(make(chunk_cls, {{"offsets", offsets}, {"sizes", dims(c.sizes)}}));
                storage[make(index_cls, {{"fqn", fqn}, {"offset", offsets}, {"index", py::int_(i)}})] = info;
              }
              out.append(py::make_tuple(fqn, it.is_bytes, it.dtype, it.size, it.requires_grad,
                                        chunks, dcp_planner_path(it)));
            }
            return out;
          },
          py::arg("size"), py::arg("chunk"), py::arg("index"), py::arg("info"),
          py::arg("storage"))
      // The index of the chunk of tensor `fqn` that starts at `offsets`, or None: `hint` (the
      // planner's MetadataIndex.index) is tried first, then the item's chunks in order.
      .def(
          "chunk_at",
          [](const zf::DcpCheckpoint& ck, const std::string& fqn,
             const std::vector<std::uint64_t>& offsets, std::int64_t hint) -> py::object {
            const zf::DcpItem* it = ck.find(fqn);
            if (it == nullptr || it->is_bytes) return py::none();
            if (hint >= 0 && static_cast<std::uint64_t>(hint) < it->chunks.size() &&
                it->chunks[static_cast<std::size_t>(hint)].offsets == offsets) {
              return py::int_(hint);
            }
            for (std::size_t i = 0; i < it->chunks.size(); ++i) {
              if (it->chunks[i].offsets == offsets) return py::int_(i);
            }
            return py::none();
          },
          py::arg("fqn"), py::arg("offsets"), py::arg("hint") = -1)
      // A bytes item's length in its file, or None when `fqn` is no bytes item.
      .def(
          "bytes_length",
          [](const zf::DcpCheckpoint& ck, const std::string& fqn) -> py::object {
            const zf::DcpItem* it = ck.find(fqn);
            if (it == nullptr || !it->is_bytes) return py::none();
            return py::int_(it->chunks.at(0).length);
          },
          py::arg("fqn"))
      // The chunks [(fqn, chunk index)] as a Checkpoint whose tensor i, named "#<i>" (12
      // digits), is chunk i (dcp_chunks_index).
      .def(
          "chunks",
          [](const zf::DcpCheckpoint& ck, const std::vector<std::pair<std::string, std::uint32_t>>& refs) {
            std::vector<zf::DcpChunkRef> r;
            r.reserve(refs.size());
            for (const auto& [fqn, chunk] : refs) r.push_back({fqn, chunk});
            py::gil_scoped_release nogil;
            return zf::dcp_chunks_index(ck, r);
          },
          py::arg("refs"))
      // A bytes item's value, made as TorchFile.value makes one (read_dcp_value).
      .def(
          "value",
          [](const zf::DcpCheckpoint& ck, const std::string& fqn) {
            const zf::TorchFile f = zf::read_dcp_value(ck, fqn);
            Budget budget(f);
            return to_python(f, f.root, budget);
          },
          py::arg("fqn"));

  py::class_<zf::DeepSpeedCheckpoint>(m, "DeepSpeedCheckpoint")
      .def(py::init([](const std::string& dir, const std::optional<std::string>& tag) {
             py::gil_scoped_release nogil;
             return zf::open_deepspeed_checkpoint(dir, tag);
           }),
           py::arg("dir"), py::arg("tag") = std::nullopt)
      .def_property_readonly("dir",
                             [](const zf::DeepSpeedCheckpoint& c) { return os_name(c.dir); })
      .def_property_readonly("tag",
                             [](const zf::DeepSpeedCheckpoint& c) { return os_name(c.tag); })
      .def_property_readonly("format",
                             [](const zf::DeepSpeedCheckpoint& c) {
                               return std::string(zf::deepspeed_format_name(c.format));
                             })
      .def_readonly("zero_stage", &zf::DeepSpeedCheckpoint::zero_stage)
      .def_readonly("world", &zf::DeepSpeedCheckpoint::world)
      .def_readonly("ds_version", &zf::DeepSpeedCheckpoint::ds_version)
      .def_readonly("dtype", &zf::DeepSpeedCheckpoint::dtype)
      .def_readonly("round_robin", &zf::DeepSpeedCheckpoint::round_robin)
      .def_readonly("parameter_alignment", &zf::DeepSpeedCheckpoint::parameter_alignment)
      .def_readonly("sub_group_size", &zf::DeepSpeedCheckpoint::sub_group_size)
      .def_readonly("buffer_names", &zf::DeepSpeedCheckpoint::buffer_names)
      .def_readonly("global_steps", &zf::DeepSpeedCheckpoint::global_steps)
      // Each optimizer group's parameters, in group order: (name, shape, numel, offset).
      .def_property_readonly("groups",
                             [](const zf::DeepSpeedCheckpoint& c) {
                               py::list out;
                               for (const zf::DeepSpeedGroup& g : c.groups) out.append(params_of(g));
                               return out;
                             })
      // The parameters the optimizer does not train: (name, shape, numel).
      .def_property_readonly("frozen",
                             [](const zf::DeepSpeedCheckpoint& c) {
                               py::list out;
                               for (const zf::DeepSpeedFrozen& f : c.frozen) {
                                 out.append(py::make_tuple(f.name, f.shape, f.numel));
                               }
                               return out;
                             })
      // Every file: (path, role, saving rank or -1).
      .def_property_readonly("files",
                             [](const zf::DeepSpeedCheckpoint& c) {
                               py::list out;
                               for (const zf::DeepSpeedFile& f : c.files) {
                                 out.append(py::make_tuple(os_name(f.path), f.role, f.rank));
                               }
                               return out;
                             })
      // The optimizer states saved per partition (the first saving rank's, every rank saves the
      // same), by name: "exp_avg", "exp_avg_sq", "step", ... (universal: its files' stems).
      .def("state_names",
           [](const zf::DeepSpeedCheckpoint& c) {
             std::vector<std::string> out;
             if (!c.sub_groups.empty() && !c.sub_groups.front().ranks.empty()) {
               for (const zf::DeepSpeedState& s : c.sub_groups.front().ranks.front().states) {
                 out.push_back(s.name);
               }
             } else if (!c.universal.empty()) {
               for (const zf::DeepSpeedState& s : c.universal.front().tensors) {
                 if (s.name != "fp32") out.push_back(s.name);
               }
             }
             return out;
           })
      // Of state_names(), those saved per element, partitioned as the fp32 master is (Adam's
      // exp_avg and exp_avg_sq; not step): the targets source() takes. A name is one when every
      // saved partition (universal: every parameter) holds it with the fp32 master's elements
      // (deepspeed_partitioned_states).
      .def("partitioned_states", &zf::deepspeed_partitioned_states)
      // The value at `path` of file `file` (an index into files) as a Python object.
      .def(
          "value",
          [](const zf::DeepSpeedCheckpoint& c, std::size_t file, const std::string& path) {
            const zf::TorchFile& f = zf::deepspeed_file_state(c, file);
            Budget budget(f);
            return to_python(f, f.at(path), budget);
          },
          py::arg("file"), py::arg("path") = "")
      // The keys of the dict (or an object's state) at `path` of file `file`, as path segments
      // (torch_path_segment), in saved order; [] for a value of another kind.
      .def(
          "keys",
          [](const zf::DeepSpeedCheckpoint& c, std::size_t file, const std::string& path) {
            const zf::TorchValue& v = zf::deepspeed_file_state(c, file).at(path);
            std::vector<std::string> out;
            if (v.kind == zf::TorchKind::kDict || v.kind == zf::TorchKind::kObject) {
              for (const auto& [key, value] : v.entries) out.push_back(zf::torch_path_segment(key));
            }
            return out;
          },
          py::arg("file"), py::arg("path") = "")
      .def(
          "has",
          [](const zf::DeepSpeedCheckpoint& c, std::size_t file, const std::string& path) {
            return zf::deepspeed_file_state(c, file).find(path) != nullptr;
          },
          py::arg("file"), py::arg("path"))
      // A target's saved runs as a checkpoint the loader reads, and each named parameter's
      // LoadParam (deepspeed_source).
      .def(
          "source",
          [](const zf::DeepSpeedCheckpoint& c, const std::string& target,
             const std::vector<std::string>& names, const std::vector<std::uint64_t>& numels) {
            zf::DeepSpeedSource s = zf::deepspeed_source(c, target, names, numels);
            return py::make_tuple(std::move(s.index), std::move(s.params));
          },
          py::arg("target"), py::arg("names"), py::arg("numels"));
}

}  // namespace zeroflat_python
