// The bound on a model's size that keeps every byte count computed from it within 64 bits.
#pragma once

#include "zeroflat/model.h"

namespace zeroflat::detail {

// Throws InvalidArgument when the model has more than kMaxModelNumel elements, naming the
// tensor at which the count passes the bound and its size (callers add the model's source).
void check_model_numel(const ModelSpec& model);

}  // namespace zeroflat::detail
