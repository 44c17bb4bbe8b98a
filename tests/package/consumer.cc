// A program outside the project: it includes only the umbrella header, links the installed
// package, and flattens a group through the front door (probe, plan, execute, master partition)
// on the cpu device. The README's C++ example is this program.
#include <zeroflat/zeroflat.h>

#include <cstdio>
#include <cstring>
#include <vector>

int main() {
  std::unique_ptr<zeroflat::Device> device = zeroflat::make_device("cpu");
  // Three bf16 parameters in memory the program owns (bit patterns 1, 2 and 3).
  std::vector<std::uint16_t> a(5, 1), b(7, 2), c(3, 3);
  std::vector<zeroflat::TensorRef> params;
  for (std::vector<std::uint16_t>* v : {&a, &b, &c}) {
    params.push_back({v->data(), v->size(), {static_cast<std::int64_t>(v->size())},
                      zeroflat::DType::kBF16, device.get()});
  }
  zeroflat::FlattenOptions options;  // one rank (no communicator), DeepSpeed's layout
  zeroflat::FlattenResult r = zeroflat::flatten_param_group(params, *device, nullptr, options);
  if (!r.feasible()) {
    std::printf("no plan fits: %s\n", r.plan.reason.c_str());
    return 3;
  }
  if (!r.complete()) {
    std::printf("failed: %s\n", r.execution.error.c_str());
    return 4;
  }
  // params[i].data now points into the flat buffer; the program may free a, b and c.
  const zeroflat::FlatGroup& g = r.execution.group;
  const auto* flat = static_cast<const std::uint16_t*>(g.flat.data());
  const auto* master = static_cast<const float*>(r.master.data());
  std::uint32_t master5 = 0;
  std::memcpy(&master5, master + 5, 4);
  const bool ok = g.layout.flat_numel() == 16 && flat[4] == 1 && flat[5] == 2 && flat[12] == 3 &&
                  flat[15] == 0 && params[2].data == flat + 12 && master5 == 2u << 16;
  std::printf("zeroflat %s: %s tier (%s), flat_numel %llu, free memory from %s: %s\n",
              ZEROFLAT_VERSION, std::string(zeroflat::tier_name(*r.plan.chosen)).c_str(),
              r.plan.reason.c_str(), static_cast<unsigned long long>(g.layout.flat_numel()),
              r.probe.used.c_str(), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
