// The saved states behind the public checkpoint classes (deepspeed_checkpoint.h,
// dcp_checkpoint.h), as the torch.save reader (model/torch_file.h) parsed them. Private, as the
// reader is: the public classes describe tensors and byte ranges; the Python binding makes its
// values of these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "model/torch_file.h"
#include "zeroflat/dcp_checkpoint.h"
#include "zeroflat/deepspeed_checkpoint.h"

namespace zeroflat {

namespace detail {
// What DeepSpeedFile::saved points to.
struct SavedFile {
  TorchFile torch;
};
}  // namespace detail

// The saved state of file `file` of a checkpoint open_deepspeed_checkpoint opened. Throws
// std::out_of_range for a file the checkpoint lacks, InvalidArgument for a file it describes
// without having read it.
const TorchFile& deepspeed_file_state(const DeepSpeedCheckpoint& ck, std::size_t file);

// The largest DCP bytes item read (an optimizer's hyperparameter is a few hundred bytes).
inline constexpr std::uint64_t kMaxDcpValueBytes = std::uint64_t{64} << 20;

// A DCP bytes item's archive, read by the torch.save reader (the caller makes its value, as for
// a DeepSpeed file; read_torch_tensor reads its tensors). Its size is bounded by
// kMaxDcpValueBytes. Throws InvalidArgument naming the file, the range and the fqn.
TorchFile read_dcp_value(const DcpCheckpoint& ck, const std::string& fqn);

}  // namespace zeroflat
