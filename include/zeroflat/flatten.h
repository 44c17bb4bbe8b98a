// Flattening one parameter group on one device: the flat buffer, the views, the master partition.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/layout.h"

namespace zeroflat {

// Checks that params can form one group under options: same dtype as options.dtype, on
// device, numel equal to the shape's product, data non-null when numel > 0, no two parameters
// overlapping in memory. Throws InvalidArgument naming the parameter's index and shape.
void validate_group(std::span<const TensorRef> params, const Device& device,
                    const LayoutOptions& options);

// The segments that gather the flat buffer's byte range [lo_bytes, hi_bytes) from the
// parameters (dst offsets relative to lo_bytes). Gaps between them are padding.
std::vector<Segment> gather_segments(const Layout& layout, std::span<const TensorRef> params,
                                     std::uint64_t lo_bytes, std::uint64_t hi_bytes);

// A flattened group: the flat buffer that owns every parameter's data, and the views.
struct FlatGroup {
  Layout layout;
  DeviceBuffer flat;
  // views[i] is input parameter i re-pointed into flat: data = flat + offsets[i] * esize,
  // same numel, shape, dtype and device.
  std::vector<TensorRef> views;

  // Rank r's partition [r * S, (r + 1) * S) of flat, as a 1-D tensor.
  TensorRef partition(std::uint64_t rank) const;
};

// The `device` tier alone, as a building block: no probe, no plan, no agreement. Most callers
// want flatten_param_group (engine.h), which proves a way of flattening fits first. Builds the
// flat buffer of params on device (one allocation of layout.flat_bytes(), one gather with every
// padding gap zeroed) and returns it with the views.
// The originals are not modified and may be released by the caller afterwards. Throws
// InvalidArgument (bad group, checked before anything is allocated) or OutOfMemory.
FlatGroup flatten_group(Device& device, std::span<const TensorRef> params,
                        const LayoutOptions& options);

// The fp32 master copy of rank's partition of group.flat, padding included (zeros): the
// up-cast of every element. Returns a buffer of partition_numel * 4 bytes on the same device.
DeviceBuffer make_master_partition(Device& device, const FlatGroup& group, std::uint64_t rank);

}  // namespace zeroflat
