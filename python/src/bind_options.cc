// zeroflat._C's options (engine.h, layout.h, loader.h, common.h): the library's structs, made
// from keyword arguments, with the read options and the probe's context flattened into
// FlattenOptions.
#include "bind.h"
#include "os_names.h"

namespace zeroflat_python {

void bind_options(py::module_& m) {
  py::class_<zf::LayoutOptions>(m, "LayoutOptions")
      .def(py::init([](const py::kwargs& kw) { return from_kwargs<zf::LayoutOptions>(kw); }))
      .def_readwrite("dp", &zf::LayoutOptions::dp)
      .def_readwrite("round_robin", &zf::LayoutOptions::round_robin)
      .def_readwrite("alignment_factor", &zf::LayoutOptions::alignment_factor)
      .def_readwrite("param_align_bytes", &zf::LayoutOptions::param_align_bytes)
      .def_property(
          "dtype", [](const zf::LayoutOptions& o) { return std::string(zf::dtype_name(o.dtype)); },
          [](zf::LayoutOptions& o, const std::string& d) { o.dtype = zf::parse_dtype(d); })
      .def("validate", [](const zf::LayoutOptions& o) { zf::validate(o); });
  // A rank's read progress (common.h), shared with the loads that count it; its counts are
  // read while a load runs on another thread (the loads release the GIL).
  py::class_<zf::ReadProgress, std::shared_ptr<zf::ReadProgress>>(m, "ReadProgress")
      .def(py::init<>())
      .def_property(
          "expected", [](const zf::ReadProgress& p) { return p.expected.load(); },
          [](zf::ReadProgress& p, std::uint64_t v) { p.expected = v; })
      .def_property_readonly("planned", [](const zf::ReadProgress& p) { return p.planned.load(); })
      .def_property_readonly("done", [](const zf::ReadProgress& p) { return p.done.load(); })
      .def_property_readonly("total", &zf::ReadProgress::total);
  m.def("describe_progress", &zf::describe_progress, py::arg("done"), py::arg("total"),
        py::arg("seconds"));
  // The probe's context and the fault injection are flattened into the options (the
  // framework's cache, the step that fails).
  py::class_<zf::FlattenOptions>(m, "FlattenOptions")
      .def(py::init([](const py::kwargs& kw) { return from_kwargs<zf::FlattenOptions>(kw); }))
      .def_readwrite("layout", &zf::FlattenOptions::layout)
      .def_property(
          "tier",
          [](const zf::FlattenOptions& o) -> std::string {
            return o.tier ? std::string(zf::tier_name(*o.tier)) : "auto";
          },
          [](zf::FlattenOptions& o, const std::string& t) {
            o.tier = zf::parse_tier_choice(t, "tier");
          })
      .def_readwrite("margin_bytes", &zf::FlattenOptions::margin_bytes)
      .def_readwrite("master", &zf::FlattenOptions::master)
      .def_readwrite("check_values", &zf::FlattenOptions::check_values)
      .def_readwrite("release", &zf::FlattenOptions::release)
      // Text the ranks compare, and this rank's own error: either may quote a path whose name
      // is not UTF-8 (os.fsdecode's surrogate escapes), taken as its bytes.
      .def_property(
          "must_match", [](const zf::FlattenOptions& o) { return os_names(o.must_match); },
          [](zf::FlattenOptions& o, py::iterable v) { o.must_match = os_bytes_list(v); })
      .def_readwrite("expected_offsets", &zf::FlattenOptions::expected_offsets)
      .def_readwrite("expected_flat_numel", &zf::FlattenOptions::expected_flat_numel)
      .def_readwrite("names", &zf::FlattenOptions::names)
      .def_property(
          "local_error", [](const zf::FlattenOptions& o) { return os_name(o.local_error); },
          [](zf::FlattenOptions& o, py::handle v) { o.local_error = os_bytes(v); })
      .def_property(
          "framework_cached_free_bytes",
          [](const zf::FlattenOptions& o) { return o.probe.framework_cached_free_bytes; },
          [](zf::FlattenOptions& o, std::uint64_t v) { o.probe.framework_cached_free_bytes = v; })
      .def_property(
          "framework_held_bytes",
          [](const zf::FlattenOptions& o) { return o.probe.framework_held_bytes; },
          [](zf::FlattenOptions& o, std::uint64_t v) { o.probe.framework_held_bytes = v; })
      .def_property(
          "fault_step", [](const zf::FlattenOptions& o) { return o.execute.fault_step; },
          [](zf::FlattenOptions& o, std::optional<std::size_t> v) { o.execute.fault_step = v; })
      .def_readwrite("storage_bytes_per_second", &zf::FlattenOptions::storage_bytes_per_second)
      // The read options (engine.h: ReadOptions), flattened into the options.
      .def_property(
          "cold", [](const zf::FlattenOptions& o) { return o.read.cold; },
          [](zf::FlattenOptions& o, bool v) { o.read.cold = v; })
      .def_property(
          "threads", [](const zf::FlattenOptions& o) { return o.read.threads; },
          [](zf::FlattenOptions& o, unsigned v) { o.read.threads = v; })
      .def_property(
          "through_ring", [](const zf::FlattenOptions& o) { return o.read.through_ring; },
          [](zf::FlattenOptions& o, bool v) { o.read.through_ring = v; })
      .def_property(
          "progress", [](const zf::FlattenOptions& o) { return o.read.progress; },
          [](zf::FlattenOptions& o, std::shared_ptr<zf::ReadProgress> v) {
            o.read.progress = std::move(v);
          })
      .def_property(
          "fail_after_bytes", [](const zf::FlattenOptions& o) { return o.read.fail_after_bytes; },
          [](zf::FlattenOptions& o, std::optional<std::uint64_t> v) {
            o.read.fail_after_bytes = v;
          })
      // The read plan by name (None or "auto": the cost model's choice), as `tier`.
      .def_property(
          "read_plan",
          [](const zf::FlattenOptions& o) -> std::optional<std::string> {
            if (!o.tier) return std::nullopt;
            return std::string(zf::tier_name(*o.tier));
          },
          [](zf::FlattenOptions& o, const std::optional<std::string>& name) {
            o.tier.reset();
            if (!name || *name == "auto") return;
            for (zf::Tier t : {zf::Tier::kLoad, zf::Tier::kLoadWhole, zf::Tier::kLoadPartitions}) {
              if (*name == zf::tier_name(t)) o.tier = t;
            }
            if (!o.tier) {
              throw zf::InvalidArgument(
                  "read_plan '" + *name +
                  "': expected None, 'auto', 'load', 'load-whole' or 'load-partitions'");
            }
          })
      // The copies check by name ("sampled", "full", "off").
      .def_property(
          "copies",
          [](const zf::FlattenOptions& o) {
            return std::string(zf::copy_check_name(o.read.copies));
          },
          [](zf::FlattenOptions& o, const std::string& name) {
            o.read.copies = zf::parse_copy_check(name, "copies");
          });
  py::class_<zf::LoadParam>(m, "LoadParam")
      .def(py::init([](const py::kwargs& kw) { return from_kwargs<zf::LoadParam>(kw); }))
      .def_readwrite("name", &zf::LoadParam::name)
      .def_readwrite("shape", &zf::LoadParam::shape)
      .def_readwrite("sources", &zf::LoadParam::sources)
      .def_readwrite("source_shapes", &zf::LoadParam::source_shapes);
}

}  // namespace zeroflat_python
