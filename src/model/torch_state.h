// A torch.save'd state dict (Hugging Face's pytorch_model.bin and its shards) as checkpoint
// index entries: each tensor's name, dtype, shape and byte range in the file, from the zip
// directory and the pickle read by the restricted reader (torch_file.h): nothing in the file is
// executed, and no tensor data is read here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "zeroflat/checkpoint.h"

namespace zeroflat::detail {

struct TorchStateShard {
  std::vector<CheckpointTensor> tensors;  // in the file's order; each with file index `file`
  std::uint64_t file_bytes = 0;
  FileStamp stamp;
};

// The entries of `path`, a torch.save file whose saved object is a dict of names to tensors (a
// state dict, as model.state_dict() and Transformers' save_pretrained(safe_serialization=False)
// write it). Throws InvalidArgument naming the file and the entry: another kind of saved object
// (a training checkpoint whose state dict sits under a key), a key that is not a name, a value
// that is not a tensor, a tensor not stored contiguously (a view read whole would be other
// elements), and whatever read_torch_file refuses.
TorchStateShard torch_state_shard(const std::string& path, std::uint32_t file);

// Whether `path` names a sharded checkpoint's index (model.safetensors.index.json, or
// pytorch_model.bin.index.json for torch.save'd shards) and is not a folder: given in place of
// its directory, the checkpoint is the directory it describes.
bool is_index_file(const std::string& path);

}  // namespace zeroflat::detail
