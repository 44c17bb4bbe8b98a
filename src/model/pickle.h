// A pickle machine that executes nothing: the opcodes build a graph of plain values, and the
// few globals of the allow-list (torch_file.h) act only as their row says.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace zeroflat::detail {

// What an allowed global may do (torch_file.h lists them with their reasons).
enum class GlobalRole : std::uint8_t {
  kRebuildTensorV2,  // called: a tensor
  kRebuildTensor,    // called: a tensor (older torch)
  kRebuildFromType,  // called with kRebuildTensorV2, kTensorType, args, attributes: a tensor
  kTensorType,       // torch.Tensor: only as kRebuildFromType's type
  kRebuildParameter, // called with a tensor: that tensor
  kStorage,          // only in a storage persistent id: its dtype
  kSize,             // called with a tuple of ints: a tuple "torch.Size"
  kDevice,           // called: an object "torch.device"
  kOrderedDict,      // called with () or a list of pairs: a dict
  kGetattr,          // called with an enum class and a member name: that member
  kEnum,             // an enum class: getattr'd by name, or called with a value
  kObject,           // a class: NEWOBJ/REDUCE make an instance, BUILD sets its state dict
  kSet,              // called with nothing or a list: a set (a list tagged "set")
  kValue,            // only as a value (a dtype): never called
  kEncode,           // _codecs.encode(text, 'latin1') and bytes(): bytes, as protocol 2 writes
  kStateObject,      // a class whose saved state is a tuple (DCP's TensorProperties): NEWOBJ
                     // makes an instance, BUILD keeps the tuple as its state
  kLayout,           // torch.serialization._get_layout('torch.strided'): the string
  kPath,             // pathlib's PosixPath called with its parts: the path, as a string
};

// The files a row may be named in: the scopes run_pickle is asked to read.
enum Scope : unsigned {
  kTorchSave = 1,    // torch.save archives' data.pkl (DeepSpeed's checkpoints)
  kDcpMetadata = 2,  // a DCP checkpoint's .metadata (pickle.dump of its Metadata)
  kDcpValue = 4,     // a DCP bytes item: a torch.save archive inside a .distcp file (an
                     // optimizer's hyperparameters): plain values and tensors, none of
                     // DeepSpeed's classes
};

struct AllowedGlobal {
  const char* module;
  const char* name;
  GlobalRole role;
  const char* dtype;   // kStorage: torch's dtype name of its elements
  const char* reason;  // one line: why it is on the list
  unsigned scopes = kTorchSave | kDcpValue;  // where a file may name it
};

// The kinds of file `scopes` names, in words ("torch.save files", "DCP .metadata", "DCP
// values", joined by "and").
const char* scope_name(unsigned scopes) noexcept;

// The allow-list: every global the machine resolves. One table, in pickle.cc.
std::span<const AllowedGlobal> allowed_globals();

// Members of an allowed enum class (role kEnum): name and value.
struct EnumMember {
  const char* name;
  std::int64_t value;
};
std::span<const EnumMember> enum_members(const AllowedGlobal& cls);

// torch's dtype name -> bytes per element, 0 when unknown.
std::uint64_t torch_dtype_size(std::string_view dtype) noexcept;

inline constexpr std::uint32_t kNoNode = UINT32_MAX;

enum class NodeKind : std::uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kBytes,
  kList,     // tag: kPlain, kSet or kFrozenSet
  kTuple,    // tag: kPlain or kSize
  kDict,     // tag: kPlain or kOrderedDict; items: key, value, key, value, ...;
             // state: an OrderedDict's attributes set by BUILD (a dict node), or kNoNode
  kGlobal,   // ref: allow-list row
  kStorage,  // ref: the storage type's row; text: key; location(): location; integer: numel
  kTensor,   // ref: the storage node; integer: storage offset; dims(): size then stride;
             // flag: requires_grad
  kObject,   // ref: the class's row; items: arguments; state: BUILD's dict node (or kNoNode)
  kEnum,     // ref: the enum's row; integer: value; text: member name
};

// What a list, tuple or dict is besides its kind.
enum class Tag : std::uint8_t { kPlain, kSet, kFrozenSet, kSize, kOrderedDict };

// "", "set", "frozenset", "torch.Size", "collections.OrderedDict".
std::string_view tag_name(Tag t) noexcept;

// A run of one of the graph's pools: [at, at + size).
struct Run {
  std::uint32_t at = 0;
  std::uint32_t size = 0;
};

// One value: 40 bytes, its variable parts in the graph's pools, so that an index of millions
// of chunks costs a few hundred bytes per chunk (PickleGraph's accessors read them).
struct Node {
  NodeKind kind = NodeKind::kNone;
  bool flag = false;
  Tag tag = Tag::kPlain;
  std::uint32_t ref = kNoNode;
  std::uint32_t state = kNoNode;
  // Lists, tuples, dicts and objects: their items in `refs`; tensors: size then stride in
  // `dims`; storages: the location in `text`.
  Run items;
  Run text;  // str, bytes, an enum member's name, a storage's key: in `text`
  union {
    std::int64_t integer = 0;
    double real;  // kFloat only
  };
};

// "None", "bool", "int", "float", "str", "bytes", "list", "tuple", "dict", "global", "storage",
// "tensor", "object", "enum member".
std::string_view node_kind_name(NodeKind k);

struct PickleGraph {
  std::vector<Node> nodes;
  std::vector<std::uint32_t> refs;   // the items of containers and objects
  std::vector<std::int64_t> dims;    // tensors' sizes and strides
  std::string text;                  // the bytes of str, bytes, names and keys
  std::uint32_t root = kNoNode;
  std::uint64_t protocol = 0;
  std::vector<std::string> globals;  // "module name", in the order first named

  const Node& node(std::uint32_t i) const { return nodes[i]; }
  // The items of a list, tuple, dict or object (none for any other kind).
  std::span<const std::uint32_t> items(const Node& n) const {
    if (n.kind != NodeKind::kList && n.kind != NodeKind::kTuple && n.kind != NodeKind::kDict &&
        n.kind != NodeKind::kObject) {
      return {};
    }
    return {refs.data() + n.items.at, n.items.size};
  }
  std::span<const std::uint32_t> items(std::uint32_t i) const { return items(nodes[i]); }
  // The text of a str, bytes, enum member or storage key.
  std::string_view text_of(const Node& n) const { return {text.data() + n.text.at, n.text.size}; }
  std::string_view text_of(std::uint32_t i) const { return text_of(nodes[i]); }
  // A storage's location.
  std::string_view location(const Node& n) const {
    if (n.kind != NodeKind::kStorage) return {};
    return {text.data() + n.items.at, n.items.size};
  }
  // A tensor's size then stride.
  std::span<const std::int64_t> dims_of(const Node& n) const {
    if (n.kind != NodeKind::kTensor) return {};
    return {dims.data() + n.items.at, n.items.size};
  }
};

// The most values (nodes), memo entries, stack items and marks a DCP index may make: 32 for each
// of kMaxDcpChunks chunks (DCP pickles a chunk as about 17 values and 27 memo entries;
// dcp_checkpoint.cc checks the two bounds agree).
inline constexpr std::uint64_t kMaxDcpIndexValues = 320'000'000;

// The most values, memo entries, stack items and marks a run of a pickle of `scope` may make:
// kMaxTorchValues for torch.save files and DCP values, kMaxDcpIndexValues for a DCP index.
std::uint64_t max_pickle_values(Scope scope) noexcept;

// Runs the pickle `data`. Throws InvalidArgument naming `source` (the file and entry), the
// offset and the opcode: truncated input, an opcode it refuses, a global off the list, a call,
// persistent id or BUILD the list does not allow, malformed arguments, a stack or mark
// underflow, a memo index never stored, integers beyond 64 bits, more than
// max_pickle_values(scope) nodes or memo entries, a dict with an unhashable or repeated key,
// input after STOP or no STOP. Time and memory are linear in the pickle's size: ints and the
// empty tuple are shared, a container's items grow in one pool, and a repeated key is found by
// hashing (no text is built per key).
// Only the rows whose scopes hold `scope` resolve: a global allowed in another kind of file is
// refused as one off the list (saying where it is allowed).
PickleGraph run_pickle(std::span<const unsigned char> data, const std::string& source,
                       Scope scope = kTorchSave);

}  // namespace zeroflat::detail
