// A torch.save archive stored inside a larger file: DCP's FileSystemWriter writes each item of
// a .distcp file as one, at an offset of its own.
#pragma once

#include <cstdint>

#include "model/files.h"
#include "model/torch_file.h"

namespace zeroflat::detail {

// Reads the archive at bytes [offset, offset + length) of the open file as read_torch_file
// reads a whole file (the same checks, the archive's own offsets taken from its first byte),
// its pickle by the allow-list's rows for DCP values (none of DeepSpeed's classes).
// The result's offsets (TorchTensor::offset, TorchStorage::offset) are of the whole file, its
// path the file's, file_bytes the archive's length, stamp the file's; read_torch_tensor reads
// its tensors. Throws InvalidArgument naming the file and the byte range.
TorchFile read_torch_window(const File& file, std::uint64_t offset, std::uint64_t length);

}  // namespace zeroflat::detail
