// Shapes and tensor references.
#include "zeroflat/common.h"

#include "zeroflat/common.h"

namespace zeroflat {

std::uint64_t shape_numel(std::span<const std::int64_t> shape) {
  std::uint64_t numel = 1;
  for (std::int64_t dim : shape) {
    if (dim < 0) {
      throw InvalidArgument("shape " + shape_to_string(shape) + " has a negative dimension");
    }
    if (__builtin_mul_overflow(numel, static_cast<std::uint64_t>(dim), &numel)) {
      throw InvalidArgument("shape " + shape_to_string(shape) +
                            " has more elements than fit in 64 bits");
    }
  }
  return numel;
}

std::string shape_to_string(std::span<const std::int64_t> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::uint64_t TensorRef::num_bytes() const noexcept {
  return numel * element_size(dtype);
}

}  // namespace zeroflat
