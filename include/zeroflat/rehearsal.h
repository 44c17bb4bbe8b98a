// Rehearsals: a model materialized from a deterministic pattern instead of a checkpoint, checked
// against that pattern wherever its data ends up, and the flatten timed against memcpy of the
// same bytes in the same run. What `zeroflat run` does with any device and any tier.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/engine.h"
#include "zeroflat/plan.h"

namespace zeroflat {

// Called with the bytes done since the last call, from any of the worker threads.
using ProgressFn = std::function<void(std::uint64_t bytes)>;

// Fills tensor i with pattern i (pattern.h): in place where the host can write the device's
// memory (`threads` host threads), through a host buffer otherwise, not at all on a device
// without data. Throws OutOfMemory for the host buffer.
void fill_pattern_tensors(Device& device, std::span<const TensorRef> tensors, unsigned threads,
                          const ProgressFn& progress = {});

// True when every tensor, wherever its data is now, holds pattern i (false if one has no data).
bool tensors_hold_pattern(Device& device, std::span<const TensorRef> tensors, unsigned threads);

// Checks every view's place and shape, every parameter byte of the flat buffer against its
// pattern, every padding byte for zero, and every element of the master partition (if `master`
// holds one) against an independent up-cast of rank's partition. Returns "" or what is wrong
// first.
std::string verify_flat_group(Device& device, const FlatGroup& group, const DeviceBuffer& master,
                              std::uint64_t rank, unsigned threads,
                              const ProgressFn& progress = {});

// Best-of-`repeat` seconds, on the cpu device.
struct Timing {
  double copy_only = 0;     // the whole layout gathered into a buffer already faulted in
  double end_to_end = 0;    // the tier's step list, again, into fresh memory
  double memcpy = 0;        // the ceiling: memcpy of the flat bytes into a faulted-in buffer
  double fresh_memcpy = 0;  // memcpy into freshly allocated memory
};
// first_seconds is the real run's time (round 0 of end_to_end). Runs the step list again with
// the group's views standing in for the originals (every rank of comm must call it, so that
// all contend for the cores as in the real run). Throws InvalidArgument for another device.
Timing time_rounds(Device& device, const FlatGroup& group, const std::vector<Step>& steps,
                   std::uint64_t rank, Communicator* comm, std::uint64_t repeat,
                   double first_seconds);

// Flips one byte of the flat buffer (a testing aid, to prove that verification looks).
void corrupt_byte(Device& device, void* flat, std::uint64_t byte);

}  // namespace zeroflat
