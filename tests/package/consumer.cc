// Uses the installed headers and library: lays out and flattens a small group.
#include <zeroflat/config.h>
#include <zeroflat/flatten.h>

#include <cstdio>
#include <cstring>
#include <vector>

int main() {
  auto dev = zeroflat::make_device("cpu");
  std::vector<std::uint16_t> a(5, 1), b(7, 2), c(3, 3);
  std::vector<zeroflat::TensorRef> params;
  for (auto* v : {&a, &b, &c}) {
    params.push_back({v->data(),
                      v->size(),
                      {static_cast<std::int64_t>(v->size())},
                      zeroflat::DType::kBF16,
                      dev.get()});
  }
  zeroflat::LayoutOptions options;
  options.dp = 4;
  zeroflat::FlatGroup g = zeroflat::flatten_group(*dev, params, options);
  const auto* flat = static_cast<const std::uint16_t*>(g.flat.data());
  const bool ok = g.layout.flat_numel() == 16 && flat[4] == 1 && flat[5] == 2 && flat[12] == 3 &&
                  flat[15] == 0 && g.views[2].data == flat + 12;
  std::printf("zeroflat %s: flat_numel %llu, %s\n", ZEROFLAT_VERSION,
              static_cast<unsigned long long>(g.layout.flat_numel()), ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
