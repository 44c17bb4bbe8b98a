// torch.save files read without running them: archives and pickles built here by hand, valid
// ones listed exactly, hostile ones (foreign globals, compressed or truncated archives, missing
// or short storages, tensors past their storage, deep or self-referring or exploding states,
// huge declared lengths) refused with InvalidArgument naming the file and the entry; a real
// torch.save archive (the fuzz corpus' seed) listed as torch saved it; and the reads of a
// resume at a new world size, against the layouts they come from. Past 700 lines on purpose:
// the hand-built archives and pickles every case needs are built here, by one set of helpers.
#include "model/torch_file.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <filesystem>
#include <fstream>
#include <map>

#include "zeroflat/common.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/layout.h"
#include "zeroflat/resume.h"

namespace zeroflat {
namespace {

namespace fs = std::filesystem;

// ---- a zip writer: STORED entries, optionally with ZIP64 records and extra fields -----------

void put(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

struct Entry {
  std::string name;
  std::string data;
  int method = 0;
};

struct ZipOptions {
  bool zip64 = false;     // ZIP64 end records, and offsets in ZIP64 extra fields
  std::uint64_t align = 0;  // pad local headers' extra fields so data starts aligned
};

std::string zip(const std::vector<Entry>& entries, const ZipOptions& o = {}) {
  std::string out, cd;
  for (const Entry& e : entries) {
    const std::uint64_t header = out.size();
    std::uint64_t extra = 0;
    if (o.align) {
      const std::uint64_t data_at = header + 30 + e.name.size() + 4;
      extra = 4 + (o.align - data_at % o.align) % o.align;
    }
    put(out, 0x04034b50, 4);
    put(out, 20, 2);
    put(out, 0, 2);
    put(out, e.method, 2);
    put(out, 0, 4);  // time, date
    put(out, 0, 4);  // crc (not checked)
    put(out, e.data.size(), 4);
    put(out, e.data.size(), 4);
    put(out, e.name.size(), 2);
    put(out, extra, 2);
    out += e.name;
    if (extra) {
      put(out, 0x4246, 2);  // "FB", as torch writes
      put(out, extra - 4, 2);
      out += std::string(extra - 4, 'Z');
    }
    out += e.data;
    put(cd, 0x02014b50, 4);
    put(cd, 45, 2);
    put(cd, 45, 2);
    put(cd, 0, 2);
    put(cd, e.method, 2);
    put(cd, 0, 4);
    put(cd, 0, 4);
    put(cd, e.data.size(), 4);
    put(cd, e.data.size(), 4);
    put(cd, e.name.size(), 2);
    put(cd, o.zip64 ? 12 : 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 2);
    put(cd, 0, 4);
    put(cd, o.zip64 ? 0xffffffff : header, 4);
    cd += e.name;
    if (o.zip64) {
      put(cd, 0x0001, 2);
      put(cd, 8, 2);
      put(cd, header, 8);
    }
  }
  const std::uint64_t cd_at = out.size();
  out += cd;
  if (o.zip64) {
    const std::uint64_t e64 = out.size();
    put(out, 0x06064b50, 4);
    put(out, 44, 8);
    put(out, 45, 2);
    put(out, 45, 2);
    put(out, 0, 4);
    put(out, 0, 4);
    put(out, entries.size(), 8);
    put(out, entries.size(), 8);
    put(out, cd.size(), 8);
    put(out, cd_at, 8);
    put(out, 0x07064b50, 4);
    put(out, 0, 4);
    put(out, e64, 8);
    put(out, 1, 4);
  }
  put(out, 0x06054b50, 4);
  put(out, 0, 2);
  put(out, 0, 2);
  put(out, o.zip64 ? 0xffff : entries.size(), 2);
  put(out, o.zip64 ? 0xffff : entries.size(), 2);
  put(out, o.zip64 ? 0xffffffff : cd.size(), 4);
  put(out, o.zip64 ? 0xffffffff : cd_at, 4);
  put(out, 0, 2);
  return out;
}

// ---- a pickle builder ------------------------------------------------------------------------

struct Pickle {
  std::string b = "\x80\x02";

  Pickle& op(char c) {
    b += c;
    return *this;
  }
  Pickle& raw(const std::string& s) {
    b += s;
    return *this;
  }
  Pickle& mark() { return op('('); }
  Pickle& global(const std::string& module, const std::string& name) {
    return raw("c" + module + "\n" + name + "\n");
  }
  Pickle& str(const std::string& s) {
    op('X');
    put(b, s.size(), 4);
    return raw(s);
  }
  Pickle& integer(std::int64_t v) {
    if (v >= 0 && v < 256) {
      op('K');
      put(b, static_cast<std::uint64_t>(v), 1);
    } else {
      op('\x8a');
      put(b, 8, 1);
      put(b, static_cast<std::uint64_t>(v), 8);
    }
    return *this;
  }
  Pickle& real(double v) {
    op('G');
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, 8);
    for (int i = 7; i >= 0; --i) b += static_cast<char>((bits >> (8 * i)) & 0xff);
    return *this;
  }
  Pickle& ints(const std::vector<std::int64_t>& v) {
    mark();
    for (std::int64_t x : v) integer(x);
    return op('t');
  }
  Pickle& ordered_dict() { return global("collections", "OrderedDict").op(')').op('R'); }
  // torch._utils._rebuild_tensor_v2 of storage KEY (numel elements of `type`).
  Pickle& tensor(const std::string& key, const std::string& type, std::int64_t numel,
                 std::int64_t offset, const std::vector<std::int64_t>& size,
                 const std::vector<std::int64_t>& stride) {
    global("torch._utils", "_rebuild_tensor_v2").mark();
    mark().str("storage").global("torch", type).str(key).str("cpu").integer(numel).op('t');
    op('Q').integer(offset).ints(size).ints(stride).op('\x89').ordered_dict();
    return op('t').op('R');
  }
  std::string done() const { return b + "."; }
};

// An archive whose data.pkl is `pickle`, with these storages.
std::string archive(const std::string& pickle,
                    const std::map<std::string, std::string>& storages = {},
                    const ZipOptions& o = {}, const std::string& byteorder = "little") {
  std::vector<Entry> e{{"archive/data.pkl", pickle}, {"archive/byteorder", byteorder}};
  for (const auto& [k, v] : storages) e.push_back({"archive/data/" + k, v});
  e.push_back({"archive/version", "3\n"});
  return zip(e, o);
}

TorchFile parse(const std::string& bytes) {
  return parse_torch_file(
      std::span(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()), "test.pt");
}

std::string error_of(const std::string& bytes) {
  try {
    (void)parse(bytes);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "accepted";
}

std::string floats(int n) { return std::string(static_cast<std::size_t>(4 * n), '\x01'); }

// {'a': fp32 [2, 3], 'b': a strided view of the same storage, 'c': [1, 2.5, 'x', None, True],
//  'd': OrderedDict(w=bf16 [4]), 'shape': torch.Size([7, 2])}
std::string valid_pickle() {
  Pickle p;
  p.op('}').mark();
  p.str("a").tensor("0", "FloatStorage", 8, 0, {2, 3}, {3, 1});
  p.str("b").tensor("0", "FloatStorage", 8, 2, {2}, {3});
  p.str("c").op(']').mark().integer(1).real(2.5).str("x").op('N').op('\x88').op('e');
  p.str("d").ordered_dict().str("w").tensor("1", "BFloat16Storage", 4, 0, {4}, {1}).op('s');
  p.str("shape").global("torch", "Size").ints({7, 2}).op('\x85').op('R');
  p.op('u');
  return p.done();
}

std::string valid_archive(const ZipOptions& o = {}) {
  return archive(valid_pickle(), {{"0", floats(8)}, {"1", std::string(8, '\x02')}}, o);
}

TEST(TorchFile, ListsEveryTensorWithItsPlaceAndBytes) {
  for (const ZipOptions& o : {ZipOptions{}, ZipOptions{true, 64}}) {
    const std::string bytes = valid_archive(o);
    const TorchFile f = parse(bytes);
    EXPECT_EQ(f.archive, "archive");
    EXPECT_EQ(f.byteorder, "little");
    EXPECT_EQ(f.version, "3");
    EXPECT_EQ(f.protocol, 2u);
    ASSERT_EQ(f.tensors.size(), 3u);
    ASSERT_EQ(f.storages.size(), 2u);
    const TorchTensor& a = f.tensors[0];
    EXPECT_EQ(a.path, "a");
    EXPECT_EQ(a.dtype, "fp32");
    EXPECT_EQ(a.type, DType::kFP32);
    EXPECT_EQ(a.shape, (Shape{2, 3}));
    EXPECT_EQ(a.stride, (std::vector<std::int64_t>{3, 1}));
    EXPECT_TRUE(a.contiguous);
    EXPECT_EQ(a.numel, 6u);
    EXPECT_EQ(a.bytes, 24u);
    // Its bytes are the storage entry's, which begins where the archive says.
    const std::size_t at = bytes.find(floats(8));
    EXPECT_EQ(a.offset, at);
    EXPECT_EQ(f.storages[0].offset, at);
    if (o.align) EXPECT_EQ(at % o.align, 0u);
    const TorchTensor& b = f.tensors[1];
    EXPECT_EQ(b.path, "b");
    EXPECT_EQ(b.storage_offset, 2u);
    EXPECT_EQ(b.offset, at + 8);
    EXPECT_FALSE(b.contiguous);
    EXPECT_EQ(b.bytes, 0u);
    EXPECT_EQ(b.extent_bytes, 16u);  // elements 2 and 5
    EXPECT_EQ(b.storage, a.storage);
    const TorchTensor& w = f.tensors[2];
    EXPECT_EQ(w.path, "d/w");
    EXPECT_EQ(w.dtype, "bf16");
    EXPECT_EQ(f.storages[w.storage].key, "1");
    EXPECT_EQ(f.storages[w.storage].entry, "archive/data/1");
    // Lookups.
    EXPECT_EQ(f.int_at("c/0"), 1);
    EXPECT_EQ(f.float_at("c/1"), 2.5);
    EXPECT_EQ(f.string_at("c/2"), "x");
    EXPECT_EQ(f.at("c/3").kind, TorchKind::kNone);
    EXPECT_EQ(f.int_at("c/4"), 1);
    EXPECT_EQ(f.list_at("c").size(), 5u);
    EXPECT_EQ(f.shape_at("shape"), (Shape{7, 2}));
    EXPECT_EQ(f.at("shape").text, "torch.Size");
    EXPECT_EQ(f.at("d").text, "collections.OrderedDict");
    EXPECT_EQ(&f.tensor_at("d/w"), &f.tensors[2]);
    EXPECT_EQ(f.find_tensor("c"), nullptr);
    EXPECT_EQ(f.find("nope"), nullptr);
    EXPECT_EQ(f.globals.front(), "torch._utils _rebuild_tensor_v2");
  }
}

TEST(TorchFile, TypedReadsSayWhatTheyExpectedAndFound) {
  const TorchFile f = parse(valid_archive());
  auto message = [&](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const InvalidArgument& e) {
      return e.what();
    }
    return "accepted";
  };
  std::string m = message([&] { (void)f.int_at("c/2"); });
  EXPECT_NE(m.find("test.pt"), std::string::npos) << m;
  EXPECT_NE(m.find("'c/2'"), std::string::npos) << m;
  EXPECT_NE(m.find("expected an int, found string"), std::string::npos) << m;
  m = message([&] { (void)f.at("d/missing/deeper"); });
  EXPECT_NE(m.find("'d' is a dict without 'missing'"), std::string::npos) << m;
  m = message([&] { (void)f.tensor_at("shape"); });
  EXPECT_NE(m.find("expected a tensor, found tuple"), std::string::npos) << m;
}

TEST(TorchFile, PathSegmentsOfOtherKeys) {
  Pickle p;
  p.op('}').mark();
  p.integer(3).integer(30);
  p.str("a/b%").integer(1);
  p.op('N').integer(2);
  p.integer(1).integer(2).op('\x86').integer(4);
  p.op('u');
  const TorchFile f = parse(archive(p.done()));
  EXPECT_EQ(f.int_at("3"), 30);
  EXPECT_EQ(f.int_at("a%2Fb%25"), 1);
  EXPECT_EQ(f.int_at("None"), 2);
  EXPECT_EQ(f.int_at("(1, 2)"), 4);
}

TEST(TorchFile, DeepSpeedObjectsEnumsAndAttributes) {
  Pickle p;
  p.op('}').mark();
  // Python 3.11+: getattr(ZeroStageEnum, 'gradients'); before: ZeroStageEnum(1).
  p.str("stage").global("__builtin__", "getattr").global("deepspeed.runtime.zero.config",
                                                          "ZeroStageEnum");
  p.str("gradients").op('\x86').op('R');
  p.str("old_stage").global("deepspeed.runtime.zero.config", "ZeroStageEnum").integer(1);
  p.op('\x85').op('R');
  p.str("frag").global("deepspeed.utils.tensor_fragment", "fragment_address").op(')').op('\x81');
  p.op('}').mark().str("numel").integer(227).str("start").integer(5).op('u').op('b');
  p.str("scaler").global("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler").op(')');
  p.op('\x81').op('}').mark().str("cur_scale").real(65536.0).str("dtype");
  p.global("torch", "float16").op('u').op('b');
  p.str("module").ordered_dict().str("w").integer(1).op('s');
  p.op('}').str("_metadata").integer(0).op('s').op('b');
  p.str("names").global("__builtin__", "set").op(']').str("x").op('a').op('\x85').op('R');
  p.op('u');
  const TorchFile f = parse(archive(p.done()));
  const TorchValue& stage = f.at("stage");
  EXPECT_EQ(stage.kind, TorchKind::kEnum);
  EXPECT_EQ(stage.member(), "gradients");
  EXPECT_EQ(f.int_at("stage"), 2);
  EXPECT_EQ(f.at("old_stage").member(), "optimizer_states");
  EXPECT_EQ(f.at("frag").kind, TorchKind::kObject);
  EXPECT_EQ(f.at("frag").text, "deepspeed.utils.tensor_fragment.fragment_address");
  EXPECT_EQ(f.int_at("frag/numel"), 227);
  EXPECT_EQ(f.int_at("frag/start"), 5);
  EXPECT_EQ(f.float_at("scaler/cur_scale"), 65536.0);
  EXPECT_EQ(f.at("scaler/dtype").kind, TorchKind::kGlobal);
  EXPECT_EQ(f.at("scaler/dtype").text, "torch.float16");
  EXPECT_EQ(f.int_at("module/w"), 1);
  EXPECT_EQ(f.int_at("module/__attrs__/_metadata"), 0);
  EXPECT_EQ(f.at("names").text, "set");
  EXPECT_EQ(f.string_at("names/0"), "x");
}

TEST(TorchFile, UnknownGlobalIsRefusedByName) {
  for (const auto& [module, name] : std::vector<std::pair<std::string, std::string>>{
           {"os", "system"}, {"builtins", "eval"}, {"torch", "load"},
           {"collections", "defaultdict"}, {"torch._utils", "_rebuild_qtensor"}}) {
    Pickle p;
    p.global(module, name).str("echo hi").op('\x85').op('R');
    const std::string m = error_of(archive(p.done()));
    EXPECT_NE(m.find("'" + module + " " + name + "'"), std::string::npos) << m;
    EXPECT_NE(m.find("test.pt"), std::string::npos) << m;
    EXPECT_NE(m.find("allow-list"), std::string::npos) << m;
  }
  // STACK_GLOBAL (protocol 4) is held to the same list.
  Pickle p;
  p.str("posix").str("system").op('\x93');
  EXPECT_NE(error_of(archive(p.done())).find("'posix system'"), std::string::npos);
}

TEST(TorchFile, AllowedGlobalsActOnlyAsTheirRowSays) {
  auto refused = [](Pickle p, const std::string& expect) {
    const std::string m = error_of(archive(p.done()));
    EXPECT_NE(m.find(expect), std::string::npos) << m;
  };
  // A storage type called, a class instantiated by REDUCE of a function it is not, BUILD on a
  // tensor, getattr on something other than an allowed enum, a persistent id of another kind.
  refused(Pickle().global("torch", "FloatStorage").integer(3).op('\x85').op('R'), "may not be called");
  refused(Pickle().global("torch", "Size").op(')').op('\x81'), "only the allow-list's classes");
  refused(Pickle().global("__builtin__", "getattr").global("torch", "Size").str("__class__")
              .op('\x86').op('R'),
          "may only name a member of an allowed enum");
  refused(Pickle().global("__builtin__", "getattr").global("deepspeed.runtime.zero.config",
                                                             "ZeroStageEnum")
              .str("__init__").op('\x86').op('R'),
          "has no member '__init__'");
  refused(Pickle().mark().str("module").str("os").str("0").str("cpu").integer(1).op('t').op('Q'),
          "persistent id of kind 'module'");
  refused(Pickle().tensor("0", "FloatStorage", 2, 0, {2}, {1}).op('}').op('b'),
          "sets the state of a tensor");
  refused(Pickle().global("torch._tensor", "_rebuild_from_type_v2").mark()
              .global("torch._utils", "_rebuild_tensor_v2").global("torch", "Size").op(')')
              .op('N').op('t').op('R'),
          "must be torch.Tensor");
}

TEST(TorchFile, RefusedOpcodesAreNamed) {
  for (const auto& [bytes, name] : std::vector<std::pair<std::string, std::string>>{
           {"(ios\nsystem\n.", "INST"},
           {"(o.", "OBJ"},
           {"P0\n.", "PERSID"},
           {"\x82\x01.", "EXT1"},
           {"\x97.", "NEXT_BUFFER"},
           {"S'x'\n.", "STRING"},
           {"\xff.", "unknown opcode 0xff"}}) {
    const std::string m = error_of(archive("\x80\x02" + bytes));
    EXPECT_NE(m.find(name), std::string::npos) << m;
    EXPECT_NE(m.find("data.pkl"), std::string::npos) << m;
  }
}

TEST(TorchFile, CompressedEntryIsRefused) {
  const std::string bytes =
      zip({{"archive/data.pkl", Pickle().op('N').done(), 8}, {"archive/byteorder", "little"}});
  const std::string m = error_of(bytes);
  EXPECT_NE(m.find("'archive/data.pkl'"), std::string::npos) << m;
  EXPECT_NE(m.find("compressed (method 8)"), std::string::npos) << m;
}

TEST(TorchFile, EveryTruncationIsRefused) {
  const std::string whole = valid_archive({true, 64});
  for (std::size_t n = 0; n < whole.size(); ++n) {
    const std::string m = error_of(whole.substr(0, n));
    EXPECT_NE(m, "accepted") << n;
    EXPECT_NE(m.find("test.pt"), std::string::npos) << m;
  }
  // A file cut inside its data keeps no end record: the message says what it looks like.
  EXPECT_NE(error_of(whole.substr(0, 100)).find("truncated"), std::string::npos);
}

TEST(TorchFile, CorruptBytesAreRefusedNeverCrash) {
  // Every single-byte change of a valid archive: refused with InvalidArgument, or still a file
  // (a byte of storage data, of a name the pickle does not need, of padding).
  const std::string whole = valid_archive({true, 64});
  for (std::size_t i = 0; i < whole.size(); ++i) {
    for (unsigned char x : {0x00, 0xff, 0x80}) {
      std::string b = whole;
      b[i] = static_cast<char>(static_cast<unsigned char>(b[i]) ^ x);
      try {
        (void)parse(b);
      } catch (const InvalidArgument&) {
      }
    }
  }
}

TEST(TorchFile, MissingOrShortStorageIsRefused) {
  Pickle p;
  p.tensor("7", "FloatStorage", 4, 0, {4}, {1});
  std::string m = error_of(archive(p.done(), {{"0", floats(4)}}));
  EXPECT_NE(m.find("no entry 'archive/data/7'"), std::string::npos) << m;
  m = error_of(archive(p.done(), {{"7", floats(3)}}));
  EXPECT_NE(m.find("'archive/data/7' holds 12 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("need 16"), std::string::npos) << m;
  // One key named with two dtypes.
  Pickle two;
  two.mark().tensor("0", "FloatStorage", 4, 0, {4}, {1});
  two.tensor("0", "HalfStorage", 8, 0, {8}, {1}).op('l');
  m = error_of(archive(two.done(), {{"0", floats(4)}}));
  EXPECT_NE(m.find("storage '0' is named as fp16"), std::string::npos) << m;
}

TEST(TorchFile, TensorOutsideItsStorageIsRefused) {
  struct Case {
    std::int64_t offset;
    std::vector<std::int64_t> size, stride;
  };
  for (const Case& c : std::vector<Case>{{2, {3}, {1}},
                                        {0, {2, 3}, {3, 1}},
                                        {5, {0}, {1}},
                                        {0, {2}, {std::int64_t{1} << 62}},
                                        {0, {std::int64_t{1} << 40, std::int64_t{1} << 40}, {1, 1}}}) {
    Pickle p;
    p.tensor("0", "FloatStorage", 4, c.offset, c.size, c.stride);
    const std::string m = error_of(archive(p.done(), {{"0", floats(4)}}));
    EXPECT_TRUE(m.find("of storage '0', which holds 4 elements") != std::string::npos ||
                m.find("more elements than 64 bits") != std::string::npos)
        << m;
  }
  // An empty view at the storage's end is a tensor; a negative stride is not.
  Pickle empty;
  empty.tensor("0", "FloatStorage", 4, 4, {0}, {1});
  EXPECT_EQ(parse(archive(empty.done(), {{"0", floats(4)}})).tensors[0].numel, 0u);
  Pickle negative;
  negative.tensor("0", "FloatStorage", 4, 3, {2}, {-1});
  EXPECT_NE(error_of(archive(negative.done(), {{"0", floats(4)}})).find("no negative value"),
            std::string::npos);
}

TEST(TorchFile, DeepSelfReferringAndExplodingStatesAreBounded) {
  // 200 nested lists.
  Pickle deep;
  for (int i = 0; i < 200; ++i) deep.op(']');
  for (int i = 0; i < 199; ++i) deep.op('a');
  std::string m = error_of(archive(deep.done()));
  EXPECT_NE(m.find("nests deeper than 100"), std::string::npos) << m;
  // A list that holds itself.
  Pickle cycle;
  cycle.op(']').op('q').raw(std::string(1, '\0')).op('h').raw(std::string(1, '\0')).op('a');
  m = error_of(archive(cycle.done()));
  EXPECT_NE(m.find("refers to itself"), std::string::npos) << m;
  // Each list holds the one before twice: 2^60 values if copied out.
  Pickle laughs;
  laughs.op(']');
  for (int i = 0; i < 60; ++i) laughs.op('2').op('\x86');
  m = error_of(archive(laughs.done()));
  EXPECT_NE(m.find("values"), std::string::npos) << m;
  // A long string shared 512 times: bounded text, refused before any copy is made.
  Pickle text;
  text.str(std::string(1 << 20, 'x'));
  for (int i = 0; i < 9; ++i) text.op('2').op('\x86');
  m = error_of(archive(text.done()));
  EXPECT_NE(m.find("of text"), std::string::npos) << m;
}

TEST(TorchFile, HugeDeclaredLengthsAreRefused) {
  std::string big8 = "\x80\x02\x8d";
  put(big8, std::uint64_t{1} << 62, 8);
  std::string bytes4 = "\x80\x02" "B";
  put(bytes4, 0xffffffff, 4);
  std::string long4 = "\x80\x02\x8b";
  put(long4, 0x7fffffff, 4);
  std::string frame = "\x80\x04\x95";
  put(frame, ~std::uint64_t{0}, 8);
  for (const std::string& pkl : {big8, bytes4, long4, frame}) {
    const std::string m = error_of(archive(pkl));
    EXPECT_NE(m.find("truncated data.pkl"), std::string::npos) << m;
  }
  // An integer beyond 64 bits.
  std::string wide = "\x80\x02\x8a\x09";
  wide += std::string(8, '\0') + "\x01.";
  EXPECT_NE(error_of(archive(wide)).find("beyond 64 bits"), std::string::npos);
  // A storage of 2^62 elements in a small entry; shapes of more than 64 bits of elements.
  Pickle p;
  p.tensor("0", "DoubleStorage", std::int64_t{1} << 62, 0, {1}, {1});
  EXPECT_NE(error_of(archive(p.done(), {{"0", floats(2)}})).find("more bytes than 64 bits"),
            std::string::npos);
  // A zip end record promising a huge directory, or more entries than it can hold.
  std::string z = valid_archive();
  const std::size_t end = z.size() - 22;
  std::string huge = z;
  for (int i = 0; i < 4; ++i) huge[end + 12 + static_cast<std::size_t>(i)] = '\x7f';
  EXPECT_NE(error_of(huge).find("central directory"), std::string::npos) << error_of(huge);
  std::string many = z;
  many[end + 8] = many[end + 10] = '\xfe';
  many[end + 9] = many[end + 11] = '\x7f';
  EXPECT_NE(error_of(many).find("cannot hold"), std::string::npos) << error_of(many);
}

TEST(TorchFile, ArchiveChecks) {
  // Big-endian archives, a missing data.pkl, entries outside the archive's folder, the legacy
  // format, not a zip at all.
  EXPECT_NE(error_of(archive(Pickle().op('N').done(), {}, {}, "big")).find("little-endian"),
            std::string::npos);
  std::string m = error_of(zip({{"archive/byteorder", "little"}}));
  EXPECT_NE(m.find("no entry 'archive/data.pkl'"), std::string::npos) << m;
  m = error_of(zip({{"archive/data.pkl", Pickle().op('N').done()}, {"other/x", "1"}}));
  EXPECT_NE(m.find("outside the archive's folder"), std::string::npos) << m;
  m = error_of(std::string("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15));
  EXPECT_NE(m.find("legacy format"), std::string::npos) << m;
  m = error_of(std::string(100, 'x'));
  EXPECT_NE(m.find("not a zip archive"), std::string::npos) << m;
  // Two directory entries over one local header: the same name twice, or overlapping bytes.
  std::string dup = zip({{"archive/data.pkl", Pickle().op('N').done()},
                         {"archive/data.pkl", Pickle().op('N').done()}});
  EXPECT_NE(error_of(dup).find("listed twice"), std::string::npos) << error_of(dup);
  std::string a = zip({{"archive/data.pkl", Pickle().op('N').done()}, {"archive/x", "abcdef"}});
  // Point the second entry's directory record at the first local header.
  const std::size_t second = a.rfind(std::string("\x50\x4b\x01\x02", 4));
  for (int i = 0; i < 4; ++i) a[second + 42 + static_cast<std::size_t>(i)] = 0;
  m = error_of(a);
  EXPECT_TRUE(m.find("overlap") != std::string::npos ||
              m.find("local header names it") != std::string::npos)
      << m;
  // A ZIP64-saturated end record without its locator.
  std::string z = valid_archive();
  z[z.size() - 22 + 10] = z[z.size() - 22 + 11] = '\xff';
  EXPECT_NE(error_of(z).find("ZIP64"), std::string::npos) << error_of(z);
}

TEST(TorchFile, DuplicateKeysAndUnhashableKeysAreRefused) {
  Pickle dup;
  dup.op('}').mark().str("k").integer(1).str("k").integer(2).op('u');
  EXPECT_NE(error_of(archive(dup.done())).find("appears twice ('k')"), std::string::npos);
  Pickle list_key;
  list_key.op('}').op(']').integer(1).op('s');
  EXPECT_NE(error_of(archive(list_key.done())).find("as a dict key"), std::string::npos);
}

TEST(TorchFile, RepeatedKeysAreFoundInLargeDictsAndSetsByPythonsEquality) {
  // Past a handful of keys the machine finds a repeat by hashing: a repeated str, a float
  // equal to an int key (7.0 == 7), an equal tuple ((True, 2) == (1, 2)), each among many
  // keys and in a later SETITEMS batch, is refused; distinct keys of every kind pass; a set
  // keeps one of equal members.
  auto dict_with = [](const std::function<void(Pickle&)>& last) {
    Pickle p;
    p.op('}').mark();
    for (int i = 0; i < 40; ++i) p.str("key" + std::to_string(i)).integer(i);
    p.integer(7).integer(0).ints({1, 2}).integer(0).real(2.5).integer(0).op('u');
    p.mark();
    last(p);
    return p.op('u').done();
  };
  EXPECT_NO_THROW((void)parse(archive(dict_with([](Pickle& p) { p.str("key40").integer(1); }))));
  EXPECT_NO_THROW((void)parse(archive(dict_with([](Pickle& p) { p.real(7.5).integer(1); }))));
  EXPECT_NO_THROW((void)parse(archive(dict_with([](Pickle& p) { p.ints({2, 1}).integer(1); }))));
  for (const auto& repeat : std::vector<std::function<void(Pickle&)>>{
           [](Pickle& p) { p.str("key17"); }, [](Pickle& p) { p.real(7.0); },
           [](Pickle& p) { p.ints({1, 2}); }, [](Pickle& p) { p.op('\x88').integer(2).op('\x86'); },
           [](Pickle& p) { p.real(2.5); }}) {
    const std::string m = error_of(archive(dict_with([&](Pickle& p) {
      repeat(p);
      p.integer(1);
    })));
    EXPECT_NE(m.find("a dict key appears twice"), std::string::npos) << m;
  }
  // (1, True) is (1, 1): not (1, 2), so not a repeat.
  EXPECT_NO_THROW((void)parse(archive(dict_with([](Pickle& p) {
    p.integer(1).op('\x88').op('\x86').integer(1);
  }))));
  Pickle set;
  set.op('\x8f').mark();
  for (int i = 0; i < 30; ++i) set.integer(i % 20);
  set.op('\x90');
  const TorchFile f = parse(archive(set.done()));
  EXPECT_EQ(f.root.items.size(), 20u);
}

TEST(TorchFile, KeysBuiltFromSharedTuplesAreRefusedBeforeTheyCostTime) {
  // A tuple of two references to the one before, 15 deep, in the keys of many entries: each
  // key's hash would visit 2^15 values. The machine's bound on key work refuses it at once.
  Pickle p;
  p.integer(1).op('q').raw(std::string(1, '\0'));
  for (int d = 1; d < 16; ++d) {
    p.op('h').raw(std::string(1, static_cast<char>(d - 1)));
    p.op('h').raw(std::string(1, static_cast<char>(d - 1)));
    p.op('\x86').op('q').raw(std::string(1, static_cast<char>(d)));
  }
  p.op('0').op('}').mark();
  for (int i = 0; i < 200; ++i) {
    p.op('h').raw(std::string(1, '\x0f')).integer(i).op('\x86').integer(i);
  }
  p.op('u');
  const auto start = std::chrono::steady_clock::now();
  const std::string m = error_of(archive(p.done()));
  EXPECT_NE(m.find("steps to compare"), std::string::npos) << m;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(TorchFile, AMemoIndexFarPastTheEndCostsNoMemoryForTheGap) {
  // LONG_BINPUT at 2^31, then GET of it: read (a map holds it), and an index never stored is
  // refused by number.
  Pickle p;
  p.integer(5).op('r').raw(std::string("\x00\x00\x00\x80", 4)).op('0');
  p.op('j').raw(std::string("\x00\x00\x00\x80", 4));
  const TorchFile f = parse(archive(p.done()));
  EXPECT_EQ(f.root.integer, 5);
  Pickle q;
  q.integer(5).op('r').raw(std::string("\x00\x00\x00\x80", 4)).op('0');
  q.op('j').raw(std::string("\x01\x00\x00\x80", 4));
  EXPECT_NE(error_of(archive(q.done())).find("memo entry 2147483649 was never stored"),
            std::string::npos);
}

TEST(TorchFile, AStrThatIsNotUtf8IsRefusedAsPythonsPickleRefusesIt) {
  // Good UTF-8 of every length passes (as a dict key and a value); each bad form is refused,
  // under each opcode that makes a str (protocol 2's byte strings too), naming the byte.
  Pickle good;
  good.op('}').mark().str("w\xc3\xa9ight \xe2\x82\xac \xf0\x9f\x99\x82").integer(1).op('u');
  EXPECT_NO_THROW((void)parse(archive(good.done())));
  for (const std::string bad : {"name\xff", "\xc3", "\xc0\xaf", "\xe0\x80\xaf",
                                "\xed\xa0\x80", "\xf4\x90\x80\x80", "\x80", "a\xe2\x82"}) {
    for (const char op : {'X', '\x8c', '\x8d', 'T', 'U'}) {
      Pickle p;
      p.op('}').mark().op(op);
      put(p.b, bad.size(), op == 'X' || op == 'T' ? 4 : op == '\x8c' || op == 'U' ? 1 : 8);
      p.raw(bad).integer(1).op('u');
      const std::string m = error_of(archive(p.done()));
      EXPECT_NE(m.find("a str that is not UTF-8"), std::string::npos) << m;
    }
  }
}

TEST(TorchFile, ReadFromAPathReadsTheSame) {
  const std::string bytes = valid_archive({true, 64});
  const std::string path = ::testing::TempDir() + "torch_file_test_" + std::to_string(getpid()) + ".pt";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  EXPECT_TRUE(is_torch_file(path));
  const TorchFile f = read_torch_file(path);
  const TorchFile g = parse(bytes);
  ASSERT_EQ(f.tensors.size(), g.tensors.size());
  for (std::size_t i = 0; i < f.tensors.size(); ++i) {
    EXPECT_EQ(f.tensors[i].path, g.tensors[i].path);
    EXPECT_EQ(f.tensors[i].offset, g.tensors[i].offset);
  }
  EXPECT_EQ(f.path, path);
  // A safetensors file whose header length is 0x280 starts 0x80 0x02, as a pickle's PROTO 2
  // does: its ninth byte opens the JSON header, so it is not taken for torch's legacy format.
  {
    std::string st(8, '\0');
    st[0] = '\x80';
    st[1] = '\x02';
    st += "{" + std::string(0x280 - 2, ' ') + "}";
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(st.data(), static_cast<std::streamsize>(st.size()));
  }
  EXPECT_FALSE(is_torch_file(path));
  fs::remove(path);
  EXPECT_FALSE(is_torch_file(path));
  EXPECT_THROW((void)read_torch_file(path), InvalidArgument);
  EXPECT_THROW((void)read_torch_file(::testing::TempDir()), InvalidArgument);  // a folder
}

TEST(TorchFile, AllowListNamesEachGlobalWithAReason) {
  const std::vector<std::string> rows = torch_allowed_globals();
  auto has = [&](const std::string& g) {
    for (const std::string& r : rows) {
      if (r.rfind(g + ":", 0) == 0) return true;
    }
    return false;
  };
  for (const char* g : {"torch._utils _rebuild_tensor_v2", "torch BFloat16Storage", "torch Size",
                        "collections OrderedDict", "__builtin__ getattr",
                        "deepspeed.runtime.zero.config ZeroStageEnum",
                        "deepspeed.utils.tensor_fragment fragment_address",
                        "deepspeed.runtime.fp16.loss_scaler LossScaler"}) {
    EXPECT_TRUE(has(g)) << g;
  }
  for (const std::string& r : rows) EXPECT_GT(r.size(), r.find(": ") + 10) << r;
}

// The seed of the fuzz corpus: a torch.save archive written by torch itself (its first byte
// selects the torch parser of the fuzz target).
TEST(TorchFile, RealTorchSaveArchive) {
  const std::string path = std::string(ZEROFLAT_TEST_DATA_DIR) + "/../fuzz/corpus/torch_save";
  std::ifstream in(path, std::ios::binary);
  ASSERT_TRUE(in) << path;
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  bytes.erase(0, 1);
  const TorchFile f = parse(bytes);
  // torch.save({'w': torch.arange(6.).reshape(2, 3), 'v': w[:, 1], 'h': arange(4, bf16),
  //             'n': 7, 'names': ['a', 'b']}) as written by python/tests/test_torch_file.py.
  ASSERT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.tensors[0].path, "w");
  EXPECT_EQ(f.tensors[0].shape, (Shape{2, 3}));
  EXPECT_EQ(f.tensors[1].path, "v");
  EXPECT_EQ(f.tensors[1].storage_offset, 1u);
  EXPECT_EQ(f.tensors[1].stride, (std::vector<std::int64_t>{3}));
  EXPECT_FALSE(f.tensors[1].contiguous);
  EXPECT_EQ(f.tensors[2].dtype, "bf16");
  EXPECT_EQ(f.int_at("n"), 7);
  EXPECT_EQ(f.string_at("names/1"), "b");
  // The values at the byte ranges are the ones saved.
  float w[6];
  std::memcpy(w, bytes.data() + f.tensors[0].offset, sizeof w);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(w[i], static_cast<float>(i));
  EXPECT_EQ(f.tensors[0].offset % 64, 0u);  // torch aligns storages
}

// ---- the reads of a resume at a new world size, on a described checkpoint --------------------


// A ZeRO-1/2 checkpoint of one group saved by `world` ranks: each rank's fp32 partition in file
// `rank` at offset 1000 * (rank + 1), exp_avg after it, step elsewhere.
DeepSpeedCheckpoint zero12(const std::vector<std::uint64_t>& numels, std::uint64_t world) {
  DeepSpeedCheckpoint ck;
  ck.format = DeepSpeedFormat::kZero12;
  ck.zero_stage = 2;
  ck.world = world;
  ck.ds_version = "0.19.8";
  ck.dtype = "bf16";
  LayoutOptions o;
  o.dp = world;
  const Layout l = Layout::compute(numels, o);
  DeepSpeedGroup g;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    DeepSpeedParam p;
    p.name = "p" + std::to_string(i);
    p.shape = {static_cast<std::int64_t>(numels[i])};
    p.numel = numels[i];
    p.offset = l.offsets()[i];
    g.params.push_back(p);
    g.numel += numels[i];
  }
  g.flat_numel = l.flat_numel();
  g.sub_groups = {0};
  DeepSpeedSubGroup sg;
  sg.num_params = numels.size();
  sg.partition_numel = l.partition_numel();
  for (std::uint64_t r = 0; r < world; ++r) {
    ck.files.emplace_back();
    DeepSpeedPartition part;
    part.padding = l.rank(r).padding;
    auto tensor = [&](std::uint64_t numel, std::uint64_t offset) {
      DeepSpeedTensor t;
      t.file = static_cast<std::uint32_t>(r);
      t.dtype = "fp32";
      t.type = DType::kFP32;
      t.element_size = 4;
      t.numel = numel;
      t.offset = offset;
      t.bytes = 4 * numel;
      return t;
    };
    part.fp32 = tensor(sg.partition_numel - part.padding, 1000 * (r + 1));
    part.states.push_back({"exp_avg", tensor(sg.partition_numel, 1000 * (r + 1) + 500)});
    part.states.push_back({"step", tensor(1, 10)});
    sg.ranks.push_back(part);
  }
  ck.groups.push_back(g);
  ck.sub_groups.push_back(sg);
  return ck;
}

// The plan's small values are what the running model reads whole: its frozen parameters and its
// buffers from the module file, by name (one the file lacks left out; another element count
// refused); without the running model's names, the checkpoint's own.
TEST(ResumePlan, SmallValuesAreTheRunningModelsFrozenParametersAndBuffers) {
  DeepSpeedCheckpoint ck = zero12({64, 8}, 2);
  auto module_tensor = [](const std::string& name, std::uint64_t numel, std::uint64_t offset) {
    DeepSpeedTensor t;
    t.path = "module/" + name;
    t.dtype = "bf16";
    t.type = DType::kBF16;
    t.element_size = 2;
    t.numel = numel;
    t.offset = offset;
    t.bytes = 2 * numel;
    return t;
  };
  ck.module = {module_tensor("p0", 64, 0), module_tensor("emb.w", 5, 200),
               module_tensor("norm.count", 3, 300), module_tensor("old.buf", 2, 400)};
  ck.buffer_names = {"old.buf"};
  auto names = [](const ResumePlan& plan) {
    std::vector<std::string> out;
    for (const ResumeSmall& s : plan.small) out.push_back(s.target + ":" + s.name);
    return out;
  };
  ResumeOptions ro;
  ro.world = 3;
  ro.frozen = {"emb.w", "not.saved"};
  ro.frozen_numels = {5, 9};
  ro.buffers = std::vector<std::string>{"norm.count", "absent"};
  ResumePlan plan = plan_resume(ck, ro);
  EXPECT_EQ(names(plan),
            (std::vector<std::string>{"step:", "module:emb.w", "module:norm.count"}));
  EXPECT_EQ(plan.small[1].tensor.offset, 200u);
  EXPECT_EQ(plan.small[2].tensor.bytes, 6u);
  // Without the running model's buffers: the checkpoint's buffer_names.
  ro.buffers.reset();
  EXPECT_EQ(names(plan_resume(ck, ro)),
            (std::vector<std::string>{"step:", "module:emb.w", "module:old.buf"}));
  ro.frozen_numels = {6, 9};
  try {
    plan_resume(ck, ro);
    FAIL() << "a frozen parameter of another element count was planned";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'emb.w' holds 5 elements"), std::string::npos)
        << e.what();
  }
  ro.frozen_numels = {5};
  EXPECT_THROW(plan_resume(ck, ro), InvalidArgument);  // names and counts must pair up
}

TEST(ResumePlan, Zero12EveryElementOnceFromTheRankThatSavedIt) {
  const std::vector<std::uint64_t> numels{481, 13, 13, 7, 100, 1};
  for (std::uint64_t saved : {1, 2, 3}) {
    const DeepSpeedCheckpoint ck = zero12(numels, saved);
    LayoutOptions oo;
    oo.dp = saved;
    const Layout old_layout = Layout::compute(numels, oo);
    const std::uint64_t P = old_layout.partition_numel();
    for (std::uint64_t world : {1, 2, 3, 4, 7}) {
      ResumeOptions ro;
      ro.world = world;
      const ResumePlan plan = plan_resume(ck, ro);
      ASSERT_EQ(plan.targets, (std::vector<std::string>{"fp32", "exp_avg"}));
      ASSERT_EQ(plan.buffers.size(), 2u);
      // The step, read whole once: from the first saving rank's file.
      ASSERT_EQ(plan.small.size(), 1u);
      EXPECT_EQ(plan.small[0].target, "step");
      EXPECT_EQ(plan.small[0].tensor.file, 0u);
      const Layout nl = Layout::compute(numels, plan.buffers[0].layout);
      std::uint64_t total = 0;
      for (std::uint64_t r = 0; r < world; ++r) {
        const ResumeRank rr = resume_rank(plan, r);
        // The flat element each destination must hold, and the flat element each read brings.
        std::vector<std::int64_t> want(nl.partition_numel(), -1);
        for (const Fragment& f : nl.rank(r).fragments) {
          for (std::uint64_t k = 0; k < f.numel; ++k) {
            want[f.partition_offset + k] =
                static_cast<std::int64_t>(old_layout.offsets()[f.param] + f.param_offset + k);
          }
        }
        for (std::size_t i = 0; i < plan.buffers.size(); ++i) {
          const ResumeRankBuffer& b = rr.buffers[i];
          const bool fp32 = plan.buffers[i].target == "fp32";
          ASSERT_EQ(b.partition_numel, nl.partition_numel());
          EXPECT_EQ(b.kept_bytes, 4 * nl.partition_numel());
          EXPECT_EQ(b.data_numel, nl.partition_numel() - nl.rank(r).padding);
          EXPECT_EQ(b.share_bytes, 4 * b.data_numel);
          std::vector<std::int64_t> got(want.size(), -1);
          std::uint64_t bytes = 0;
          for (const PlannedRead& x : b.reads) {
            const std::uint64_t q = x.file;
            const std::uint64_t base = 1000 * (q + 1) + (fp32 ? 0 : 500);
            ASSERT_EQ(x.bytes, 4 * x.numel);
            bytes += x.bytes;
            total += fp32 ? x.numel : 0;
            for (std::uint64_t k = 0; k < x.numel; ++k) {
              ASSERT_LT(x.dest + k, got.size());
              EXPECT_EQ(got[x.dest + k], -1) << "read twice";
              got[x.dest + k] = static_cast<std::int64_t>(q * P + (x.offset - base) / 4 + k);
            }
          }
          EXPECT_EQ(b.read_bytes, bytes);
          EXPECT_EQ(got, want) << saved << " -> " << world << " rank " << r << " "
                               << plan.buffers[i].target;
        }
      }
      EXPECT_EQ(total, 615u);  // every parameter element, once over all new ranks
    }
  }
  ResumeOptions bad;
  bad.world = 0;
  EXPECT_THROW((void)plan_resume(zero12(numels, 2), bad), InvalidArgument);
  bad.world = 2;
  EXPECT_THROW((void)resume_rank(plan_resume(zero12(numels, 2), bad), 2), InvalidArgument);
  bad.states = std::vector<std::string>{"momentum_buffer"};
  EXPECT_THROW((void)plan_resume(zero12(numels, 2), bad), InvalidArgument);
  bad.states.reset();
  bad.stage = 3;  // a ZeRO-2 checkpoint under ZeRO-3
  EXPECT_THROW((void)plan_resume(zero12(numels, 2), bad), InvalidArgument);
}

}  // namespace
}  // namespace zeroflat
