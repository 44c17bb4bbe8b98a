// The `device` tier on one rank: validate, lay out, allocate, gather, re-point, up-cast.
#include "zeroflat/engine.h"

#include <algorithm>
#include <numeric>
#include <string>

#include "zeroflat/common.h"

namespace zeroflat {
namespace {

std::string describe(std::uint64_t index, const TensorRef& p) {
  return "parameter " + std::to_string(index) + " (shape " + shape_to_string(p.shape) + ", " +
         std::string(dtype_name(p.dtype)) + ")";
}

}  // namespace

void validate_group(std::span<const TensorRef> params, const Device& device,
                    const LayoutOptions& options) {
  validate(options);
  for (std::uint64_t i = 0; i < params.size(); ++i) {
    const TensorRef& p = params[i];
    if (p.dtype != options.dtype) {
      throw InvalidArgument(describe(i, p) + " has dtype " + std::string(dtype_name(p.dtype)) +
                            ", but the group's dtype is " + std::string(dtype_name(options.dtype)) +
                            ": a group holds one dtype");
    }
    if (p.device != &device) {
      throw InvalidArgument(describe(i, p) + " is on " +
                            (p.device ? p.device->name() : std::string("no device")) +
                            ", but the group is flattened on " + device.name());
    }
    if (shape_numel(p.shape) != p.numel) {
      throw InvalidArgument(describe(i, p) + " says numel " + std::to_string(p.numel) +
                            ", but its shape holds " + std::to_string(shape_numel(p.shape)));
    }
    if (p.numel > 0 && p.data == nullptr) {
      throw InvalidArgument(describe(i, p) + " has no data pointer");
    }
    std::uint64_t bytes = 0;
    if (__builtin_mul_overflow(p.numel, std::uint64_t{element_size(p.dtype)}, &bytes)) {
      throw InvalidArgument(describe(i, p) + " has more bytes than fit in 64 bits");
    }
  }
  // Two parameters sharing memory would be copied twice and silently untied.
  std::vector<std::uint64_t> by_address;
  for (std::uint64_t i = 0; i < params.size(); ++i) {
    if (params[i].numel > 0) by_address.push_back(i);
  }
  std::sort(by_address.begin(), by_address.end(),
            [&](std::uint64_t a, std::uint64_t b) { return params[a].data < params[b].data; });
  for (std::size_t k = 1; k < by_address.size(); ++k) {
    const TensorRef& prev = params[by_address[k - 1]];
    const TensorRef& cur = params[by_address[k]];
    if (static_cast<const unsigned char*>(prev.data) + prev.num_bytes() >
        static_cast<const unsigned char*>(cur.data)) {
      throw InvalidArgument(describe(by_address[k], cur) + " shares memory with " +
                            describe(by_address[k - 1], prev) +
                            ": tied or overlapping parameters cannot be flattened twice");
    }
  }
}

std::vector<Segment> gather_segments(const Layout& layout, std::span<const TensorRef> params,
                                     std::uint64_t lo_bytes, std::uint64_t hi_bytes) {
  if (params.size() != layout.num_params()) {
    throw InvalidArgument("gather_segments: " + std::to_string(params.size()) +
                          " parameters for a layout of " + std::to_string(layout.num_params()));
  }
  const std::uint64_t esize = layout.element_size();
  if (lo_bytes % esize != 0 || hi_bytes % esize != 0 || lo_bytes > hi_bytes ||
      hi_bytes > layout.flat_bytes()) {
    throw InvalidArgument("gather_segments: byte range [" + std::to_string(lo_bytes) + ", " +
                          std::to_string(hi_bytes) + ") is not a range of whole elements of " +
                          "the " + std::to_string(layout.flat_bytes()) + "-byte flat buffer");
  }
  std::vector<Fragment> frags = layout.fragments_in(lo_bytes / esize, hi_bytes / esize);
  std::vector<Segment> out;
  out.reserve(frags.size());
  for (const Fragment& f : frags) {
    out.push_back(
        Segment{static_cast<const unsigned char*>(params[f.param].data) + f.param_offset * esize,
                f.partition_offset * esize, f.numel * esize});
  }
  return out;
}

TensorRef FlatGroup::partition(std::uint64_t rank) const {
  if (rank >= layout.options().dp) {
    throw InvalidArgument("rank " + std::to_string(rank) + " is outside [0, " +
                          std::to_string(layout.options().dp) + ")");
  }
  TensorRef t;
  t.data = static_cast<unsigned char*>(flat.data()) + rank * layout.partition_bytes();
  t.numel = layout.partition_numel();
  t.shape = {static_cast<std::int64_t>(t.numel)};
  t.dtype = layout.options().dtype;
  t.device = flat.device();
  return t;
}

FlatGroup flatten_group(Device& device, std::span<const TensorRef> params,
                        const LayoutOptions& options) {
  validate_group(params, device, options);
  std::vector<std::uint64_t> numels(params.size());
  for (std::size_t i = 0; i < params.size(); ++i) numels[i] = params[i].numel;
  FlatGroup group{Layout::compute(numels, options), DeviceBuffer(), {}};
  const Layout& layout = group.layout;
  std::vector<Segment> segments = gather_segments(layout, params, 0, layout.flat_bytes());
  group.flat = DeviceBuffer(device, layout.flat_bytes());
  device.gather(group.flat.data(), layout.flat_bytes(), segments);
  group.views.reserve(params.size());
  auto* base = static_cast<unsigned char*>(group.flat.data());
  for (std::size_t i = 0; i < params.size(); ++i) {
    TensorRef v = params[i];
    v.data = base + layout.offsets()[i] * layout.element_size();
    group.views.push_back(std::move(v));
  }
  return group;
}

DeviceBuffer make_master_partition(Device& device, const FlatGroup& group, std::uint64_t rank) {
  TensorRef part = group.partition(rank);
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(part.numel, std::uint64_t{4}, &bytes)) {
    throw InvalidArgument("master partition of " + std::to_string(part.numel) +
                          " elements overflows 64 bits");
  }
  DeviceBuffer master(device, bytes);
  device.upcast_to_fp32(static_cast<float*>(master.data()), part.data, part.dtype, part.numel);
  return master;
}

}  // namespace zeroflat
