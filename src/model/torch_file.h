// torch.save files read without running them: every tensor's place in the saved state, dtype,
// shape, strides, storage offset and byte range in the file, from the zip directory and the
// pickle alone (no tensor data is read).
//
// Private: the public checkpoint classes (deepspeed_checkpoint.h, dcp_checkpoint.h) describe
// their tensors and byte ranges, not the parsed files. Besides the library, only `zeroflat
// inspect` (which prints a file's state) and the Python binding (which makes Python values of
// one) include it (tests/layers_check.cmake holds them to that).
//
// The format (torch 1.6 and later): a zip archive whose entries are all STORED (uncompressed),
// inside one folder ARCHIVE (the first path component: the file's stem, "archive", ...):
// ARCHIVE/data.pkl (a pickle of the saved object, protocol 2), ARCHIVE/data/KEY (storage KEY's
// raw bytes), ARCHIVE/byteorder ("little"), ARCHIVE/version, ARCHIVE/.format_version,
// ARCHIVE/.storage_alignment. A tensor in the pickle is torch._utils._rebuild_tensor_v2(storage,
// storage_offset, size, stride, requires_grad, hooks), its storage a persistent id
// ('storage', torch.<Type>Storage, KEY, location, numel).
//
// torch.load(weights_only=False), which DeepSpeed uses, unpickles data.pkl and so runs whatever
// code the file names. This reader runs none. Its contract:
//   - Nothing is executed or imported. A global (GLOBAL, STACK_GLOBAL) resolves only against
//     the allow-list below (torch_allowed_globals(), one table in the code); any other is
//     InvalidArgument naming "module name" and the file.
//   - REDUCE, NEWOBJ, NEWOBJ_EX and BUILD act only on allowed globals, each only as its row
//     says; persistent ids (BINPERSID) only as torch's storage tuples above. The opcodes of
//     protocols 0 to 5 that need neither code nor out-of-band data are read; any other (PERSID,
//     INST, OBJ, EXT1/2/4, NEXT_BUFFER, READONLY_BUFFER, STRING, UNICODE) is InvalidArgument
//     naming the opcode and its offset.
//   - Everything is bounded (constants below): data.pkl's size, zip entries, values in the
//     state (shared references counted at each place they appear), nesting depth (a state
//     that refers to itself hits it), text bytes, dimensions. Integers beyond 64 bits are
//     refused. Hostile input cannot exhaust memory or recurse without limit.
//   - The archive is checked before it is believed (InvalidArgument naming the file and the
//     entry): truncated archive, bad signatures, compressed or encrypted entries, overlapping
//     entries or entries outside the file, a big-endian byteorder, no data.pkl, a storage the
//     pickle names but the archive lacks, a storage entry shorter than numel * element size,
//     one storage key given two dtypes or sizes, a tensor whose (storage_offset, size, stride)
//     reaches outside its storage, negative sizes or strides. The legacy non-zip format (torch
//     before 1.6) is refused with a message saying so.
//
// The allow-list (module, name: what it may do):
//   torch._utils _rebuild_tensor_v2      called: a tensor (storage, offset, size, stride,
//                                        requires_grad, hooks[, metadata])
//   torch._utils _rebuild_tensor         called: a tensor (older torch: storage, offset, size,
//                                        stride)
//   torch._tensor _rebuild_from_type_v2  called with _rebuild_tensor_v2, torch.Tensor, its
//                                        arguments and a dict of Python attributes: the tensor
//                                        (DeepSpeed's Stage 3 tensors carry ds_id); the
//                                        attributes are dropped
//   torch Tensor                         only as _rebuild_from_type_v2's type
//   torch._utils _rebuild_parameter      called: an nn.Parameter saved as itself, its tensor
//   torch FloatStorage, DoubleStorage, HalfStorage, BFloat16Storage, LongStorage, IntStorage,
//     ShortStorage, CharStorage, ByteStorage, BoolStorage, UntypedStorage
//                                        only inside a storage persistent id: its dtype
//   torch Size                           called with a tuple of ints: a tuple, type "torch.Size"
//   torch device                         called with a type and an index: an object
//   collections OrderedDict              called with nothing or a list of pairs: a dict, type
//                                        "collections.OrderedDict"; BUILD may give it a dict of
//                                        attributes (torch's state dicts carry _metadata)
//   __builtin__ set, builtins set, __builtin__ frozenset, builtins frozenset
//                                        called with nothing or a list: a list, type "set" or
//                                        "frozenset" (DeepSpeed before 0.19 saves
//                                        sparse_tensor_module_names as a set)
//   torch float16, bfloat16, float32     only as values, kind kGlobal (DynamicLossScaler's
//                                        dtype)
//   _codecs encode                       only encode(text, 'latin1'): bytes, as protocol 2
//                                        writes them
//   __builtin__ bytes, builtins bytes    only bytes(): empty bytes, as protocol 2 writes them
//   __builtin__ getattr, builtins getattr
//                                        only getattr(<an allowed enum>, "<member>"): how
//                                        Python 3.11+ pickles an enum member
//   deepspeed.runtime.zero.config ZeroStageEnum
//                                        an enum: getattr by name, or called with a value
//   deepspeed.utils.tensor_fragment fragment_address
//                                        an object (NEWOBJ + BUILD): numel, start
//   deepspeed.runtime.fp16.loss_scaler LossScaler, DynamicLossScaler
//                                        an object (NEWOBJ + BUILD): the loss scaler's state
// DCP's .metadata (read by dcp_checkpoint.h, never by read_torch_file; those rows resolve there
// only, and a torch.save file naming one is refused as off the list):
//   torch.distributed.checkpoint.metadata Metadata, TensorStorageMetadata,
//     BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex, StorageMeta
//                                        an object (NEWOBJ + BUILD of its fields)
//   torch.distributed.checkpoint.metadata TensorProperties
//                                        an object whose state is a tuple (dtype, layout,
//                                        requires_grad, memory_format, pin_memory[, strides])
//   torch.distributed.checkpoint.metadata _MEM_FORMAT_ENCODING
//                                        an enum (getattr by member name)
//   torch.distributed.checkpoint.filesystem _StorageInfo
//                                        an object: relative_path, offset, length
//   torch.serialization _get_layout      only _get_layout('torch.strided'): that name
//   pathlib PosixPath, pathlib._local PosixPath
//                                        called with strings: the joined path, a string
//   torch Size, builtins getattr, torch float16/bfloat16/float32 (both kinds of file);
//   torch float64, int64, int32, int16, int8, uint8, bool (as values)
// Only the rows whose role is "only as values" (the dtypes) may stand in the state as a global
// itself (kind kGlobal); a class or function of the list named there without being called is
// InvalidArgument, as is any global off the list.
//
// What a checkpoint can make a caller build (torch_global_of, TorchMake): the globals of kind
// kGlobal above as they are, members of an allowed enum by a name checked against the enum's
// members, torch.device from a checked type string and index, and instances of the three
// DeepSpeed classes made without calling their code (cls.__new__, then the saved attributes
// set). A dict from the file is only ever a dict: no key or value of it names code.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat {

// The largest data.pkl read.
inline constexpr std::uint64_t kMaxTorchPickleBytes = std::uint64_t{256} << 20;
// The most values a saved state may hold (each container, scalar, key and tensor counts; a
// value referred to from several places counts at each).
inline constexpr std::uint64_t kMaxTorchValues = 4'000'000;
// The deepest nesting of containers (a dict in a list in a dict ... ).
inline constexpr std::uint64_t kMaxTorchDepth = 100;
// The most bytes of text (strings, bytes, keys) a saved state may hold, counted as values are.
inline constexpr std::uint64_t kMaxTorchTextBytes = std::uint64_t{256} << 20;
// The most dimensions of a tensor.
inline constexpr std::uint64_t kMaxTorchDims = 64;

enum class TorchKind : std::uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kBytes,
  kList,
  kTuple,
  kDict,
  kTensor,   // integer: index into TorchFile::tensors
  kStorage,  // a storage saved as itself; integer: index into TorchFile::storages
  kObject,   // an instance of an allowed class: text its class, items its arguments, entries
             // its state (the dict BUILD set)
  kEnum,     // an enum member: text "module.Class.member", integer its value
  kGlobal,   // an allowed global used as a value: text "module.name"
};

// How a value of kind kObject, kEnum or kGlobal is made into a live object by a caller that
// makes one (the Python binding); nothing else may be made. One per row of the allow-list.
enum class TorchMake : std::uint8_t {
  kNever,     // never a value of the state (tensor rebuilders, storage types, containers' types:
              // the reader turns them into plain values itself)
  kGlobal,    // the global as it is (a dtype)
  kMember,    // a member of the enum class, by its name (TorchValue::member(), checked)
  kCall,      // the class called with the value's arguments, which the reader checked (torch.device)
  kInstance,  // cls.__new__(cls, *arguments), then the saved state set as attributes: no
              // constructor, __setstate__ or other code of the class runs
};

// One row of the allow-list.
struct TorchGlobal {
  std::string module;
  std::string name;
  TorchMake make = TorchMake::kNever;
  std::string does;    // what the reader lets it do
  std::string reason;  // why it is on the list
  std::string files;   // where a file may name it: "torch.save files", "DCP .metadata", or both
};

// The allow-list, in the reader's order: the one list of what a file may name, with reasons.
const std::vector<TorchGlobal>& torch_globals();

// "none", "bool", "int", "float", "string", "bytes", "list", "tuple", "dict", "tensor",
// "storage", "object", "enum", "global".
std::string_view torch_kind_name(TorchKind kind) noexcept;

struct TorchEntry;

// One value of the saved state: a tree (shared references are copied at each place).
struct TorchValue {
  TorchKind kind = TorchKind::kNone;
  bool boolean = false;
  std::int64_t integer = 0;
  double real = 0;
  // kString, kBytes: the text or bytes. kObject, kEnum, kGlobal: see TorchKind. kTuple, kDict,
  // kList: the type when it is not the plain one ("torch.Size", "collections.OrderedDict",
  // "set", "frozenset"), else empty.
  std::string text;
  // kList, kTuple: the items. kObject: its arguments. kDict: empty, or one dict, the
  // attributes an OrderedDict was saved with (torch's state dicts: _metadata).
  std::vector<TorchValue> items;
  std::vector<TorchEntry> entries;  // kDict, kObject: in saved order
  // kObject, kEnum, kGlobal: its row of torch_globals() (the reader's; never text of the file).
  std::uint32_t global = UINT32_MAX;

  bool is_sequence() const noexcept {
    return kind == TorchKind::kList || kind == TorchKind::kTuple;
  }
  // The entry of a kDict or kObject whose key is the string `key`, or null (also for other
  // kinds). O(entries).
  const TorchValue* get(std::string_view key) const noexcept;
  // kEnum: the member's name ("gradients"); else empty.
  std::string_view member() const noexcept;
};

// A key and its value (a struct of its own, not std::pair: a pair of the incomplete TorchValue
// inside TorchValue is refused by some standard libraries' compilers).
struct TorchEntry {
  TorchValue first;
  TorchValue second;
};

// One path segment for a dict key: a string as it is, with '%' and '/' written %25 and %2F;
// an int in decimal; None, True, False; a float as Python's repr would (shortest round trip);
// bytes as b'..' (printable ASCII, other bytes \xNN); a tuple as (a, b) of its items' segments;
// an enum member as its member's name.
std::string torch_path_segment(const TorchValue& key);

// A tensor of the saved state. Its elements are storage elements storage_offset + sum(i_d *
// stride[d]) for 0 <= i_d < shape[d].
struct TorchTensor {
  // Its place in the state: dict keys (torch_path_segment), list and tuple indices, an
  // object's state keys, "__args__/i" for an object's arguments, "__attrs__" for a dict's
  // attributes, joined by '/' ("optimizer_state_dict/base_optimizer_state/state/0/exp_avg");
  // "" when the state is the tensor itself.
  std::string path;
  std::string dtype;          // zeroflat's name where it has one ("bf16", "fp16", "fp32"), else
                              // torch's ("float64", "int64", "int32", "int16", "int8", "uint8",
                              // "bool", "complex64", "complex128")
  std::optional<DType> type;  // zeroflat's dtype, when it is one
  std::uint64_t element_size = 0;  // bytes
  Shape shape;
  std::vector<std::int64_t> stride;  // in elements, one per dimension, never negative
  std::uint64_t storage_offset = 0;  // in elements
  std::uint64_t storage = 0;         // index into TorchFile::storages
  std::uint64_t numel = 0;
  bool requires_grad = false;
  // torch's is_contiguous(): row-major strides (dimensions of size 1 aside), or no element.
  bool contiguous = false;
  // File offset of its first element (storage's offset + storage_offset * element_size).
  std::uint64_t offset = 0;
  // Contiguous: numel * element_size, its elements being bytes [offset, offset + bytes) of the
  // file. Not contiguous: 0 (read extent_bytes and pick the elements by the strides).
  std::uint64_t bytes = 0;
  // Bytes from its first element to the end of its last (numel * element_size when
  // contiguous; 0 for no element).
  std::uint64_t extent_bytes = 0;
};

// A storage of the archive: ARCHIVE/data/KEY.
struct TorchStorage {
  std::string key;       // "0", "1", ...
  std::string dtype;     // as TorchTensor::dtype; "uint8" for an UntypedStorage
  std::optional<DType> type;
  std::uint64_t element_size = 0;
  std::uint64_t numel = 0;  // elements of dtype, as the pickle declares
  std::string location;     // where it was saved from: "cpu", "cuda:0", ...
  std::string entry;        // "ARCHIVE/data/KEY"
  std::uint64_t offset = 0; // of its first byte in the file
  std::uint64_t bytes = 0;  // numel * element_size (the entry holds at least that many)
};

struct TorchFile {
  std::string path;              // as given (for bytes in memory: the source name)
  std::uint64_t file_bytes = 0;
  FileStamp stamp;               // read_torch_file: the file as it was read (parse: not known)
  std::string archive;           // the folder every entry lies in
  std::string byteorder;         // "little" (a file without the entry is taken as little)
  std::string version;           // ARCHIVE/version, trimmed; empty when absent
  std::uint64_t storage_alignment = 0;  // ARCHIVE/.storage_alignment; 0 when absent
  std::uint64_t pickle_bytes = 0;       // data.pkl's size
  std::uint64_t protocol = 0;           // the pickle protocol (PROTO), 0 when not given
  std::vector<std::string> globals;     // the globals the pickle named, "module name", in the
                                        // order first named
  TorchValue root;
  std::vector<TorchTensor> tensors;     // in the state's order (depth first, as saved); a
                                        // tensor referred to from two places is listed twice
  std::vector<TorchStorage> storages;   // the storages the tensors use, by key (numerically
                                        // when keys are numbers)

  // The value at `path` (TorchTensor::path's syntax; "" is the root), or null.
  const TorchValue* find(std::string_view path) const;
  // The same; throws InvalidArgument naming the file and the path, and which segment is
  // missing, when there is none.
  const TorchValue& at(std::string_view path) const;
  // Typed reads of `path`: InvalidArgument naming the file, the path, the kind expected and the
  // kind found. int_at takes an int, a bool, or an enum member (its value).
  std::int64_t int_at(std::string_view path) const;
  double float_at(std::string_view path) const;  // a float or an int
  const std::string& string_at(std::string_view path) const;
  const std::vector<TorchValue>& list_at(std::string_view path) const;  // a list or a tuple
  const TorchTensor& tensor_at(std::string_view path) const;
  // A list or tuple of ints (a torch.Size among them) as a shape.
  Shape shape_at(std::string_view path) const;
  // The tensor at `path`, or null when there is none or it is another kind.
  const TorchTensor* find_tensor(std::string_view path) const;
};

// Reads a torch.save file: its zip directory, its small entries and data.pkl, never a storage's
// bytes. Throws InvalidArgument (naming the file and the entry, global, opcode or path) as the
// contract above says.
TorchFile read_torch_file(const std::string& path);

// The same from the whole file held in memory; `source` names it in errors (the fuzzer's door).
TorchFile parse_torch_file(std::span<const unsigned char> bytes, const std::string& source);

// Whether `path` is a regular file that starts as a torch.save file does: a zip archive's local
// header, or a pickle's PROTO 2 to 5 (the legacy format, which read_torch_file refuses, saying
// why) that is not a safetensors header (a length beginning 0x80 02, then '{'). Reads at most 9
// bytes; never blocks (files.h) and never throws.
bool is_torch_file(const std::string& path) noexcept;

// The elements of tensor t of file f (one of f.tensors), in row-major order, element_size bytes
// each, read from f.path (a tensor that is not contiguous is gathered by its strides). For the
// small values of a state (steps, a scheduler's numbers), not for partitions: more than
// max_bytes of extent, or of elements (an expanded tensor yields more than it spans), is
// InvalidArgument. Throws InvalidArgument naming the file and the
// tensor's path when the file is shorter or the read fails.
std::vector<unsigned char> read_torch_tensor(const TorchFile& f, const TorchTensor& t,
                                             std::uint64_t max_bytes = std::uint64_t{1} << 30);
// The same from the whole file held in memory (parse_torch_file's bytes).
std::vector<unsigned char> read_torch_tensor(const TorchFile& f, const TorchTensor& t,
                                             std::span<const unsigned char> file_bytes,
                                             std::uint64_t max_bytes = std::uint64_t{1} << 30);

// The allow-list, one row per global: "module name: why it is on the list".
std::vector<std::string> torch_allowed_globals();

// The row of torch_globals() that a value of kind kObject, kEnum or kGlobal names, checked
// against its kind (a kGlobal's row makes kGlobal, a kEnum's kMember, a kObject's kCall or
// kInstance); null for any other value, or one whose row does not fit its kind.
const TorchGlobal* torch_global_of(const TorchValue& v) noexcept;

}  // namespace zeroflat
