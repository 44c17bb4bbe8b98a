// zeroflat._C's layouts and DeepSpeed's release rules (layout.h).
#include <sstream>

#include "bind.h"
#include "os_names.h"

namespace zeroflat_python {
namespace {

py::dict rules_dict(const zf::ReleaseRules& r) {
  py::dict d;
  d["release"] = r.release;
  d["rules"] = r.rules;
  d["tested"] = r.tested;
  d["skips_zero_element"] = r.skips_zero_element;
  d["has_parameter_alignment"] = r.has_parameter_alignment;
  d["padding_on_last_rank"] = r.padding_on_last_rank;
  d["checks_accelerator_memory"] = r.checks_accelerator_memory;
  return d;
}

// The ZeRO-3 layout of optimizer groups (layout.h) seen from `rank`: per parameter (flat over the
// groups) its numel, partition_numel, padding (p * W - n) and offset in the rank buffer; the
// buffer's elements; the sub-groups; this rank's groups_padding and elements of data.
py::dict zero3_layout(const std::vector<std::vector<std::uint64_t>>& groups, std::uint64_t world,
                      std::uint64_t sub_group_size, std::uint64_t rank) {
  const zf::Zero3Layout l =
      zf::Zero3Layout::compute(groups, zf::Zero3Options{world, sub_group_size, zf::DType::kBF16});
  std::vector<std::uint64_t> paddings;
  for (std::uint64_t i = 0; i < l.num_params(); ++i) paddings.push_back(l.padding(i));
  py::list subs;
  for (const zf::Zero3SubGroup& g : l.sub_groups()) {
    py::dict d;
    d["group"] = g.group;
    d["params"] = std::vector<std::uint64_t>{g.first_param, g.num_params};
    d["offset"] = g.offset;
    d["numel"] = g.numel;
    subs.append(d);
  }
  py::dict out;
  out["world"] = world;
  out["sub_group_size"] = sub_group_size;
  out["rank"] = rank;
  out["numels"] = l.numels();
  out["groups"] = l.groups();
  out["partition_numels"] = l.partition_numels();
  out["paddings"] = paddings;
  out["offsets"] = l.offsets();
  out["buffer_numel"] = l.buffer_numel();
  out["sub_groups"] = subs;
  out["groups_padding"] = l.groups_padding(rank);
  out["data_numel"] = l.data_numel(rank);
  return out;
}

}  // namespace

void bind_layouts(py::module_& m) {
  m.def(
      "layout_json",
      [](const std::vector<std::uint64_t>& numels, const zf::LayoutOptions& options) {
        zf::validate(options);
        return parse_json(zf::Layout::compute(numels, options).to_json());
      },
      py::arg("numels"), py::arg("options"));
  py::class_<zf::ReleaseRules>(m, "ReleaseRules")
      .def_readonly("release", &zf::ReleaseRules::release)
      .def_readonly("rules", &zf::ReleaseRules::rules)
      .def_readonly("tested", &zf::ReleaseRules::tested)
      .def_readonly("skips_zero_element", &zf::ReleaseRules::skips_zero_element)
      .def_readonly("has_parameter_alignment", &zf::ReleaseRules::has_parameter_alignment)
      .def_readonly("padding_on_last_rank", &zf::ReleaseRules::padding_on_last_rank)
      .def_readonly("checks_accelerator_memory", &zf::ReleaseRules::checks_accelerator_memory)
      .def("to_dict", &rules_dict)
      .def("__repr__", [](const zf::ReleaseRules& r) {
        return "ReleaseRules(release='" + r.release + "', rules='" + r.rules + "')";
      });
  m.def("deepspeed_rules", &zf::deepspeed_rules, py::arg("release"));
  m.def("default_deepspeed_rules", &zf::default_deepspeed_rules,
        py::arg("installed_version") = std::string_view{});
  m.def(
      "select_for_release",
      [](const std::vector<std::uint64_t>& numels, const std::vector<bool>& frozen,
         const zf::ReleaseRules& rules) {
        const zf::ReleaseSelection s = zf::select_for_release(numels, frozen, rules);
        py::list left_out;
        for (const auto& [i, why] : s.left_out) {
          left_out.append(py::make_tuple(i, std::string(zf::left_out_name(why))));
        }
        return py::make_tuple(s.kept, left_out);
      },
      py::arg("numels"), py::arg("frozen"), py::arg("rules"));
  m.def("check_release_options", &zf::check_release_options, py::arg("options"), py::arg("rules"));
  m.def(
      "release_layout_json",
      [](const std::vector<std::uint64_t>& numels, const std::vector<bool>& frozen,
         const zf::LayoutOptions& options, const zf::ReleaseRules& rules) {
        zf::validate(options);
        std::ostringstream out;
        zf::layout_for_release(numels, frozen, options, rules).write_json(out);
        return parse_json(out.str());
      },
      py::arg("numels"), py::arg("frozen"), py::arg("options"), py::arg("rules"));
  m.attr("tested_deepspeed_releases") = zf::tested_deepspeed_releases();
  m.def("zero3_layout", &zero3_layout, py::arg("groups"), py::arg("world"),
        py::arg("sub_group_size"), py::arg("rank"));
}

}  // namespace zeroflat_python
