// The host-side work of `zeroflat run` around the executor: filling the originals with the
// pattern, checking them afterwards, the timing rounds against memcpy, and verification.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "device/cpu_device.h"
#include "zeroflat/comm.h"
#include "zeroflat/device.h"
#include "zeroflat/flatten.h"
#include "zeroflat/plan.h"
#include "zeroflat/progress.h"
#include "zeroflat/tensor.h"

namespace zeroflat::cli {

// Fills every parameter with its pattern (pattern.h): in place where the host can write the
// device's memory, through a host buffer otherwise, not at all on a device without data. The
// team's threads do the work.
void fill_tensors(Device& device, detail::CpuDevice& team, const std::vector<TensorRef>& params,
                  Progress& progress);

// True when every parameter, wherever its data now is, holds the pattern it was filled with
// (false if any has no data).
bool params_intact(Device& device, detail::CpuDevice& team, const std::vector<TensorRef>& params);

// Best-of-`repeat` seconds, on a host device with data.
struct Timing {
  double copy_only = 0;     // the whole layout gathered into a buffer already faulted in
  double end_to_end = 0;    // the tier's step list, again, into fresh memory
  double memcpy = 0;        // the ceiling: memcpy of the flat bytes into a faulted-in buffer
  double fresh_memcpy = 0;  // memcpy into freshly allocated memory
};
// first_seconds is the real run's time (round 0 of end_to_end). Runs the step list again with
// the group's views as the originals (every rank of comm must call it), so all ranks contend
// for the cores as in the real run.
Timing time_rounds(detail::CpuDevice& device, const FlatGroup& group,
                   const std::vector<Step>& steps, std::uint64_t rank, Communicator* comm,
                   std::uint64_t repeat, double first_seconds);

// Flips one byte of the flat buffer (testing aid for --verify).
void corrupt_byte(Device& device, void* flat, std::uint64_t byte);

// Checks every view's place and shape, every parameter byte against the pattern, every padding
// byte for zero, and every master element (if there is a master) against an independent
// up-cast. Returns "" or what is wrong first.
std::string verify_group(Device& device, detail::CpuDevice& team, const FlatGroup& group,
                         const DeviceBuffer& master, std::uint64_t rank, Progress& progress);

}  // namespace zeroflat::cli
