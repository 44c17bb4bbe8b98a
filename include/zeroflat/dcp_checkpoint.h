// PyTorch Distributed Checkpoint (DCP) folders read without running them: what
// torch.distributed.checkpoint.save wrote with its FileSystemWriter (a `.metadata` index and
// `__R_N.distcp` data files), for a reader that fetches each rank's share (python/zeroflat/dcp.py).
//
// The format (torch 2.x): `.metadata` is pickle.dump of DCP's Metadata: state_dict_metadata
// maps every saved name (its "fqn": "model.layers.0.mlp.up_proj.weight",
// "optim.state.<fqn>.exp_avg", "optim.param_groups.0.lr") to a TensorStorageMetadata (dtype,
// global size, the chunks saved: each an offset and a size per dimension) or a
// BytesStorageMetadata (a value saved by torch.save: optimizer hyperparameters); storage_data maps
// each (fqn, chunk offset) to the file, offset and length of its item; planner_data maps a
// flattened fqn to its path in the nested state dict. Each item is itself a torch.save archive
// (a chunk's tensor, or the value) at that offset of its .distcp file.
//
// DCP's FileSystemReader unpickles `.metadata` with pickle.load, which runs whatever it names.
// This reader runs nothing: `.metadata` is read by the library's restricted pickle machine with
// its DCP rows (the torch.save reader's allow-list, the one list: docs/security.md), every item
// by that torch.save reader; nothing is believed before it is checked (InvalidArgument naming
// the file and the entry):
//   - the index: its classes and fields as DCP writes them, every size, offset and count bounded
//     (at most kMaxDcpChunks chunks, 64 dimensions), chunks inside their tensor and
//     tiling it (no overlap; in the global index, no element missing), one storage entry per
//     chunk and per bytes item, no entry for anything the index does not list;
//   - the files: plain names inside the folder (no '/', no "..", no hidden path), regular files,
//     each item's bytes inside its file; transformed items (DCP's compression extensions) are
//     refused, saying so;
//   - each item: one torch.save archive of one contiguous tensor of the chunk's dtype and size
//     (chunks), or of a value (bytes items, whose values the Python binding makes).
// What a DCP file can name is the allow-list's DCP rows: DCP's dataclasses, its memory-format
// enum, torch.Size, the dtypes, the 'torch.strided' layout and a PosixPath (as a string).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zeroflat/checkpoint.h"

namespace zeroflat {

// The most chunks (of every tensor together) an index may list.
inline constexpr std::uint64_t kMaxDcpChunks = 10'000'000;
// The largest index read. DCP pickles a chunk in about 140 bytes: a save of a 405B model with
// AdamW at 1,024 ranks (3.5 million chunks) writes an index of about 0.5 GB, and
// kMaxDcpChunks chunks fit. Reading one costs about 8 bytes of memory per byte of index, freed
// when the index is parsed, and time linear in its size.
inline constexpr std::uint64_t kMaxDcpIndexBytes = std::uint64_t{2} << 30;

// A segment of a planner_data path: a dict key (a string) or a list index (an int).
struct DcpPathPart {
  bool is_index = false;
  std::int64_t index = 0;
  std::string key;
};

// One saved chunk of a tensor: elements [offsets, offsets + sizes) of its global tensor.
struct DcpChunk {
  std::vector<std::uint64_t> offsets;
  std::vector<std::uint64_t> sizes;
  std::uint32_t file = 0;     // index into DcpCheckpoint::files
  std::uint64_t offset = 0;   // the item's torch.save archive: bytes [offset, offset + length)
  std::uint64_t length = 0;
};

struct DcpItem {
  std::string fqn;
  bool is_bytes = false;       // a value saved by torch.save, not a tensor
  std::string dtype;           // tensors: torch's name ("float32", "bfloat16", "int64", ...)
  Shape size;                  // tensors: the global size
  std::uint64_t numel = 0;     // tensors: elements of the global tensor
  std::uint64_t bytes = 0;     // tensors: numel * the dtype's element size
  bool requires_grad = false;
  std::vector<DcpChunk> chunks;  // tensors: every chunk saved; bytes items: one, no dimensions
  // planner_data's path of the fqn in the nested state dict; empty when the index has none.
  std::vector<DcpPathPart> path;
};

struct DcpCheckpoint {
  std::string dir;                  // as given
  std::string version;              // Metadata.version ("1.0.0"), empty when absent
  std::vector<std::string> files;   // full paths of the data files the index names
  std::vector<FileStamp> stamps;    // each as it was when opened
  std::vector<std::uint64_t> file_bytes;
  std::vector<DcpItem> items;       // in the index's order
  std::uint64_t metadata_bytes = 0;
  std::uint64_t tensor_bytes = 0;   // every tensor item's bytes
  std::uint64_t chunks = 0;         // every tensor item's chunks
  // The save's StorageMeta, where the index holds one: its checkpoint_id (a path saved as a
  // PosixPath is its text), save_id and modules.
  bool storage_meta = false;
  std::optional<std::string> checkpoint_id, save_id;
  std::vector<std::string> modules;
  // The item of that fqn, or null. O(log n).
  const DcpItem* find(const std::string& fqn) const;
  std::vector<std::uint32_t> by_fqn;  // indices of items sorted by fqn
};

// Whether `dir` is a directory holding a regular `.metadata` file (`index`: that name instead).
// Never throws.
bool is_dcp_checkpoint(const std::string& dir, const std::string& index = ".metadata") noexcept;

// Reads and checks a DCP folder's index and stats its data files (no item is read). `index`:
// the global ".metadata", or "__<rank>.metadata", the rank's own index that a save without
// collectives (`dcp.save(..., use_collectives=False)`) writes in its place, listing that rank's
// items alone. Throws InvalidArgument naming the file and the entry, the global or the field.
DcpCheckpoint open_dcp_checkpoint(const std::string& dir, const std::string& index = ".metadata");

// The index alone, from `.metadata`'s bytes (the fuzzer's door): files named, not opened
// (stamps and file_bytes empty). `dir` names the folder in messages and the files' paths.
// `every_rank`: the index lists every rank's chunks (the global `.metadata`), so each tensor's
// chunks must hold each of its elements once; a rank's own index need only not overlap.
DcpCheckpoint parse_dcp_metadata(std::span<const unsigned char> bytes, const std::string& dir,
                                 bool every_rank = true);

// Chunks to read: (fqn, chunk index into its item's chunks).
struct DcpChunkRef {
  std::string fqn;
  std::uint32_t chunk = 0;
};

// The chunks as a checkpoint of tensors for the loader (read_checkpoint_boxes,
// read_checkpoint_tensor): tensor i of the result is chunk i of `chunks`, named "#<i>" zero
// padded to 12 digits (natural order = the order given), its byte range the tensor inside the
// item's archive. Each item's archive is read (its directory and pickle, never its tensor's
// bytes) and checked: one contiguous tensor of the chunk's size and the item's dtype. The
// result's files and stamps are the checkpoint's: a file replaced since it was opened is refused
// by the reads. Throws InvalidArgument naming the file, the item's byte range and the fqn.
CheckpointIndex dcp_chunks_index(const DcpCheckpoint& ck, const std::vector<DcpChunkRef>& chunks);

}  // namespace zeroflat
