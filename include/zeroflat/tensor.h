// A non-owning reference to a tensor's memory: pointer, element count, shape, dtype, device.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/dtype.h"

namespace zeroflat {

class Device;

using Shape = std::vector<std::int64_t>;

// Product of the dimensions (1 for a scalar shape {}). Throws InvalidArgument on a negative
// dimension or when the product overflows 64 bits.
std::uint64_t shape_numel(std::span<const std::int64_t> shape);

// "[4096, 2048]".
std::string shape_to_string(std::span<const std::int64_t> shape);

// A view of numel contiguous elements of dtype at data, on device. Does not own the memory.
// data may be null only when numel is 0. data may have any alignment that the dtype allows
// (zeroflat never assumes more than element alignment).
struct TensorRef {
  void* data = nullptr;
  std::uint64_t numel = 0;
  Shape shape;
  DType dtype = DType::kBF16;
  Device* device = nullptr;

  std::uint64_t num_bytes() const noexcept;
};

}  // namespace zeroflat
