// Safetensors checkpoints as the loader reads them: every tensor's file, byte range and dtype
// (headers only are read), and a writer of deterministic test checkpoints.
//
// A checkpoint is one `.safetensors` file, or a directory of them, with Hugging Face's
// `model.safetensors.index.json` naming the shard of each tensor when there is one. These files
// are untrusted input: every header is validated (model_source.h), the index must agree with
// the shards, and a file shorter than its header says is refused, before anything is read.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/model.h"

namespace zeroflat {

struct CheckpointTensor {
  std::string name;
  std::string dtype;          // as in the file: "BF16", "F32", ...
  std::optional<DType> type;  // zeroflat's dtype, when it is one the loader converts from
  Shape shape;
  std::uint64_t numel = 0;
  std::uint32_t file = 0;    // index into CheckpointIndex::files
  std::uint64_t offset = 0;  // of the tensor's first byte in its file
  std::uint64_t bytes = 0;
  // A piece of a tensor saved in pieces (DCP's HuggingFaceStorageWriter with save_distributed
  // and no consolidation: each rank's file holds its shards, __metadata__ DCP_SHARDING_INFO
  // says where each starts), in an index opened with CheckpointOptions::pieces: where the piece
  // starts in the whole tensor (its saved_offsets; zeros for a tensor stored whole) and the
  // whole's shape. Both empty in an index opened without pieces.
  Shape piece_offsets;
  Shape whole_shape;
  // Another name of an earlier entry's bytes (a torch.save'd state dict keeps tied weights under
  // every name, one storage): found by name, but not a tensor of its own, so readers that take
  // every tensor (the CLI's group, inspect's counts) leave it out, as a safetensors save does.
  bool alias = false;
};

// What a file was when its headers were read: a file replaced since (another run's file of the
// same size renamed over it, or rewritten in place) has another identity or time, and is refused
// rather than read.
struct FileStamp {
  bool known = false;  // false: not recorded (a description, not files read); sizes alone checked
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  std::uint64_t size = 0;
  std::int64_t mtime_ns = 0;
};

struct CheckpointIndex {
  std::string path;                // as given
  std::vector<std::string> files;  // full paths
  std::vector<std::uint64_t> file_bytes;
  // Per file, as it was when read (empty, or a stamp not known: sizes alone are checked).
  std::vector<FileStamp> stamps;
  std::vector<CheckpointTensor> tensors;  // in natural name order (layers.2 before layers.10)
  // The tensor of that name, or null. O(log n).
  const CheckpointTensor* find(const std::string& name) const;
};

struct CheckpointOptions {
  // Accept files that hold pieces of tensors (a DCP_SHARDING_INFO placing a tensor anywhere but
  // at the origin): every piece is an entry of its own, a name may then have several, and a
  // name's pieces must tile its whole exactly (one dtype, no overlap, no gap: a missing rank's
  // file is refused, never read as zeros). Empty pieces are dropped where the name has others.
  // Without it such a file is refused: every other reader takes a name's entry for the whole
  // tensor.
  bool pieces = false;
};

// Reads and checks the headers (and the index) of a checkpoint. Throws InvalidArgument naming
// the file and, where there is one, the tensor.
CheckpointIndex open_checkpoint(const std::string& path, const CheckpointOptions& options = {});

// One digest of what ranks compare when they read a checkpoint together: every file's size and
// every tensor's name, dtype, shape and byte range (the entries the loader's agreement compares
// one by one, to name the first that differs). Equal on ranks that opened identical copies; a
// caller that compares it across ranks (the Python resume: once, after all its loads, before it
// writes anything) may run the loads without their own agreement.
std::uint64_t checkpoint_header_digest(const CheckpointIndex& ck);

// One piece of an index opened with pieces: its tensor's name and where it starts in the whole.
struct PieceRef {
  std::string name;
  Shape offsets;
};

// Those pieces as an index whose tensor i, named "#<i>" (i in 12 digits), is piece i: what
// read_checkpoint_boxes reads a piece's boxes from, by name. Throws InvalidArgument naming a
// piece the index does not hold.
CheckpointIndex checkpoint_pieces(const CheckpointIndex& checkpoint,
                                  const std::vector<PieceRef>& refs);

// Writes a deterministic checkpoint of `model` in `dtype`: the tensor that comes i-th in natural
// name order (the order of CheckpointIndex::tensors, in which `--model CHECKPOINT` flattens it)
// holds the fill pattern i (pattern.h) of `values` (default: dtype; the values zeroflat run
// materializes in that dtype), converted to dtype. Tensors are stored in the model's order, in
// shards of at most shard_bytes of data each (model-00001-of-0000N.safetensors, with
// model.safetensors.index.json, when N > 1; a single model.safetensors otherwise) in `dir`, which
// is created and must not hold a checkpoint already. progress gets the bytes written. Throws
// InvalidArgument for a bad directory or model, Error when writing fails (the files written so far
// are removed).
void write_pattern_checkpoint(const ModelSpec& model, DType dtype, const std::string& dir,
                              std::uint64_t shard_bytes, std::optional<DType> values = std::nullopt,
                              const std::function<void(std::uint64_t)>& progress = {});

// The index of the checkpoint write_pattern_checkpoint would write into dir, computed without
// writing or reading anything: what rehearsals of a checkpoint too large to hold here load
// (on sim devices without data, which read nothing).
CheckpointIndex pattern_checkpoint_index(const ModelSpec& model, DType dtype,
                                         const std::string& dir, std::uint64_t shard_bytes);

}  // namespace zeroflat
