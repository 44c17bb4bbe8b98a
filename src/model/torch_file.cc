// torch.save archives (torch_file.h): the zip directory, data.pkl through the restricted pickle
// machine, and the state as a tree of values with every tensor's and storage's bytes located.
// Past 700 lines on purpose: the conversion of the pickle's graph into values is where every
// bound and every check of a tensor against its storage is made, and the reads of a value's
// bytes (read_torch_tensor) recheck the same geometry; one file keeps the two in step.
#include "model/torch_file.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <optional>
#include <map>
#include <unordered_set>

#include "model/files.h"
#include "model/pickle.h"
#include "model/torch_window.h"
#include "model/zip.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

TorchMake make_of(detail::GlobalRole role) noexcept {
  using R = detail::GlobalRole;
  switch (role) {
    case R::kValue: return TorchMake::kGlobal;
    case R::kEnum: return TorchMake::kMember;
    case R::kDevice: return TorchMake::kCall;
    case R::kObject: return TorchMake::kInstance;
    default: return TorchMake::kNever;
  }
}

const char* does_of(detail::GlobalRole role) noexcept {
  using R = detail::GlobalRole;
  switch (role) {
    case R::kRebuildTensorV2:
    case R::kRebuildTensor: return "called: a tensor (its bytes stay in the file)";
    case R::kRebuildFromType: return "called with _rebuild_tensor_v2 and torch.Tensor: the tensor";
    case R::kTensorType: return "only as _rebuild_from_type_v2's type";
    case R::kRebuildParameter: return "called with a tensor: that tensor";
    case R::kStorage: return "only inside a storage's persistent id: its dtype";
    case R::kSize: return "called with a tuple of ints: a tuple";
    case R::kDevice: return "called with a type string and an index: a device";
    case R::kOrderedDict: return "called with nothing or (key, value) pairs: a dict";
    case R::kGetattr: return "only getattr(<an allowed enum>, '<one of its members>')";
    case R::kEnum: return "an enum: a member by name, or by value";
    case R::kObject: return "an instance made without its code: __new__, then its saved attributes";
    case R::kSet: return "called with nothing or a list: a set";
    case R::kValue: return "only as a value, never called";
    case R::kEncode: return "only bytes: encode(text, 'latin1') or bytes()";
    case R::kStateObject: return "an instance whose saved state is a tuple, read as values";
    case R::kLayout: return "called with 'torch.strided' only: that name";
    case R::kPath: return "called with strings: the path they join to, as a string";
  }
  return "";
}


using detail::Node;
using detail::NodeKind;

std::string torch_dtype_display(std::string_view torch_name, std::optional<DType>* type) {
  if (torch_name == "bfloat16") *type = DType::kBF16;
  else if (torch_name == "float16") *type = DType::kFP16;
  else if (torch_name == "float32") *type = DType::kFP32;
  else *type = std::nullopt;
  return *type ? std::string(dtype_name(**type)) : std::string(torch_name);
}

std::string quote_path(std::string_view path) {
  return "'" + printable(path, 200) + "'";
}

// The size of the tree the graph expands to (values, text bytes, height), measured on the graph
// itself in O(nodes + references) without building anything, so that a state that refers to
// itself, nests too deep or expands past the bounds is refused before memory is spent on it.
// Iterative: a chain of millions of nested lists must not recurse.
void measure(const detail::PickleGraph& g, const std::string& file) {
  auto fail = [&](const std::string& why) { return InvalidArgument(file + ": the saved state " + why); };
  enum : std::uint8_t { kNew, kActive, kDone };
  const std::size_t n = g.nodes.size();
  std::vector<std::uint8_t> state(n, kNew);
  std::vector<std::uint64_t> values(n, 0), text(n, 0), height(n, 0);
  // A node's children as the tree holds them: items (list, tuple, dict keys and values, object
  // arguments), a dict's attributes, an object's state entries (its dict is not a value).
  auto child = [&](const Node& node, std::size_t k, std::uint32_t* out) -> bool {
    const std::span<const std::uint32_t> held = g.items(node);
    const std::size_t items = held.size();
    if (k < items) {
      *out = held[k];
      return true;
    }
    if (node.state == detail::kNoNode) return false;
    if (node.kind == NodeKind::kDict) {
      if (k != items) return false;
      *out = node.state;
      return true;
    }
    if (node.kind != NodeKind::kObject) return false;
    const std::span<const std::uint32_t> st = g.items(node.state);
    if (k - items >= st.size()) return false;
    *out = st[k - items];
    return true;
  };
  auto sat_add = [](std::uint64_t a, std::uint64_t b) {
    std::uint64_t out = 0;
    return __builtin_add_overflow(a, b, &out) ? UINT64_MAX : out;
  };
  std::vector<std::pair<std::uint32_t, std::size_t>> stack{{g.root, 0}};
  state[g.root] = kActive;
  while (!stack.empty()) {
    auto& [i, k] = stack.back();
    const Node& node = g.nodes[i];
    std::uint32_t c = 0;
    if (node.kind != NodeKind::kTensor && node.kind != NodeKind::kStorage && child(node, k, &c)) {
      ++k;
      if (state[c] == kActive) throw fail("refers to itself (a container holds itself)");
      if (state[c] == kNew) {
        if (stack.size() > kMaxTorchDepth + 1) {
          throw fail("nests deeper than " + std::to_string(kMaxTorchDepth) + " levels");
        }
        state[c] = kActive;
        stack.emplace_back(c, 0);
      }
      continue;
    }
    // All children done: sum them up.
    std::uint64_t v = 1, t = node.kind == NodeKind::kString || node.kind == NodeKind::kBytes
                                 ? node.text.size : 0;
    std::uint64_t h = 0;
    for (std::size_t j = 0; child(node, j, &c) && node.kind != NodeKind::kTensor &&
                            node.kind != NodeKind::kStorage;
         ++j) {
      v = sat_add(v, values[c]);
      t = sat_add(t, text[c]);
      h = std::max(h, height[c]);
    }
    values[i] = v;
    text[i] = t;
    height[i] = h + 1;
    state[i] = kDone;
    stack.pop_back();
  }
  if (height[g.root] > kMaxTorchDepth + 1) {
    throw fail("nests deeper than " + std::to_string(kMaxTorchDepth) + " levels");
  }
  if (values[g.root] > kMaxTorchValues) {
    throw fail("holds " + (values[g.root] == UINT64_MAX ? std::string("more than 2^64")
                                                        : format_count(values[g.root])) +
               " values (shared ones counted where each appears); the reader's bound is " +
               format_count(kMaxTorchValues));
  }
  if (text[g.root] > kMaxTorchTextBytes) {
    throw fail("holds " + format_bytes(text[g.root]) +
               " of text (shared ones counted where each appears); the reader's bound is " +
               format_bytes(kMaxTorchTextBytes));
  }
}

// Turns the pickle's graph into the tree of values, locating every tensor.
class Converter {
 public:
  Converter(const detail::PickleGraph& g, const detail::ZipArchive& zip, TorchFile& out,
            const std::string& file)
      : g_(g), zip_(zip), out_(out), file_(file) {}

  void run() {
    std::string path;
    convert(g_.root, 0, path, out_.root);
    // Storages by key, numerically where the keys are numbers.
    std::vector<std::uint64_t> order(out_.storages.size());
    for (std::uint64_t i = 0; i < order.size(); ++i) order[i] = i;
    auto number = [](const std::string& k) -> std::optional<std::uint64_t> {
      std::uint64_t v = 0;
      auto [p, ec] = std::from_chars(k.data(), k.data() + k.size(), v);
      if (ec != std::errc() || p != k.data() + k.size()) return std::nullopt;
      return v;
    };
    std::stable_sort(order.begin(), order.end(), [&](std::uint64_t a, std::uint64_t b) {
      const auto na = number(out_.storages[a].key), nb = number(out_.storages[b].key);
      if (na && nb) return *na < *nb;
      if (na || nb) return na.has_value();
      return out_.storages[a].key < out_.storages[b].key;
    });
    std::vector<std::uint64_t> new_index(order.size());
    std::vector<TorchStorage> sorted;
    sorted.reserve(order.size());
    for (std::uint64_t k = 0; k < order.size(); ++k) {
      new_index[order[k]] = k;
      sorted.push_back(std::move(out_.storages[order[k]]));
    }
    out_.storages = std::move(sorted);
    for (TorchTensor& t : out_.tensors) t.storage = new_index[t.storage];
    renumber(out_.root, new_index);
  }

 private:
  void renumber(TorchValue& v, const std::vector<std::uint64_t>& new_index) {
    if (v.kind == TorchKind::kStorage) {
      v.integer = static_cast<std::int64_t>(new_index[static_cast<std::uint64_t>(v.integer)]);
    }
    for (TorchValue& i : v.items) renumber(i, new_index);
    for (auto& [k, x] : v.entries) {
      renumber(k, new_index);
      renumber(x, new_index);
    }
  }

  InvalidArgument fail(const std::string& path, const std::string& why) const {
    return InvalidArgument(file_ + ": " + (path.empty() ? std::string("the saved state")
                                                        : "entry " + quote_path(path)) +
                           ": " + why);
  }

  void count(const std::string& path, std::uint64_t text_bytes) {
    if (++values_ > kMaxTorchValues) {
      throw fail(path, "the saved state holds more than " + format_count(kMaxTorchValues) +
                           " values (shared ones counted where each appears), the reader's "
                           "bound");
    }
    text_ += text_bytes;
    if (text_ > kMaxTorchTextBytes) {
      throw fail(path, "the saved state holds more than " + format_bytes(kMaxTorchTextBytes) +
                           " of text (shared ones counted where each appears), the reader's "
                           "bound");
    }
  }

  // The storage a tensor or a storage value names: one entry per key, the same dtype and numel
  // wherever the key is named.
  std::uint64_t storage_of(const Node& s, const std::string& path) {
    const detail::AllowedGlobal& type = detail::allowed_globals()[s.ref];
    const std::string key(g_.text_of(s));
    auto it = storage_index_.find(key);
    if (it != storage_index_.end()) {
      const TorchStorage& have = out_.storages[it->second];
      std::optional<DType> t;
      const std::string dtype = torch_dtype_display(type.dtype, &t);
      if (have.dtype != dtype || have.numel != static_cast<std::uint64_t>(s.integer)) {
        throw fail(path, "storage '" + printable(key) + "' is named as " + dtype + " of " +
                             std::to_string(s.integer) + " elements here, and as " + have.dtype +
                             " of " + std::to_string(have.numel) + " before");
      }
      return it->second;
    }
    TorchStorage st;
    st.key = key;
    st.dtype = torch_dtype_display(type.dtype, &st.type);
    st.element_size = detail::torch_dtype_size(type.dtype);
    st.numel = static_cast<std::uint64_t>(s.integer);
    st.location = g_.location(s);
    st.entry = out_.archive + "/data/" + key;
    const detail::ZipEntry* e = zip_.find(st.entry);
    if (e == nullptr) {
      throw fail(path, "its storage '" + printable(key) + "' has no entry '" +
                           printable(st.entry, 200) + "' in the archive");
    }
    if (__builtin_mul_overflow(st.numel, st.element_size, &st.bytes)) {
      throw fail(path, "storage '" + printable(key) + "' declares " +
                           std::to_string(st.numel) + " elements: more bytes than 64 bits hold");
    }
    if (e->bytes < st.bytes) {
      throw fail(path, "storage entry '" + printable(st.entry, 200) + "' holds " +
                           std::to_string(e->bytes) + " bytes, but its " +
                           std::to_string(st.numel) + " " + st.dtype + " elements need " +
                           std::to_string(st.bytes));
    }
    st.offset = e->offset;
    out_.storages.push_back(std::move(st));
    storage_index_[key] = out_.storages.size() - 1;
    return out_.storages.size() - 1;
  }

  std::uint64_t tensor_of(const Node& n, const std::string& path) {
    TorchTensor t;
    t.path = path;
    const Node& s = g_.nodes[n.ref];
    t.storage = storage_of(s, path);
    const TorchStorage& st = out_.storages[t.storage];
    t.dtype = st.dtype;
    t.type = st.type;
    t.element_size = st.element_size;
    const std::span<const std::int64_t> dims = g_.dims_of(n);
    const std::size_t nd = dims.size() / 2;
    t.shape.assign(dims.begin(), dims.begin() + static_cast<std::ptrdiff_t>(nd));
    t.stride.assign(dims.begin() + static_cast<std::ptrdiff_t>(nd), dims.end());
    t.storage_offset = static_cast<std::uint64_t>(n.integer);
    t.requires_grad = n.flag;
    try {
      t.numel = shape_numel(t.shape);
    } catch (const InvalidArgument&) {
      throw fail(path, "shape " + shape_to_string(t.shape) + " has more elements than 64 bits hold");
    }
    // Its elements' bytes, which a read of it yields: an expanded tensor (stride 0) has more
    // of them than its storage, and may have more than 64 bits count.
    std::uint64_t element_bytes = 0;
    if (__builtin_mul_overflow(t.numel, t.element_size, &element_bytes)) {
      throw fail(path, "shape " + shape_to_string(t.shape) + " of " + t.dtype +
                           " elements is more bytes than 64 bits hold");
    }
    // The last element it reaches: storage_offset + sum((size - 1) * stride).
    std::uint64_t last = t.storage_offset;
    bool overflow = false;
    if (t.numel > 0) {
      for (std::size_t d = 0; d < nd; ++d) {
        std::uint64_t step = 0;
        overflow |= __builtin_mul_overflow(static_cast<std::uint64_t>(t.shape[d] - 1),
                                           static_cast<std::uint64_t>(t.stride[d]), &step);
        overflow |= __builtin_add_overflow(last, step, &last);
      }
    }
    const std::string geometry = "(storage_offset " + std::to_string(t.storage_offset) +
                                 ", size " + shape_to_string(t.shape) + ", stride " +
                                 shape_to_string(t.stride) + ")";
    if (overflow || (t.numel > 0 && last >= st.numel) || t.storage_offset > st.numel) {
      throw fail(path, "tensor " + geometry + " reaches " +
                           (overflow ? std::string("past 64 bits")
                                     : "element " + std::to_string(t.numel > 0 ? last : t.storage_offset)) +
                           " of storage '" + printable(st.key) + "', which holds " +
                           std::to_string(st.numel) + " elements");
    }
    // torch's is_contiguous: row-major where the size is not 1.
    t.contiguous = true;
    if (t.numel > 0) {
      std::uint64_t expected = 1;  // at most numel: no overflow
      for (std::size_t d = nd; d-- > 0;) {
        if (t.shape[d] == 1) continue;
        if (static_cast<std::uint64_t>(t.stride[d]) != expected) {
          t.contiguous = false;
          break;
        }
        expected *= static_cast<std::uint64_t>(t.shape[d]);
      }
    }
    t.offset = st.offset + t.storage_offset * t.element_size;  // within the entry: no overflow
    t.extent_bytes = t.numel > 0 ? (last - t.storage_offset + 1) * t.element_size : 0;
    t.bytes = t.contiguous ? t.numel * t.element_size : 0;
    count(path, path.size());
    out_.tensors.push_back(std::move(t));
    return out_.tensors.size() - 1;
  }

  void convert(std::uint32_t i, std::uint64_t depth, std::string& path, TorchValue& v) {
    if (depth > kMaxTorchDepth) {
      throw fail(path, "the saved state nests deeper than " + std::to_string(kMaxTorchDepth) +
                           " levels (or refers to itself)");
    }
    const Node& n = g_.nodes[i];
    switch (n.kind) {
      case NodeKind::kNone: v.kind = TorchKind::kNone; break;
      case NodeKind::kBool:
        v.kind = TorchKind::kBool;
        v.boolean = n.flag;
        break;
      case NodeKind::kInt:
        v.kind = TorchKind::kInt;
        v.integer = n.integer;
        break;
      case NodeKind::kFloat:
        v.kind = TorchKind::kFloat;
        v.real = n.real;
        break;
      case NodeKind::kString:
      case NodeKind::kBytes:
        v.kind = n.kind == NodeKind::kString ? TorchKind::kString : TorchKind::kBytes;
        count(path, n.text.size);
        v.text = g_.text_of(n);
        return;
      case NodeKind::kGlobal: {
        const detail::AllowedGlobal& a = detail::allowed_globals()[n.ref];
        if (a.role != detail::GlobalRole::kValue) {
          // A class or function standing in the state uncalled: nothing DeepSpeed or torch
          // saves, and a caller handed it could call it.
          throw fail(path, "names the global '" + std::string(a.module) + " " + a.name +
                               "' as a value; the allow-list has it only for one use (" +
                               does_of(a.role) + "), and only the dtypes may stand as values");
        }
        v.kind = TorchKind::kGlobal;
        v.text = std::string(a.module) + "." + a.name;
        v.global = n.ref;
        break;
      }
      case NodeKind::kEnum: {
        const detail::AllowedGlobal& a = detail::allowed_globals()[n.ref];
        v.kind = TorchKind::kEnum;
        v.text = std::string(a.module) + "." + a.name + "." + std::string(g_.text_of(n));
        v.integer = n.integer;
        v.global = n.ref;
        break;
      }
      case NodeKind::kStorage:
        v.kind = TorchKind::kStorage;
        v.integer = static_cast<std::int64_t>(storage_of(n, path));
        break;
      case NodeKind::kTensor:
        v.kind = TorchKind::kTensor;
        v.integer = static_cast<std::int64_t>(tensor_of(n, path));
        return;
      case NodeKind::kList:
      case NodeKind::kTuple: {
        v.kind = n.kind == NodeKind::kList ? TorchKind::kList : TorchKind::kTuple;
        v.text = std::string(detail::tag_name(n.tag));
        count(path, 0);
        const std::span<const std::uint32_t> held = g_.items(n);
        v.items.resize(held.size());
        for (std::size_t k = 0; k < held.size(); ++k) {
          child(held[k], depth, path, std::to_string(k), v.items[k]);
        }
        return;
      }
      case NodeKind::kDict:
        v.kind = TorchKind::kDict;
        v.text = std::string(detail::tag_name(n.tag));
        count(path, 0);
        entries(n, depth, path, v);
        if (n.state != detail::kNoNode) {
          v.items.resize(1);
          child(n.state, depth, path, "__attrs__", v.items[0]);
        }
        return;
      case NodeKind::kObject: {
        const detail::AllowedGlobal& a = detail::allowed_globals()[n.ref];
        v.kind = TorchKind::kObject;
        v.text = std::string(a.module) + "." + a.name;
        v.global = n.ref;
        count(path, 0);
        const std::span<const std::uint32_t> args = g_.items(n);
        v.items.resize(args.size());
        for (std::size_t k = 0; k < args.size(); ++k) {
          child(args[k], depth, path, "__args__/" + std::to_string(k), v.items[k]);
        }
        if (n.state != detail::kNoNode) entries(g_.nodes[n.state], depth, path, v);
        return;
      }
    }
    count(path, 0);
  }

  void entries(const Node& d, std::uint64_t depth, std::string& path, TorchValue& v) {
    const std::span<const std::uint32_t> held = g_.items(d);
    v.entries.resize(held.size() / 2);
    // Two keys Python tells apart but a path does not (the int 0 and the string '0') would make
    // a lookup by path pick one of them: the state is ambiguous, and refused.
    std::unordered_set<std::string> segments;
    for (std::size_t k = 0; k < v.entries.size(); ++k) {
      auto& [key, value] = v.entries[k];
      convert(held[2 * k], depth + 1, path, key);
      std::string segment = torch_path_segment(key);
      if (!segments.insert(segment).second) {
        throw fail(path, "two keys of one dict are both '" + printable(segment) +
                             "' as a path (such as the int 0 and the string '0'): which one a "
                             "lookup means is ambiguous");
      }
      child(held[2 * k + 1], depth, path, segment, value);
    }
  }

  void child(std::uint32_t i, std::uint64_t depth, std::string& path, const std::string& segment,
             TorchValue& v) {
    const std::size_t keep = path.size();
    if (depth > 0) path += '/';  // the root's children: no leading '/'
    path += segment;
    convert(i, depth + 1, path, v);
    path.resize(keep);
  }

  const detail::PickleGraph& g_;
  const detail::ZipArchive& zip_;
  TorchFile& out_;
  const std::string& file_;
  std::map<std::string, std::uint64_t> storage_index_;
  std::uint64_t values_ = 0;
  std::uint64_t text_ = 0;
};

std::string read_entry(const detail::ByteSource& src, const detail::ZipEntry& e,
                       std::uint64_t max_bytes, const std::string& file) {
  if (e.bytes > max_bytes) {
    throw InvalidArgument(file + ": entry '" + printable(e.name, 200) + "' holds " +
                          format_bytes(e.bytes) + "; at most " + format_bytes(max_bytes) +
                          " are read");
  }
  std::string out(e.bytes, '\0');
  if (e.bytes > 0) src.read(out.data(), e.bytes, e.offset);
  return out;
}

std::string trim_end(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

TorchFile parse(const detail::ByteSource& src, const std::string& given,
                detail::Scope scope = detail::kTorchSave) {
  const std::string file = printable(given, 200);
  TorchFile out;
  out.path = given;
  out.file_bytes = src.size();
  const detail::ZipArchive zip = detail::read_zip(src);

  const std::string& first = zip.entries.front().name;
  const std::size_t slash = first.find('/');
  if (slash == std::string::npos || slash == 0) {
    throw InvalidArgument(file + ": entry '" + printable(first, 200) +
                          "' lies in no folder (torch.save puts every entry in one folder, "
                          "such as 'archive/'): not a torch.save archive");
  }
  out.archive = first.substr(0, slash);
  const std::string prefix = out.archive + "/";
  for (const detail::ZipEntry& e : zip.entries) {
    if (e.name.compare(0, prefix.size(), prefix) != 0) {
      throw InvalidArgument(file + ": entry '" + printable(e.name, 200) +
                            "' lies outside the archive's folder '" + printable(out.archive) +
                            "' (torch.save puts every entry in one folder)");
    }
  }
  if (const detail::ZipEntry* e = zip.find(prefix + "byteorder")) {
    out.byteorder = trim_end(read_entry(src, *e, 64, file));
    if (out.byteorder != "little") {
      throw InvalidArgument(file + ": entry '" + printable(e->name, 200) + "' says '" +
                            printable(out.byteorder) +
                            "'; zeroflat reads little-endian archives only (expected 'little')");
    }
  } else {
    out.byteorder = "little";  // archives from before torch wrote the entry
  }
  if (const detail::ZipEntry* e = zip.find(prefix + "version")) {
    out.version = printable(trim_end(read_entry(src, *e, 64, file)));
  }
  if (const detail::ZipEntry* e = zip.find(prefix + ".storage_alignment")) {
    const std::string text = trim_end(read_entry(src, *e, 64, file));
    std::uint64_t v = 0;
    auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc() || p != text.data() + text.size()) {
      throw InvalidArgument(file + ": entry '" + printable(e->name, 200) + "' holds '" +
                            printable(text) + "' (expected a number of bytes)");
    }
    out.storage_alignment = v;
  }
  const detail::ZipEntry* pkl = zip.find(prefix + "data.pkl");
  if (pkl == nullptr) {
    throw InvalidArgument(file + ": no entry '" + printable(prefix, 200) +
                          "data.pkl' (the pickled state every torch.save archive holds)");
  }
  const std::string data = read_entry(src, *pkl, kMaxTorchPickleBytes, file);
  out.pickle_bytes = data.size();
  const detail::PickleGraph graph = detail::run_pickle(
      std::span(reinterpret_cast<const unsigned char*>(data.data()), data.size()),
      file + ", entry '" + printable(pkl->name, 200) + "'", scope);
  out.protocol = graph.protocol;
  out.globals = graph.globals;
  measure(graph, file);
  Converter(graph, zip, out, file).run();
  return out;
}

std::string float_text(double v) {
  char buf[40];
  auto [p, ec] = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, ec == std::errc() ? p : buf);
  if (s.find_first_of(".eni") == std::string::npos) s += ".0";  // Python's repr: 1.0
  return s;
}

std::vector<std::string_view> split_path(std::string_view path) {
  std::vector<std::string_view> out;
  if (path.empty()) return out;
  std::size_t at = 0;
  while (true) {
    const std::size_t slash = path.find('/', at);
    out.push_back(path.substr(at, slash == std::string_view::npos ? std::string_view::npos
                                                                  : slash - at));
    if (slash == std::string_view::npos) break;
    at = slash + 1;
  }
  return out;
}

std::optional<std::uint64_t> index_of(std::string_view s) {
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

}  // namespace

std::string_view torch_kind_name(TorchKind kind) noexcept {
  switch (kind) {
    case TorchKind::kNone: return "none";
    case TorchKind::kBool: return "bool";
    case TorchKind::kInt: return "int";
    case TorchKind::kFloat: return "float";
    case TorchKind::kString: return "string";
    case TorchKind::kBytes: return "bytes";
    case TorchKind::kList: return "list";
    case TorchKind::kTuple: return "tuple";
    case TorchKind::kDict: return "dict";
    case TorchKind::kTensor: return "tensor";
    case TorchKind::kStorage: return "storage";
    case TorchKind::kObject: return "object";
    case TorchKind::kEnum: return "enum";
    case TorchKind::kGlobal: return "global";
  }
  return "?";
}

const TorchValue* TorchValue::get(std::string_view key) const noexcept {
  if (kind != TorchKind::kDict && kind != TorchKind::kObject) return nullptr;
  for (const auto& [k, v] : entries) {
    if (k.kind == TorchKind::kString && k.text == key) return &v;
  }
  return nullptr;
}

std::string_view TorchValue::member() const noexcept {
  if (kind != TorchKind::kEnum) return {};
  const std::size_t dot = text.rfind('.');
  return dot == std::string::npos ? std::string_view(text) : std::string_view(text).substr(dot + 1);
}

std::string torch_path_segment(const TorchValue& key) {
  switch (key.kind) {
    case TorchKind::kString: {
      std::string out;
      for (char c : key.text) {
        if (c == '%') out += "%25";
        else if (c == '/') out += "%2F";
        else out += c;
      }
      return out;
    }
    case TorchKind::kInt: return std::to_string(key.integer);
    case TorchKind::kNone: return "None";
    case TorchKind::kBool: return key.boolean ? "True" : "False";
    case TorchKind::kFloat: return float_text(key.real);
    case TorchKind::kBytes: {
      std::string out = "b'";
      static const char* digits = "0123456789abcdef";
      for (unsigned char c : key.text) {
        if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\' && c != '/' && c != '%') {
          out += static_cast<char>(c);
        } else {
          out += "\\x";
          out += digits[c >> 4];
          out += digits[c & 0xf];
        }
      }
      return out + "'";
    }
    case TorchKind::kTuple: {
      std::string out = "(";
      for (std::size_t i = 0; i < key.items.size(); ++i) {
        if (i > 0) out += ", ";
        out += torch_path_segment(key.items[i]);
      }
      return out + ")";
    }
    case TorchKind::kEnum: return std::string(key.member());
    default: return "<" + std::string(torch_kind_name(key.kind)) + ">";
  }
}

const TorchValue* TorchFile::find(std::string_view entry) const {
  const TorchValue* v = &root;
  const std::vector<std::string_view> parts = split_path(entry);
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::string_view seg = parts[i];
    if (v->kind == TorchKind::kDict && seg == "__attrs__" && !v->items.empty()) {
      v = &v->items[0];
      continue;
    }
    if (v->is_sequence() || (v->kind == TorchKind::kObject && seg == "__args__")) {
      if (v->kind == TorchKind::kObject) {
        if (++i == parts.size()) return nullptr;
      }
      const std::optional<std::uint64_t> k = index_of(parts[i]);
      if (!k || *k >= v->items.size()) return nullptr;
      v = &v->items[*k];
      continue;
    }
    if (v->kind != TorchKind::kDict && v->kind != TorchKind::kObject) return nullptr;
    const TorchValue* next = nullptr;
    for (const auto& [key, value] : v->entries) {
      if (torch_path_segment(key) == seg) {
        next = &value;
        break;
      }
    }
    if (next == nullptr) return nullptr;
    v = next;
  }
  return v;
}

const TorchValue& TorchFile::at(std::string_view entry) const {
  if (const TorchValue* v = find(entry)) return *v;
  // Name the first segment that is missing.
  const std::vector<std::string_view> parts = split_path(entry);
  std::string have;
  for (const std::string_view seg : parts) {
    const std::string next = have.empty() ? std::string(seg) : have + "/" + std::string(seg);
    const TorchValue* v = find(next);
    if (v == nullptr) {
      const TorchValue* parent = find(have);
      throw InvalidArgument(printable(this->path, 200) + ": no entry " + quote_path(entry) +
                            " (" + (have.empty() ? "the saved state" : quote_path(have)) +
                            (parent ? " is a " + std::string(torch_kind_name(parent->kind)) +
                                          " without '" + printable(seg) + "'"
                                    : std::string(" is missing")) +
                            ")");
    }
    have = next;
  }
  throw InvalidArgument(printable(this->path, 200) + ": no entry " + quote_path(entry));
}

namespace {
[[noreturn]] void wrong_kind(const TorchFile& f, std::string_view entry, const char* expected,
                             const TorchValue& v) {
  throw InvalidArgument(printable(f.path, 200) + ": entry " + quote_path(entry) + ": expected " +
                        expected + ", found " + std::string(torch_kind_name(v.kind)) +
                        (v.kind == TorchKind::kObject || v.kind == TorchKind::kGlobal
                             ? " " + printable(v.text)
                             : std::string()));
}
}  // namespace

std::int64_t TorchFile::int_at(std::string_view entry) const {
  const TorchValue& v = at(entry);
  if (v.kind == TorchKind::kInt || v.kind == TorchKind::kEnum) return v.integer;
  if (v.kind == TorchKind::kBool) return v.boolean ? 1 : 0;
  wrong_kind(*this, entry, "an int", v);
}

double TorchFile::float_at(std::string_view entry) const {
  const TorchValue& v = at(entry);
  if (v.kind == TorchKind::kFloat) return v.real;
  if (v.kind == TorchKind::kInt) return static_cast<double>(v.integer);
  wrong_kind(*this, entry, "a float", v);
}

const std::string& TorchFile::string_at(std::string_view entry) const {
  const TorchValue& v = at(entry);
  if (v.kind == TorchKind::kString) return v.text;
  wrong_kind(*this, entry, "a string", v);
}

const std::vector<TorchValue>& TorchFile::list_at(std::string_view entry) const {
  const TorchValue& v = at(entry);
  if (v.is_sequence()) return v.items;
  wrong_kind(*this, entry, "a list", v);
}

const TorchTensor& TorchFile::tensor_at(std::string_view entry) const {
  const TorchValue& v = at(entry);
  if (v.kind == TorchKind::kTensor) return tensors[static_cast<std::uint64_t>(v.integer)];
  wrong_kind(*this, entry, "a tensor", v);
}

Shape TorchFile::shape_at(std::string_view entry) const {
  const TorchValue& v = at(entry);
  if (!v.is_sequence()) wrong_kind(*this, entry, "a shape (a tuple of ints)", v);
  Shape out;
  for (const TorchValue& d : v.items) {
    if (d.kind != TorchKind::kInt || d.integer < 0) {
      throw InvalidArgument(printable(this->path, 200) + ": entry " + quote_path(entry) +
                            ": expected a shape (non-negative ints), found a " +
                            std::string(torch_kind_name(d.kind)) + " in it");
    }
    out.push_back(d.integer);
  }
  return out;
}

const TorchTensor* TorchFile::find_tensor(std::string_view entry) const {
  const TorchValue* v = find(entry);
  if (v == nullptr || v->kind != TorchKind::kTensor) return nullptr;
  return &tensors[static_cast<std::uint64_t>(v->integer)];
}

TorchFile read_torch_file(const std::string& path) {
  const detail::FileSource src(path);
  TorchFile out = parse(src, path);
  out.stamp = src.stamp();
  return out;
}

namespace detail {
namespace {

// Bytes [base, base + length) of an open file, as a source of their own.
class WindowSource final : public ByteSource {
 public:
  WindowSource(const File& file, std::uint64_t base, std::uint64_t length, std::string name)
      : file_(file), base_(base), length_(length), name_(std::move(name)) {}
  std::uint64_t size() const override { return length_; }
  void read(void* out, std::uint64_t n, std::uint64_t offset) const override {
    if (offset > length_ || n > length_ - offset) {
      throw InvalidArgument(name_ + ": bytes " + std::to_string(offset) + "+" + std::to_string(n) +
                            " lie outside it");
    }
    file_.read_at(out, n, base_ + offset);
  }
  const std::string& name() const override { return name_; }

 private:
  const File& file_;
  std::uint64_t base_, length_;
  std::string name_;
};

}  // namespace

TorchFile read_torch_window(const File& file, std::uint64_t offset, std::uint64_t length) {
  if (offset > file.size() || length > file.size() - offset) {
    throw InvalidArgument(printable(file.path(), 200) + ": an item at bytes " +
                          std::to_string(offset) + "+" + std::to_string(length) +
                          " runs past the end of the file (" + std::to_string(file.size()) +
                          " bytes): truncated, or not the file the index describes");
  }
  const std::string name = file.path() + " (the item at bytes " + std::to_string(offset) + "+" +
                           std::to_string(length) + ")";
  const WindowSource src(file, offset, length, name);
  TorchFile out = parse(src, name, kDcpValue);  // a DCP item: DCP values' rows only
  out.path = file.path();
  out.stamp = file.stamp();
  for (TorchTensor& t : out.tensors) t.offset += offset;
  for (TorchStorage& s : out.storages) s.offset += offset;
  return out;
}

}  // namespace detail

TorchFile parse_torch_file(std::span<const unsigned char> bytes, const std::string& source) {
  const detail::MemorySource src(bytes, source);
  return parse(src, source);
}

bool is_torch_file(const std::string& path) noexcept {
  try {
    const detail::File file(path);
    unsigned char head[9] = {};
    const std::uint64_t n = std::min<std::uint64_t>(file.size(), sizeof head);
    if (n < 2) return false;
    file.read_at(head, n, 0);
    if (n >= 4 && head[0] == 'P' && head[1] == 'K' && head[2] == 3 && head[3] == 4) return true;
    // PROTO 2 to 5 (the legacy format pickles with protocol 2), unless the ninth byte opens a
    // JSON header: a safetensors file whose header length begins with 0x80 looks like a pickle
    // in its first two bytes.
    return head[0] == 0x80 && head[1] >= 2 && head[1] <= 5 && !(n == 9 && head[8] == '{');
  } catch (...) {
    return false;
  }
}


const std::vector<TorchGlobal>& torch_globals() {
  static const std::vector<TorchGlobal> rows = [] {
    std::vector<TorchGlobal> out;
    for (const detail::AllowedGlobal& g : detail::allowed_globals()) {
      // Rows of DCP's .metadata only are read by the library itself (dcp_checkpoint.h): a
      // caller never makes them.
      const TorchMake make =
          (g.scopes & detail::kTorchSave) != 0 ? make_of(g.role) : TorchMake::kNever;
      out.push_back({g.module, g.name, make, does_of(g.role), g.reason,
                     detail::scope_name(g.scopes)});
    }
    return out;
  }();
  return rows;
}

std::vector<std::string> torch_allowed_globals() {
  std::vector<std::string> out;
  for (const TorchGlobal& g : torch_globals()) out.push_back(g.module + " " + g.name + ": " + g.reason);
  return out;
}

const TorchGlobal* torch_global_of(const TorchValue& v) noexcept {
  const std::vector<TorchGlobal>& rows = torch_globals();
  if (v.global >= rows.size()) return nullptr;
  const TorchGlobal& g = rows[v.global];
  const bool fits = (v.kind == TorchKind::kGlobal && g.make == TorchMake::kGlobal) ||
                    (v.kind == TorchKind::kEnum && g.make == TorchMake::kMember) ||
                    (v.kind == TorchKind::kObject &&
                     (g.make == TorchMake::kCall || g.make == TorchMake::kInstance));
  return fits ? &g : nullptr;
}

namespace {

// read_torch_tensor with `read(out, n, offset)` for the file's bytes.
template <typename Read>
std::vector<unsigned char> read_tensor_with(const TorchFile& f, const TorchTensor& t,
                                            std::uint64_t max_bytes, const Read& read) {
  const std::string where = printable(f.path, 200) + ": tensor '" + printable(t.path) + "'";
  std::vector<unsigned char> out;
  if (t.numel == 0) return out;
  // The bytes it reads and the bytes it yields (more than it reads when expanded), each bounded
  // and counted without wrapping: a hand-made TorchTensor is checked as the reader's are.
  std::uint64_t yields = 0;
  if (__builtin_mul_overflow(t.numel, t.element_size, &yields) || t.element_size == 0) {
    throw InvalidArgument(where + ": " + std::to_string(t.numel) + " elements of " +
                          std::to_string(t.element_size) + " bytes cannot be counted in 64 bits");
  }
  if (t.extent_bytes > max_bytes || yields > max_bytes) {
    throw InvalidArgument(where + " holds " + std::to_string(yields) + " bytes over a span of " +
                          std::to_string(t.extent_bytes) + ", more than the " +
                          std::to_string(max_bytes) + " read whole here");
  }
  if (t.contiguous && t.extent_bytes != yields) {
    throw InvalidArgument(where + ": contiguous, yet spans " + std::to_string(t.extent_bytes) +
                          " bytes for " + std::to_string(yields));
  }
  if (t.shape.size() != t.stride.size()) {
    throw InvalidArgument(where + ": " + std::to_string(t.shape.size()) + " sizes but " +
                          std::to_string(t.stride.size()) + " strides");
  }
  std::vector<unsigned char> extent(t.extent_bytes);
  try {
    read(extent.data(), extent.size(), t.offset);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + ": " + e.what());
  }
  if (t.contiguous) return extent;
  // Gather by the strides: element (i_0, ..., i_k) lies at sum(i_d * stride[d]) elements from
  // the first (every one inside the extent: the reader checked the tensor against its storage).
  out.resize(yields);
  std::vector<std::int64_t> index(t.shape.size(), 0);
  for (std::uint64_t k = 0; k < t.numel; ++k) {
    std::uint64_t at = 0;
    for (std::size_t d = 0; d < index.size(); ++d) {
      at += static_cast<std::uint64_t>(index[d]) * static_cast<std::uint64_t>(t.stride[d]);
    }
    if (at >= extent.size() / t.element_size) {
      throw InvalidArgument(where + ": its strides reach past its " +
                            std::to_string(t.extent_bytes) + " bytes");
    }
    std::copy_n(extent.data() + at * t.element_size, t.element_size,
                out.data() + k * t.element_size);
    for (std::size_t d = index.size(); d-- > 0;) {
      if (++index[d] < t.shape[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

}  // namespace

std::vector<unsigned char> read_torch_tensor(const TorchFile& f, const TorchTensor& t,
                                             std::uint64_t max_bytes) {
  std::optional<detail::File> file;  // opened only when there are bytes to read
  return read_tensor_with(f, t, max_bytes, [&](void* out, std::uint64_t n, std::uint64_t at) {
    if (!file) file.emplace(f.path);
    file->read_at(out, n, at);
  });
}

std::vector<unsigned char> read_torch_tensor(const TorchFile& f, const TorchTensor& t,
                                             std::span<const unsigned char> file_bytes,
                                             std::uint64_t max_bytes) {
  return read_tensor_with(f, t, max_bytes, [&](void* out, std::uint64_t n, std::uint64_t at) {
    if (at > file_bytes.size() || n > file_bytes.size() - at) {
      throw InvalidArgument("bytes [" + std::to_string(at) + ", +" + std::to_string(n) +
                            ") lie past the end of its " + std::to_string(file_bytes.size()) +
                            " bytes");
    }
    if (n > 0) std::memcpy(out, file_bytes.data() + at, n);
  });
}

}  // namespace zeroflat
