// The deterministic fill pattern of rehearsal runs: every element of every tensor gets a value
// computed from (tensor index, element index), so data can be checked anywhere without a copy.
#pragma once

#include <cstdint>

#include "zeroflat/common.h"

namespace zeroflat {

// The bit pattern of element `element` of tensor `tensor`: a finite, non-negative value of
// dtype (in the low 16 bits for bf16 and fp16).
std::uint32_t pattern_bits(DType dtype, std::uint64_t tensor, std::uint64_t element) noexcept;

// Writes elements [first, first + count) of tensor's pattern to data (which holds element
// `first` at its start).
void fill_pattern(void* data, DType dtype, std::uint64_t tensor, std::uint64_t first,
                  std::uint64_t count) noexcept;

// The number of leading elements of data that match tensor's pattern from element `first`:
// count when all match.
std::uint64_t match_pattern(const void* data, DType dtype, std::uint64_t tensor,
                            std::uint64_t first, std::uint64_t count) noexcept;

}  // namespace zeroflat
