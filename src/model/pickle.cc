// The restricted pickle machine (pickle.h): opcodes of protocols 0-5 that build plain values,
// and the allow-list of globals, in one table. One file past 700 lines on purpose: the machine is
// one class whose opcodes share its stack, memo, marks and bounds, and the allow-list beside it
// is what every global is checked against; split, the rules of one row would live in two files.
#include "model/pickle.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <unordered_map>
#include <unordered_set>

#include "model/torch_file.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {
namespace {

using R = GlobalRole;

constexpr unsigned kAll = kTorchSave | kDcpValue | kDcpMetadata;
// DeepSpeed's own classes: its checkpoints only, never a DCP file (one allow-list per format).
constexpr unsigned kDeepSpeed = kTorchSave;
constexpr const char* kDcpModule = "torch.distributed.checkpoint.metadata";

// Every global the machine resolves, where, and why. Nothing else is ever named by a file and
// accepted. Rows found in DeepSpeed 0.14.5 to 0.19.8 checkpoints saved by python/tests, and in
// the .metadata of DCP checkpoints saved by torch 2.x (python/tests/test_dcp.py).
constexpr AllowedGlobal kAllowed[] = {
    {"torch._utils", "_rebuild_tensor_v2", R::kRebuildTensorV2, nullptr,
     "every tensor torch.save writes"},
    {"torch._utils", "_rebuild_tensor", R::kRebuildTensor, nullptr,
     "tensors saved by older torch releases"},
    {"torch._tensor", "_rebuild_from_type_v2", R::kRebuildFromType, nullptr,
     "a tensor carrying Python attributes (DeepSpeed's Stage 3 fp32 partitions carry ds_id)"},
    {"torch", "Tensor", R::kTensorType, nullptr, "the type _rebuild_from_type_v2 gives back"},
    {"torch._utils", "_rebuild_parameter", R::kRebuildParameter, nullptr,
     "an nn.Parameter saved as itself: its tensor"},
    {"torch", "FloatStorage", R::kStorage, "float32", "storage type of float32 tensors"},
    {"torch", "DoubleStorage", R::kStorage, "float64", "storage type of float64 tensors"},
    {"torch", "HalfStorage", R::kStorage, "float16", "storage type of float16 tensors"},
    {"torch", "BFloat16Storage", R::kStorage, "bfloat16", "storage type of bfloat16 tensors"},
    {"torch", "LongStorage", R::kStorage, "int64", "storage type of int64 tensors"},
    {"torch", "IntStorage", R::kStorage, "int32", "storage type of int32 tensors"},
    {"torch", "ShortStorage", R::kStorage, "int16", "storage type of int16 tensors"},
    {"torch", "CharStorage", R::kStorage, "int8", "storage type of int8 tensors"},
    {"torch", "ByteStorage", R::kStorage, "uint8", "storage type of uint8 tensors"},
    {"torch", "BoolStorage", R::kStorage, "bool", "storage type of bool tensors"},
    {"torch", "UntypedStorage", R::kStorage, "uint8", "a storage saved as itself, in bytes"},
    {"torch", "Size", R::kSize, nullptr, "shapes: DeepSpeed's param_shapes, DCP's sizes",
     kAll},
    {"torch", "device", R::kDevice, nullptr, "a device named in a saved state"},
    {"collections", "OrderedDict", R::kOrderedDict, nullptr,
     "state dicts, and every tensor's (empty) backward hooks"},
    {"__builtin__", "set", R::kSet, nullptr,
     "a set: DeepSpeed before 0.19 saves sparse_tensor_module_names as one"},
    {"builtins", "set", R::kSet, nullptr, "the same, under protocol 3 and later"},
    {"__builtin__", "frozenset", R::kSet, nullptr, "a frozen set, as a set"},
    {"builtins", "frozenset", R::kSet, nullptr, "the same, under protocol 3 and later"},
    {"_codecs", "encode", R::kEncode, nullptr,
     "bytes under protocol 2: encode(text, 'latin1'), nothing else"},
    {"__builtin__", "bytes", R::kEncode, nullptr, "empty bytes under protocol 2: bytes()"},
    {"builtins", "bytes", R::kEncode, nullptr, "the same, under protocol 3 and later"},
    {"torch", "float16", R::kValue, nullptr, "a dtype as a value: DynamicLossScaler's dtype",
     kAll},
    {"torch", "bfloat16", R::kValue, nullptr, "a dtype as a value", kAll},
    {"torch", "float32", R::kValue, nullptr, "a dtype as a value", kAll},
    {"torch", "float64", R::kValue, nullptr, "a tensor's dtype in DCP's metadata", kDcpMetadata},
    {"torch", "int64", R::kValue, nullptr, "a tensor's dtype in DCP's metadata", kDcpMetadata},
    {"torch", "int32", R::kValue, nullptr, "a tensor's dtype in DCP's metadata", kDcpMetadata},
    {"torch", "int16", R::kValue, nullptr, "a tensor's dtype in DCP's metadata", kDcpMetadata},
    {"torch", "int8", R::kValue, nullptr, "a tensor's dtype in DCP's metadata", kDcpMetadata},
    {"torch", "uint8", R::kValue, nullptr, "a tensor's dtype in DCP's metadata", kDcpMetadata},
    {"torch", "bool", R::kValue, nullptr, "a tensor's dtype in DCP's metadata", kDcpMetadata},
    {"__builtin__", "getattr", R::kGetattr, nullptr,
     "how Python 3.11+ pickles an enum member (protocol 2 names builtins so)"},
    {"builtins", "getattr", R::kGetattr, nullptr, "the same, under protocol 3 and later", kAll},
    {"deepspeed.runtime.zero.config", "ZeroStageEnum", R::kEnum, nullptr,
     "DeepSpeed's zero_stage in every optimizer file", kDeepSpeed},
    {"deepspeed.utils.tensor_fragment", "fragment_address", R::kObject, nullptr,
     "DeepSpeed's param_slice_mappings: each parameter's (numel, start) in a partition",
     kDeepSpeed},
    {"deepspeed.runtime.fp16.loss_scaler", "LossScaler", R::kObject, nullptr,
     "DeepSpeed's static loss scaler (bf16 and fp32 runs)", kDeepSpeed},
    {"deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", R::kObject, nullptr,
     "DeepSpeed's dynamic loss scaler (fp16 runs)", kDeepSpeed},
    // A DCP checkpoint's index (FileSystemWriter pickles its Metadata): plain dataclasses, read
    // by the library (dcp_checkpoint.h), never made into Python objects from the file.
    {kDcpModule, "Metadata", R::kObject, nullptr, "DCP's index: every item and where it is stored",
     kDcpMetadata},
    {kDcpModule, "TensorStorageMetadata", R::kObject, nullptr,
     "DCP: a tensor's properties, size and saved chunks", kDcpMetadata},
    {kDcpModule, "BytesStorageMetadata", R::kObject, nullptr,
     "DCP: an item saved as torch.save bytes (optimizer hyperparameters)", kDcpMetadata},
    {kDcpModule, "ChunkStorageMetadata", R::kObject, nullptr, "DCP: a chunk's offsets and sizes",
     kDcpMetadata},
    {kDcpModule, "MetadataIndex", R::kObject, nullptr,
     "DCP: an item's name and chunk offset (storage_data's keys)", kDcpMetadata},
    {kDcpModule, "StorageMeta", R::kObject, nullptr, "DCP: the save's id and path",
     kDcpMetadata},
    {kDcpModule, "TensorProperties", R::kStateObject, nullptr,
     "DCP: a tensor's dtype, layout, requires_grad, memory format, pinning, strides (a tuple)",
     kDcpMetadata},
    {kDcpModule, "_MEM_FORMAT_ENCODING", R::kEnum, nullptr,
     "DCP: TensorProperties' memory format, as a member of this enum", kDcpMetadata},
    // The same two as torch releases before DCP had its own named them (a checkpoint of then).
    {"torch.distributed._shard.sharded_tensor.metadata", "TensorProperties", R::kStateObject,
     nullptr, "DCP: TensorProperties, as older torch releases' indexes name it", kDcpMetadata},
    {"torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING", R::kEnum,
     nullptr, "DCP: its memory format, as older torch releases' indexes name the enum",
     kDcpMetadata},
    {"torch.serialization", "_get_layout", R::kLayout, nullptr,
     "DCP: TensorProperties' layout, only 'torch.strided'", kDcpMetadata},
    {"torch.distributed.checkpoint.filesystem", "_StorageInfo", R::kObject, nullptr,
     "DCP: the file, offset and length of each saved item", kDcpMetadata},
    {"pathlib", "PosixPath", R::kPath, nullptr, "DCP: StorageMeta's checkpoint_id",
     kDcpMetadata},
    {"pathlib._local", "PosixPath", R::kPath, nullptr, "the same, as Python 3.13 names it",
     kDcpMetadata},
};

constexpr EnumMember kZeroStages[] = {
    {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3},
};
constexpr EnumMember kMemFormats[] = {
    {"TORCH_CONTIGUOUS_FORMAT", 0}, {"TORCH_CHANNELS_LAST", 1}, {"TORCH_PRESERVE_FORMAT", 2},
};

struct DtypeSize {
  const char* name;
  std::uint64_t size;
};
constexpr DtypeSize kDtypeSizes[] = {
    {"float32", 4}, {"float64", 8}, {"float16", 2}, {"bfloat16", 2},
    {"int64", 8},   {"int32", 4},   {"int16", 2},   {"int8", 1},
    {"uint8", 1},   {"bool", 1},    {"complex64", 8}, {"complex128", 16},
};

const char* opcode_name(unsigned char op) {
  switch (op) {
    case '(': return "MARK";
    case '.': return "STOP";
    case '0': return "POP";
    case '1': return "POP_MARK";
    case '2': return "DUP";
    case 'F': return "FLOAT";
    case 'I': return "INT";
    case 'J': return "BININT";
    case 'K': return "BININT1";
    case 'L': return "LONG";
    case 'M': return "BININT2";
    case 'N': return "NONE";
    case 'P': return "PERSID";
    case 'Q': return "BINPERSID";
    case 'R': return "REDUCE";
    case 'S': return "STRING";
    case 'T': return "BINSTRING";
    case 'U': return "SHORT_BINSTRING";
    case 'V': return "UNICODE";
    case 'X': return "BINUNICODE";
    case 'a': return "APPEND";
    case 'b': return "BUILD";
    case 'c': return "GLOBAL";
    case 'd': return "DICT";
    case '}': return "EMPTY_DICT";
    case 'e': return "APPENDS";
    case 'g': return "GET";
    case 'h': return "BINGET";
    case 'i': return "INST";
    case 'j': return "LONG_BINGET";
    case 'l': return "LIST";
    case ']': return "EMPTY_LIST";
    case 'o': return "OBJ";
    case 'p': return "PUT";
    case 'q': return "BINPUT";
    case 'r': return "LONG_BINPUT";
    case 's': return "SETITEM";
    case 't': return "TUPLE";
    case ')': return "EMPTY_TUPLE";
    case 'u': return "SETITEMS";
    case 'G': return "BINFLOAT";
    case 'B': return "BINBYTES";
    case 'C': return "SHORT_BINBYTES";
    case 0x80: return "PROTO";
    case 0x81: return "NEWOBJ";
    case 0x82: return "EXT1";
    case 0x83: return "EXT2";
    case 0x84: return "EXT4";
    case 0x85: return "TUPLE1";
    case 0x86: return "TUPLE2";
    case 0x87: return "TUPLE3";
    case 0x88: return "NEWTRUE";
    case 0x89: return "NEWFALSE";
    case 0x8a: return "LONG1";
    case 0x8b: return "LONG4";
    case 0x8c: return "SHORT_BINUNICODE";
    case 0x8d: return "BINUNICODE8";
    case 0x8e: return "BINBYTES8";
    case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS";
    case 0x91: return "FROZENSET";
    case 0x92: return "NEWOBJ_EX";
    case 0x93: return "STACK_GLOBAL";
    case 0x94: return "MEMOIZE";
    case 0x95: return "FRAME";
    case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER";
    case 0x98: return "READONLY_BUFFER";
    default: return nullptr;
  }
}


// The deepest tuple a dict key may be.
constexpr int kMaxKeyDepth = 16;
// The longest text line (GLOBAL's module and name, INT, FLOAT, PUT, GET).
constexpr std::size_t kMaxLine = 4096;
// The most arguments a call may be given (_rebuild_tensor_v2 takes 7).
constexpr std::size_t kMaxArgs = 16;

// A dict or set holding more keys than this finds a repeated one through the machine's hash
// set; a smaller one compares the new key with each it holds.
constexpr std::uint32_t kLinearKeys = 8;
// Steps spent hashing and comparing dict keys, per byte of the pickle (and a floor): a key built
// from shared tuples expands exponentially, and must not multiply the time. DCP's index takes
// about 0.3 per byte.
constexpr std::uint64_t kKeyWorkPerByte = 4;
constexpr std::uint64_t kKeyWorkFloor = std::uint64_t{1} << 20;

class Machine {
 public:
  Machine(std::span<const unsigned char> data, const std::string& source, Scope scope)
      : d_(data), src_(source), scope_(scope), max_values_(max_pickle_values(scope)),
        key_work_(0) {
    // DCP's index makes a value per 8 bytes: room for one per 6, reserved (and touched only as
    // used), so that a large graph is not copied as it grows.
    g_.nodes.reserve(std::min<std::uint64_t>(data.size() / 6 + 16, max_values_));
    none_ = add(Node{});
    Node t;
    t.kind = NodeKind::kBool;
    t.flag = true;
    true_ = add(std::move(t));
    Node f;
    f.kind = NodeKind::kBool;
    false_ = add(std::move(f));
    empty_tuple_ = make_seq(NodeKind::kTuple, {});
  }

  PickleGraph run() {
    while (true) {
      if (pos_ >= d_.size()) {
        at_ = pos_;
        throw fail_plain("the pickle ends without STOP (truncated data.pkl)");
      }
      at_ = pos_;
      op_ = d_[pos_++];
      if (step()) break;
    }
    if (pos_ != d_.size()) {
      throw fail_plain(std::to_string(d_.size() - pos_) +
                       " bytes follow STOP (torch.save writes none)");
    }
    return std::move(g_);
  }

 private:
  // The keys of the dicts and sets past kLinearKeys, each with its container and hash: one
  // open-addressed table (linear probing, at most half full) for all of them.
  struct HeldKey {
    std::uint64_t hash = 0;
    std::uint32_t owner = kNoNode;
    std::uint32_t key = kNoNode;
  };
  // Records `k` unless an equal key of its container is held; whether one was.
  bool hold(const HeldKey& k) {
    if (2 * (held_count_ + 1) > held_.size()) {
      std::vector<HeldKey> old(std::max<std::size_t>(1024, 2 * held_.size()));
      old.swap(held_);
      for (const HeldKey& h : old) {
        if (h.owner == kNoNode) continue;
        std::size_t i = slot_of(h);
        while (held_[i].owner != kNoNode) i = (i + 1) & (held_.size() - 1);
        held_[i] = h;
      }
    }
    for (std::size_t i = slot_of(k);; i = (i + 1) & (held_.size() - 1)) {
      HeldKey& h = held_[i];
      if (h.owner == kNoNode) {
        h = k;
        ++held_count_;
        return false;
      }
      if (h.owner == k.owner && h.hash == k.hash && key_equal(h.key, k.key, 0)) return true;
    }
  }
  std::size_t slot_of(const HeldKey& k) const {
    return static_cast<std::size_t>(mix(k.hash, k.owner) >> 20) & (held_.size() - 1);
  }
  // The int cache: a direct-mapped table of 4096 values.
  struct IntSlot {
    std::int64_t value = 0;
    std::uint32_t node = kNoNode;
  };
  static constexpr std::size_t kIntSlots = 4096;
  static constexpr int kIntShift = 52;

  InvalidArgument fail_plain(const std::string& why) const {
    return InvalidArgument(src_ + ", byte " + std::to_string(at_) + ": " + why);
  }
  InvalidArgument fail(const std::string& why) const {
    const char* name = opcode_name(op_);
    return InvalidArgument(src_ + ", byte " + std::to_string(at_) + " (opcode " +
                           (name ? std::string(name) : "0x??") + "): " + why);
  }

  // What the machine copies rather than reads: references kept in containers, and text it
  // builds (dict keys' canonical forms, bytes decoded from latin-1). Bounded, so that a value
  // stored once and used many times cannot multiply memory or time.
  void keep_refs(std::uint64_t n) {
    refs_ += n;
    if (refs_ > 4 * max_values_) {
      throw fail("the pickle's containers hold more than " + format_count(4 * max_values_) +
                 " references (the reader's bound)");
    }
  }
  void keep_text(std::uint64_t n) {
    text_ += n;
    if (text_ > kMaxTorchTextBytes) {
      throw fail("the pickle builds more than " + format_bytes(kMaxTorchTextBytes) +
                 " of keys and text (the reader's bound)");
    }
  }
  // Arguments of a call: no allowed global takes more than a few. A copy: the pool they lie in
  // grows as the call makes values.
  std::vector<std::uint32_t> args_of(std::uint32_t i, const std::string& fn) {
    expect(i, NodeKind::kTuple, fn + "'s arguments");
    const std::span<const std::uint32_t> a = items(i);
    if (a.size() > kMaxArgs) {
      throw fail(fn + " given " + std::to_string(a.size()) + " arguments (at most " +
                 std::to_string(kMaxArgs) + " are taken by any allowed global)");
    }
    return {a.begin(), a.end()};
  }

  std::uint32_t add(Node&& n) {
    if (g_.nodes.size() >= max_values_) {
      throw fail("more than " + format_count(max_values_) +
                 " values in the pickle (the reader's bound)");
    }
    g_.nodes.push_back(n);
    return static_cast<std::uint32_t>(g_.nodes.size() - 1);
  }
  Node& node(std::uint32_t i) { return g_.nodes[i]; }
  std::span<const std::uint32_t> items(std::uint32_t i) const { return g_.items(g_.nodes[i]); }
  std::string_view text(std::uint32_t i) const { return g_.text_of(g_.nodes[i]); }

  // Pools: runs appended at their ends, each bounded to what a 32-bit offset reaches.
  Run add_refs(std::span<const std::uint32_t> v, std::uint64_t capacity) {
    keep_refs(v.size());
    if (g_.refs.size() + capacity > UINT32_MAX) throw fail("the pickle's containers outgrow 2^32 items");
    Run r{static_cast<std::uint32_t>(g_.refs.size()), static_cast<std::uint32_t>(v.size())};
    g_.refs.insert(g_.refs.end(), v.begin(), v.end());
    g_.refs.resize(r.at + capacity);
    return r;
  }
  Run add_text(std::string_view t) {
    if (g_.text.size() + t.size() > UINT32_MAX) throw fail("the pickle's text outgrows 4 GiB");
    Run r{static_cast<std::uint32_t>(g_.text.size()), static_cast<std::uint32_t>(t.size())};
    g_.text.append(t);
    return r;
  }
  // The slots a list, set or dict of `size` items holds in the pool: it grows by doubling, in
  // place when it ends the pool, else moved to the end (an item, once set, never changes, so a
  // tuple made from a list may share its run).
  static std::uint64_t capacity(std::uint64_t size) {
    return size == 0 ? 0 : std::max<std::uint64_t>(4, std::bit_ceil(size));
  }
  void push_item(std::uint32_t c, std::uint32_t v) {
    keep_refs(1);
    Run& r = node(c).items;
    const std::uint64_t cap = capacity(r.size);
    if (r.size == cap) {
      const std::uint64_t grown = cap == 0 ? 4 : 2 * cap;
      if (cap > 0 && r.at + cap == g_.refs.size()) {
        if (r.at + grown > UINT32_MAX) throw fail("the pickle's containers outgrow 2^32 items");
        g_.refs.resize(r.at + grown);
      } else {
        if (g_.refs.size() + grown > UINT32_MAX) {
          throw fail("the pickle's containers outgrow 2^32 items");
        }
        const auto at = static_cast<std::uint32_t>(g_.refs.size());
        g_.refs.resize(at + grown);
        std::copy_n(g_.refs.begin() + r.at, r.size, g_.refs.begin() + at);
        r.at = at;
      }
    }
    g_.refs[r.at + r.size++] = v;
  }

  void need(std::uint64_t n) {
    if (n > d_.size() - pos_) {
      throw fail("needs " + std::to_string(n) + " more bytes, but the pickle has " +
                 std::to_string(d_.size() - pos_) + " left (truncated data.pkl)");
    }
  }
  std::uint64_t le(int n) {
    need(static_cast<std::uint64_t>(n));
    std::uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = v << 8 | d_[pos_ + static_cast<std::size_t>(i)];
    pos_ += static_cast<std::size_t>(n);
    return v;
  }
  std::string_view bytes(std::uint64_t n) {
    need(n);
    std::string_view out(reinterpret_cast<const char*>(d_.data() + pos_), n);
    pos_ += n;
    return out;
  }
  std::string_view line() {
    const std::size_t left = d_.size() - pos_;
    const std::size_t n = std::min(left, kMaxLine + 1);
    const void* nl = std::memchr(d_.data() + pos_, '\n', n);
    if (nl == nullptr) {
      throw fail(left <= kMaxLine ? "its text line has no end (truncated data.pkl)"
                                  : "its text line is longer than " + std::to_string(kMaxLine) +
                                        " bytes");
    }
    const std::size_t len = static_cast<const unsigned char*>(nl) - (d_.data() + pos_);
    std::string_view out(reinterpret_cast<const char*>(d_.data() + pos_), len);
    pos_ += len + 1;
    return out;
  }

  void push(std::uint32_t i) {
    if (stack_.size() >= max_values_) {
      throw fail("the pickle's stack grows past " + format_count(max_values_) + " items");
    }
    stack_.push_back(i);
  }
  std::size_t base() const { return marks_.empty() ? 0 : marks_.back(); }
  std::uint32_t pop() {
    if (stack_.size() <= base()) throw fail("needs a value, but the stack is empty");
    const std::uint32_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  std::uint32_t top() {
    if (stack_.size() <= base()) throw fail("needs a value, but the stack is empty");
    return stack_.back();
  }
  // The items above the last MARK, which is dropped: valid until the next pop_mark.
  const std::vector<std::uint32_t>& pop_mark() {
    if (marks_.empty()) throw fail("needs a MARK, but there is none");
    const std::size_t b = marks_.back();
    marks_.pop_back();
    marked_.assign(stack_.begin() + static_cast<std::ptrdiff_t>(b), stack_.end());
    stack_.resize(b);
    return marked_;
  }

  // An int: one shared node per value while the cache's slot holds it (ints never change).
  std::uint32_t make_int(std::int64_t v) {
    if (!ints_) {
      ints_ = std::make_unique<IntSlot[]>(kIntSlots);
    }
    IntSlot& slot = ints_[(static_cast<std::uint64_t>(v) * 0x9E3779B97F4A7C15ull) >> kIntShift];
    if (slot.node != kNoNode && slot.value == v) return slot.node;
    Node n;
    n.kind = NodeKind::kInt;
    n.integer = v;
    slot.value = v;
    slot.node = add(std::move(n));
    return slot.node;
  }
  std::uint32_t make_text(NodeKind kind, std::string_view text) {
    Node n;
    n.kind = kind;
    n.text = add_text(text);
    return add(std::move(n));
  }
  // A tuple's items never change: the empty one is shared.
  std::uint32_t make_seq(NodeKind kind, std::span<const std::uint32_t> items, Tag tag = Tag::kPlain) {
    if (kind == NodeKind::kTuple && items.empty() && tag == Tag::kPlain && empty_tuple_ != kNoNode) {
      return empty_tuple_;
    }
    Node n;
    n.kind = kind;
    n.items = add_refs(items, kind == NodeKind::kTuple ? items.size() : capacity(items.size()));
    n.tag = tag;
    return add(std::move(n));
  }
  std::uint32_t make_seq(NodeKind kind, std::initializer_list<std::uint32_t> items,
                         Tag tag = Tag::kPlain) {
    return make_seq(kind, std::span<const std::uint32_t>(items.begin(), items.size()), tag);
  }

  // Python's int(text) for the INT and LONG opcodes (and I01/I00 booleans).
  std::int64_t parse_int(std::string_view t) {
    if (!t.empty() && t.back() == 'L') t.remove_suffix(1);
    std::int64_t v = 0;
    const char* b = t.data();
    if (!t.empty() && t.front() == '+') ++b;
    auto [p, ec] = std::from_chars(b, t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || p != t.data() + t.size()) {
      throw fail("'" + printable(t) + "' is not an integer that fits in 64 bits");
    }
    return v;
  }
  // Little-endian two's complement of n bytes (LONG1, LONG4), at most 64 bits of value.
  std::int64_t parse_long(std::string_view b) {
    if (b.empty()) return 0;
    const auto* u = reinterpret_cast<const unsigned char*>(b.data());
    const bool negative = (u[b.size() - 1] & 0x80) != 0;
    if (b.size() > 8) {
      const unsigned char fill = negative ? 0xff : 0x00;
      for (std::size_t i = 8; i < b.size(); ++i) {
        if (u[i] != fill) throw fail("an integer of " + std::to_string(b.size()) +
                                     " bytes, beyond 64 bits (refused)");
      }
      if (((u[7] & 0x80) != 0) != negative) {
        throw fail("an integer beyond 64 bits (refused)");
      }
    }
    std::uint64_t v = negative ? ~std::uint64_t{0} : 0;
    const std::size_t n = std::min<std::size_t>(b.size(), 8);
    for (std::size_t i = 0; i < n; ++i) {
      v &= ~(std::uint64_t{0xff} << (8 * i));
      v |= std::uint64_t{u[i]} << (8 * i);
    }
    return static_cast<std::int64_t>(v);
  }

  // Python's equality of hashable keys (True == 1 == 1.0): a number's canonical form.
  struct Number {
    bool is_int = true;
    std::int64_t i = 0;
    double f = 0;
  };
  static Number number_of(const Node& n) {
    if (n.kind == NodeKind::kBool) return {true, n.flag ? 1 : 0, 0};
    if (n.kind == NodeKind::kInt) return {true, n.integer, 0};
    // In range before the cast (a float past int64's range does not convert: UB); NaN fails
    // both comparisons.
    if (n.real >= -9.2e18 && n.real <= 9.2e18 &&
        n.real == static_cast<double>(static_cast<std::int64_t>(n.real))) {
      return {true, static_cast<std::int64_t>(n.real), 0};
    }
    return {false, 0, std::isnan(n.real) ? std::numeric_limits<double>::quiet_NaN() : n.real};
  }
  static bool is_number(NodeKind k) {
    return k == NodeKind::kBool || k == NodeKind::kInt || k == NodeKind::kFloat;
  }
  static std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
  }
  void key_work(int depth) {
    if (depth > kMaxKeyDepth) throw fail("a dict key nested deeper than 16 tuples");
    if (++key_work_ > kKeyWorkPerByte * d_.size() + kKeyWorkFloor) {
      throw fail("the pickle's dict keys take more than " +
                 format_count(kKeyWorkPerByte * d_.size() + kKeyWorkFloor) +
                 " steps to compare (keys built from shared tuples; the reader's bound)");
    }
  }
  // A hashable key's state dict (DCP's MetadataIndex keys storage_data: keyed by its class and
  // saved state; the reader checks the names and offsets themselves).
  std::uint32_t key_state(const Node& n) {
    if (n.state == kNoNode || node(n.state).kind != NodeKind::kDict) {
      throw fail("an object without a saved state as a dict key");
    }
    return n.state;
  }
  std::uint64_t key_hash(std::uint32_t k, int depth) {
    key_work(depth);
    const Node& n = node(k);
    const auto seed = [](char c) { return static_cast<std::uint64_t>(c) << 56; };
    if (is_number(n.kind)) {
      const Number v = number_of(n);
      return v.is_int ? mix(seed('i'), static_cast<std::uint64_t>(v.i))
                      : mix(seed('f'), std::bit_cast<std::uint64_t>(v.f));
    }
    switch (n.kind) {
      case NodeKind::kNone: return seed('N');
      case NodeKind::kString:
      case NodeKind::kBytes:
        return mix(seed(n.kind == NodeKind::kString ? 's' : 'b'),
                   std::hash<std::string_view>{}(text(k)));
      case NodeKind::kEnum: return mix(mix(seed('e'), n.ref), std::hash<std::string_view>{}(text(k)));
      case NodeKind::kGlobal: return mix(seed('g'), n.ref);
      case NodeKind::kObject: {
        std::uint64_t h = mix(seed('o'), n.ref);
        for (std::uint32_t i : items(key_state(n))) h = mix(h, key_hash(i, depth + 1));
        return h;
      }
      case NodeKind::kTuple: {
        std::uint64_t h = seed('(');
        for (std::uint32_t i : items(k)) h = mix(h, key_hash(i, depth + 1));
        return h;
      }
      default:
        throw fail(std::string("a ") + std::string(node_kind_name(n.kind)) +
                   " as a dict key (unhashable, or not what torch.save writes)");
    }
  }
  bool key_equal(std::uint32_t a, std::uint32_t b, int depth) {
    if (a == b) return true;
    key_work(depth);
    const Node& x = node(a);
    const Node& y = node(b);
    if (is_number(x.kind) || is_number(y.kind)) {
      if (!is_number(x.kind) || !is_number(y.kind)) return false;
      const Number p = number_of(x), q = number_of(y);
      if (p.is_int != q.is_int) return false;
      return p.is_int ? p.i == q.i : (p.f == q.f || (std::isnan(p.f) && std::isnan(q.f)));
    }
    if (x.kind != y.kind) return false;
    switch (x.kind) {
      case NodeKind::kNone: return true;
      case NodeKind::kString:
      case NodeKind::kBytes: return text(a) == text(b);
      case NodeKind::kEnum: return x.ref == y.ref && text(a) == text(b);
      case NodeKind::kGlobal: return x.ref == y.ref;
      case NodeKind::kObject:
      case NodeKind::kTuple: {
        if (x.ref != y.ref && x.kind == NodeKind::kObject) return false;
        const std::uint32_t sa = x.kind == NodeKind::kObject ? key_state(x) : a;
        const std::uint32_t sb = y.kind == NodeKind::kObject ? key_state(y) : b;
        const std::span<const std::uint32_t> p = items(sa), q = items(sb);
        if (p.size() != q.size()) return false;
        for (std::size_t i = 0; i < p.size(); ++i) {
          if (!key_equal(p[i], q[i], depth + 1)) return false;
        }
        return true;
      }
      default: return false;
    }
  }
  // Whether `key` is already among the keys of dict or set `c` (stride 2 for a dict's key,
  // value pairs); if not, it is recorded as one.
  bool has_key(std::uint32_t c, std::uint32_t key, std::uint32_t stride) {
    const std::uint64_t h = key_hash(key, 0);
    const std::uint32_t held = node(c).items.size / stride;
    if (held < kLinearKeys) {
      for (std::uint32_t i = 0; i < held; ++i) {
        if (key_equal(g_.refs[node(c).items.at + i * stride], key, 0)) return true;
      }
      return false;
    }
    if (held == kLinearKeys) {
      for (std::uint32_t i = 0; i < held; ++i) {
        const std::uint32_t k = g_.refs[node(c).items.at + i * stride];
        hold(HeldKey{key_hash(k, 0), c, k});
      }
    }
    return hold(HeldKey{h, c, key});
  }
  void set_item(std::uint32_t dict, std::uint32_t key, std::uint32_t value) {
    const Node& d = node(dict);
    if (d.kind != NodeKind::kDict) {
      throw fail(std::string("sets an item on a ") + std::string(node_kind_name(d.kind)) +
                 " (expected a dict)");
    }
    if (has_key(dict, key, 2)) {
      const Node& kn = node(key);
      throw fail("a dict key appears twice" +
                 (kn.kind == NodeKind::kString ? " ('" + printable(text(key)) + "')"
                                               : std::string()) +
                 " (torch.save never writes one dict key twice)");
    }
    push_item(dict, key);
    push_item(dict, value);
  }
  void add_to_set(std::uint32_t set, std::uint32_t item) {
    const Node& s = node(set);
    if (s.kind != NodeKind::kList || s.tag != Tag::kSet) {
      throw fail("adds items to a " + std::string(node_kind_name(s.kind)) + " (expected a set)");
    }
    if (!has_key(set, item, 1)) push_item(set, item);
  }
  void append(std::uint32_t list, std::uint32_t item) {
    const Node& l = node(list);
    if (l.kind != NodeKind::kList || l.tag != Tag::kPlain) {
      throw fail("appends to a " + std::string(node_kind_name(l.kind)) + " (expected a list)");
    }
    push_item(list, item);
  }

  std::uint32_t resolve(std::string_view module, std::string_view name) {
    std::string named = std::string(module) + " " + std::string(name);
    if (named_.size() < 1000 && named_.insert(named).second) g_.globals.push_back(named);
    for (std::size_t i = 0; i < std::size(kAllowed); ++i) {
      if (module == kAllowed[i].module && name == kAllowed[i].name) {
        if ((kAllowed[i].scopes & scope_) == 0) {
          throw fail("global '" + printable(named, 200) + "' is allowed in " +
                     scope_name(kAllowed[i].scopes) + " only, not in " + scope_name(scope_) +
                     " (torch_file.h's allow-list)");
        }
        Node n;
        n.kind = NodeKind::kGlobal;
        n.ref = static_cast<std::uint32_t>(i);
        return add(std::move(n));
      }
    }
    throw fail("global '" + printable(named, 200) +
               "' is not on the allow-list of torch_file.h (loading it would import and run "
               "code the file names; " + scope_name(scope_) + " need no global off the list)");
  }

  const AllowedGlobal* global_of(std::uint32_t i) {
    const Node& n = node(i);
    return n.kind == NodeKind::kGlobal ? &kAllowed[n.ref] : nullptr;
  }
  std::string global_text(const AllowedGlobal& g) {
    return std::string(g.module) + "." + g.name;
  }

  const Node& expect(std::uint32_t i, NodeKind kind, const std::string& what) {
    const Node& n = node(i);
    if (n.kind != kind) {
      throw fail(what + ": expected a " + std::string(node_kind_name(kind)) + ", found a " +
                 std::string(node_kind_name(n.kind)));
    }
    return n;
  }
  // The items of a dict that may be None (key, value, key, value, ...; none for None).
  std::span<const std::uint32_t> none_or_dict(std::uint32_t i, const std::string& what) {
    const Node& n = node(i);
    if (n.kind == NodeKind::kNone) return {};
    if (n.kind != NodeKind::kDict) {
      throw fail(what + ": expected None or a dict, found a " +
                 std::string(node_kind_name(n.kind)));
    }
    return items(i);
  }
  const Node& expect_seq(std::uint32_t i, const std::string& what) {
    const Node& n = node(i);
    if (n.kind != NodeKind::kTuple && n.kind != NodeKind::kList) {
      throw fail(what + ": expected a tuple, found a " + std::string(node_kind_name(n.kind)));
    }
    return n;
  }
  std::vector<std::int64_t> int_list(std::uint32_t i, const std::string& what) {
    const Node& n = expect_seq(i, what);
    if (n.items.size > kMaxTorchDims) {
      throw fail(what + " has " + std::to_string(n.items.size) + " dimensions; at most " +
                 std::to_string(kMaxTorchDims));
    }
    std::vector<std::int64_t> out;
    for (std::uint32_t x : items(i)) {
      const Node& v = expect(x, NodeKind::kInt, what);
      if (v.integer < 0) throw fail(what + " holds " + std::to_string(v.integer) +
                                    " (expected no negative value)");
      out.push_back(v.integer);
    }
    return out;
  }

  std::uint32_t rebuild_tensor(const std::vector<std::uint32_t>& a, const AllowedGlobal& g) {
    const std::string fn = global_text(g);
    const bool v2 = g.role == R::kRebuildTensorV2;
    if (v2 ? (a.size() != 6 && a.size() != 7) : a.size() != 4) {
      throw fail(fn + " takes " + (v2 ? "6 or 7" : "4") + " arguments, given " +
                 std::to_string(a.size()));
    }
    expect(a[0], NodeKind::kStorage, fn + "'s storage (argument 1)");
    const Node& off = expect(a[1], NodeKind::kInt, fn + "'s storage offset (argument 2)");
    if (off.integer < 0) throw fail(fn + "'s storage offset " + std::to_string(off.integer) +
                                    " is negative");
    std::vector<std::int64_t> size = int_list(a[2], fn + "'s size (argument 3)");
    std::vector<std::int64_t> stride = int_list(a[3], fn + "'s stride (argument 4)");
    if (size.size() != stride.size()) {
      throw fail(fn + ": size has " + std::to_string(size.size()) + " dimensions, stride " +
                 std::to_string(stride.size()));
    }
    bool requires_grad = false;
    if (v2) {
      const Node& rg = expect(a[4], NodeKind::kBool, fn + "'s requires_grad (argument 5)");
      requires_grad = rg.flag;
      const Node& hooks = node(a[5]);
      if (!(hooks.kind == NodeKind::kNone || (hooks.kind == NodeKind::kDict && hooks.items.size == 0))) {
        throw fail(fn + "'s backward hooks (argument 6) must be empty; found a " +
                   std::string(node_kind_name(hooks.kind)) +
                   (hooks.kind == NodeKind::kDict ? " of " + std::to_string(hooks.items.size / 2) +
                                                        " hooks"
                                                  : std::string()));
      }
      if (a.size() == 7) {
        // torch writes it only for a tensor with a bit such as 'neg' or 'conj' set: its values
        // are not its stored bytes (a negative view reads back negated). Only bits set to False
        // describe the stored bytes as they are.
        const std::span<const std::uint32_t> meta =
            none_or_dict(a[6], fn + "'s metadata (argument 7)");
        for (std::size_t i = 0; i + 1 < meta.size(); i += 2) {
          const Node& key = node(meta[i]);
          const Node& value = node(meta[i + 1]);
          if (value.kind == NodeKind::kBool && !value.flag) continue;
          throw fail(fn + "'s metadata (argument 7) sets " +
                     (key.kind == NodeKind::kString ? "'" + printable(g_.text_of(key), 40) + "'"
                                                    : std::string("a key")) +
                     ": a view whose values are not its stored bytes (torch.save it after "
                     "resolve_neg() / resolve_conj(), or as a plain tensor)");
        }
      }
    }
    Node t;
    t.kind = NodeKind::kTensor;
    t.ref = a[0];
    t.integer = node(a[1]).integer;
    t.flag = requires_grad;
    const std::uint64_t at = g_.dims.size();
    if (at + size.size() + stride.size() > UINT32_MAX) throw fail("too many tensor dimensions");
    g_.dims.insert(g_.dims.end(), size.begin(), size.end());
    g_.dims.insert(g_.dims.end(), stride.begin(), stride.end());
    t.items = {static_cast<std::uint32_t>(at), static_cast<std::uint32_t>(2 * size.size())};
    return add(std::move(t));
  }

  const EnumMember* member_named(const AllowedGlobal& cls, std::string_view name) {
    for (const EnumMember& m : enum_members(cls)) {
      if (name == m.name) return &m;
    }
    return nullptr;
  }
  std::uint32_t make_enum(std::uint32_t cls_row, const EnumMember& m) {
    Node n;
    n.kind = NodeKind::kEnum;
    n.ref = cls_row;
    n.integer = m.value;
    // An alias (max_stage) pickles under its canonical name; report that one.
    for (const EnumMember& c : enum_members(kAllowed[cls_row])) {
      if (c.value == m.value) {
        n.text = add_text(c.name);
        break;
      }
    }
    return add(std::move(n));
  }

  std::uint32_t call(std::uint32_t callable, std::uint32_t args_node) {
    const AllowedGlobal* g = global_of(callable);
    if (g == nullptr) {
      throw fail("calls a " + std::string(node_kind_name(node(callable).kind)) +
                 "; only globals of the allow-list may be called");
    }
    const std::string fn = global_text(*g);
    const std::vector<std::uint32_t> a = args_of(args_node, fn);
    const std::uint32_t row = node(callable).ref;
    switch (g->role) {
      case R::kRebuildTensorV2:
      case R::kRebuildTensor:
        return rebuild_tensor(a, *g);
      case R::kRebuildFromType: {
        if (a.size() != 4) throw fail(fn + " takes 4 arguments, given " + std::to_string(a.size()));
        const AllowedGlobal* f = global_of(a[0]);
        if (f == nullptr || (f->role != R::kRebuildTensorV2 && f->role != R::kRebuildTensor)) {
          throw fail(fn + "'s function (argument 1) must be torch._utils._rebuild_tensor_v2");
        }
        const AllowedGlobal* type = global_of(a[1]);
        if (type == nullptr || type->role != R::kTensorType) {
          throw fail(fn + "'s type (argument 2) must be torch.Tensor (a tensor subclass would "
                     "run its own code)");
        }
        const std::vector<std::uint32_t> inner_args = args_of(a[2], fn + "'s argument 3");
        // torch sets each as an attribute of the tensor it rebuilt. Most are the saver's own
        // (DeepSpeed's ds_id), kept by torch beside the values and dropped here; the tensor's
        // own setters replace its values (data, real, imag): refused, as any key not a name.
        const std::span<const std::uint32_t> state =
            none_or_dict(a[3], fn + "'s attributes (argument 4)");
        for (std::size_t i = 0; i + 1 < state.size(); i += 2) {
          const Node& key = node(state[i]);
          if (key.kind != NodeKind::kString) {
            throw fail(fn + "'s attributes (argument 4): a key that is not a name (a " +
                       std::string(node_kind_name(key.kind)) + ")");
          }
          const std::string_view name = text(state[i]);
          if (name == "data" || name == "real" || name == "imag") {
            throw fail(fn + "'s attributes (argument 4) set '" + std::string(name) +
                       "', which replaces the tensor's values with another's");
          }
          refuse_dunder(name, fn + "'s attributes (argument 4)");
        }
        return rebuild_tensor(inner_args, *f);
      }
      case R::kRebuildParameter: {
        if (a.size() != 3) throw fail(fn + " takes 3 arguments, given " + std::to_string(a.size()));
        Node t = expect(a[0], NodeKind::kTensor, fn + "'s data (argument 1)");
        t.flag = expect(a[1], NodeKind::kBool, fn + "'s requires_grad (argument 2)").flag;
        return add(std::move(t));
      }
      case R::kSize: {
        if (a.size() != 1) throw fail(fn + " takes 1 argument, given " + std::to_string(a.size()));
        (void)int_list(a[0], fn + "'s dimensions");
        // Its items are the tuple's (or the list's first ones, which never change): shared.
        Node n;
        n.kind = NodeKind::kTuple;
        n.tag = Tag::kSize;
        n.items = node(a[0]).items;
        return add(std::move(n));
      }
      case R::kDevice: {
        if (a.empty() || a.size() > 2) {
          throw fail(fn + " takes 1 or 2 arguments, given " + std::to_string(a.size()));
        }
        expect(a[0], NodeKind::kString, fn + "'s type (argument 1)");
        if (a.size() == 2 && node(a[1]).kind != NodeKind::kInt &&
            node(a[1]).kind != NodeKind::kNone) {
          throw fail(fn + "'s index (argument 2): expected an int or None");
        }
        Node o;
        o.kind = NodeKind::kObject;
        o.ref = row;
        o.items = add_refs(a, a.size());
        return add(std::move(o));
      }
      case R::kOrderedDict: {
        if (a.size() > 1) throw fail(fn + " takes 0 or 1 argument, given " + std::to_string(a.size()));
        const std::uint32_t d = make_seq(NodeKind::kDict, {}, Tag::kOrderedDict);
        if (a.size() == 1) {
          expect_seq(a[0], fn + "'s items");
          const std::span<const std::uint32_t> held = items(a[0]);
          const std::vector<std::uint32_t> pairs(held.begin(), held.end());
          for (std::uint32_t p : pairs) {
            expect_seq(p, fn + "'s item");
            if (items(p).size() != 2) throw fail(fn + "'s items must be (key, value) pairs");
            const std::uint32_t k = items(p)[0], v = items(p)[1];
            set_item(d, k, v);
          }
        }
        return d;
      }
      case R::kGetattr: {
        if (a.size() != 2) throw fail(fn + " takes 2 arguments, given " + std::to_string(a.size()));
        const AllowedGlobal* cls = global_of(a[0]);
        if (cls == nullptr || cls->role != R::kEnum) {
          throw fail(fn + " may only name a member of an allowed enum (argument 1 is a " +
                     (cls ? global_text(*cls) : std::string(node_kind_name(node(a[0]).kind))) +
                     ")");
        }
        const Node& name = expect(a[1], NodeKind::kString, fn + "'s name (argument 2)");
        const EnumMember* m = member_named(*cls, g_.text_of(name));
        if (m == nullptr) {
          throw fail(global_text(*cls) + " has no member '" + printable(g_.text_of(name)) + "'");
        }
        return make_enum(node(a[0]).ref, *m);
      }
      case R::kEnum: {
        if (a.size() != 1) throw fail(fn + " takes 1 argument, given " + std::to_string(a.size()));
        const Node& v = expect(a[0], NodeKind::kInt, fn + "'s value");
        for (const EnumMember& m : enum_members(*g)) {
          if (m.value == v.integer) return make_enum(row, m);
        }
        throw fail(fn + " has no member of value " + std::to_string(v.integer));
      }
      case R::kObject: {
        Node o;
        o.kind = NodeKind::kObject;
        o.ref = row;
        o.items = add_refs(a, a.size());
        return add(std::move(o));
      }
      case R::kSet: {
        if (a.size() > 1) throw fail(fn + " takes 0 or 1 argument, given " + std::to_string(a.size()));
        const std::uint32_t s = make_seq(NodeKind::kList, {}, Tag::kSet);
        if (a.size() == 1) {
          expect_seq(a[0], fn + "'s items");
          const std::span<const std::uint32_t> held = items(a[0]);
          const std::vector<std::uint32_t> members(held.begin(), held.end());
          for (std::uint32_t i : members) add_to_set(s, i);
        }
        if (g->name == std::string_view("frozenset")) node(s).tag = Tag::kFrozenSet;
        return s;
      }
      case R::kEncode: {
        if (std::string_view(g->name) == "bytes") {
          if (!a.empty()) throw fail(fn + " is allowed only without arguments (empty bytes)");
          return make_text(NodeKind::kBytes, "");
        }
        if (a.size() != 2) throw fail(fn + " takes 2 arguments, given " + std::to_string(a.size()));
        keep_text(expect(a[0], NodeKind::kString, fn + "'s text").text.size);
        const std::string content(text(a[0]));
        expect(a[1], NodeKind::kString, fn + "'s codec");
        const std::string codec(text(a[1]));
        if (codec != "latin1" && codec != "latin-1") {
          throw fail(fn + " is allowed only with 'latin1' (how protocol 2 writes bytes), given '" +
                     printable(codec) + "'");
        }
        return make_text(NodeKind::kBytes, latin1(content, fn));
      }
      case R::kLayout: {
        if (a.size() != 1) throw fail(fn + " takes 1 argument, given " + std::to_string(a.size()));
        expect(a[0], NodeKind::kString, fn + "'s name");
        const std::string name(text(a[0]));
        if (name != "torch.strided") {
          throw fail(fn + "('" + printable(name) +
                     "'): only 'torch.strided' is read (a sparse or other layout is not a dense "
                     "run of bytes)");
        }
        return make_text(NodeKind::kString, name);
      }
      case R::kPath: {
        std::string path;
        for (std::uint32_t part : a) {
          expect(part, NodeKind::kString, fn + "'s parts");
          if (!path.empty() && path.back() != '/') path += '/';
          path += text(part);
        }
        keep_text(path.size());
        return make_text(NodeKind::kString, path);
      }
      case R::kStorage:
      case R::kTensorType:
      case R::kValue:
      case R::kStateObject:
        break;
    }
    throw fail(fn + " may not be called (it is allowed only as " +
               (g->role == R::kStorage      ? "a storage type in a persistent id)"
                : g->role == R::kTensorType ? "the type _rebuild_from_type_v2 names)"
                                            : "a value)"));
  }

  // The text of a str opcode, which must be UTF-8: Python's pickle refuses other bytes there
  // (torch.load decodes protocol 2's byte strings as UTF-8 too), and the names and values it
  // holds reach Python and JSON as text. Strict: no overlong forms, nothing past U+10FFFF, and
  // no lone surrogates, which Python's pickle lets through (surrogatepass) but which cannot
  // cross to Python as text: such a str is refused by name here, not a UnicodeDecodeError
  // later.
  std::string_view utf8(std::string_view text) {
    for (std::size_t i = 0; i < text.size();) {
      const auto c = static_cast<unsigned char>(text[i]);
      const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3
                                                         : (c >> 3) == 0x1e ? 4 : 0;
      bool ok = n > 0 && i + n <= text.size();
      std::uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1f : n == 3 ? c & 0x0f : c & 0x07;
      for (std::size_t k = 1; ok && k < n; ++k) {
        const auto b = static_cast<unsigned char>(text[i + k]);
        ok = (b & 0xc0) == 0x80;
        cp = cp << 6 | (b & 0x3f);
      }
      ok = ok && (n == 1 || (n == 2 && cp >= 0x80) || (n == 3 && cp >= 0x800) ||
                  (n == 4 && cp >= 0x10000)) &&
           cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff);
      if (!ok) {
        throw fail("a str that is not UTF-8 (byte " + std::to_string(i) + " of its " +
                   std::to_string(text.size()) + ")");
      }
      i += n;
    }
    return text;
  }

  // UTF-8 text whose code points are all below 256, as the bytes they number.
  std::string latin1(const std::string& text, const std::string& fn) {
    std::string out;
    for (std::size_t i = 0; i < text.size();) {
      const auto c = static_cast<unsigned char>(text[i]);
      if (c < 0x80) {
        out += static_cast<char>(c);
        i += 1;
      } else if ((c == 0xc2 || c == 0xc3) && i + 1 < text.size() &&
                 (static_cast<unsigned char>(text[i + 1]) & 0xc0) == 0x80) {
        out += static_cast<char>(((c & 0x03) << 6) | (static_cast<unsigned char>(text[i + 1]) & 0x3f));
        i += 2;
      } else {
        throw fail(fn + "'s text holds a character beyond latin-1 (byte " + std::to_string(i) +
                   "): not bytes as protocol 2 writes them");
      }
    }
    return out;
  }

  std::uint32_t new_object(std::uint32_t cls, std::uint32_t args_node) {
    const AllowedGlobal* g = global_of(cls);
    if (g == nullptr || (g->role != R::kObject && g->role != R::kStateObject)) {
      throw fail("makes an instance of " +
                 (g ? "'" + global_text(*g) + "'" : "a " + std::string(node_kind_name(node(cls).kind))) +
                 "; only the allow-list's classes may be");
    }
    Node o;
    o.kind = NodeKind::kObject;
    o.ref = node(cls).ref;
    const std::vector<std::uint32_t> a = args_of(args_node, global_text(*g));
    o.items = add_refs(a, a.size());
    return add(std::move(o));
  }

  // An attribute named __like_this__ is Python's own machinery (__reduce_ex__, __class__,
  // __dict__): a file's value there would decide what code runs on the object later.
  void refuse_dunder(std::string_view name, const std::string& where) {
    if (name.size() >= 4 && name.starts_with("__") && name.ends_with("__")) {
      throw fail(where + " sets '" + printable(name, 100) + "', a name of Python's own "
                 "machinery (a value there would choose the code run on the object)");
    }
  }

  void build(std::uint32_t inst, std::uint32_t state) {
    Node& o = node(inst);
    if (o.kind == NodeKind::kDict && o.tag == Tag::kOrderedDict) {
      // An OrderedDict's attributes: torch's state dicts carry _metadata (module versions).
      if (o.state != kNoNode) throw fail("sets a dict's attributes twice");
      const Node& attrs = node(state);
      if (attrs.kind != NodeKind::kDict) {
        throw fail("an OrderedDict's attributes: expected a dict, found a " +
                   std::string(node_kind_name(attrs.kind)));
      }
      node(inst).state = state;
      return;
    }
    if (o.kind == NodeKind::kObject && kAllowed[o.ref].role == R::kStateObject) {
      // TensorProperties: __setstate__ takes a tuple, kept as it is for the reader to check.
      if (o.state != kNoNode) throw fail("sets an object's state twice");
      if (node(state).kind != NodeKind::kTuple) {
        throw fail("the state of '" + global_text(kAllowed[o.ref]) + "': expected a tuple, found a " +
                   std::string(node_kind_name(node(state).kind)));
      }
      node(inst).state = state;
      return;
    }
    if (o.kind != NodeKind::kObject || kAllowed[o.ref].role != R::kObject) {
      throw fail("sets the state of a " + std::string(node_kind_name(o.kind)) +
                 (o.kind == NodeKind::kObject ? " '" + global_text(kAllowed[o.ref]) + "'" : "") +
                 "; only instances of the allow-list's classes have one");
    }
    if (o.state != kNoNode) throw fail("sets an object's state twice");
    std::uint32_t s = state;
    const Node& sn = node(state);
    if (sn.kind == NodeKind::kTuple && sn.items.size == 2) {
      // (state, slot state): the slots may be empty, nothing else.
      const Node& slots = node(items(state)[1]);
      if (!(slots.kind == NodeKind::kNone || (slots.kind == NodeKind::kDict && slots.items.size == 0))) {
        throw fail("an object's slot state is not empty (not what DeepSpeed's classes save)");
      }
      s = items(state)[0];
    }
    const Node& d = node(s);
    if (d.kind != NodeKind::kDict && d.kind != NodeKind::kNone) {
      throw fail("an object's state: expected a dict, found a " +
                 std::string(node_kind_name(d.kind)));
    }
    const std::span<const std::uint32_t> attrs = d.kind == NodeKind::kDict
                                                       ? items(s)
                                                       : std::span<const std::uint32_t>();
    for (std::size_t i = 0; i + 1 < attrs.size(); i += 2) {
      const Node& key = node(attrs[i]);
      if (key.kind != NodeKind::kString) {
        throw fail("the state of '" + global_text(kAllowed[o.ref]) + "': an attribute that is "
                   "not a name (a " + std::string(node_kind_name(key.kind)) + ")");
      }
      refuse_dunder(text(attrs[i]), "the state of '" + global_text(kAllowed[o.ref]) + "'");
    }
    node(inst).state = d.kind == NodeKind::kDict ? s : kNoNode;
  }

  std::uint32_t persistent(std::uint32_t pid) {
    const Node& t = node(pid);
    if (t.kind != NodeKind::kTuple || t.items.size != 5) {
      throw fail("a persistent id must be torch's ('storage', type, key, location, numel); "
                 "found a " + std::string(node_kind_name(t.kind)) +
                 (t.kind == NodeKind::kTuple ? " of " + std::to_string(t.items.size) + " items"
                                             : std::string()));
    }
    const std::span<const std::uint32_t> held = items(pid);
    const std::vector<std::uint32_t> p(held.begin(), held.end());
    expect(p[0], NodeKind::kString, "a persistent id's tag");
    if (text(p[0]) != "storage") {
      throw fail("a persistent id of kind '" + printable(text(p[0])) + "' (expected 'storage')");
    }
    const AllowedGlobal* type = global_of(p[1]);
    if (type == nullptr || type->role != R::kStorage) {
      throw fail("a persistent id's storage type is " +
                 (type ? "'" + global_text(*type) + "'" : "a " + std::string(node_kind_name(node(p[1]).kind))) +
                 " (expected a torch storage type such as torch.FloatStorage)");
    }
    const Node key = expect(p[2], NodeKind::kString, "a persistent id's key");
    if (key.text.size == 0 || key.text.size > 256) {
      throw fail("a storage key of " + std::to_string(key.text.size) +
                 " bytes (expected 1 to 256)");
    }
    const Node loc = expect(p[3], NodeKind::kString, "a persistent id's location");
    const Node& numel = expect(p[4], NodeKind::kInt, "a persistent id's numel");
    if (numel.integer < 0) throw fail("storage '" + printable(text(p[2])) + "' has numel " +
                                      std::to_string(numel.integer));
    Node s;
    s.kind = NodeKind::kStorage;
    s.ref = node(p[1]).ref;
    s.text = key.text;
    s.items = {loc.text.at, std::min<std::uint32_t>(loc.text.size, 256)};
    s.integer = numel.integer;
    return add(std::move(s));
  }

  void put(std::uint64_t index) {
    const std::uint32_t v = top();
    // Picklers number entries from 0 up; a gap past a few would let a few bytes of input claim
    // much memory, and goes to the map instead.
    const bool dense = index < memo_.size() + 16;
    const bool fresh = dense ? index >= memo_.size() || memo_[index] == kNoNode
                             : !memo_far_.count(index);
    if (fresh && memo_count_ >= max_values_) {
      throw fail("more than " + format_count(max_values_) + " memo entries");
    }
    memo_count_ += fresh ? 1 : 0;
    if (!dense) {
      memo_far_[index] = v;
      return;
    }
    if (index >= memo_.size()) memo_.resize(index + 1, kNoNode);
    memo_[index] = v;
  }
  void get(std::uint64_t index) {
    if (index < memo_.size() && memo_[index] != kNoNode) return push(memo_[index]);
    auto it = memo_far_.find(index);
    if (it == memo_far_.end()) throw fail("memo entry " + std::to_string(index) + " was never stored");
    push(it->second);
  }

  // One opcode; true at STOP.
  bool step() {
    switch (op_) {
      case '(':
        if (marks_.size() >= kMaxTorchValues) throw fail("too many MARKs");
        marks_.push_back(stack_.size());
        return false;
      case '.':
        g_.root = pop();
        return true;
      case '0':
        if (stack_.size() > base()) stack_.pop_back();
        else (void)pop_mark();
        return false;
      case '1': (void)pop_mark(); return false;
      case '2': push(top()); return false;
      case 'N': push(none_); return false;
      case 0x88: push(true_); return false;
      case 0x89: push(false_); return false;
      case 'I': {
        std::string_view t = line();
        if (t == "01") push(true_);
        else if (t == "00") push(false_);
        else push(make_int(parse_int(t)));
        return false;
      }
      case 'L': push(make_int(parse_int(line()))); return false;
      case 'J': push(make_int(static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4))))); return false;
      case 'K': push(make_int(static_cast<std::int64_t>(le(1)))); return false;
      case 'M': push(make_int(static_cast<std::int64_t>(le(2)))); return false;
      case 0x8a: {
        const std::uint64_t n = le(1);
        push(make_int(parse_long(bytes(n))));
        return false;
      }
      case 0x8b: {
        const std::int64_t n = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4)));
        if (n < 0) throw fail("negative length " + std::to_string(n));
        push(make_int(parse_long(bytes(static_cast<std::uint64_t>(n)))));
        return false;
      }
      case 'F': {
        std::string_view t = line();
        double v = 0;
        auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
        if (t.empty() || ec != std::errc() || p != t.data() + t.size()) {
          throw fail("'" + printable(t) + "' is not a float");
        }
        Node n;
        n.kind = NodeKind::kFloat;
        n.real = v;
        push(add(std::move(n)));
        return false;
      }
      case 'G': {
        need(8);
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = bits << 8 | d_[pos_ + static_cast<std::size_t>(i)];
        pos_ += 8;
        Node n;
        n.kind = NodeKind::kFloat;
        n.real = std::bit_cast<double>(bits);
        push(add(std::move(n)));
        return false;
      }
      case 'T': {
        const std::int64_t n = static_cast<std::int32_t>(static_cast<std::uint32_t>(le(4)));
        if (n < 0) throw fail("negative length " + std::to_string(n));
        push(make_text(NodeKind::kString, utf8(bytes(static_cast<std::uint64_t>(n)))));
        return false;
      }
      case 'U': push(make_text(NodeKind::kString, utf8(bytes(le(1))))); return false;
      case 'X': push(make_text(NodeKind::kString, utf8(bytes(le(4))))); return false;
      case 0x8c: push(make_text(NodeKind::kString, utf8(bytes(le(1))))); return false;
      case 0x8d: push(make_text(NodeKind::kString, utf8(bytes(le(8))))); return false;
      case 'B': push(make_text(NodeKind::kBytes, bytes(le(4)))); return false;
      case 'C': push(make_text(NodeKind::kBytes, bytes(le(1)))); return false;
      case 0x8e: push(make_text(NodeKind::kBytes, bytes(le(8)))); return false;
      case 0x96: push(make_text(NodeKind::kBytes, bytes(le(8)))); return false;
      case ']': push(make_seq(NodeKind::kList, {})); return false;
      case ')': push(make_seq(NodeKind::kTuple, {})); return false;
      case '}': push(make_seq(NodeKind::kDict, {})); return false;
      case 0x8f: push(make_seq(NodeKind::kList, {}, Tag::kSet)); return false;
      case 'l': push(make_seq(NodeKind::kList, pop_mark())); return false;
      case 't': push(make_seq(NodeKind::kTuple, pop_mark())); return false;
      case 0x85: {
        const std::uint32_t a = pop();
        push(make_seq(NodeKind::kTuple, {a}));
        return false;
      }
      case 0x86: {
        const std::uint32_t b = pop(), a = pop();
        push(make_seq(NodeKind::kTuple, {a, b}));
        return false;
      }
      case 0x87: {
        const std::uint32_t c = pop(), b = pop(), a = pop();
        push(make_seq(NodeKind::kTuple, {a, b, c}));
        return false;
      }
      case 0x91: {
        const std::vector<std::uint32_t>& items = pop_mark();
        const std::uint32_t s = make_seq(NodeKind::kList, {}, Tag::kSet);
        for (std::uint32_t i : items) add_to_set(s, i);
        node(s).tag = Tag::kFrozenSet;
        push(s);
        return false;
      }
      case 'd': {
        const std::vector<std::uint32_t>& items = pop_mark();
        if (items.size() % 2 != 0) throw fail("an odd number of items for key, value pairs");
        const std::uint32_t d = make_seq(NodeKind::kDict, {});
        for (std::size_t i = 0; i < items.size(); i += 2) set_item(d, items[i], items[i + 1]);
        push(d);
        return false;
      }
      case 'a': {
        const std::uint32_t v = pop();
        append(top(), v);
        return false;
      }
      case 'e': {
        const std::vector<std::uint32_t>& items = pop_mark();
        const std::uint32_t l = top();
        for (std::uint32_t i : items) append(l, i);
        return false;
      }
      case 0x90: {
        const std::vector<std::uint32_t>& items = pop_mark();
        const std::uint32_t s = top();
        for (std::uint32_t i : items) add_to_set(s, i);
        return false;
      }
      case 's': {
        const std::uint32_t v = pop(), k = pop();
        set_item(top(), k, v);
        return false;
      }
      case 'u': {
        const std::vector<std::uint32_t>& items = pop_mark();
        if (items.size() % 2 != 0) throw fail("an odd number of items for key, value pairs");
        const std::uint32_t d = top();
        for (std::size_t i = 0; i < items.size(); i += 2) set_item(d, items[i], items[i + 1]);
        return false;
      }
      case 'g': {
        get(static_cast<std::uint64_t>(parse_int(line())));
        return false;
      }
      case 'h': get(le(1)); return false;
      case 'j': get(le(4)); return false;
      case 'p': {
        const std::int64_t i = parse_int(line());
        if (i < 0) throw fail("negative memo index");
        put(static_cast<std::uint64_t>(i));
        return false;
      }
      case 'q': put(le(1)); return false;
      case 'r': put(le(4)); return false;
      case 0x94: put(memo_count_); return false;
      case 'c': {
        const std::string module(line());
        const std::string_view name = line();
        push(resolve(module, name));
        return false;
      }
      case 0x93: {
        const std::uint32_t name = pop(), module = pop();
        expect(name, NodeKind::kString, "STACK_GLOBAL's name");
        expect(module, NodeKind::kString, "STACK_GLOBAL's module");
        push(resolve(text(module), text(name)));
        return false;
      }
      case 'R': {
        const std::uint32_t args = pop(), fn = pop();
        push(call(fn, args));
        return false;
      }
      case 0x81: {
        const std::uint32_t args = pop(), cls = pop();
        push(new_object(cls, args));
        return false;
      }
      case 0x92: {
        const std::uint32_t kwargs = pop(), args = pop(), cls = pop();
        const Node& k = expect(kwargs, NodeKind::kDict, "NEWOBJ_EX's keyword arguments");
        if (k.items.size != 0) throw fail("keyword arguments to a constructor (none allowed)");
        push(new_object(cls, args));
        return false;
      }
      case 'b': {
        const std::uint32_t state = pop();
        build(top(), state);
        return false;
      }
      case 'Q': push(persistent(pop())); return false;
      case 0x80: {
        const std::uint64_t v = le(1);
        if (v > 5) throw fail("protocol " + std::to_string(v) + " (this reader knows 0 to 5)");
        g_.protocol = v;
        return false;
      }
      case 0x95: {
        const std::uint64_t n = le(8);
        if (n > d_.size() - pos_) {
          throw fail("a frame of " + std::to_string(n) + " bytes, but " +
                     std::to_string(d_.size() - pos_) + " are left (truncated data.pkl)");
        }
        return false;
      }
      default:
        break;
    }
    const char* name = opcode_name(op_);
    if (name != nullptr) {
      throw fail(std::string("opcode ") + name +
                 " is refused: it needs code, an extension registry or out-of-band data, or is a "
                 "text form torch.save never writes");
    }
    static const char* digits = "0123456789abcdef";
    throw fail_plain(std::string("unknown opcode 0x") + digits[op_ >> 4] + digits[op_ & 0xf] +
                     " (not a pickle of protocol 0 to 5, or a corrupt data.pkl)");
  }

  std::span<const unsigned char> d_;
  const std::string& src_;
  Scope scope_;
  std::size_t pos_ = 0;
  std::size_t at_ = 0;
  unsigned char op_ = 0;
  PickleGraph g_;
  std::vector<std::uint32_t> stack_;
  std::vector<std::size_t> marks_;
  std::uint64_t max_values_;
  std::vector<std::uint32_t> marked_;  // pop_mark's items
  // The memo: dense from 0 as picklers number it; an index far past the end goes to memo_far_.
  std::vector<std::uint32_t> memo_;
  std::unordered_map<std::uint64_t, std::uint32_t> memo_far_;
  std::uint64_t memo_count_ = 0;
  std::vector<HeldKey> held_;
  std::size_t held_count_ = 0;
  std::unique_ptr<IntSlot[]> ints_;
  std::unordered_set<std::string> named_;  // the globals named so far (at most 1000 listed)
  std::uint64_t refs_ = 0;
  std::uint64_t text_ = 0;
  std::uint64_t key_work_ = 0;
  std::uint32_t none_ = 0, true_ = 0, false_ = 0, empty_tuple_ = kNoNode;
};

}  // namespace

std::string_view node_kind_name(NodeKind k) {
  switch (k) {
    case NodeKind::kNone: return "None";
    case NodeKind::kBool: return "bool";
    case NodeKind::kInt: return "int";
    case NodeKind::kFloat: return "float";
    case NodeKind::kString: return "str";
    case NodeKind::kBytes: return "bytes";
    case NodeKind::kList: return "list";
    case NodeKind::kTuple: return "tuple";
    case NodeKind::kDict: return "dict";
    case NodeKind::kGlobal: return "global";
    case NodeKind::kStorage: return "storage";
    case NodeKind::kTensor: return "tensor";
    case NodeKind::kObject: return "object";
    case NodeKind::kEnum: return "enum member";
  }
  return "?";
}

std::span<const AllowedGlobal> allowed_globals() { return kAllowed; }

std::string_view tag_name(Tag t) noexcept {
  switch (t) {
    case Tag::kPlain: return "";
    case Tag::kSet: return "set";
    case Tag::kFrozenSet: return "frozenset";
    case Tag::kSize: return "torch.Size";
    case Tag::kOrderedDict: return "collections.OrderedDict";
  }
  return "";
}

std::uint64_t max_pickle_values(Scope scope) noexcept {
  return scope == kDcpMetadata ? kMaxDcpIndexValues : kMaxTorchValues;
}

std::span<const EnumMember> enum_members(const AllowedGlobal& cls) {
  if (cls.role == R::kEnum && std::string_view(cls.name) == "ZeroStageEnum") return kZeroStages;
  if (cls.role == R::kEnum && (std::string_view(cls.name) == "_MEM_FORMAT_ENCODING" ||
                                std::string_view(cls.name) == "MEM_FORMAT_ENCODING")) {
    return kMemFormats;
  }
  return {};
}

std::uint64_t torch_dtype_size(std::string_view dtype) noexcept {
  for (const DtypeSize& d : kDtypeSizes) {
    if (dtype == d.name) return d.size;
  }
  return 0;
}

PickleGraph run_pickle(std::span<const unsigned char> data, const std::string& source,
                       Scope scope) {
  return Machine(data, source, scope).run();
}

const char* scope_name(unsigned scopes) noexcept {
  switch (scopes) {
    case kTorchSave: return "torch.save files";
    case kDcpMetadata: return "DCP .metadata";
    case kDcpValue: return "DCP values";
    case kTorchSave | kDcpValue: return "torch.save files and DCP values";
    case kDcpMetadata | kDcpValue: return "DCP .metadata and DCP values";
    case kTorchSave | kDcpMetadata: return "torch.save files and DCP .metadata";
    default: return "torch.save files, DCP .metadata and DCP values";
  }
}

}  // namespace zeroflat::detail
