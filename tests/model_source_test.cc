// Untrusted model files: safetensors headers, checkpoint directories, config.json. Valid files
// parse to what they hold; every kind of malformed input is InvalidArgument naming the file.
// Past 700 lines on purpose: one case per kind of malformed input, over the same file writers.
#include "zeroflat/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"
#include "zeroflat/loader.h"

namespace zeroflat {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string bytes_of(const std::string& header, std::uint64_t n, std::uint64_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\x01');
}

// A file whose header is `header` (its length written truthfully) followed by data_bytes.
std::string file_with(const std::string& header, std::uint64_t data_bytes) {
  return bytes_of(header, header.size(), data_bytes);
}

SafetensorsHeader parse(const std::string& file) {
  return parse_safetensors_header(
      std::span(reinterpret_cast<const unsigned char*>(file.data()), file.size()), file.size(),
      "test.safetensors");
}

std::string error_of(const std::string& file) {
  try {
    (void)parse(file);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "accepted";
}

TEST(Safetensors, ValidHeaderParses) {
  json h = {{"b", {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {6, 22}}}},
            {"a", {{"dtype", "BF16"}, {"shape", {3}}, {"data_offsets", {0, 6}}}},
            {"empty", {{"dtype", "F16"}, {"shape", {0, 5}}, {"data_offsets", {22, 22}}}},
            {"__metadata__", {{"format", "pt"}}}};
  SafetensorsHeader out = parse(file_with(h.dump() + "   ", 22));
  ASSERT_EQ(out.tensors.size(), 3u);
  EXPECT_EQ(out.tensors[0].name, "a");  // sorted by offset
  EXPECT_EQ(out.tensors[1].shape, (Shape{2, 2}));
  EXPECT_EQ(out.tensors[1].numel, 4u);
  EXPECT_EQ(out.metadata.at("format"), "pt");
  EXPECT_EQ(out.data_bytes, 22u);
}

TEST(Safetensors, EveryMalformedHeaderIsRejectedWithTheProblemNamed) {
  const std::string t = R"("t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]})";
  struct Case {
    std::string file;
    std::string says;
  };
  const Case cases[] = {
      {"", "too short"},
      {std::string(7, '\0'), "too short"},
      {bytes_of("{}", 200'000'000, 0), "not a safetensors file: it must start with the length"},
      {bytes_of("{}", 50, 0), "runs past the end"},
      {bytes_of("{}", 1, 1), "too short for JSON"},
      {file_with("[]", 0), "not a safetensors file: its header must be a JSON object"},
      {file_with("{\"t\": ", 0), "not valid JSON"},
      {file_with(std::string("{\"a\":1}\0", 8), 0), "NUL byte"},
      {file_with("{\"a\":" + std::string(50, '[') + std::string(50, ']') + "}", 0), "nested"},
      {file_with("{" + t + ", " + t + "}", 4), "appears twice"},
      {file_with(R"({"t": 5})", 0), "not an object"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4], "x": 1}})", 4),
       "unknown field 'x'"},
      {file_with(R"({"t": {"shape": [2], "data_offsets": [0, 4]}})", 4), "dtype missing"},
      {file_with(R"({"t": {"dtype": 7, "shape": [2], "data_offsets": [0, 4]}})", 4),
       "dtype missing or not a string"},
      {file_with(R"({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 4]}})", 4),
       "unknown dtype 'Q4'"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": 2, "data_offsets": [0, 4]}})", 4),
       "shape missing or not a list"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [-2], "data_offsets": [0, 4]}})", 4),
       "non-negative integer"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2.5], "data_offsets": [0, 4]}})", 4),
       "non-negative integer"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],
                   "data_offsets": [0, 2]}})",
                 2),
       "more than 16 dimensions"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [4294967296, 4294967296],
                   "data_offsets": [0, 4]}})",
                 4),
       "more elements than fit"},
      {file_with(R"({"t": {"dtype": "F64", "shape": [4611686018427387904],
                   "data_offsets": [0, 4]}})",
                 4),
       "more bytes than fit"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2]}})", 4), "data_offsets must be"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0]}})", 4),
       "data_offsets must be"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [-4, 0]}})", 4),
       "data_offsets must be"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 0]}})", 4),
       "end before they begin"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 6]}})", 6),
       "needs 4"},
      {file_with(R"({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})", 2),
       "truncated"},
      {file_with(R"({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                   "b": {"dtype": "BF16", "shape": [2], "data_offsets": [2, 6]}})",
                 6),
       "overlaps"},
      {file_with(R"({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                   "b": {"dtype": "BF16", "shape": [2], "data_offsets": [6, 10]}})",
                 10),
       "belong to no tensor"},
      {file_with(R"({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})", 9),
       "the tensors 4"},
      {file_with(R"({"__metadata__": [1]})", 0), "__metadata__ is not"},
      {file_with(R"({"__metadata__": {"k": 1}})", 0), "is not a string"},
      {file_with(R"({"": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})", 4),
       "empty name"},
      {file_with("{\"\xff\xfe\": 1}", 0), "not valid JSON"},
  };
  for (const Case& c : cases) {
    std::string msg = error_of(c.file);
    EXPECT_NE(msg.find("test.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.says), std::string::npos) << "wanted '" << c.says << "', got: " << msg;
    // Text a terminal, a JSON document and Python's exceptions take as it is: no byte of the
    // file that is not printable ASCII (the JSON parser quotes what it last read).
    for (char ch : msg) EXPECT_TRUE(ch >= 0x20 && ch < 0x7f) << "byte " << int(ch) << ": " << msg;
  }
}

TEST(Safetensors, HostileNamesArePrintedSafely) {
  std::string name = "evil\x1b[2J" + std::string(300, 'x');
  std::string msg = error_of(file_with("{\"" + name + "\": 5}", 0));
  EXPECT_EQ(msg.find('\x1b'), std::string::npos);
  EXPECT_LT(msg.size(), 250u);
}

class TempDir : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("zf_model_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  void write(const std::string& name, const std::string& content) {
    std::ofstream(dir_ / name, std::ios::binary) << content;
  }
  // inspect_path on the folder refuses it, saying `says`.
  void inspect_refuses(const std::string& says) {
    try {
      (void)inspect_path(dir_.string());
      ADD_FAILURE() << "accepted; wanted " << says;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
  std::string shard(std::initializer_list<std::pair<std::string, Shape>> tensors) {
    json h = json::object();
    std::uint64_t off = 0;
    for (const auto& [name, shape] : tensors) {
      std::uint64_t n = 1;
      for (auto d : shape) n *= static_cast<std::uint64_t>(d);
      h[name] = {{"dtype", "BF16"}, {"shape", shape}, {"data_offsets", {off, off + 2 * n}}};
      off += 2 * n;
    }
    return file_with(h.dump(), off);
  }
  fs::path dir_;
};

using Checkpoints = TempDir;

TEST_F(Checkpoints, HeadersWinOverAConfigBesideThemAndGiveTheDtype) {
  write("model.safetensors",
        file_with(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},)"
                  R"( "b": {"dtype": "BF16", "shape": [2], "data_offsets": [16, 20]}})",
                  20));
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 4, "vocab_size": 10})");
  ModelSpec m = load_model(dir_.string());
  EXPECT_EQ(m.tensors.size(), 2u);  // the checkpoint's, not the config's
  ASSERT_TRUE(m.dtype);
  EXPECT_EQ(*m.dtype, DType::kFP32);  // most bytes are fp32
  EXPECT_EQ(inspect_path(dir_.string()).tensors.size(), 2u);
  // Only a config: both use it, with its torch_dtype.
  fs::remove(dir_ / "model.safetensors");
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 4, "vocab_size": 10,
    "torch_dtype": "float16"})");
  ModelSpec c = load_model(dir_.string());
  EXPECT_GT(c.tensors.size(), 2u);
  EXPECT_EQ(*c.dtype, DType::kFP16);
  EXPECT_EQ(inspect_path(dir_.string()).source, "config");
  EXPECT_EQ(inspect_path(dir_.string()).bytes_by_dtype.count("fp16"), 1u);
}

// A folder with Transformers' one-file checkpoint takes that file, as Transformers does: a
// variant beside it holding the same names (model.fp16.safetensors) was refused as the same
// tensor twice, and an adapter's tensors were taken for the model's.
TEST_F(Checkpoints, ModelSafetensorsIsTheModelWhateverLiesBesideIt) {
  write("model.safetensors",
        file_with(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 16));
  write("model.fp16.safetensors",
        file_with(R"({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}})", 8));
  write("adapter_model.safetensors",
        file_with(R"({"lora": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8));
  const CheckpointIndex ck = open_checkpoint(dir_.string());
  ASSERT_EQ(ck.files.size(), 1u);
  EXPECT_EQ(fs::path(ck.files[0]).filename(), "model.safetensors");
  ASSERT_EQ(ck.tensors.size(), 1u);
  EXPECT_EQ(ck.tensors[0].dtype, "F32");
  // Without it, every .safetensors of the folder is read (shards of other writers).
  fs::remove(dir_ / "model.safetensors");
  fs::remove(dir_ / "model.fp16.safetensors");
  EXPECT_EQ(open_checkpoint(dir_.string()).tensors.size(), 1u);
}

// Transformers' order: model.safetensors, then model.safetensors.index.json's shards (then
// pytorch_model.bin and its index: test_hf.py), whatever else the folder holds.
TEST_F(Checkpoints, AFolderIsReadAsTransformersChoosesItsModel) {
  write("model.safetensors",
        file_with(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 16));
  write("model-00001-of-00001.safetensors", shard({{"old.w", {4, 4}}}));
  write("model.safetensors.index.json",
        json{{"weight_map", {{"old.w", "model-00001-of-00001.safetensors"}}}}.dump());
  CheckpointIndex ck = open_checkpoint(dir_.string());
  ASSERT_EQ(ck.files.size(), 1u);
  EXPECT_EQ(fs::path(ck.files[0]).filename(), "model.safetensors");
  fs::remove(dir_ / "model.safetensors");
  ck = open_checkpoint(dir_.string());
  ASSERT_EQ(ck.tensors.size(), 1u);
  EXPECT_EQ(ck.tensors[0].name, "old.w");
  // A folder that happens to be named model.safetensors is not the model file (Transformers
  // asks isfile): the index is still read.
  fs::create_directory(dir_ / "model.safetensors");
  ck = open_checkpoint(dir_.string());
  ASSERT_EQ(ck.tensors.size(), 1u);
  EXPECT_EQ(ck.tensors[0].name, "old.w");
}

TEST_F(Checkpoints, FifosAreNotRead) {
  const std::string fifo = (dir_ / "x.safetensors").string();
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  try {
    (void)inspect_path(fifo);
    ADD_FAILURE() << "read a FIFO";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos);
  }
}

TEST_F(Checkpoints, ShardedDirectoryWithIndex) {
  write("model-00001-of-00002.safetensors",
        shard({{"model.layers.10.w", {4, 4}}, {"model.layers.2.w", {4, 4}}}));
  write("model-00002-of-00002.safetensors", shard({{"lm_head.weight", {8, 4}}}));
  write("model.safetensors.index.json",
        json{{"metadata", {{"total_size", 128}}},
             {"weight_map",
              {{"model.layers.10.w", "model-00001-of-00002.safetensors"},
               {"model.layers.2.w", "model-00001-of-00002.safetensors"},
               {"lm_head.weight", "model-00002-of-00002.safetensors"}}}}
            .dump());
  Inspection in = inspect_path(dir_.string());
  EXPECT_EQ(in.files, 2u);
  EXPECT_EQ(in.tensors.size(), 3u);
  EXPECT_EQ(in.numel, 64u);
  EXPECT_EQ(in.bytes_by_dtype.at("bf16"), 128u);
  ModelSpec m = load_model(dir_.string());
  ASSERT_EQ(m.tensors.size(), 3u);
  EXPECT_EQ(m.tensors[1].name, "model.layers.2.w");  // natural order: 2 before 10
  EXPECT_EQ(m.tensors[2].name, "model.layers.10.w");
  EXPECT_THROW((void)load_model(dir_.string(), {.layers = 1}), InvalidArgument);
}

TEST_F(Checkpoints, PartsDcpSavedShardedAreRefusedWholeSavesRead) {
  // What DCP's HuggingFaceStorageWriter(save_distributed=True) writes without consolidation:
  // each rank's file holds its pieces, DCP_SHARDING_INFO says where each starts.
  auto part = [&](const std::string& info) {
    json h = {{"__metadata__", {{"format", "pt"}, {"DCP_VERSION", "1.0"},
                                {"DCP_SHARDING_INFO", info}}},
              {"a.weight", {{"dtype", "BF16"}, {"shape", {3, 4}}, {"data_offsets", {0, 24}}}}};
    return file_with(h.dump(), 24);
  };
  write("shard-00001-model-00001-of-00001.safetensors",
        part(R"({"a.weight": {"saved_offsets": [0, 0]}})"));
  // One rank's save: every piece at the origin is the whole tensor.
  EXPECT_EQ(inspect_path(dir_.string()).tensors.size(), 1u);
  write("shard-00002-model-00001-of-00001.safetensors",
        part(R"({"a.weight": {"saved_offsets": [3, 0]}})"));
  inspect_refuses("consolidate the folder first");
  inspect_refuses("or load it through DCP's load with zeroflat.dcp.Reader");
  inspect_refuses("saved_offsets [3,0]");
  fs::remove(dir_ / "shard-00001-model-00001-of-00001.safetensors");
  inspect_refuses("one rank's part");  // alone, a piece must not pass for the whole tensor
  write("shard-00002-model-00001-of-00001.safetensors", part("[1, 2]"));
  inspect_refuses("DCP_SHARDING_INFO is not a JSON object");
  write("shard-00002-model-00001-of-00001.safetensors", part("{not json"));
  inspect_refuses("DCP_SHARDING_INFO");
  write("shard-00002-model-00001-of-00001.safetensors",
        part(R"({"a.weight": {"saved_offsets": [-1, 0]}})"));
  inspect_refuses("one rank's part");
}

// One rank's file of a tensor "w" saved in pieces (DCP's HuggingFaceStorageWriter, not
// consolidated): the piece of the given shape at `at` of a whole with `cols` columns (2-D;
// cols 0: 1-D), each F32 element its index in the whole.
std::string piece_file(const Shape& shape, const Shape& at, std::int64_t cols,
                       const std::string& dtype = "F32") {
  const std::int64_t rows = shape[0], width = shape.size() > 1 ? shape[1] : 1;
  std::string data;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < width; ++c) {
      const auto v = static_cast<float>(cols == 0 ? at[0] + r : (at[0] + r) * cols + at[1] + c);
      data.append(reinterpret_cast<const char*>(&v), dtype == "F32" ? 4 : 2);
    }
  }
  json h = {{"__metadata__",
             {{"DCP_SHARDING_INFO", json({{"w", {{"saved_offsets", at}}}}).dump()}}},
            {"w", {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {0, data.size()}}}}};
  const std::string header = h.dump();
  return bytes_of(header, header.size(), 0) + data;
}

TEST_F(Checkpoints, PiecesTileTheirWholeAndReadWhereTheyLie) {
  auto opened = [&] { return open_checkpoint(dir_.string(), {.pieces = true}); };
  auto refused = [&](const std::string& says) {
    try {
      (void)opened();
      ADD_FAILURE() << "accepted; wanted " << says;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  // A 7 x 4 tensor saved at 3 ranks (rows 3, 3, 1), and one rank's empty piece.
  write("shard-1.safetensors", piece_file({3, 4}, {0, 0}, 4));
  write("shard-2.safetensors", piece_file({3, 4}, {3, 0}, 4));
  write("shard-3.safetensors", piece_file({1, 4}, {6, 0}, 4));
  write("shard-4.safetensors", piece_file({0, 4}, {7, 0}, 4));
  const CheckpointIndex ck = opened();
  ASSERT_EQ(ck.tensors.size(), 3u);  // the empty piece dropped
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(ck.tensors[i].name, "w");
    EXPECT_EQ(ck.tensors[i].whole_shape, (Shape{7, 4}));
    EXPECT_EQ(ck.tensors[i].piece_offsets, (Shape{std::int64_t(3 * i), 0}));
  }
  // Rows 2..4 of the whole: the last row of the first piece, the first two of the second, each
  // read from its piece as a box of it.
  const CheckpointIndex got = checkpoint_pieces(ck, {{"w", {0, 0}}, {"w", {3, 0}}});
  ASSERT_EQ(got.tensors.size(), 2u);
  EXPECT_EQ(got.tensors[1].name, "#000000000001");
  std::vector<float> out(12, -1.0f);
  const std::vector<BoxRead> boxes = {{"#000000000000", {2, 0}, {1, 4}, out.data(), DType::kFP32},
                                      {"#000000000001", {0, 0}, {2, 4}, out.data() + 4,
                                       DType::kFP32}};
  EXPECT_EQ(read_checkpoint_boxes(got, boxes, 2), 48u);
  for (std::size_t i = 0; i < out.size(); ++i) EXPECT_EQ(out[i], static_cast<float>(8 + i));
  EXPECT_THROW((void)checkpoint_pieces(ck, {{"w", {1, 0}}}), InvalidArgument);
  EXPECT_THROW((void)checkpoint_pieces(ck, {{"v", {0, 0}}}), InvalidArgument);
  // Without pieces every reader refuses the folder.
  inspect_refuses("one rank's part");
  // A missing rank's file is a gap, not zeros.
  fs::remove(dir_ / "shard-2.safetensors");
  refused("its pieces (in shard-1.safetensors, shard-3.safetensors) hold 16 of the 28 elements "
          "of the whole [7, 4]");
  refused("a rank's part of the folder missing?");
  // Two ranks' files placing pieces over each other.
  write("shard-2.safetensors", piece_file({3, 4}, {2, 0}, 4));
  refused("its pieces at saved_offsets [0, 0] (shard-1.safetensors) and [2, 0] "
          "(shard-2.safetensors) overlap");
  // Column pieces (Shard(1)) tile too.
  for (const char* f : {"shard-1.safetensors", "shard-2.safetensors", "shard-3.safetensors",
                        "shard-4.safetensors"}) {
    fs::remove(dir_ / f);
  }
  write("shard-1.safetensors", piece_file({5, 3}, {0, 0}, 4));
  write("shard-2.safetensors", piece_file({5, 1}, {0, 3}, 4));
  EXPECT_EQ(opened().tensors[1].whole_shape, (Shape{5, 4}));
  write("shard-3.safetensors", piece_file({5, 1}, {0, 2}, 4));
  refused("overlap");
  fs::remove(dir_ / "shard-3.safetensors");
  // One name, two dtypes; the same place twice; offsets of another rank; not counts.
  write("shard-2.safetensors", piece_file({5, 1}, {0, 3}, 4, "BF16"));
  refused("its pieces disagree");
  refused("(shard-2.safetensors)");
  write("shard-2.safetensors", piece_file({5, 3}, {0, 0}, 4));
  refused("at saved_offsets [0, 0] is also in shard-1.safetensors");
  write("shard-2.safetensors", piece_file({5, 1}, {0, 3, 0}, 4));
  refused("have another count of dimensions");
  json h = {{"__metadata__", {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [-1, 0]}})"}}},
            {"w", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}}};
  write("shard-2.safetensors", file_with(h.dump(), 4));
  refused("not a list of counts");
}

TEST_F(Checkpoints, BrokenDirectoriesAreRejected) {
  inspect_refuses("no .safetensors files");
  write("a.safetensors", shard({{"w", {2}}}));
  write("b.safetensors", shard({{"w", {2}}}));
  inspect_refuses("is also in a.safetensors");
  fs::remove(dir_ / "b.safetensors");
  write("model.safetensors.index.json", R"({"weight_map": {"w": "missing.safetensors"}})");
  inspect_refuses("does not exist");
  write("model.safetensors.index.json", R"({"weight_map": {"w": "../a.safetensors"}})");
  inspect_refuses("not a plain file name");
  write("model.safetensors.index.json",
        R"({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}})");
  inspect_refuses("'v' is not in a.safetensors");
  write("model.safetensors.index.json", R"({"weights": {}})");
  inspect_refuses("no 'weight_map'");
  write("model.safetensors.index.json", R"({"weight_map": {}})");
  inspect_refuses("the index lists no tensors");
  write("model.safetensors.index.json", R"({"weight_map": {"w": 3}})");
  inspect_refuses("not a file name");
}

// Names that differ only in leading zeros compare equal in the natural order ("layers.0" and
// "layers.00"): the index still holds both, each found by its exact name.
TEST_F(Checkpoints, NamesEqualInTheNaturalOrderAreDistinctTensors) {
  write("model.safetensors", shard({{"layers.00.w", {3}},
                                    {"layers.0.w", {2}},
                                    {"layers.1.w", {1}},
                                    {"layers.000.w", {4}},
                                    {"layers.10.w", {5}}}));
  const CheckpointIndex index = open_checkpoint((dir_ / "model.safetensors").string());
  ASSERT_EQ(index.tensors.size(), 5u);
  // Natural order; among equals, plain byte order.
  const std::vector<std::string> want = {"layers.0.w", "layers.00.w", "layers.000.w",
                                         "layers.1.w", "layers.10.w"};
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(index.tensors[i].name, want[i]);
  const std::pair<std::string, std::int64_t> by_name[] = {
      {"layers.0.w", 2}, {"layers.00.w", 3}, {"layers.000.w", 4}, {"layers.1.w", 1},
      {"layers.10.w", 5}};
  for (const auto& [name, dim] : by_name) {
    const CheckpointTensor* t = index.find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->name, name);
    EXPECT_EQ(t->shape, (Shape{dim})) << name;
  }
  EXPECT_EQ(index.find("layers.0000.w"), nullptr);
  EXPECT_EQ(index.find("layers.01.w"), nullptr);
  // The same through a sharded directory and its index.
  fs::remove(dir_ / "model.safetensors");
  write("a.safetensors", shard({{"layers.00.w", {3}}}));
  write("b.safetensors", shard({{"layers.0.w", {2}}}));
  write("model.safetensors.index.json",
        json{{"weight_map", {{"layers.00.w", "a.safetensors"}, {"layers.0.w", "b.safetensors"}}}}
            .dump());
  const CheckpointIndex sharded = open_checkpoint(dir_.string());
  ASSERT_EQ(sharded.tensors.size(), 2u);
  ASSERT_NE(sharded.find("layers.00.w"), nullptr);
  EXPECT_EQ(sharded.files[sharded.find("layers.00.w")->file], (dir_ / "a.safetensors").string());
  ASSERT_NE(sharded.find("layers.0.w"), nullptr);
  EXPECT_EQ(sharded.files[sharded.find("layers.0.w")->file], (dir_ / "b.safetensors").string());
}

// The index file given where the checkpoint is expected: the checkpoint is its directory.
TEST_F(Checkpoints, TheIndexFileStandsForItsDirectory) {
  write("model-00001-of-00002.safetensors", shard({{"model.layers.2.w", {4, 4}}}));
  write("model-00002-of-00002.safetensors", shard({{"lm_head.weight", {8, 4}}}));
  write("model.safetensors.index.json",
        json{{"weight_map",
              {{"model.layers.2.w", "model-00001-of-00002.safetensors"},
               {"lm_head.weight", "model-00002-of-00002.safetensors"}}}}
            .dump());
  const std::string index_path = (dir_ / "model.safetensors.index.json").string();
  const CheckpointIndex by_dir = open_checkpoint(dir_.string());
  const CheckpointIndex by_index = open_checkpoint(index_path);
  EXPECT_EQ(by_index.path, index_path);
  EXPECT_EQ(by_index.files, by_dir.files);
  ASSERT_EQ(by_index.tensors.size(), 2u);
  EXPECT_EQ(by_index.tensors[1].name, by_dir.tensors[1].name);
  EXPECT_EQ(by_index.tensors[1].offset, by_dir.tensors[1].offset);
  EXPECT_EQ(load_model(index_path).tensors.size(), 2u);
  const Inspection in = inspect_path(index_path);
  EXPECT_EQ(in.source, "checkpoint");
  EXPECT_EQ(in.files, 2u);
  EXPECT_EQ(in.numel, 48u);
}

// An index naming a shard that is not there: the message says the index names a missing
// shard, and names both.
TEST_F(Checkpoints, AnIndexNamingAMissingShardSaysSo) {
  write("model-00001-of-00002.safetensors", shard({{"a", {2}}}));
  write("model.safetensors.index.json",
        json{{"weight_map",
              {{"a", "model-00001-of-00002.safetensors"},
               {"b", "model-00002-of-00002.safetensors"},
               {"c", "model-00002-of-00002.safetensors"}}}}
            .dump());
  for (const fs::path& given : {dir_, dir_ / "model.safetensors.index.json"}) {
    try {
      (void)open_checkpoint(given.string());
      ADD_FAILURE() << "opened a checkpoint with a missing shard";
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.find((dir_ / "model.safetensors.index.json").string() +
                         ": the index names shard 'model-00002-of-00002.safetensors' (for 2 "
                         "tensors, 'b' first), but that shard is missing"),
                0u)
          << msg;
      EXPECT_NE(msg.find((dir_ / "model-00002-of-00002.safetensors").string() + " does not exist"),
                std::string::npos)
          << msg;
    }
  }
}

// A path with a NUL byte names no file: the system would see only what comes before it.
TEST_F(Checkpoints, PathsWithANulByteAreRefusedWhereTheyEnter) {
  write("model.safetensors", shard({{"w", {2}}}));
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 4, "vocab_size": 10})");
  // Each would otherwise reach an existing file: the part before the NUL.
  const std::string ck = (dir_ / "model.safetensors").string() + std::string("\0.bak", 5);
  const std::string cfg = (dir_ / "config.json").string() + std::string("\0x", 2);
  const std::string dir = dir_.string() + std::string("\0", 1);
  auto says_nul = [](const std::function<void()>& f, const char* what) {
    try {
      f();
      ADD_FAILURE() << what << ": accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("holds a NUL byte"), std::string::npos)
          << what << ": " << e.what();
      EXPECT_EQ(std::string(e.what()).find('\0'), std::string::npos) << what;
    }
  };
  says_nul([&] { (void)open_checkpoint(ck); }, "open_checkpoint");
  says_nul([&] { (void)open_checkpoint(dir); }, "open_checkpoint of a directory");
  says_nul([&] { (void)load_model(ck); }, "load_model of a checkpoint");
  says_nul([&] { (void)load_model(cfg); }, "load_model of a config");
  says_nul([&] { (void)inspect_path(cfg); }, "inspect_path");
  says_nul([&] { (void)read_safetensors_header(ck); }, "read_safetensors_header");
  says_nul([&] { (void)parse_numels("@" + cfg); }, "parse_numels");
  says_nul([&] { write_pattern_checkpoint(catalog_model("tiny-moe"), DType::kBF16,
                                          (dir_ / "out").string() + std::string("\0x", 2),
                                          1 << 20); },
           "write_pattern_checkpoint");
}

// Files that are not safetensors files say so, and what they seem to be.
TEST_F(Checkpoints, OtherFilesAreNamedForWhatTheyAre) {
  write("index.safetensors", json{{"weight_map", {{"w", "a.safetensors"}}}}.dump(2));
  try {
    (void)open_checkpoint((dir_ / "index.safetensors").string());
    ADD_FAILURE() << "read JSON text as a safetensors file";
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("index.safetensors: not a safetensors file: it must start with the length "
                       "of its JSON header"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("a JSON file, such as an index or a config.json?"), std::string::npos)
        << msg;
  }
  write("notes.safetensors", "these are my notes about the model, and a lot more of them");
  try {
    (void)open_checkpoint((dir_ / "notes.safetensors").string());
    ADD_FAILURE() << "read text as a safetensors file";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not a safetensors file"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'these ar': a text file?"), std::string::npos)
        << e.what();
  }
  write("bad.safetensors", file_with(R"({"t": {"dtype": "BF16", "shape": [2], "data)", 0));
  try {
    (void)open_checkpoint((dir_ / "bad.safetensors").string());
    ADD_FAILURE() << "read a header that is not JSON";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("bad.safetensors header: not valid JSON"),
              std::string::npos)
        << e.what();
  }
}

using Configs = TempDir;

// A config whose embedding has 2^63 elements: its bytes do not fit in 64 bits. Refused, naming
// the tensor, where inspect summed them wrapped (to a few gigabytes).
TEST_F(Configs, AConfigPastTheSizeLimitIsRefused) {
  write("config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4294967296,
    "num_hidden_layers": 1, "num_attention_heads": 1, "head_dim": 1, "intermediate_size": 1,
    "vocab_size": 2147483648, "tie_word_embeddings": true})");
  for (const std::string& path : {(dir_ / "config.json").string(), dir_.string()}) {
    for (int use = 0; use < 2; ++use) {
      try {
        if (use == 0) (void)inspect_path(path);
        if (use == 1) (void)load_model(path);
        ADD_FAILURE() << "accepted a model of 2^63 elements";
      } catch (const InvalidArgument& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
        EXPECT_NE(msg.find("'model.embed_tokens.weight'"), std::string::npos) << msg;
      }
    }
  }
}

TEST_F(Configs, ArchitecturesParseToTheCatalogShapes) {
  // The catalog's qwen3-30b-a3b, written as Hugging Face writes it.
  const std::string qwen = R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128, "vocab_size": 151936,
    "intermediate_size": 6144, "tie_word_embeddings": false, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "attention_bias": false, "torch_dtype": "bfloat16"})";
  write("config.json", qwen);
  ModelSpec m = load_model((dir_ / "config.json").string(), {.layers = 32});
  EXPECT_EQ(m.numel(), 20'562'192'384u);
  EXPECT_EQ(m.tensors.size(), 12'579u);
  EXPECT_EQ(load_model(dir_.string()).numel(), 30'532'122'624u);  // the directory works too
  // Transformers 5 writes the expert count as 'num_local_experts': the same model.
  const auto without = [](std::string text, const std::string& part, const std::string& with) {
    const std::size_t at = text.find(part);
    EXPECT_NE(at, std::string::npos) << part;
    return at == std::string::npos ? text : text.replace(at, part.size(), with);
  };
  std::string renamed = without(qwen, "\"num_experts\"", "\"num_local_experts\"");
  EXPECT_EQ(build_transformer("q", parse_hf_config(renamed, "c")).numel(), 30'532'122'624u);
  // Nor does it write a head_dim for Qwen3-MoE, whose attention then takes hidden / heads (64
  // here, not Qwen3Config's 128).
  renamed = without(renamed, "\"head_dim\": 128,", "");
  ASSERT_EQ(renamed.find("head_dim"), std::string::npos);
  ModelSpec t5 = build_transformer("q", parse_hf_config(renamed, "c"));
  bool found = false;
  for (const auto& t : t5.tensors) {
    if (t.name == "model.layers.0.self_attn.q_proj.weight") {
      EXPECT_EQ(t.shape, (Shape{32 * 64, 2048}));
      found = true;
    }
  }
  EXPECT_TRUE(found);
  const std::string llama = R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": false})";
  EXPECT_EQ(build_transformer("l", parse_hf_config(llama, "c")).numel(), 8'030'261'248u);
  // Qwen2 has q/k/v biases; tied embeddings drop lm_head.
  const std::string qwen2 = R"({"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 2,
    "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
    "vocab_size": 151936, "tie_word_embeddings": true})";
  ModelSpec q2 = build_transformer("q2", parse_hf_config(qwen2, "c"));
  EXPECT_EQ(q2.tensors[2].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(q2.tensors[2].shape, (Shape{896}));
  EXPECT_EQ(q2.tensors.back().name, "model.norm.weight");
  // Qwen2.5-0.5B's published parameter count.
  EXPECT_EQ(build_transformer("q2", parse_hf_config(
                                        R"({"model_type": "qwen2", "hidden_size": 896,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": true})",
                                        "c"))
                .numel(),
            494'032'768u);
}

TEST_F(Configs, MalformedConfigsAreRejectedWithTheFieldNamed) {
  const std::pair<std::string, std::string> cases[] = {
      {"[1, 2]", "not a JSON object"},
      {"{", "not valid JSON"},
      {R"({"hidden_size": 8})", "neither 'architectures' nor 'model_type'"},
      {R"({"architectures": ["GPT2LMHeadModel"]})", "'GPT2LMHeadModel' is not supported"},
      {R"({"architectures": []})", "not a non-empty list"},
      {R"({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2})",
       "'hidden_size' is missing"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": "big"})",
       "'hidden_size' is \"big\""},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": -4})", "'hidden_size' is -4"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 1e30})", "'hidden_size'"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 99999999999})",
       "implausibly large"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "hidden_size": 9})",
       "appears twice"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 0, "vocab_size": 10, "intermediate_size": 4})",
       "num_attention_heads"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": 4,
          "tie_word_embeddings": "yes"})",
       "'tie_word_embeddings' is not true or false"},
      {R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "vocab_size": 10, "moe_intermediate_size": 4})",
       "'num_experts' is missing"},
      {R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "vocab_size": 10, "moe_intermediate_size": 4,
          "num_experts": 2, "mlp_only_layers": "all"})",
       "'mlp_only_layers'"},
  };
  for (const auto& [text, says] : cases) {
    write("config.json", text);
    try {
      (void)load_model((dir_ / "config.json").string());
      ADD_FAILURE() << "accepted: " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW((void)load_model((dir_ / "nope.json").string()), InvalidArgument);
  // Products that overflow, and kv heads that do not divide the heads, name the file.
  for (const char* text :
       {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 4294967296, "head_dim": 4294967296, "intermediate_size": 4,
           "vocab_size": 10})",
        R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 3, "intermediate_size": 4,
           "vocab_size": 10})"}) {
    write("config.json", text);
    try {
      (void)load_model((dir_ / "config.json").string());
      ADD_FAILURE() << "accepted: " << text;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("config.json"), std::string::npos) << e.what();
    }
  }
}

TEST(Safetensors, ParseTimeGrowsLinearlyWithTheTensorCount) {
  // A parse callback once made nlohmann rescan every object: quadratic in the tensor count.
  // 8x the tensors: linear (with a log factor) costs about 8-11x, quadratic 64x. The two sizes
  // are timed in alternation and each keeps its best round, so that a busy machine (this suite
  // runs in parallel, under sanitizers too) slows both alike rather than one of them.
  auto header_of = [](int n) {
    json h = json::object();
    std::uint64_t off = 0;
    for (int i = 0; i < n; ++i) {
      h["model.layers." + std::to_string(i) + ".w"] = {
          {"dtype", "BF16"}, {"shape", {2}}, {"data_offsets", {off, off + 4}}};
      off += 4;
    }
    return file_with(h.dump(), off);
  };
  // This thread's CPU time: other processes stretch the wall clock, not the work done here.
  auto thread_seconds = [] {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) / 1e9;
  };
  auto seconds_to_parse = [&](const std::string& file, std::size_t want) {
    const double t0 = thread_seconds();
    EXPECT_EQ(parse(file).tensors.size(), want);
    return thread_seconds() - t0;
  };
  const std::string small_file = header_of(10000);
  const std::string large_file = header_of(80000);
  double small = 1e9;
  double large = 1e9;
  for (int round = 0; round < 4; ++round) {
    small = std::min(small, seconds_to_parse(small_file, 10000));
    large = std::min(large, seconds_to_parse(large_file, 80000));
  }
  EXPECT_LT(large / small, 24.0) << small << " s for 10k tensors, " << large << " s for 80k";
}

}  // namespace
}  // namespace zeroflat
