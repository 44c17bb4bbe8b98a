// A torch.save'd state dict as checkpoint index entries (torch_state.h).
#include "model/torch_state.h"

#include <filesystem>
#include <map>
#include <string>
#include <tuple>

#include "model/torch_file.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {
namespace {

// Safetensors' name of a torch dtype, as the index keeps dtypes (CheckpointTensor::dtype);
// torch's own name, upper-cased, for one safetensors has not (complex): read by nothing.
std::string index_dtype(const TorchTensor& t) {
  static const std::pair<const char*, const char*> kNames[] = {
      {"bf16", "BF16"},   {"fp16", "F16"},   {"fp32", "F32"},  {"float64", "F64"},
      {"int64", "I64"},   {"int32", "I32"},  {"int16", "I16"}, {"int8", "I8"},
      {"uint8", "U8"},    {"bool", "BOOL"}};
  for (const auto& [torch_name, st] : kNames) {
    if (t.dtype == torch_name) return st;
  }
  std::string out;
  for (char c : t.dtype) out += static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  return out;
}

}  // namespace

bool is_index_file(const std::string& path) {
  std::error_code ec;
  const std::string name = std::filesystem::path(path).filename().string();
  return (name.ends_with(".safetensors.index.json") || name.ends_with(".bin.index.json")) &&
         !std::filesystem::is_directory(path, ec);
}

TorchStateShard torch_state_shard(const std::string& path, std::uint32_t file) {
  const TorchFile f = read_torch_file(path);
  const std::string where = printable(path, 200);
  if (f.root.kind != TorchKind::kDict) {
    throw InvalidArgument(where + ": the saved object is a " +
                          std::string(torch_kind_name(f.root.kind)) +
                          ", not a state dict (a dict of names to tensors, as "
                          "pytorch_model.bin holds)");
  }
  TorchStateShard out;
  out.file_bytes = f.file_bytes;
  out.stamp = f.stamp;
  out.tensors.reserve(f.root.entries.size());
  // (offset, bytes, dtype, shape) -> the first name: a later name of the same bytes is an alias.
  std::map<std::tuple<std::uint64_t, std::uint64_t, std::string, Shape>, std::string> first;
  for (const TorchEntry& e : f.root.entries) {
    if (e.first.kind != TorchKind::kString) {
      throw InvalidArgument(where + ": a key of the state dict is a " +
                            std::string(torch_kind_name(e.first.kind)) + " (" +
                            printable(torch_path_segment(e.first), 80) +
                            "), not a tensor's name");
    }
    const std::string name = printable(e.first.text, 200);
    if (e.first.text.empty() || e.first.text == "__metadata__") {
      throw InvalidArgument(where + ": a tensor is named '" + name +
                            "', a name no checkpoint may give a tensor (safetensors refuses "
                            "it)");
    }
    if (e.second.kind != TorchKind::kTensor) {
      throw InvalidArgument(
          where + ": '" + name + "' is a " + std::string(torch_kind_name(e.second.kind)) +
          ", not a tensor" +
          (e.second.kind == TorchKind::kDict
               ? " (a training checkpoint that keeps its state dict under a key? save the "
                 "model's state_dict() itself)"
               : ""));
    }
    const TorchTensor& t = f.tensors.at(static_cast<std::size_t>(e.second.integer));
    if (t.numel > 0 && !t.contiguous) {
      throw InvalidArgument(where + ": tensor '" + name + "' " + shape_to_string(t.shape) +
                            " is stored as a view that is not contiguous (strides " +
                            shape_to_string(Shape(t.stride.begin(), t.stride.end())) +
                            "); save it contiguous (.contiguous()) or as safetensors");
    }
    CheckpointTensor entry;
    entry.name = e.first.text;
    entry.dtype = index_dtype(t);
    entry.type = t.type;
    entry.shape = t.shape;
    entry.numel = t.numel;
    entry.file = file;
    entry.offset = t.offset;
    entry.bytes = t.numel > 0 ? t.bytes : 0;
    if (t.numel > 0) {
      const auto [it, fresh] =
          first.emplace(std::tuple(entry.offset, entry.bytes, entry.dtype, entry.shape),
                        entry.name);
      entry.alias = !fresh;
    }
    out.tensors.push_back(std::move(entry));
  }
  return out;
}

}  // namespace zeroflat::detail
