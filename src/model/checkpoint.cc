// Safetensors checkpoints: the index of tensors by file and byte range, and the test writer.
#include "zeroflat/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "common/convert.h"
#include "common/pattern.h"
#include "model/files.h"
#include "model/strict_json.h"
#include "model/tiling.h"
#include "model/torch_file.h"
#include "model/torch_state.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

namespace fs = std::filesystem;

// A file DCP's HuggingFaceStorageWriter wrote as one rank's part (save_distributed without
// consolidation): its __metadata__'s DCP_SHARDING_INFO gives each tensor's saved_offsets, where
// the tensor in the file starts in the whole. The offsets by tensor name (none without the
// entry), each checked to be a list of counts. Without `pieces` a part that places any tensor
// off the origin is refused: its tensors are pieces that a whole-tensor reader would take for
// whole tensors. A part at the origin of every tensor is the whole (one rank saved it).
std::map<std::string, Shape> dcp_placements(const fs::path& file,
                                            const std::map<std::string, std::string>& meta,
                                            bool pieces) {
  std::map<std::string, Shape> out;
  const auto it = meta.find("DCP_SHARDING_INFO");
  if (it == meta.end()) return out;
  const std::string where = printable(file.string(), 200);
  nlohmann::json info;
  try {
    info = detail::parse_strict_json(it->second, where + " DCP_SHARDING_INFO", 8);
  } catch (const Error& e) {
    throw InvalidArgument(std::string(e.what()));
  }
  if (!info.is_object()) {
    throw InvalidArgument(where + ": __metadata__ DCP_SHARDING_INFO is not a JSON object");
  }
  for (auto t = info.begin(); t != info.end(); ++t) {
    const nlohmann::json* offsets =
        t.value().is_object() && t.value().contains("saved_offsets")
            ? &t.value()["saved_offsets"]
            : nullptr;
    const std::string shown =
        printable(offsets != nullptr ? offsets->dump() : t.value().dump(), 80);
    bool valid = offsets != nullptr && offsets->is_array() && offsets->size() <= 16;
    bool origin = valid;
    Shape at;
    if (valid) {
      for (const nlohmann::json& o : *offsets) {
        // Counts below 2^62: an offset plus a dimension then never wraps.
        if (!o.is_number_unsigned() || o.get<std::uint64_t>() >= (std::uint64_t{1} << 62)) {
          valid = origin = false;
          break;
        }
        at.push_back(static_cast<std::int64_t>(o.get<std::uint64_t>()));
        if (at.back() != 0) origin = false;
      }
    }
    if (pieces && !valid) {
      throw InvalidArgument(where + ": __metadata__ DCP_SHARDING_INFO: tensor '" +
                            printable(t.key()) + "' has saved_offsets " + shown +
                            ", not a list of counts");
    }
    if (!pieces && !origin) {
      throw InvalidArgument(
          where + ": one rank's part of a checkpoint DCP's HuggingFaceStorageWriter saved "
          "sharded (__metadata__ DCP_SHARDING_INFO: tensor '" + printable(t.key()) +
          "' is a piece at saved_offsets " + shown +
          "); this reader takes whole tensors: consolidate the folder first (DCP's "
          "consolidate_safetensors_files, or save with enable_consolidation=True), or load "
          "it through DCP's load with zeroflat.dcp.Reader, which reads the pieces");
    }
    out.emplace(t.key(), std::move(at));
  }
  return out;
}

// Names as sequences of tokens, a run of digits being one token compared by its value:
// "layers.10" after "layers.9". Negative, zero or positive as in strcmp. Names that differ only
// in leading zeros ("layers.0" and "layers.00") compare equal here.
int natural_compare(std::string_view a, std::string_view b) noexcept {
  auto digit = [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; };
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (digit(a[i]) && digit(b[j])) {
      std::size_t i2 = i, j2 = j;
      while (i2 < a.size() && digit(a[i2])) ++i2;
      while (j2 < b.size() && digit(b[j2])) ++j2;
      std::string_view x = a.substr(i, i2 - i), y = b.substr(j, j2 - j);
      while (x.size() > 1 && x.front() == '0') x.remove_prefix(1);
      while (y.size() > 1 && y.front() == '0') y.remove_prefix(1);
      if (x.size() != y.size()) return x.size() < y.size() ? -1 : 1;
      if (const int c = x.compare(y); c != 0) return c;
      i = i2;
      j = j2;
    } else {
      const auto x = static_cast<unsigned char>(a[i]), y = static_cast<unsigned char>(b[j]);
      if (x != y) return x < y ? -1 : 1;
      ++i;
      ++j;
    }
  }
  const std::size_t ra = a.size() - i, rb = b.size() - j;
  return ra == rb ? 0 : (ra < rb ? -1 : 1);
}

// The order of CheckpointIndex::tensors: natural, and among names the natural comparison finds
// equal (leading zeros) plain byte order. A strict total order, so that distinct names never
// compare equal: sorting places them deterministically and find() lands on the exact name.
bool natural_less(std::string_view a, std::string_view b) noexcept {
  const int c = natural_compare(a, b);
  return c != 0 ? c < 0 : a < b;
}

std::optional<DType> loadable(const std::string& st) {
  if (st == "BF16") return DType::kBF16;
  if (st == "F16") return DType::kFP16;
  if (st == "F32") return DType::kFP32;
  return std::nullopt;
}

const char* st_name(DType d) {
  switch (d) {
    case DType::kBF16:
      return "BF16";
    case DType::kFP16:
      return "F16";
    case DType::kFP32:
      return "F32";
  }
  return "?";
}

// Where a tensor starts in its whole: its piece's offsets, the origin for a tensor stored whole.
Shape origin_of(const CheckpointTensor& t) {
  return t.piece_offsets.empty() ? Shape(t.shape.size(), 0) : t.piece_offsets;
}

// The order of CheckpointIndex::tensors: by name (natural_less), a name's pieces by offsets.
bool entry_less(const CheckpointTensor& a, const CheckpointTensor& b) {
  if (a.name != b.name) return natural_less(a.name, b.name);
  return origin_of(a) < origin_of(b);
}

}  // namespace

const CheckpointTensor* CheckpointIndex::find(const std::string& name) const {
  auto it = std::lower_bound(
      tensors.begin(), tensors.end(), name,
      [](const CheckpointTensor& t, const std::string& n) { return natural_less(t.name, n); });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

CheckpointIndex checkpoint_pieces(const CheckpointIndex& ck, const std::vector<PieceRef>& refs) {
  CheckpointIndex out;
  out.path = ck.path;
  out.files = ck.files;
  out.file_bytes = ck.file_bytes;
  out.stamps = ck.stamps;
  out.tensors.reserve(refs.size());
  for (std::size_t i = 0; i < refs.size(); ++i) {
    const PieceRef& ref = refs[i];
    auto it = std::lower_bound(ck.tensors.begin(), ck.tensors.end(), ref,
                               [](const CheckpointTensor& t, const PieceRef& r) {
                                 if (t.name != r.name) return natural_less(t.name, r.name);
                                 return origin_of(t) < r.offsets;
                               });
    if (it == ck.tensors.end() || it->name != ref.name || origin_of(*it) != ref.offsets) {
      throw InvalidArgument(printable(ck.path, 200) + ": no piece of a tensor '" +
                            printable(ref.name, 200) + "' at saved_offsets " +
                            shape_to_string(ref.offsets) + " in its files");
    }
    char name[24];
    std::snprintf(name, sizeof name, "#%012zu", i);
    out.tensors.push_back(*it);
    out.tensors.back().name = name;
  }
  return out;
}

CheckpointIndex open_checkpoint(const std::string& path_text, const CheckpointOptions& options) {
  detail::check_path(path_text);
  const fs::path path(path_text);
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw InvalidArgument(printable(path_text, 200) + ": no such file or directory");
  }
  CheckpointIndex out;
  out.path = path_text;
  std::vector<fs::path> files;
  std::map<std::string, std::string> weight_map;
  // The index of a sharded checkpoint is its directory's model.safetensors.index.json (or,
  // for a checkpoint of torch.save'd shards, pytorch_model.bin.index.json). Given the index
  // file itself, the checkpoint is the directory it describes: read as a safetensors file, its
  // text would give a meaningless header length.
  const bool index_given = detail::is_index_file(path_text);
  const fs::path dir = index_given ? path.parent_path() : path;
  fs::path index = index_given ? path : fs::path();
  // A folder's model, as Transformers chooses it: model.safetensors, else the shards of
  // model.safetensors.index.json, else pytorch_model.bin, else the shards of
  // pytorch_model.bin.index.json (torch.save'd state dicts, read by the restricted reader:
  // nothing in them runs); whatever else lies beside the one chosen (a variant such as
  // model.fp16.safetensors holding the same names, an adapter, older shards) is not the model.
  // A folder with none of these is its .safetensors files, listed. (Files: a folder named
  // model.safetensors is not one, as Transformers' isfile says.)
  if (!index_given && fs::is_directory(path, ec)) {
    if (fs::is_regular_file(path / "model.safetensors", ec)) {
      files.push_back(path / "model.safetensors");
    } else if (fs::is_regular_file(path / "model.safetensors.index.json", ec)) {
      index = path / "model.safetensors.index.json";
    } else if (fs::is_regular_file(path / "pytorch_model.bin", ec)) {
      files.push_back(path / "pytorch_model.bin");
    } else if (fs::is_regular_file(path / "pytorch_model.bin.index.json", ec)) {
      index = path / "pytorch_model.bin.index.json";
    } else {
      std::error_code listing;
      for (auto it = fs::directory_iterator(path, listing);
           !listing && it != fs::directory_iterator(); it.increment(listing)) {
        if (it->path().extension() == ".safetensors") files.push_back(it->path());
      }
      if (listing) {
        throw InvalidArgument(printable(path_text, 200) + ": cannot list the folder (" +
                              listing.message() + ")");
      }
      std::sort(files.begin(), files.end());
    }
  } else if (!index_given) {
    files.push_back(path);
  }
  if (!index.empty()) {
    const nlohmann::json doc = detail::parse_strict_json(
        detail::read_small_file(index.string(), kMaxHeaderBytes, "an index file"), index.string());
    if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
      throw InvalidArgument(index.string() + ": no 'weight_map' object");
    }
    std::set<std::string> shard_names;
    for (auto it = doc["weight_map"].begin(); it != doc["weight_map"].end(); ++it) {
      if (!it.value().is_string()) {
        throw InvalidArgument(index.string() + ": weight_map entry for '" + printable(it.key()) +
                              "' is not a file name");
      }
      const std::string shard = it.value().get<std::string>();
      if (shard.empty() || shard.find_first_of(std::string_view("/\0", 2)) != std::string::npos ||
          shard == "." || shard == "..") {
        throw InvalidArgument(index.string() + ": shard name '" + printable(shard) +
                              "' is not a plain file name in this directory");
      }
      weight_map[it.key()] = shard;
      shard_names.insert(shard);
    }
    for (const std::string& s : shard_names) files.push_back(dir / s);
  }
  if (files.empty()) {
    throw InvalidArgument(fs::exists(index, ec)
                              ? index.string() + ": the index lists no tensors"
                              : printable(path_text, 200) +
                                    ": no .safetensors files (nor a pytorch_model.bin)");
  }
  std::map<std::pair<std::string, Shape>, std::string> seen;  // (tensor, offsets) -> file
  std::set<std::string> names;
  std::map<std::string, CheckpointTensor> empty_pieces;  // pieces mode: a name's first empty one
  // One entry of file f: no name twice (per place, in pieces mode), each where the index says.
  auto add = [&](const fs::path& f, CheckpointTensor entry) {
    names.insert(entry.name);
    if (options.pieces && entry.numel == 0) {
      empty_pieces.emplace(entry.name, std::move(entry));
      return;
    }
    auto [it, fresh] = seen.emplace(std::pair(entry.name, entry.piece_offsets),
                                    f.filename().string());
    if (!fresh) {
      throw InvalidArgument(f.string() + ": tensor '" + printable(entry.name) + "'" +
                            (options.pieces ? " at saved_offsets " +
                                                  shape_to_string(entry.piece_offsets)
                                            : std::string()) +
                            " is also in " + it->second);
    }
    if (!weight_map.empty()) {
      auto w = weight_map.find(entry.name);
      if (w == weight_map.end()) {
        throw InvalidArgument(f.string() + " holds tensor '" + printable(entry.name) +
                              "', which its index " + printable(index.filename().string()) +
                              " does not list (an index of another save, or edited?)");
      }
      if (w->second != f.filename().string()) {
        throw InvalidArgument(f.string() + " holds tensor '" + printable(entry.name) +
                              "', which its index " + printable(index.filename().string()) +
                              " places in " + printable(w->second, 200));
      }
    }
    out.tensors.push_back(std::move(entry));
  };
  for (const fs::path& f : files) {
    if (!weight_map.empty() && !fs::exists(f, ec)) {
      // The index is what is wrong (or the download incomplete): say so, and name both.
      const std::string shard = f.filename().string();
      std::size_t count = 0;
      std::string example;
      for (const auto& [tensor, file] : weight_map) {
        if (file != shard) continue;
        if (count++ == 0) example = tensor;
      }
      throw InvalidArgument(printable(index.string(), 200) + ": the index names shard '" +
                            printable(shard) + "' (for " + std::to_string(count) + " tensor" +
                            (count == 1 ? "" : "s") + ", '" + printable(example) +
                            "' first), but that shard is missing: " +
                            printable(f.string(), 200) +
                            " does not exist (an incomplete download or copy?)");
    }
    // By name first: a safetensors file's header length can begin with a pickle's PROTO byte.
    if (f.extension() != ".safetensors" && is_torch_file(f.string())) {
      const auto file = static_cast<std::uint32_t>(out.files.size());
      detail::TorchStateShard shard = detail::torch_state_shard(f.string(), file);
      out.files.push_back(f.string());
      out.file_bytes.push_back(shard.file_bytes);
      out.stamps.push_back(shard.stamp);
      for (CheckpointTensor& entry : shard.tensors) {
        if (options.pieces) entry.piece_offsets.assign(entry.shape.size(), 0);
        add(f, std::move(entry));
      }
      continue;
    }
    const SafetensorsHeader h = read_safetensors_header(f.string());
    const std::map<std::string, Shape> placed = dcp_placements(f, h.metadata, options.pieces);
    const auto file = static_cast<std::uint32_t>(out.files.size());
    out.files.push_back(f.string());
    out.file_bytes.push_back(8 + h.header_bytes + h.data_bytes);
    out.stamps.push_back(h.stamp);
    for (const SafetensorsTensor& t : h.tensors) {
      CheckpointTensor entry{t.name, t.dtype, loadable(t.dtype), t.shape, t.numel,
                             file, 8 + h.header_bytes + t.begin, t.end - t.begin, {}, {}};
      if (options.pieces) {
        const auto p = placed.find(t.name);
        entry.piece_offsets = p != placed.end() ? p->second : Shape(t.shape.size(), 0);
        if (entry.piece_offsets.size() != t.shape.size()) {
          throw InvalidArgument(f.string() + ": tensor '" + printable(t.name) + "' is " +
                                shape_to_string(t.shape) + ", its DCP_SHARDING_INFO "
                                "saved_offsets " + shape_to_string(entry.piece_offsets) +
                                " have another count of dimensions");
        }
      }
      add(f, std::move(entry));
    }
  }
  for (const auto& [name, file] : weight_map) {
    if (!names.count(name)) {
      throw InvalidArgument(index.string() + ": tensor '" + printable(name) + "' is not in " +
                            file);
    }
  }
  // A name all of whose pieces are empty keeps one (the tensor exists, with no elements).
  for (auto& [name, entry] : empty_pieces) {
    const auto any = seen.lower_bound(std::pair(name, Shape{}));
    if (any != seen.end() && any->first.first == name) continue;
    if (!entry.piece_offsets.empty()) entry.piece_offsets.assign(entry.shape.size(), 0);
    out.tensors.push_back(std::move(entry));
  }
  std::sort(out.tensors.begin(), out.tensors.end(), entry_less);
  if (options.pieces) detail::check_piece_tiling(out.tensors, out.files);
  return out;
}

namespace {

// A JSON string literal of s.
std::string json_string(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// A file write_pattern_checkpoint creates: always a new one. O_EXCL refuses any name that
// exists, a link included (even one whose target does not exist: creating through it would make
// a file outside the directory), and O_NOFOLLOW refuses a link even where O_EXCL would not be
// checked; so the writer never writes over or through anything it did not create, and may
// remove on failure exactly what it created. Writes are buffered: small tensors are many.
class NewFile {
 public:
  explicit NewFile(fs::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      const int err = errno;
      if (err == EEXIST || err == ELOOP) {
        throw InvalidArgument(printable(path_.string(), 200) +
                              " exists already (a file or a link): a checkpoint is written into "
                              "files created new, never over or through another; write into a "
                              "new directory");
      }
      throw Error(printable(path_.string(), 200) + ": cannot create it (" + std::strerror(err) +
                  ")");
    }
    buf_.reserve(kBuffer);
  }
  NewFile(const NewFile&) = delete;
  NewFile& operator=(const NewFile&) = delete;
  ~NewFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  void write(const void* data, std::size_t n) {
    const auto* p = static_cast<const char*>(data);
    if (buf_.size() + n > kBuffer) flush();
    if (n >= kBuffer) {
      put(p, n);
    } else {
      buf_.insert(buf_.end(), p, p + n);
    }
  }
  void close() {
    flush();
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail(errno);
  }

 private:
  static constexpr std::size_t kBuffer = std::size_t{4} << 20;
  void flush() {
    put(buf_.data(), buf_.size());
    buf_.clear();
  }
  void put(const char* p, std::size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) fail(w < 0 ? errno : ENOSPC);
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  [[noreturn]] void fail(int err) const {
    throw Error(printable(path_.string(), 200) + ": writing failed (" + std::strerror(err) + ")");
  }

  fs::path path_;
  int fd_ = -1;
  std::vector<char> buf_;
};

// What write_pattern_checkpoint writes: the shards' names, header texts and tensors.
struct Shard {
  std::string name;
  std::string header;               // padded so that the data starts 8-byte aligned
  std::size_t first = 0, last = 0;  // [first, last) of the model's tensors
  std::uint64_t data_bytes = 0;
};

std::vector<Shard> pattern_shards(const ModelSpec& model, DType dtype, std::uint64_t shard_bytes) {
  if (shard_bytes == 0) throw InvalidArgument("shards of 0 bytes");
  if (model.tensors.empty()) throw InvalidArgument(model.name + " has no tensors");
  // Every offset and sum below is at most this plus a shard's header, checked once here.
  const std::uint64_t total = model.num_bytes(dtype);
  if (total > UINT64_MAX - kMaxHeaderBytes - 8) {
    throw InvalidArgument(model.name + ": " + std::to_string(total) + " bytes of " +
                          std::string(dtype_name(dtype)) +
                          " leave no room for a header in a 64-bit file size");
  }
  const std::uint64_t es = element_size(dtype);
  // Consecutive tensors up to shard_bytes of data each (a larger tensor alone).
  std::vector<Shard> shards;
  Shard cur;
  for (std::size_t i = 0; i < model.tensors.size(); ++i) {
    const std::uint64_t b = model.tensors[i].numel * es;
    if (i > cur.first && cur.data_bytes + b > shard_bytes) {
      cur.last = i;
      shards.push_back(cur);
      cur = Shard{};
      cur.first = i;
    }
    cur.data_bytes += b;
  }
  cur.last = model.tensors.size();
  shards.push_back(cur);
  const std::size_t n = shards.size();
  for (std::size_t k = 0; k < n; ++k) {
    Shard& sh = shards[k];
    if (n == 1) {
      sh.name = "model.safetensors";
    } else {
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
      sh.name = buf;
    }
    // Written out entry by entry: a JSON object built key by key keeps its keys in order by a
    // linear search for each new one, quadratic in the tensors of a shard.
    std::string& h = sh.header;
    h = R"({"__metadata__":{"format":"pt"})";
    std::uint64_t at = 0;
    for (std::size_t i = sh.first; i < sh.last; ++i) {
      const TensorSpec& t = model.tensors[i];
      h += ',';
      h += json_string(t.name);
      h += R"(:{"dtype":")";
      h += st_name(dtype);
      h += R"(","shape":[)";
      for (std::size_t d = 0; d < t.shape.size(); ++d) {
        if (d > 0) h += ',';
        h += std::to_string(t.shape[d]);
      }
      h += R"(],"data_offsets":[)" + std::to_string(at) + ',' +
           std::to_string(at + t.numel * es) + "]}";
      at += t.numel * es;
    }
    h += '}';
    h.append((8 - (8 + h.size()) % 8) % 8, ' ');
  }
  return shards;
}

}  // namespace

CheckpointIndex pattern_checkpoint_index(const ModelSpec& model, DType dtype,
                                         const std::string& dir, std::uint64_t shard_bytes) {
  const std::vector<Shard> shards = pattern_shards(model, dtype, shard_bytes);
  const std::uint64_t es = element_size(dtype);
  CheckpointIndex out;
  out.path = dir;
  for (const Shard& sh : shards) {
    const auto file = static_cast<std::uint32_t>(out.files.size());
    out.files.push_back((fs::path(dir) / sh.name).string());
    const std::uint64_t data = 8 + sh.header.size();
    out.file_bytes.push_back(data + sh.data_bytes);
    std::uint64_t at = data;
    for (std::size_t i = sh.first; i < sh.last; ++i) {
      const TensorSpec& t = model.tensors[i];
      out.tensors.push_back(CheckpointTensor{t.name, st_name(dtype), dtype, t.shape, t.numel, file,
                                             at, t.numel * es, {}, {}});
      at += t.numel * es;
    }
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const CheckpointTensor& a, const CheckpointTensor& b) {
              return natural_less(a.name, b.name);
            });
  for (std::size_t i = 1; i < out.tensors.size(); ++i) {
    if (out.tensors[i].name == out.tensors[i - 1].name) {
      throw InvalidArgument(model.name + ": two tensors are named '" +
                            printable(out.tensors[i].name) + "'");
    }
  }
  return out;
}

void write_pattern_checkpoint(const ModelSpec& model, DType dtype, const std::string& dir_text,
                              std::uint64_t shard_bytes, std::optional<DType> values,
                              const std::function<void(std::uint64_t)>& progress) {
  detail::check_path(dir_text);
  const fs::path dir(dir_text);
  std::error_code ec;
  // symlink_status: a link counts as there, whether or not its target exists.
  auto there = [&](const fs::path& p) { return fs::exists(fs::symlink_status(p, ec)); };
  if (there(dir / "model.safetensors.index.json") || there(dir / "model.safetensors")) {
    throw InvalidArgument(dir_text + " holds a checkpoint already: write into a new directory");
  }
  const std::vector<Shard> shards = pattern_shards(model, dtype, shard_bytes);
  // Every name this run will create must be free before the first byte is written.
  for (const Shard& sh : shards) {
    if (there(dir / sh.name)) {
      throw InvalidArgument(printable((dir / sh.name).string(), 200) +
                            " exists already (a file or a link): a checkpoint is written into "
                            "files created new, never over or through another; write into a new "
                            "directory");
    }
  }
  // Tensor i of the natural name order (the order a checkpoint is flattened in when it is the
  // model) holds pattern i; the index also checks that the names are unique.
  const CheckpointIndex index = pattern_checkpoint_index(model, dtype, dir_text, shard_bytes);
  std::map<std::string, std::uint64_t> pattern_of;
  for (std::size_t i = 0; i < index.tensors.size(); ++i) pattern_of[index.tensors[i].name] = i;
  const bool made_dir = fs::create_directories(dir, ec);
  if (ec) throw InvalidArgument(dir_text + ": cannot create it (" + ec.message() + ")");
  const DType pattern = values.value_or(dtype);
  const std::uint64_t es = element_size(dtype);
  const std::uint64_t ps = element_size(pattern);
  std::vector<fs::path> created;  // by this run: the only files a failure removes
  try {
    std::string weight_map;  // the index's entries, written out as the shards are
    std::uint64_t total = 0;
    for (const Shard& sh : shards) {
      const fs::path file = dir / sh.name;
      NewFile out(file);
      created.push_back(file);
      const std::uint64_t len = sh.header.size();
      char len_bytes[8];
      for (int b = 0; b < 8; ++b) len_bytes[b] = static_cast<char>((len >> (8 * b)) & 0xff);
      out.write(len_bytes, 8);
      out.write(sh.header.data(), sh.header.size());
      std::vector<unsigned char> raw, buf;
      for (std::size_t i = sh.first; i < sh.last; ++i) {
        const TensorSpec& t = model.tensors[i];
        weight_map += (weight_map.empty() ? "\n    " : ",\n    ") + json_string(t.name) + ": " +
                      json_string(sh.name);
        constexpr std::uint64_t kPiece = std::uint64_t{1} << 22;  // elements at a time
        for (std::uint64_t lo = 0; lo < t.numel; lo += kPiece) {
          const std::uint64_t count = std::min(kPiece, t.numel - lo);
          raw.resize(count * ps);
          fill_pattern(raw.data(), pattern, pattern_of[t.name], lo, count);
          buf.resize(count * es);
          detail::convert_range(buf.data(), dtype, raw.data(), pattern, count);
          out.write(buf.data(), buf.size());
          if (progress) progress(buf.size());
        }
      }
      out.close();
      total += sh.data_bytes;
    }
    if (shards.size() > 1) {
      // As a JSON library indents it (two spaces), written out for the same reason as headers.
      const std::string doc = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total) +
                              "\n  },\n  \"weight_map\": {" + weight_map + "\n  }\n}\n";
      const fs::path file = dir / "model.safetensors.index.json";
      NewFile out(file);
      created.push_back(file);
      out.write(doc.data(), doc.size());
      out.close();
    }
  } catch (...) {
    for (const fs::path& f : created) fs::remove(f, ec);
    if (made_dir) fs::remove(dir, ec);  // only if empty: nothing of anyone else's
    throw;
  }
}

}  // namespace zeroflat
