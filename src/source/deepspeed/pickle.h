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
};

struct AllowedGlobal {
  const char* module;
  const char* name;
  GlobalRole role;
  const char* dtype;   // kStorage: torch's dtype name of its elements
  const char* reason;  // one line: why it is on the list
};

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
  kList,     // tag: "" or "set", "frozenset"
  kTuple,    // tag: "" or "torch.Size"
  kDict,     // tag: "" or "collections.OrderedDict"; items: key, value, key, value, ...;
             // state: an OrderedDict's attributes set by BUILD (a dict node), or kNoNode
  kGlobal,   // ref: allow-list row
  kStorage,  // ref: the storage type's row; text: key; text2: location; integer: numel
  kTensor,   // ref: the storage node; integer: storage offset; dims: size then stride;
             // flag: requires_grad
  kObject,   // ref: the class's row; items: arguments; state: BUILD's dict node (or kNoNode)
  kEnum,     // ref: the enum's row; integer: value; text: member name
};

struct Node {
  NodeKind kind = NodeKind::kNone;
  bool flag = false;
  std::int64_t integer = 0;
  double real = 0;
  std::uint32_t ref = kNoNode;
  std::uint32_t state = kNoNode;
  std::string text;
  std::string text2;
  std::string_view tag;  // static text
  std::vector<std::uint32_t> items;
  std::vector<std::int64_t> dims;
};

struct PickleGraph {
  std::vector<Node> nodes;
  std::uint32_t root = kNoNode;
  std::uint64_t protocol = 0;
  std::vector<std::string> globals;  // "module name", in the order first named
};

// Runs the pickle `data`. Throws InvalidArgument naming `source` (the file and entry), the
// offset and the opcode: truncated input, an opcode it refuses, a global off the list, a call,
// persistent id or BUILD the list does not allow, malformed arguments, a stack or mark
// underflow, a memo index never stored, integers beyond 64 bits, more than kMaxTorchValues
// nodes or memo entries, a dict with an unhashable or repeated key, input after STOP or no STOP.
PickleGraph run_pickle(std::span<const unsigned char> data, const std::string& source);

}  // namespace zeroflat::detail
