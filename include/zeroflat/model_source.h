// Model specifications read from files: Hugging Face config.json, safetensors headers (a single
// file, a directory of shards, the index file), or the built-in catalog by name.
//
// These files are untrusted input. Every size is bounded, every field validated; a malformed
// file throws InvalidArgument naming the file and, where there is one, the tensor or field.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/model.h"

namespace zeroflat {

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
