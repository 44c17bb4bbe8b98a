// DCP folders (dcp_checkpoint.h): the `.metadata` pickle read by the restricted machine with its
// DCP rows, walked field by field into plain values; each item's torch.save archive read by
// torch_file.h's reader, at its offset of its .distcp file.
#include "zeroflat/dcp_checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <sys/stat.h>

#include "common/saturate.h"
#include "model/files.h"
#include "model/pickle.h"
#include "model/tiling.h"
#include "model/torch_file.h"
#include "model/torch_window.h"
#include "source/saved_state.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

static_assert(detail::kMaxDcpIndexValues == 32 * kMaxDcpChunks,
              "the pickle machine's bound for a DCP index is 32 values per chunk");

using detail::kNoNode;
using detail::Node;
using detail::NodeKind;

// torch's dtype names DCP's index may give (the allow-list's dtype rows), with the names the
// loader's checkpoints use (safetensors') and what torch_file.h calls a tensor's dtype.
struct DcpDtype {
  const char* torch;
  const char* stored;
  const char* reader;
};
constexpr DcpDtype kDtypes[] = {
    {"float32", "F32", "fp32"},  {"bfloat16", "BF16", "bf16"}, {"float16", "F16", "fp16"},
    {"float64", "F64", "float64"}, {"int64", "I64", "int64"},  {"int32", "I32", "int32"},
    {"int16", "I16", "int16"},   {"int8", "I8", "int8"},       {"uint8", "U8", "uint8"},
    {"bool", "BOOL", "bool"},
};

const DcpDtype* dtype_named(std::string_view torch) {
  for (const DcpDtype& d : kDtypes) {
    if (torch == d.torch) return &d;
  }
  return nullptr;
}

// Walks the index's graph, every field checked; errors name `.metadata` and the field.
class Walker {
 public:
  Walker(const detail::PickleGraph& g, std::string file) : g_(g), file_(std::move(file)) {}

  InvalidArgument fail(const std::string& where, const std::string& why) const {
    return InvalidArgument(file_ + ": " + where + ": " + why);
  }
  const Node& node(std::uint32_t i) const { return g_.nodes.at(i); }
  std::span<const std::uint32_t> items(std::uint32_t i) const { return g_.items(node(i)); }

  std::string class_of(const Node& n) const {
    const detail::AllowedGlobal& row = detail::allowed_globals()[n.ref];
    return std::string(row.name);
  }

  // The fields of an instance of one of DCP's classes: BUILD's dict, name, value, name, ...
  struct Fields {
    const Walker* w = nullptr;
    std::span<const std::uint32_t> pairs;
    std::uint32_t get(std::string_view name) const {
      for (std::size_t k = 0; k + 1 < pairs.size(); k += 2) {
        if (w->g_.text_of(pairs[k]) == name) return pairs[k + 1];
      }
      return kNoNode;
    }
  };
  // DCP's dataclasses have a handful of fields; a state dict of more (shared by every object
  // of a large index, it would make each field's lookup long) is not one of them.
  static constexpr std::size_t kMaxFields = 32;
  Fields fields(std::uint32_t i, std::string_view cls, const std::string& where) const {
    const Node& n = node(i);
    if (n.kind != NodeKind::kObject || class_of(n) != cls) {
      throw fail(where, "expected DCP's " + std::string(cls) + ", found " + describe(n));
    }
    if (n.state == kNoNode) return {this, {}};
    const Node& d = node(n.state);
    if (d.kind != NodeKind::kDict) throw fail(where, "its fields are not a dict");
    const std::span<const std::uint32_t> pairs = g_.items(d);
    if (pairs.size() / 2 > kMaxFields) {
      throw fail(where, std::to_string(pairs.size() / 2) + " fields (DCP's " + std::string(cls) +
                            " has a few; at most " + std::to_string(kMaxFields) + " are read)");
    }
    for (std::size_t k = 0; k + 1 < pairs.size(); k += 2) {
      const Node& key = node(pairs[k]);
      if (key.kind != NodeKind::kString) throw fail(where, "a field named by a " + describe(key));
    }
    return {this, pairs};
  }

  std::string describe(const Node& n) const {
    if (n.kind == NodeKind::kObject || n.kind == NodeKind::kGlobal || n.kind == NodeKind::kEnum) {
      const detail::AllowedGlobal& row = detail::allowed_globals()[n.ref];
      return std::string(detail::node_kind_name(n.kind)) + " " + row.module + "." + row.name;
    }
    return "a " + std::string(detail::node_kind_name(n.kind));
  }

  static std::uint32_t get(const Fields& f, const char* name) { return f.get(name); }
  bool is_none(std::uint32_t i) const { return i == kNoNode || node(i).kind == NodeKind::kNone; }

  std::string_view text(std::uint32_t i, const std::string& where) const {
    if (i == kNoNode || node(i).kind != NodeKind::kString) {
      throw fail(where, "expected a string, found " +
                            (i == kNoNode ? std::string("nothing") : describe(node(i))));
    }
    return g_.text_of(i);
  }
  std::uint64_t count(std::uint32_t i, const std::string& where) const {
    if (i == kNoNode || node(i).kind != NodeKind::kInt || node(i).integer < 0) {
      throw fail(where, "expected an int >= 0, found " +
                            (i == kNoNode                       ? std::string("nothing")
                             : node(i).kind == NodeKind::kInt ? std::to_string(node(i).integer)
                                                              : describe(node(i))));
    }
    return static_cast<std::uint64_t>(node(i).integer);
  }
  bool flag(std::uint32_t i, const std::string& where) const {
    if (i == kNoNode || node(i).kind != NodeKind::kBool) {
      throw fail(where, "expected a bool, found " +
                            (i == kNoNode ? std::string("nothing") : describe(node(i))));
    }
    return node(i).flag;
  }
  // A torch.Size (or a plain tuple or list) of ints >= 0.
  std::vector<std::uint64_t> dims(std::uint32_t i, const std::string& where) const {
    if (i == kNoNode || (node(i).kind != NodeKind::kTuple && node(i).kind != NodeKind::kList)) {
      throw fail(where, "expected a torch.Size, found " +
                            (i == kNoNode ? std::string("nothing") : describe(node(i))));
    }
    const std::span<const std::uint32_t> items = this->items(i);
    if (items.size() > kMaxTorchDims) {
      throw fail(where, std::to_string(items.size()) + " dimensions (at most " +
                            std::to_string(kMaxTorchDims) + ")");
    }
    std::vector<std::uint64_t> out;
    for (std::uint32_t k : items) out.push_back(count(k, where));
    return out;
  }

  const detail::PickleGraph& g_;
  std::string file_;
};

// A data file's name as the index gives it: one plain name inside the folder.
void check_relative(std::string_view name, const std::string& where, const Walker& w) {
  if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\\') != std::string::npos || name.find('\0') != std::string::npos ||
      name.front() == '.') {
    throw w.fail(where, "relative_path '" + printable(name, 200) +
                            "' is not a plain file name inside the checkpoint's folder");
  }
}

std::string offsets_text(const std::vector<std::uint64_t>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

// A tensor's chunks (each inside the tensor, checked before): no two share an element, and,
// in an index of every rank's chunks (`cover`), together they hold each element once. DCP
// saves each element of a tensor once (replicas deduplicated); a chunk left out of the index,
// or one moved, would leave rows of a target as they were, or fill them twice.
void check_chunks_tile(const Walker& w, const std::string& where, const DcpItem& item,
                       bool cover) {
  std::vector<Shape> offsets, sizes;
  offsets.reserve(item.chunks.size());
  sizes.reserve(item.chunks.size());
  for (const DcpChunk& c : item.chunks) {
    offsets.emplace_back(c.offsets.begin(), c.offsets.end());
    sizes.emplace_back(c.sizes.begin(), c.sizes.end());
  }
  std::vector<detail::Box> boxes;
  for (std::size_t i = 0; i < offsets.size(); ++i) boxes.push_back({&offsets[i], &sizes[i]});
  const detail::TilingProblem p = detail::tiling_problem(boxes, item.size, cover);
  if (p.overlap) {
    throw w.fail(where, "its chunks at offsets " + offsets_text(item.chunks[p.a].offsets) +
                            " and " + offsets_text(item.chunks[p.b].offsets) + " overlap");
  }
  if (p.too_many) {
    throw w.fail(where, "its " + std::to_string(item.chunks.size()) +
                            " chunks form no grid and are too many to check for overlap (no "
                            "save places chunks so)");
  }
  if (!p.ok()) {
    throw w.fail(where, "its chunks hold " + std::to_string(p.covered) + " of its " +
                            std::to_string(p.total) +
                            " elements: a chunk is missing from the index (DCP saves each "
                            "element of a tensor once)");
  }
}

}  // namespace

const DcpItem* DcpCheckpoint::find(const std::string& fqn) const {
  auto it = std::lower_bound(by_fqn.begin(), by_fqn.end(), fqn,
                             [&](std::uint32_t i, const std::string& f) { return items[i].fqn < f; });
  return it == by_fqn.end() || items[*it].fqn != fqn ? nullptr : &items[*it];
}

bool is_dcp_checkpoint(const std::string& dir, const std::string& index) noexcept {
  struct stat d {}, m {};
  const std::string meta = dir + "/" + index;
  return ::stat(dir.c_str(), &d) == 0 && S_ISDIR(d.st_mode) && ::stat(meta.c_str(), &m) == 0 &&
         S_ISREG(m.st_mode);
}

namespace {

// planner_data (each fqn's path in the nested state dict), then the items' order by name.
void index_planner_data(const Walker& w, const Walker::Fields& meta,
                        const std::unordered_map<std::string_view, std::uint32_t>& item_of,
                        DcpCheckpoint& out) {
  if (const std::uint32_t pd = Walker::get(meta, "planner_data"); !w.is_none(pd)) {
    if (w.node(pd).kind != NodeKind::kDict) throw w.fail("planner_data", "expected a dict");
    const std::span<const std::uint32_t> pe = w.items(pd);
    for (std::size_t k = 0; k + 1 < pe.size(); k += 2) {
      const std::string_view fqn = w.text(pe[k], "planner_data's key");
      const auto it = item_of.find(fqn);
      if (it == item_of.end()) continue;  // a name saved nowhere: nothing to place
      const Node& path = w.node(pe[k + 1]);
      if (path.kind != NodeKind::kTuple && path.kind != NodeKind::kList) {
        throw w.fail("planner_data for '" + printable(fqn, 200) + "'", "expected a tuple");
      }
      std::vector<DcpPathPart> parts;
      for (std::uint32_t s : w.items(pe[k + 1])) {
        const Node& n = w.node(s);
        if (n.kind == NodeKind::kString) {
          parts.push_back({false, 0, std::string(w.text(s, "planner_data"))});
        } else if (n.kind == NodeKind::kInt) {
          parts.push_back({true, n.integer, {}});
        } else {
          throw w.fail("planner_data for '" + printable(fqn, 200) + "'",
                       "a path segment is " + w.describe(n) + " (expected a string or an int)");
        }
      }
      out.items[it->second].path = std::move(parts);
    }
  }
  out.by_fqn.resize(out.items.size());
  for (std::uint32_t i = 0; i < out.by_fqn.size(); ++i) out.by_fqn[i] = i;
  std::sort(out.by_fqn.begin(), out.by_fqn.end(),
            [&](std::uint32_t a, std::uint32_t b) { return out.items[a].fqn < out.items[b].fqn; });
  for (std::size_t i = 1; i < out.by_fqn.size(); ++i) {
    if (out.items[out.by_fqn[i]].fqn == out.items[out.by_fqn[i - 1]].fqn) {
      throw w.fail("state_dict_metadata", "item '" + printable(out.items[out.by_fqn[i]].fqn, 200) +
                                              "' listed twice");
    }
  }
}

}  // namespace

DcpCheckpoint parse_dcp_metadata(std::span<const unsigned char> bytes, const std::string& dir,
                                 bool every_rank) {
  DcpCheckpoint out;
  out.dir = dir;
  const std::string file = printable(dir + "/.metadata", 200);
  out.metadata_bytes = bytes.size();
  const detail::PickleGraph g = detail::run_pickle(bytes, file, detail::kDcpMetadata);
  const Walker w(g, file);
  const auto meta = w.fields(g.root, "Metadata", "the index");
  if (const std::uint32_t v = Walker::get(meta, "version"); !w.is_none(v)) {
    out.version = printable(w.text(v, "version"), 64);
  }
  // The save's own record (StorageMeta): its checkpoint_id, save_id and modules, as the save
  // wrote them (DCP's reader hands them on, with its own load_id).
  if (const std::uint32_t sm = Walker::get(meta, "storage_meta"); !w.is_none(sm)) {
    const auto m = w.fields(sm, "StorageMeta", "storage_meta");
    out.storage_meta = true;
    auto text_or_none = [&](const char* field) -> std::optional<std::string> {
      const std::uint32_t v = Walker::get(m, field);
      if (w.is_none(v)) return std::nullopt;
      return std::string(w.text(v, std::string("storage_meta's ") + field));
    };
    out.checkpoint_id = text_or_none("checkpoint_id");
    out.save_id = text_or_none("save_id");
    if (const std::uint32_t v = Walker::get(m, "modules"); !w.is_none(v)) {
      const Node& list = w.node(v);
      if (list.kind != NodeKind::kList && list.kind != NodeKind::kTuple) {
        throw w.fail("storage_meta's modules", "expected a list of names, found " +
                                                   w.describe(list));
      }
      for (const std::uint32_t x : w.items(v)) {
        out.modules.push_back(std::string(w.text(x, "storage_meta's modules")));
      }
    }
  }

  // Every item and its chunks.
  const std::uint32_t sdm = Walker::get(meta, "state_dict_metadata");
  if (sdm == kNoNode || w.node(sdm).kind != NodeKind::kDict) {
    throw w.fail("state_dict_metadata", "expected a dict of the saved items");
  }
  // Each tensor's chunks in the order of their offsets, for storage_data's lookups.
  std::vector<std::vector<std::uint32_t>> by_offsets;
  std::uint64_t chunks_total = 0;
  const std::span<const std::uint32_t> entries = w.items(sdm);
  for (std::size_t k = 0; k + 1 < entries.size(); k += 2) {
    DcpItem item;
    item.fqn = w.text(entries[k], "state_dict_metadata's key");
    const std::string where = "item '" + printable(item.fqn, 200) + "'";
    const Node& v = w.node(entries[k + 1]);
    if (v.kind == NodeKind::kObject && w.class_of(v) == "BytesStorageMetadata") {
      item.is_bytes = true;
      item.chunks.emplace_back();
      by_offsets.emplace_back();
      out.items.push_back(std::move(item));
      continue;
    }
    const auto f = w.fields(entries[k + 1], "TensorStorageMetadata", where);
    // TensorProperties: (dtype, layout, requires_grad, memory_format, pin_memory[, strides]).
    const std::uint32_t props = Walker::get(f, "properties");
    if (props == kNoNode || w.node(props).kind != NodeKind::kObject ||
        w.class_of(w.node(props)) != "TensorProperties" || w.node(props).state == kNoNode) {
      throw w.fail(where, "its properties are not DCP's TensorProperties");
    }
    const std::span<const std::uint32_t> p = w.items(w.node(props).state);
    if (p.size() != 5 && p.size() != 6) {
      throw w.fail(where, "its properties hold " + std::to_string(p.size()) +
                              " values (DCP saves dtype, layout, requires_grad, memory_format, "
                              "pin_memory and, since torch 2.9, strides)");
    }
    if (p.size() == 6 && !w.is_none(p[5])) (void)w.dims(p[5], where + "'s strides");
    const Node& dt = w.node(p[0]);
    const detail::AllowedGlobal* row =
        dt.kind == NodeKind::kGlobal ? &detail::allowed_globals()[dt.ref] : nullptr;
    if (row == nullptr || row->role != detail::GlobalRole::kValue ||
        dtype_named(row->name) == nullptr) {
      throw w.fail(where, "its dtype is " + w.describe(dt) + ", not a torch dtype");
    }
    item.dtype = row->name;
    if (w.text(p[1], where + "'s layout") != "torch.strided") {
      throw w.fail(where, "its layout is not torch.strided (a sparse or other layout is not a "
                          "dense run of bytes)");
    }
    item.requires_grad = w.flag(p[2], where + "'s requires_grad");
    const Node& fmt = w.node(p[3]);
    if (fmt.kind != NodeKind::kEnum || (w.class_of(fmt) != "_MEM_FORMAT_ENCODING" &&
                                        w.class_of(fmt) != "MEM_FORMAT_ENCODING")) {
      throw w.fail(where, "its memory format is " + w.describe(fmt) + ", not DCP's encoding");
    }
    (void)w.flag(p[4], where + "'s pin_memory");
    const std::vector<std::uint64_t> size = w.dims(Walker::get(f, "size"), where + "'s size");
    std::uint64_t numel = 1;
    for (std::uint64_t s : size) {
      numel = detail::checked_mul(numel, s, (file + ": " + where + "'s element count").c_str());
      item.size.push_back(static_cast<std::int64_t>(s));
    }
    item.numel = numel;
    item.bytes = detail::checked_mul(numel, detail::torch_dtype_size(item.dtype),
                                     (file + ": " + where + "'s bytes").c_str());
    out.tensor_bytes = detail::checked_add(out.tensor_bytes, item.bytes,
                                           (file + ": the tensors' bytes").c_str());
    const std::uint32_t chunks = Walker::get(f, "chunks");
    if (chunks == kNoNode || w.node(chunks).kind != NodeKind::kList) {
      throw w.fail(where, "its chunks are not a list");
    }
    for (std::uint32_t c : w.items(chunks)) {
      const std::string cw = where + "'s chunk " + std::to_string(item.chunks.size());
      const auto cf = w.fields(c, "ChunkStorageMetadata", cw);
      DcpChunk chunk;
      chunk.offsets = w.dims(Walker::get(cf, "offsets"), cw + "'s offsets");
      chunk.sizes = w.dims(Walker::get(cf, "sizes"), cw + "'s sizes");
      if (chunk.offsets.size() != size.size() || chunk.sizes.size() != size.size()) {
        throw w.fail(cw, std::to_string(chunk.offsets.size()) + " offsets and " +
                             std::to_string(chunk.sizes.size()) + " sizes for a tensor of " +
                             std::to_string(size.size()) + " dimensions");
      }
      for (std::size_t d = 0; d < size.size(); ++d) {
        if (chunk.offsets[d] > size[d] || chunk.sizes[d] > size[d] - chunk.offsets[d]) {
          throw w.fail(cw, "offsets " + offsets_text(chunk.offsets) + " and sizes " +
                               offsets_text(chunk.sizes) + " reach outside the tensor's size " +
                               offsets_text(size));
        }
      }
      out.chunks = ++chunks_total;
      if (chunks_total > kMaxDcpChunks) {
        throw w.fail(cw, "more than " + std::to_string(kMaxDcpChunks) + " chunks");
      }
      item.chunks.push_back(std::move(chunk));
    }
    std::vector<std::uint32_t> order(item.chunks.size());
    for (std::uint32_t c = 0; c < order.size(); ++c) order[c] = c;
    std::sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
      return item.chunks[a].offsets < item.chunks[b].offsets;
    });
    for (std::size_t c = 1; c < order.size(); ++c) {
      if (item.chunks[order[c]].offsets == item.chunks[order[c - 1]].offsets) {
        throw w.fail(where + "'s chunk " + std::to_string(std::max(order[c], order[c - 1])),
                     "a second chunk at offsets " + offsets_text(item.chunks[order[c]].offsets));
      }
    }
    by_offsets.push_back(std::move(order));
    check_chunks_tile(w, where, item, every_rank);
    out.items.push_back(std::move(item));
  }

  // Where each chunk and bytes item lies.
  const std::uint32_t sd = Walker::get(meta, "storage_data");
  if (sd == kNoNode || w.node(sd).kind != NodeKind::kDict) {
    throw w.fail("storage_data", "expected a dict of where each item is stored");
  }
  std::unordered_map<std::string_view, std::uint32_t> item_of;  // fqn -> item
  item_of.reserve(out.items.size());
  for (std::uint32_t i = 0; i < out.items.size(); ++i) item_of.emplace(out.items[i].fqn, i);
  std::vector<std::uint64_t> first(out.items.size() + 1, 0);  // each item's first in `seen`
  for (std::size_t i = 0; i < out.items.size(); ++i) first[i + 1] = first[i] + out.items[i].chunks.size();
  std::vector<bool> seen(first.back(), false);
  std::map<std::string, std::uint32_t, std::less<>> file_of;
  const std::span<const std::uint32_t> stored = w.items(sd);
  for (std::size_t k = 0; k + 1 < stored.size(); k += 2) {
    const auto key = w.fields(stored[k], "MetadataIndex", "storage_data's key");
    const std::string_view fqn = w.text(Walker::get(key, "fqn"), "storage_data's key's fqn");
    const std::string where = "storage_data for '" + printable(fqn, 200) + "'";
    std::optional<std::vector<std::uint64_t>> offset;
    if (const std::uint32_t off = Walker::get(key, "offset"); !w.is_none(off)) {
      offset = w.dims(off, where + "'s offset");
    }
    const auto found = item_of.find(fqn);
    const std::uint32_t item = found == item_of.end() ? kNoNode : found->second;
    std::uint32_t chunk = kNoNode;
    if (item != kNoNode && offset.has_value() != out.items[item].is_bytes) {
      if (!offset) {
        chunk = 0;
      } else {
        const std::vector<std::uint32_t>& order = by_offsets[item];
        const std::vector<DcpChunk>& chunks = out.items[item].chunks;
        const auto at = std::lower_bound(
            order.begin(), order.end(), *offset,
            [&](std::uint32_t c, const std::vector<std::uint64_t>& o) { return chunks[c].offsets < o; });
        if (at != order.end() && chunks[*at].offsets == *offset) chunk = *at;
      }
    }
    if (chunk == kNoNode) {
      throw w.fail(where, offset ? "no chunk of that item starts at " + offsets_text(*offset)
                                 : "the index lists no bytes item of that name");
    }
    if (seen[first[item] + chunk]) throw w.fail(where, "given twice");
    seen[first[item] + chunk] = true;
    const auto info = w.fields(stored[k + 1], "_StorageInfo", where);
    const std::string_view rel =
        w.text(Walker::get(info, "relative_path"), where + "'s relative_path");
    check_relative(rel, where, w);
    if (const std::uint32_t t = Walker::get(info, "transform_descriptors");
        !w.is_none(t) && !(w.node(t).kind == NodeKind::kList && w.items(t).empty()) &&
        !(w.node(t).kind == NodeKind::kTuple && w.items(t).empty())) {
      throw w.fail(where, "the item was saved through DCP's stream transforms (compression or "
                          "another extension), which zeroflat does not read");
    }
    auto f = file_of.find(rel);
    if (f == file_of.end()) {
      f = file_of.emplace(std::string(rel), static_cast<std::uint32_t>(out.files.size())).first;
      out.files.push_back(dir + "/" + std::string(rel));
    }
    DcpChunk& c = out.items[item].chunks[chunk];
    c.file = f->second;
    c.offset = w.count(Walker::get(info, "offset"), where + "'s offset");
    c.length = w.count(Walker::get(info, "length"), where + "'s length");
  }
  for (std::size_t i = 0; i < out.items.size(); ++i) {
    for (std::size_t c = 0; c < out.items[i].chunks.size(); ++c) {
      if (seen[first[i] + c]) continue;
      const DcpItem& item = out.items[i];
      throw w.fail("storage_data", "no entry for '" + printable(item.fqn, 200) + "'" +
                                       (item.is_bytes ? "" : " at " + offsets_text(item.chunks[c].offsets)));
    }
  }

  index_planner_data(w, meta, item_of, out);
  return out;
}

DcpCheckpoint open_dcp_checkpoint(const std::string& dir, const std::string& index) {
  // The global index, or one rank's: a plain name in the folder, never a path out of it.
  bool rank_index = index.size() > 11 && index.starts_with("__") && index.ends_with(".metadata");
  for (std::size_t i = 2; rank_index && i < index.size() - 9; ++i) {
    rank_index = index[i] >= '0' && index[i] <= '9';
  }
  if (index != ".metadata" && !rank_index) {
    throw InvalidArgument("'" + printable(index, 80) +
                          "': a DCP index is '.metadata' or '__<rank>.metadata'");
  }
  if (!is_dcp_checkpoint(dir, index)) {
    struct stat m {};
    if (::lstat((dir + "/" + index).c_str(), &m) == 0) {
      throw InvalidArgument(printable(dir + "/" + index, 200) +
                            " is not a regular file (a FIFO, a device, a folder or a link to "
                            "one): not a DCP checkpoint's index; nothing was read");
    }
    throw InvalidArgument(printable(dir, 200) + ": not a DCP checkpoint (a folder holding the '" +
                          index + "' index that torch.distributed.checkpoint.save writes)");
  }
  const std::string data =
      detail::read_small_file(dir + "/" + index, kMaxDcpIndexBytes, "a DCP checkpoint's index");
  DcpCheckpoint out = parse_dcp_metadata(
      std::span(reinterpret_cast<const unsigned char*>(data.data()), data.size()), dir,
      index == ".metadata");
  // The data files: regular, and every item inside its file.
  for (const std::string& path : out.files) {
    const detail::File f(path);
    out.stamps.push_back(f.stamp());
    out.file_bytes.push_back(f.size());
  }
  for (const DcpItem& item : out.items) {
    for (const DcpChunk& c : item.chunks) {
      if (c.offset > out.file_bytes[c.file] || c.length > out.file_bytes[c.file] - c.offset) {
        throw InvalidArgument(printable(out.files[c.file], 200) + ": item '" +
                              printable(item.fqn, 200) + "' lies at bytes " +
                              std::to_string(c.offset) + "+" + std::to_string(c.length) +
                              ", past the end of the file (" +
                              std::to_string(out.file_bytes[c.file]) +
                              " bytes): truncated, or not the file the index describes");
      }
    }
  }
  return out;
}

CheckpointIndex dcp_chunks_index(const DcpCheckpoint& ck, const std::vector<DcpChunkRef>& chunks) {
  CheckpointIndex out;
  out.path = ck.dir;
  out.files = ck.files;
  out.file_bytes = ck.file_bytes;
  out.stamps = ck.stamps;
  std::vector<std::unique_ptr<detail::File>> open(ck.files.size());
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const DcpChunkRef& ref = chunks[i];
    const DcpItem* item = ck.find(ref.fqn);
    if (item == nullptr || item->is_bytes || ref.chunk >= item->chunks.size()) {
      throw InvalidArgument(printable(ck.dir, 200) + ": no chunk " + std::to_string(ref.chunk) +
                            " of a tensor '" + printable(ref.fqn, 200) + "' in its index");
    }
    const DcpChunk& c = item->chunks[ref.chunk];
    if (!open[c.file]) {
      open[c.file] = std::make_unique<detail::File>(ck.files[c.file]);
      const FileStamp now = open[c.file]->stamp();
      const FileStamp& then = ck.stamps[c.file];
      if (now.device != then.device || now.inode != then.inode || now.size != then.size ||
          now.mtime_ns != then.mtime_ns) {
        throw InvalidArgument(printable(ck.files[c.file], 200) +
                              ": replaced or rewritten since the checkpoint was opened");
      }
    }
    const TorchFile f = detail::read_torch_window(*open[c.file], c.offset, c.length);
    const std::string where = printable(ck.files[c.file], 200) + ": the item at bytes " +
                              std::to_string(c.offset) + "+" + std::to_string(c.length) +
                              " ('" + printable(ref.fqn, 200) + "' at " +
                              offsets_text(c.offsets) + ")";
    if (f.root.kind != TorchKind::kTensor) {
      throw InvalidArgument(where + " holds a " + std::string(torch_kind_name(f.root.kind)) +
                            ", not the chunk's tensor");
    }
    const TorchTensor& t = f.tensors.at(static_cast<std::size_t>(f.root.integer));
    const DcpDtype* d = dtype_named(item->dtype);
    if (d == nullptr || t.dtype != d->reader) {
      throw InvalidArgument(where + " is " + t.dtype + "; the index says " + item->dtype);
    }
    Shape want(c.sizes.begin(), c.sizes.end());
    if (t.shape != want) {
      throw InvalidArgument(where + " has shape " + shape_to_string(t.shape) +
                            "; the index says " + shape_to_string(want));
    }
    if (!t.contiguous) {
      throw InvalidArgument(where + " is not contiguous (strides of a view): not a chunk as DCP "
                            "saves one");
    }
    char name[32];
    std::snprintf(name, sizeof name, "#%012llu", static_cast<unsigned long long>(i));
    CheckpointTensor ct;
    ct.name = name;
    ct.dtype = d->stored;
    ct.type = t.type;
    ct.shape = t.shape;
    ct.numel = t.numel;
    ct.file = c.file;
    ct.offset = t.offset;
    ct.bytes = t.numel == 0 ? 0 : t.bytes;
    out.tensors.push_back(std::move(ct));
  }
  return out;
}

TorchFile read_dcp_value(const DcpCheckpoint& ck, const std::string& fqn) {
  const DcpItem* item = ck.find(fqn);
  if (item == nullptr || !item->is_bytes) {
    throw InvalidArgument(printable(ck.dir, 200) + ": no bytes item '" + printable(fqn, 200) +
                          "' in its index");
  }
  const DcpChunk& c = item->chunks.front();
  if (c.length > kMaxDcpValueBytes) {
    throw InvalidArgument(printable(ck.files[c.file], 200) + ": the bytes item '" +
                          printable(fqn, 200) + "' holds " + format_bytes(c.length) +
                          "; at most " + format_bytes(kMaxDcpValueBytes) + " are read");
  }
  const detail::File file(ck.files[c.file]);
  return detail::read_torch_window(file, c.offset, c.length);
}

}  // namespace zeroflat
