// Model files and checkpoints as zeroflat reads them: safetensors checkpoints for the loader
// (every tensor's file, byte range and dtype; headers only are read) and a writer of
// deterministic test checkpoints; and model specifications read from files (Hugging Face
// config.json, safetensors headers, lists of element counts), with what `zeroflat inspect`
// reports of a path.
//
// These files are untrusted input. Every size is bounded, every field validated; a malformed
// file throws InvalidArgument naming the file and, where there is one, the tensor or field.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/common.h"
#include "zeroflat/model.h"

namespace zeroflat {

// --- Safetensors checkpoints ---------------------------------------------------------------------
// Safetensors checkpoints as the loader reads them: every tensor's file, byte range and dtype
// (headers only are read), and a writer of deterministic test checkpoints.
//
// A checkpoint is one `.safetensors` file, or a directory of them, with Hugging Face's
// `model.safetensors.index.json` naming the shard of each tensor when there is one. These files
// are untrusted input: every header is validated (below), the index must agree with
// the shards, and a file shorter than its header says is refused, before anything is read.

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

// --- Model specifications from files -------------------------------------------------------------
// Model specifications read from files: Hugging Face config.json, safetensors headers (a single
// file, a directory of shards, the index file), or the built-in catalog by name.

// The largest header or config file zeroflat reads (the safetensors format's own limit).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as in the file: "BF16", "F32", ...
  Shape shape;
  std::uint64_t numel = 0;
  std::uint64_t begin = 0;  // data_offsets, relative to the start of the data section
  std::uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsTensor> tensors;  // sorted by data offset
  std::map<std::string, std::string> metadata;
  std::uint64_t header_bytes = 0;  // n, the JSON's length
  std::uint64_t data_bytes = 0;    // file size - 8 - n
  FileStamp stamp;                 // read_safetensors_header: the file as it was read
};

// Bytes per element of a safetensors dtype name; 0 when zeroflat does not know it.
std::uint64_t safetensors_dtype_size(std::string_view dtype) noexcept;

// Parses a header held in memory. `head` starts at byte 0 of the file and holds at least the
// 8-byte length and the JSON (it may hold more); file_size is the whole file's size. `source`
// names the file in errors.
SafetensorsHeader parse_safetensors_header(std::span<const unsigned char> head,
                                           std::uint64_t file_size, const std::string& source);

// Reads and parses the header of a .safetensors file, reading nothing of its data.
SafetensorsHeader read_safetensors_header(const std::string& path);

// Whether a file's first bytes are a safetensors header's (a little-endian length that fits the
// file, then '{'), whatever its name: a safetensors file named .bin is one. Never throws.
bool is_safetensors_file(const std::string& path) noexcept;

// Parses a Hugging Face config.json for the supported architectures (Qwen3MoeForCausalLM,
// Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM).
TransformerConfig parse_hf_config(std::string_view text, const std::string& source);

// A model from a catalog name, a config.json path, a directory holding one (config.json) or
// safetensors checkpoint files, or a single .safetensors file. Overrides apply to catalog and
// config models; a checkpoint's tensors are taken as they are (overrides are refused).
ModelSpec load_model(const std::string& name_or_path, const ModelOverrides& overrides = {});

// The most element counts a list may hold, and the largest file of them zeroflat reads.
inline constexpr std::uint64_t kMaxNumels = 10'000'000;
inline constexpr std::uint64_t kMaxNumelsFileBytes = std::uint64_t{256} << 20;

// Element counts from "5,7,3" (commas and/or white space) or "@FILE" (a regular file of one
// integer per line, or a flat JSON list). Parsing is linear in the input; at most kMaxNumels
// items. Throws InvalidArgument naming the bad item or file.
std::vector<std::uint64_t> parse_numels(std::string_view text);
// The contents of such a file (one integer per line, or a flat JSON list); `source` names it in
// errors.
std::vector<std::uint64_t> parse_numels_file_text(std::string_view content,
                                                  const std::string& source);

// What `zeroflat inspect` reports about a path.
struct TensorInfo {
  std::string name;
  std::string dtype;  // "bf16", "fp32", ... (zeroflat's names where it has one)
  Shape shape;
  std::uint64_t numel = 0;
  std::uint64_t bytes = 0;
};
struct Inspection {
  std::string source;  // "safetensors", "checkpoint", "config"
  std::uint64_t files = 0;
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::uint64_t> bytes_by_dtype;
  std::uint64_t numel = 0;
  std::uint64_t bytes = 0;
};
Inspection inspect_path(const std::string& path);

}  // namespace zeroflat
