// The DeepSpeed checkpoint builder's Universal checkpoints (ds_to_universal's output): every trained parameter's own files
// under zero/ (builder.h).
#include <algorithm>
#include <map>

#include "source/deepspeed/builder.h"
#include "zeroflat/layout.h"

namespace zeroflat::detail {

void Builder::universal(std::uint32_t model, const std::string& zero_dir) {
  // Trained parameters in group order from the model file; every parameter's files.
  const TorchValue& ps = torch(model).at("param_shapes");
  if (!ps.is_sequence()) {
    throw fail(model, "param_shapes", "expected a list of groups, found " +
                                          std::string(torch_kind_name(ps.kind)));
  }
  const bool zero3 = ck_.zero_stage == 3;
  ck_.round_robin = !zero3 && config_flag("zero_optimization/round_robin_gradients");
  for (std::uint64_t g = 0; g < ps.items.size(); ++g) {
    std::vector<DeepSpeedParam> flat = shapes(model, "param_shapes/" + std::to_string(g));
    DeepSpeedGroup group;
    std::vector<std::uint64_t> order;
    const std::uint64_t n = flat.size();
    if (ck_.round_robin) {
      for (std::uint64_t b = 0; b < ck_.world; ++b) {
        for (std::uint64_t i = b; i < n; i += ck_.world) order.push_back(i);
      }
    } else {
      for (std::uint64_t i = 0; i < n; ++i) order.push_back(i);
    }
    group.params.resize(n);
    for (std::uint64_t k = 0; k < n; ++k) {
      group.numel += flat[k].numel;
      flat[k].sub_group = g;
      group.params[order[k]] = std::move(flat[k]);
    }
    group.flat_numel = group.numel;
    // Stage 3's param_shapes lists sub-groups: several may belong to one optimizer group,
    // which the universal files do not say; each is taken as a group of its own.
    ck_.groups.push_back(std::move(group));
  }
  std::map<std::string, std::uint64_t> index;
  for (std::uint64_t i = 0; i < ck_.universal.size(); ++i) index[ck_.universal[i].name] = i;
  for (const DeepSpeedGroup& g : ck_.groups) {
    for (const DeepSpeedParam& p : g.params) {
      auto it = index.find(p.name);
      if (it == index.end()) {
        throw InvalidArgument(shown(zero_dir) + ": no folder of parameter '" +
                              printable(p.name) + "' (" + name(model) +
                              "'s param_shapes lists it)");
      }
      const DeepSpeedUniversalParam& u = ck_.universal[it->second];
      bool has_fp32 = false;
      for (const DeepSpeedState& s : u.tensors) has_fp32 = has_fp32 || s.name == "fp32";
      if (!has_fp32) {
        throw InvalidArgument(shown(zero_dir) + "/" + printable(p.name) +
                              "/fp32.pt: missing (every trained parameter's folder holds its "
                              "fp32 master weights)");
      }
      for (const DeepSpeedState& s : u.tensors) {
        if (s.name == "step") continue;
        if (s.tensor.numel != p.numel) {
          throw fail(s.tensor.file, s.tensor.path,
                     std::to_string(s.tensor.numel) + " elements, but parameter '" +
                         printable(p.name) + "' has shape " + shape_to_string(p.shape));
        }
      }
    }
  }
}

}  // namespace zeroflat::detail
