// The checkpoint loader: every rank's buffer equals the layout of the tensors read whole (for
// every file and buffer dtype, 1 to 3 ranks, round-robin or not, direct or through the ring),
// each rank reads only its partition's bytes, bad checkpoints are refused before any read, a
// read that fails midway fails every rank with nothing kept, and the rehearsal's accounting.
// Past 700 lines on purpose: every placement and read plan is checked against the same
// reference layouts and checkpoint writers, which live here.
#include "zeroflat/loader.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/pattern.h"
#include "device/host_kernels.h"
#include "model/files.h"
#include "source/checkpoint/files.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/comm.h"
#include "zeroflat/common.h"
#include "zeroflat/device.h"
#include "zeroflat/dtensor.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"
#include "zeroflat/model.h"

namespace zeroflat {
namespace {

// The layout options of a world of `world` ranks (ZeRO-3 partitions and shards take only dp).
LayoutOptions world_layout(std::uint64_t world) {
  LayoutOptions o;
  o.dp = world;
  return o;
}

// The loader's options as the tests take them: no master partition unless a test asks.
FlattenOptions load_options() {
  FlattenOptions o;
  o.master = false;
  return o;
}

// The all-gather steps' time of a load.
double allgather_seconds(const FlattenResult& res) {
  double s = 0;
  const std::vector<Step>& steps = res.chosen().steps;
  for (std::size_t k = 0; k < steps.size() && k < res.execution.step_seconds.size(); ++k) {
    if (steps[k].op == Op::kAllGather) s += res.execution.step_seconds[k];
  }
  return s;
}

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  const fs::path p =
      fs::path(::testing::TempDir()) / ("zeroflat_loader_" + std::to_string(getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

// The checkpoint's tensors as LoadParams, in the index's (natural) order.
std::vector<LoadParam> params_of(const CheckpointIndex& ck) {
  std::vector<LoadParam> out;
  for (const CheckpointTensor& t : ck.tensors) out.push_back(LoadParam{t.name, t.shape, {}});
  return out;
}

// Parameter p's values: its tensors read whole from their files with std::ifstream, each
// converted on its own to `dtype`, concatenated.
std::vector<unsigned char> values_of(const CheckpointIndex& ck, const LoadParam& p, DType dtype) {
  const std::uint64_t es = element_size(dtype);
  std::vector<unsigned char> out(shape_numel(p.shape) * es);
  std::vector<std::string> names = p.sources;
  if (names.empty()) names.push_back(p.name);
  std::uint64_t at = 0;
  for (const std::string& name : names) {
    const CheckpointTensor& t = *ck.find(name);
    std::vector<unsigned char> raw(t.bytes);
    std::ifstream in(ck.files[t.file], std::ios::binary);
    in.seekg(static_cast<std::streamoff>(t.offset));
    in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size()));
    EXPECT_TRUE(in) << t.name;
    detail::convert_range(out.data() + at, dtype, raw.data(), *t.type, t.numel);
    at += t.numel * es;
  }
  return out;
}

// The layout of the parameters' buffer.
Layout layout_of(const std::vector<LoadParam>& params, const LayoutOptions& options) {
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
  return Layout::compute(numels, options);
}

// What the buffer must hold: every parameter's values at its layout offset; zeros elsewhere.
std::vector<unsigned char> expected_flat(const CheckpointIndex& ck,
                                         const std::vector<LoadParam>& params,
                                         const LayoutOptions& options) {
  const Layout layout = layout_of(params, options);
  const std::uint64_t es = element_size(options.dtype);
  std::vector<unsigned char> flat(layout.flat_bytes(), 0);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::vector<unsigned char> v = values_of(ck, params[i], options.dtype);
    std::memcpy(flat.data() + layout.offsets()[i] * es, v.data(), v.size());
  }
  return flat;
}

// Runs body(rank, comm) on dp threads joined by a local group.
void on_ranks(int dp, const std::function<void(int, Communicator*)>& body) {
  if (dp == 1) {
    body(0, nullptr);
    return;
  }
  LocalGroup group(dp, std::chrono::seconds(30));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(dp);
  for (int r = 0; r < dp; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> c = group.rank(r);
      try {
        body(r, c.get());
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < dp; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

class LoaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ModelSpec m = catalog_model("tiny-moe");
    bf16_dir_ = new std::string(temp_dir("bf16"));
    fp32_dir_ = new std::string(temp_dir("fp32"));
    write_pattern_checkpoint(m, DType::kBF16, *bf16_dir_, 1'500'000);
    write_pattern_checkpoint(m, DType::kFP32, *fp32_dir_, 3'000'000);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*bf16_dir_);
    fs::remove_all(*fp32_dir_);
    delete bf16_dir_;
    delete fp32_dir_;
  }
  static std::string* bf16_dir_;
  static std::string* fp32_dir_;
};
std::string* LoaderTest::bf16_dir_ = nullptr;
std::string* LoaderTest::fp32_dir_ = nullptr;

TEST_F(LoaderTest, EveryRankHoldsTheLayoutOfTheTensorsAndReadsOnlyItsPartition) {
  for (const std::string* dir : {bf16_dir_, fp32_dir_}) {
    const CheckpointIndex ck = open_checkpoint(*dir);
    ASSERT_GT(ck.files.size(), 1u);
    const std::vector<LoadParam> params = params_of(ck);
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      for (int dp = 1; dp <= 3; ++dp) {
        for (bool rr : {false, true}) {
          for (bool ring : {false, true}) {
            SCOPED_TRACE(*dir + " -> " + std::string(dtype_name(dtype)) + " dp " +
                         std::to_string(dp) + (rr ? " rr" : "") + (ring ? " ring" : ""));
            FlattenOptions o = load_options();
            o.layout.dp = static_cast<std::uint64_t>(dp);
            o.layout.round_robin = rr;
            o.layout.dtype = dtype;
            o.read.through_ring = ring;
            o.read.ring_chunk_bytes =
                8192;  // many windows, cutting tensors and elements' neighbours
            o.read.ring_depth = 2;
            o.read.threads = 2;
            o.tier = Tier::kLoad;  // each rank its slice (load-whole: ReadPlans below)
            const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
            std::vector<std::uint64_t> read(dp, 0);
            on_ranks(dp, [&](int r, Communicator* comm) {
              std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
              const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, o);
              ASSERT_TRUE(res.feasible());
              ASSERT_EQ(res.group().layout.flat_bytes(), want.size());
              EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
              EXPECT_EQ(verify_load(ck, params, LoadPlacement::flat(), *dev, res.group(), 1, 0),
                        "");
              read[r] = res.read->bytes;
              // Exactly the partition's elements, at the file's element size.
              const Layout& l = res.group().layout;
              std::uint64_t bytes = 0;
              for (const Fragment& f :
                   l.fragments_in(r * l.partition_numel(), (r + 1) * l.partition_numel())) {
                bytes += f.numel * element_size(*ck.find(params[f.param].name)->type);
              }
              EXPECT_EQ(res.read->bytes, bytes);
              EXPECT_EQ(res.execution.measured_peak_device_bytes, res.predicted_peak_device_bytes);
              EXPECT_EQ(res.execution.measured_peak_host_bytes,
                        res.chosen().profile.peak_host_bytes);
            });
            // Together the ranks read every byte of the checkpoint once.
            std::uint64_t sum = 0, total = 0;
            for (std::uint64_t b : read) sum += b;
            for (const CheckpointTensor& t : ck.tensors) total += t.bytes;
            EXPECT_EQ(sum, total);
          }
        }
      }
    }
  }
}

TEST_F(LoaderTest, AnFp32FileOfBf16ValuesLoadsAsTheBf16Pattern) {
  const ModelSpec m = catalog_model("tiny-moe");
  const std::string dir = temp_dir("fp32_of_bf16");
  write_pattern_checkpoint(m, DType::kFP32, dir, 2'000'000, DType::kBF16);
  const CheckpointIndex ck = open_checkpoint(dir);
  const std::vector<LoadParam> params = params_of(ck);
  FlattenOptions o = load_options();
  o.layout.dtype = DType::kBF16;
  std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
  const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, nullptr, o);
  // Parameter i (natural order) holds the bf16 pattern i: what `zeroflat run --model DIR`
  // fills it with.
  for (std::size_t i = 0; i < params.size(); ++i) {
    const TensorRef& v = res.group().views[i];
    EXPECT_EQ(match_pattern(v.data, DType::kBF16, i, 0, v.numel), v.numel) << params[i].name;
  }
  fs::remove_all(dir);
}

TEST_F(LoaderTest, TiedWeightsShareOneTensor) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  std::vector<LoadParam> params = params_of(ck);
  // A second parameter reading the first tensor's values, as a tied lm_head reads the
  // embedding.
  params.push_back(LoadParam{"tied.copy", params.front().shape, {params.front().name}});
  FlattenOptions o = load_options();
  o.layout.dp = 2;
  const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
  on_ranks(2, [&](int, Communicator* comm) {
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
    const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, o);
    EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
    EXPECT_EQ(std::memcmp(res.group().views.back().data, res.group().views.front().data,
                          res.group().views.front().numel * 2),
              0);
  });
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return std::string("InvalidArgument: ") + e.what();
  } catch (const std::exception& e) {
    return std::string("other: ") + e.what();
  }
  return "";
}

// Runs load(rank, comm, device) on n ranks, threads of one local group, each with a cpu device
// of its own: each rank's error (error_of's text, "" for none); no rank keeps any memory after.
std::vector<std::string> errors_on_ranks(
    int n, const std::function<void(int, Communicator*, Device&)>& load) {
  std::vector<std::string> errors(n);
  LocalGroup group(n, std::chrono::seconds(30));
  std::vector<std::thread> t;
  for (int r = 0; r < n; ++r) {
    t.emplace_back([&, r] {
      std::unique_ptr<Communicator> c = group.rank(r);
      std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
      errors[r] = error_of([&] { load(r, c.get(), *dev); });
      const MemoryInfo mem = dev->memory_info();
      EXPECT_EQ(mem.allocated_bytes, 0u) << "rank " << r;
      EXPECT_EQ(mem.host_allocated_bytes, 0u) << "rank " << r;
    });
  }
  for (std::thread& th : t) th.join();
  return errors;
}

TEST_F(LoaderTest, BadGroupsAreRefusedOnEveryRankBeforeAnyRead) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> good = params_of(ck);
  // Rank 1 loads `mine`, rank 0 `theirs`, with `rank0_error` as rank 0's own error.
  auto on_two = [&](const std::vector<LoadParam>& mine, const std::vector<LoadParam>& theirs,
                    const std::string& rank0_error = "") {
    return errors_on_ranks(2, [&](int r, Communicator* c, Device& dev) {
      FlattenOptions o = load_options();
      o.layout.dp = 2;
      if (r == 0) o.local_error = rank0_error;
      load(ck, r == 1 ? mine : theirs, LoadPlacement::flat(), dev, c, o);
    });
  };
  // A missing tensor, named.
  std::vector<LoadParam> missing = good;
  missing.push_back(LoadParam{"no.such.weight", {4}, {}});
  std::vector<std::string> e = on_two(missing, missing);
  for (const std::string& m : e) {
    EXPECT_NE(m.find("InvalidArgument"), std::string::npos) << m;
    EXPECT_NE(m.find("no.such.weight"), std::string::npos) << m;
  }
  // A shape that disagrees, on one rank only: the other learns of it too.
  std::vector<LoadParam> shaped = good;
  shaped[3].shape.push_back(1);
  e = on_two(shaped, good);
  EXPECT_NE(e[1].find(good[3].name), std::string::npos) << e[1];
  EXPECT_NE(e[1].find("shape"), std::string::npos) << e[1];
  EXPECT_NE(e[0].find("rank 1"), std::string::npos) << e[0];
  EXPECT_NE(e[0].find("InvalidArgument"), std::string::npos) << e[0];
  // A caller's own error on one rank: every rank raises, nothing read.
  e = on_two(good, good, "the model has a parameter named nowhere");
  EXPECT_NE(e[0].find("named nowhere"), std::string::npos) << e[0];
  EXPECT_NE(e[1].find("rank 0"), std::string::npos) << e[1];
}

// A copy of the bf16 checkpoint to damage.
std::string copy_checkpoint(const std::string& from, const std::string& name) {
  const std::string to = temp_dir(name);
  fs::copy(from, to, fs::copy_options::recursive);
  return to;
}

// checkpoint_header_digest, what a caller compares across ranks instead of each load's own
// agreement: the same for the same copy opened again, another as soon as any entry the loader's
// agreement compares differs (a file's size; a tensor's name, dtype, shape or byte range; one
// tensor fewer).
TEST_F(LoaderTest, HeaderDigestCoversEveryEntryTheRanksCompare) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::uint64_t d = checkpoint_header_digest(ck);
  EXPECT_EQ(checkpoint_header_digest(open_checkpoint(*bf16_dir_)), d);
  const std::vector<std::function<void(CheckpointIndex&)>> changes = {
      [](CheckpointIndex& c) { c.file_bytes.back() += 1; },
      [](CheckpointIndex& c) { c.tensors.back().name += "x"; },
      [](CheckpointIndex& c) { c.tensors.back().dtype = "F16"; },
      [](CheckpointIndex& c) { c.tensors.back().shape.back() += 1; },
      [](CheckpointIndex& c) { c.tensors.back().offset += 2; },
      [](CheckpointIndex& c) { c.tensors.front().bytes -= 2; },
      [](CheckpointIndex& c) { c.tensors.pop_back(); },
  };
  for (std::size_t k = 0; k < changes.size(); ++k) {
    CheckpointIndex c = ck;
    changes[k](c);
    EXPECT_NE(checkpoint_header_digest(c), d) << "change " << k;
  }
}

TEST_F(LoaderTest, AFusedParameterConcatenatesItsTensorsInOrder) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  // Tensors of one shape, stacked as a MoE layer's experts are fused: [k, rows, cols].
  std::map<Shape, std::vector<std::string>> by_shape;
  for (const CheckpointTensor& t : ck.tensors) {
    if (t.shape.size() == 2) by_shape[t.shape].push_back(t.name);
  }
  std::vector<std::string> stack;
  Shape shape;
  for (const auto& [s, names] : by_shape) {
    if (names.size() >= 4) {
      stack.assign(names.begin(), names.begin() + 4);
      shape = s;
      break;
    }
  }
  ASSERT_FALSE(stack.empty());
  std::vector<LoadParam> params = params_of(ck);
  // Tensors in any order (not the checkpoint's), two of them twice.
  params.push_back(LoadParam{
      "fused.experts", {4, shape[0], shape[1]}, {stack[2], stack[0], stack[3], stack[1]}});
  params.push_back(LoadParam{"fused.pair", {2 * shape[0], shape[1]}, {stack[1], stack[2]}});
  for (int dp : {1, 3}) {
    FlattenOptions o = load_options();
    o.layout.dp = static_cast<std::uint64_t>(dp);
    o.layout.dtype = DType::kFP16;
    o.tier = Tier::kLoad;
    const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
    on_ranks(dp, [&](int r, Communicator* comm) {
      std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
      const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, o);
      EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
      EXPECT_EQ(verify_load(ck, params, LoadPlacement::flat(), *dev, res.group(), 1, 0), "");
      EXPECT_EQ(res.read->bytes, load_read_bytes(ck, params, LoadPlacement::flat(), o.layout, r));
    });
  }
  // Sources that do not hold the parameter's element count.
  std::vector<LoadParam> bad = {LoadParam{"fused", {5, shape[0], shape[1]}, stack}};
  std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
  const std::string m =
      error_of([&] { load(ck, bad, LoadPlacement::flat(), *dev, nullptr, load_options()); });
  EXPECT_NE(m.find("'fused'"), std::string::npos) << m;
  EXPECT_NE(m.find("elements"), std::string::npos) << m;
}

TEST_F(LoaderTest, BadCheckpointsAreRefusedNamingFileAndTensor) {
  // An index naming a shard that is not there.
  {
    const std::string dir = copy_checkpoint(*bf16_dir_, "missing_shard");
    const CheckpointIndex ck = open_checkpoint(dir);
    fs::remove(ck.files.back());
    const std::string m = error_of([&] { open_checkpoint(dir); });
    EXPECT_NE(m.find("InvalidArgument"), std::string::npos) << m;
    EXPECT_NE(m.find(fs::path(ck.files.back()).filename().string()), std::string::npos) << m;
    fs::remove_all(dir);
  }
  // A file shorter than its header says.
  {
    const std::string dir = copy_checkpoint(*bf16_dir_, "short");
    const CheckpointIndex ck = open_checkpoint(dir);
    fs::resize_file(ck.files.front(), ck.file_bytes.front() - 1);
    const std::string m = error_of([&] { open_checkpoint(dir); });
    EXPECT_NE(m.find("InvalidArgument"), std::string::npos) << m;
    EXPECT_NE(m.find(ck.files.front()), std::string::npos) << m;
    fs::remove_all(dir);
  }
  // Truncated after the headers were read: refused before any read, naming the file.
  {
    const std::string dir = copy_checkpoint(*bf16_dir_, "truncated_later");
    const CheckpointIndex ck = open_checkpoint(dir);
    fs::resize_file(ck.files.front(), ck.file_bytes.front() / 2);
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
    const std::string m = error_of(
        [&] { load(ck, params_of(ck), LoadPlacement::flat(), *dev, nullptr, load_options()); });
    EXPECT_NE(m.find("InvalidArgument"), std::string::npos) << m;
    EXPECT_NE(m.find(ck.files.front()), std::string::npos) << m;
    EXPECT_NE(m.find("truncated"), std::string::npos) << m;
    EXPECT_EQ(dev->memory_info().allocated_bytes, 0u);
    fs::remove_all(dir);
  }
  // An index that puts a tensor in the wrong shard.
  {
    const std::string dir = copy_checkpoint(*bf16_dir_, "wrong_shard");
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    nlohmann::json doc = nlohmann::json::parse(std::ifstream(index));
    const CheckpointIndex ck = open_checkpoint(dir);
    const CheckpointTensor& t = ck.tensors.front();
    const std::string other =
        fs::path(ck.files[(t.file + 1) % ck.files.size()]).filename().string();
    doc["weight_map"][t.name] = other;
    std::ofstream(index) << doc.dump();
    const std::string m = error_of([&] { open_checkpoint(dir); });
    EXPECT_NE(m.find("InvalidArgument"), std::string::npos) << m;
    EXPECT_NE(m.find(t.name), std::string::npos) << m;
    fs::remove_all(dir);
  }
  // A tensor of a dtype the loader does not read.
  {
    const std::string dir = temp_dir("int_tensor");
    fs::create_directories(dir);
    const std::string header = R"({"a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},)"
                               R"("ids":{"dtype":"I64","shape":[2],"data_offsets":[8,24]}})";
    std::ofstream f(fs::path(dir) / "model.safetensors", std::ios::binary);
    const std::uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header << std::string(24, '\0');
    f.close();
    const CheckpointIndex ck = open_checkpoint(dir);
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
    const std::string m = error_of(
        [&] { load(ck, params_of(ck), LoadPlacement::flat(), *dev, nullptr, load_options()); });
    EXPECT_NE(m.find("'ids'"), std::string::npos) << m;
    EXPECT_NE(m.find("I64"), std::string::npos) << m;
    // Without it, the rest loads.
    std::vector<LoadParam> floats = {LoadParam{"a", {4}, {}}};
    const FlattenResult res =
        load(ck, floats, LoadPlacement::flat(), *dev, nullptr, load_options());
    EXPECT_EQ(res.read->bytes, 8u);
    fs::remove_all(dir);
  }
}

TEST_F(LoaderTest, ReadPlansFillTheSameBufferAndAreChosenByTopology) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  std::uint64_t all = 0;
  for (const CheckpointTensor& t : ck.tensors) all += t.bytes;
  // load-whole: every rank reads the whole buffer, no all-gather, the same bytes as load.
  for (int dp : {2, 3}) {
    for (bool ring : {false, true}) {
      SCOPED_TRACE("dp " + std::to_string(dp) + (ring ? " ring" : ""));
      FlattenOptions o = load_options();
      o.layout.dp = static_cast<std::uint64_t>(dp);
      o.read.through_ring = ring;
      o.read.ring_chunk_bytes = 8192;
      o.tier = Tier::kLoadWhole;
      const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
      on_ranks(dp, [&](int, Communicator* comm) {
        std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
        const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, o);
        EXPECT_EQ(res.chosen().tier, Tier::kLoadWhole);
        EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
        EXPECT_EQ(res.read->bytes, all);
        EXPECT_EQ(allgather_seconds(res), 0.0);
        EXPECT_EQ(res.execution.measured_peak_device_bytes, res.predicted_peak_device_bytes);
        for (const Step& s : res.chosen().steps) EXPECT_NE(s.op, Op::kAllGather);
      });
    }
  }
  // Chosen by the cost model: one node of ranks sharing its page cache reads whole; separate
  // nodes sharing one storage read 1/N each and gather.
  struct Case {
    unsigned local_ranks;
    double storage;
    Tier want;
  };
  for (const Case& c : {Case{2, 0, Tier::kLoadWhole}, Case{2, 100e6, Tier::kLoadWhole},
                        Case{1, 100e6, Tier::kLoad}}) {
    SCOPED_TRACE(std::to_string(c.local_ranks) + " local, storage " + std::to_string(c.storage));
    FlattenOptions o = load_options();
    o.layout.dp = 2;
    o.probe.local_ranks = c.local_ranks;
    o.storage_bytes_per_second = c.storage;
    on_ranks(2, [&](int, Communicator* comm) {
      std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
      const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, o);
      EXPECT_EQ(res.chosen().tier, c.want) << res.plan.reason;
      EXPECT_EQ(res.plan.candidates.size(), 2u);
      EXPECT_NE(res.plan.reason.find(tier_name(c.want)), std::string::npos);
    });
  }
  // Copies that differ are caught under load-whole too (the ranks compare digests).
  const std::string other = copy_checkpoint(*bf16_dir_, "whole_other");
  {
    const CheckpointTensor& t = ck.tensors.front();
    std::fstream f(other + "/" + fs::path(ck.files[t.file]).filename().string(),
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(t.offset + 2));
    f.write("\x7f\x7f", 2);
  }
  const std::vector<std::string> errors =
      errors_on_ranks(2, [&](int r, Communicator* c, Device& dev) {
        const CheckpointIndex mine = open_checkpoint(r == 0 ? *bf16_dir_ : other);
        FlattenOptions o = load_options();
        o.layout.dp = 2;
        o.tier = Tier::kLoadWhole;
        o.read.copies = CopyCheck::kFull;
        load(mine, params_of(mine), LoadPlacement::flat(), dev, c, o);
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("hold different bytes"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("'" + ck.tensors.front().name + "'"), std::string::npos) << errors[r];
  }
  fs::remove_all(other);
}

// Two ranks, each loading its own copy of the checkpoint (as on two nodes); the errors, or "".
std::vector<std::string> load_two_copies(const std::string& a, const std::string& b,
                                         CopyCheck copies,
                                         const LoadPlacement& where = LoadPlacement::flat()) {
  return errors_on_ranks(2, [&](int r, Communicator* c, Device& dev) {
    const CheckpointIndex ck = open_checkpoint(r == 0 ? a : b);
    FlattenOptions o = load_options();
    o.layout.dp = 2;
    o.read.copies = copies;
    load(ck, params_of(ck), where, dev, c, o);
  });
}

TEST_F(LoaderTest, ASliceIsTheRanksPartitionOfTheFlatBufferAndNothingMore) {
  for (const std::string* dir : {bf16_dir_, fp32_dir_}) {
    const CheckpointIndex ck = open_checkpoint(*dir);
    const std::vector<LoadParam> params = params_of(ck);
    for (int dp = 1; dp <= 3; ++dp) {
      for (bool rr : {false, true}) {
        for (bool ring : {false, true}) {
          SCOPED_TRACE(*dir + " dp " + std::to_string(dp) + (rr ? " rr" : "") +
                       (ring ? " ring" : ""));
          FlattenOptions o = load_options();
          o.layout.dp = static_cast<std::uint64_t>(dp);
          o.layout.round_robin = rr;
          o.layout.dtype = DType::kFP32;  // an optimizer's fp32 partition
          o.read.through_ring = ring;
          o.read.ring_chunk_bytes = 8192;
          o.read.ring_depth = 2;
          o.master = true;  // the slice's own, up-cast (here: the same bytes)
          const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
          on_ranks(dp, [&](int r, Communicator* comm) {
            std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
            const FlattenResult res = load(ck, params, LoadPlacement::slice(), *dev, comm, o);
            ASSERT_TRUE(res.complete()) << res.plan.reason << res.execution.error;
            EXPECT_EQ(res.chosen().tier, Tier::kLoadSlice);
            for (const Step& s : res.chosen().steps) {
              EXPECT_NE(s.op, Op::kAllGather);
              EXPECT_NE(s.op, Op::kRepoint);
            }
            const Layout& l = res.group().layout;
            const std::uint64_t sb = l.partition_bytes();
            ASSERT_EQ(res.group().flat.num_bytes(), sb);
            EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data() + r * sb, sb), 0);
            ASSERT_TRUE(res.master);
            EXPECT_EQ(std::memcmp(res.master.data(), want.data() + r * sb, sb), 0);
            EXPECT_EQ(res.read->bytes, load_read_bytes(ck, params, LoadPlacement::slice(), o.layout,
                                                       static_cast<std::uint64_t>(r)));
            EXPECT_EQ(res.execution.measured_peak_device_bytes, res.predicted_peak_device_bytes);
            // The slice, never the whole buffer; and the master, built as the slice is read.
            EXPECT_EQ(res.predicted_peak_device_bytes, sb + res.master.num_bytes());
          });
        }
      }
    }
  }
}

TEST_F(LoaderTest, VerifySliceChecksTheRanksSliceAgainstTheTensorsAndItsPaddingAgainstZero) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  std::atomic<int> paddings_changed{0};
  for (int dp = 1; dp <= 3; ++dp) {
    for (bool rr : {false, true}) {
      SCOPED_TRACE("dp " + std::to_string(dp) + (rr ? " rr" : ""));
      FlattenOptions o = load_options();
      o.layout.dp = static_cast<std::uint64_t>(dp);
      o.layout.round_robin = rr;
      o.layout.dtype = DType::kFP32;
      o.layout.param_align_bytes = 32;  // DeepSpeed's 16 bytes of bf16, in fp32
      on_ranks(dp, [&](int r, Communicator* comm) {
        const auto rank = static_cast<std::uint64_t>(r);
        std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
        const FlattenResult res = load(ck, params, LoadPlacement::slice(), *dev, comm, o);
        ASSERT_TRUE(res.complete()) << res.plan.reason << res.execution.error;
        const FlatGroup& g = res.group();
        EXPECT_EQ(verify_load(ck, params, LoadPlacement::slice(), *dev, g, o.layout.dp, rank), "");
        auto* bytes = static_cast<unsigned char*>(g.flat.data());
        // A data element of the slice: the parameter holding it is named.
        const RankLayout mine = g.layout.rank(rank, false);
        ASSERT_FALSE(mine.fragments.empty());
        const Fragment& f = mine.fragments.back();
        const std::uint64_t at = (f.partition_offset + f.numel - 1) * 4 + 1;
        bytes[at] ^= 0x10;
        const std::string m =
            verify_load(ck, params, LoadPlacement::slice(), *dev, g, o.layout.dp, rank);
        EXPECT_NE(m.find("'" + params[f.param].name + "'"), std::string::npos) << m;
        bytes[at] ^= 0x10;
        // A padding byte (the interior alignment gaps and the trailing padding).
        std::vector<bool> data(g.layout.partition_numel(), false);
        for (const Fragment& x : mine.fragments) {
          for (std::uint64_t e = 0; e < x.numel; ++e) data[x.partition_offset + e] = true;
        }
        for (std::uint64_t e = 0; e < data.size(); ++e) {
          if (data[e]) continue;
          ASSERT_EQ(bytes[e * 4], 0);
          bytes[e * 4 + 2] = 1;
          const std::string pad =
              verify_load(ck, params, LoadPlacement::slice(), *dev, g, o.layout.dp, rank);
          EXPECT_EQ(pad, "padding byte " + std::to_string(e * 4 + 2) + " is not zero");
          bytes[e * 4 + 2] = 0;
          ++paddings_changed;
          break;
        }
        EXPECT_EQ(verify_load(ck, params, LoadPlacement::slice(), *dev, g, o.layout.dp, rank), "");
        // Another rank's slice, another group, a rank outside the layout.
        if (dp > 1) {
          EXPECT_NE(verify_load(ck, params, LoadPlacement::slice(), *dev, g, o.layout.dp,
                                (rank + 1) % o.layout.dp),
                    "");
        }
        EXPECT_NE(verify_load(ck, std::span(params).first(params.size() - 1),
                              LoadPlacement::slice(), *dev, g, o.layout.dp, rank),
                  "");
        EXPECT_NE(verify_load(ck, params, LoadPlacement::slice(), *dev, g, o.layout.dp, o.layout.dp)
                      .find("outside"),
                  std::string::npos);
      });
    }
  }
  EXPECT_GT(paddings_changed.load(), 0);
}

TEST_F(LoaderTest, CopiesWhoseHeadersDifferAreRefusedOnEveryRankNamingTheTensor) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const CheckpointTensor& t = ck.tensors[3];
  // One copy's header says F16 where the other says BF16 (the same header length: JSON allows
  // the space).
  const std::string b = copy_checkpoint(*bf16_dir_, "relabelled");
  {
    const std::string file = b + "/" + fs::path(ck.files[t.file]).filename().string();
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    std::uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, '\0');
    f.read(header.data(), static_cast<std::streamsize>(n));
    const std::size_t at = header.find("\"" + t.name + "\"");
    ASSERT_NE(at, std::string::npos);
    const std::size_t d = header.find("\"BF16\"", at);
    ASSERT_NE(d, std::string::npos);
    header.replace(d, 6, "\"F16\" ");
    f.seekp(8);
    f.write(header.data(), static_cast<std::streamsize>(n));
  }
  const std::vector<std::string> e = load_two_copies(*bf16_dir_, b, CopyCheck::kOff);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(e[r].find("InvalidArgument"), std::string::npos) << e[r];
    EXPECT_NE(e[r].find("'" + t.name + "'"), std::string::npos) << e[r];
    EXPECT_NE(e[r].find("differs between the ranks' copies"), std::string::npos) << e[r];
  }
  fs::remove_all(b);
}

TEST_F(LoaderTest, CopiesWhoseBytesDifferAreRefusedOnEveryRank) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  // One flipped byte in every 4 KiB of every tensor: the sampled check (the default) must land
  // on one; a single flipped byte needs the full check.
  const std::string many = copy_checkpoint(*bf16_dir_, "many_flips");
  const std::string one = copy_checkpoint(*bf16_dir_, "one_flip");
  for (const CheckpointTensor& t : ck.tensors) {
    const std::string name = fs::path(ck.files[t.file]).filename().string();
    std::fstream f(many + "/" + name, std::ios::in | std::ios::out | std::ios::binary);
    for (std::uint64_t at = t.offset; at < t.offset + t.bytes; at += 4096) {
      f.seekg(static_cast<std::streamoff>(at));
      char c = 0;
      f.read(&c, 1);
      c = static_cast<char>(c ^ 0x40);
      f.seekp(static_cast<std::streamoff>(at));
      f.write(&c, 1);
    }
  }
  const CheckpointTensor& last = ck.tensors.back();
  {
    const std::string name = fs::path(ck.files[last.file]).filename().string();
    std::fstream f(one + "/" + name, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(last.offset + last.bytes / 2);
    f.seekg(at);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(at);
    f.write(&c, 1);
  }
  // ZeRO-3's partitions and a slice alone (no rank holds another's bytes) are checked as well.
  for (const LoadPlacement& where :
       {LoadPlacement::flat(), LoadPlacement::partitions(), LoadPlacement::slice()}) {
    for (const auto& [dir, check] :
         {std::pair{many, CopyCheck::kSampled}, std::pair{one, CopyCheck::kFull}}) {
      SCOPED_TRACE(std::string(copy_check_name(check)) + " " +
                   std::string(load_placement_name(where.kind)));
      const std::vector<std::string> e = load_two_copies(*bf16_dir_, dir, check, where);
      for (int r = 0; r < 2; ++r) {
        EXPECT_NE(e[r].find("hold different bytes"), std::string::npos) << e[r];
        EXPECT_EQ(e[r].find("InvalidArgument"), std::string::npos) << e[r];
      }
      // At least one rank names the tensor and the file.
      EXPECT_TRUE(e[0].find("tensor '") != std::string::npos ||
                  e[1].find("tensor '") != std::string::npos)
          << e[0] << "\n"
          << e[1];
    }
    // Identical copies pass every check.
    for (CopyCheck check : {CopyCheck::kOff, CopyCheck::kSampled, CopyCheck::kFull}) {
      const std::string same = copy_checkpoint(*bf16_dir_, "same");
      const std::vector<std::string> e = load_two_copies(*bf16_dir_, same, check, where);
      EXPECT_EQ(e[0], "");
      EXPECT_EQ(e[1], "");
      fs::remove_all(same);
    }
  }
  fs::remove_all(many);
  fs::remove_all(one);
}

TEST_F(LoaderTest, ASourceOfTheRightSizeButAnotherShapeIsRefused) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const CheckpointTensor* two_d = nullptr;
  for (const CheckpointTensor& t : ck.tensors) {
    if (t.shape.size() == 2 && t.shape[0] != t.shape[1]) two_d = &t;
  }
  ASSERT_NE(two_d, nullptr);
  const Shape transposed = {two_d->shape[1], two_d->shape[0]};
  // Stacked as one expert of a fused parameter, expected transposed: refused, naming it.
  std::vector<LoadParam> p = {LoadParam{"fused",
                                        {2, transposed[0], transposed[1]},
                                        {two_d->name, two_d->name},
                                        {transposed, transposed}}};
  std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
  const std::string m =
      error_of([&] { load(ck, p, LoadPlacement::flat(), *dev, nullptr, load_options()); });
  EXPECT_NE(m.find("InvalidArgument"), std::string::npos) << m;
  EXPECT_NE(m.find("'" + two_d->name + "'"), std::string::npos) << m;
  EXPECT_NE(m.find(shape_to_string(transposed)), std::string::npos) << m;
  // The shape it has loads.
  p[0] = LoadParam{"fused",
                   {2, two_d->shape[0], two_d->shape[1]},
                   {two_d->name, two_d->name},
                   {two_d->shape, two_d->shape}};
  EXPECT_EQ(load(ck, p, LoadPlacement::flat(), *dev, nullptr, load_options()).read->bytes,
            2 * two_d->bytes);
}

TEST(Loader, ManyShardsLoadUnderALowOpenFileLimit) {
  // More shards than the descriptors this process may open: a rank keeps a bounded number open,
  // reading them and mapping them (a mapping holds its file without a descriptor).
  const std::string dir = temp_dir("many_shards");
  ModelSpec m = catalog_model("tiny-moe");
  write_pattern_checkpoint(m, DType::kBF16, dir, 4096);
  const CheckpointIndex ck = open_checkpoint(dir);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &old), 0);
  std::uint64_t in_use = 0;
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) in_use += e.path().empty() ? 0 : 1;
  const rlimit low{in_use + 32, old.rlim_max};
  ASSERT_GT(ck.files.size(), low.rlim_cur) << "the checkpoint needs more shards than the limit";
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  std::string error;
  std::vector<unsigned char> flat;
  std::vector<unsigned char> want;
  {
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
    try {
      const FlattenResult res =
          load(ck, params_of(ck), LoadPlacement::flat(), *dev, nullptr, load_options());
      const auto* p = static_cast<const unsigned char*>(res.group().flat.data());
      flat.assign(p, p + res.group().layout.flat_bytes());
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  std::vector<FileRange> ranges;
  for (const CheckpointTensor& t : ck.tensors) ranges.push_back({t.file, t.offset, t.bytes});
  std::optional<MappedRanges> mapped;
  try {
    mapped = map_file_ranges(ck, ranges, {2});
  } catch (const std::exception& e) {
    error += e.what();
  }
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &old), 0);
  EXPECT_EQ(error, "");
  EXPECT_EQ(flat, expected_flat(ck, params_of(ck), LayoutOptions{}));
  ASSERT_TRUE(mapped.has_value());
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    const CheckpointTensor& t = ck.tensors[k];
    const std::vector<unsigned char> want_t =
        values_of(ck, LoadParam{t.name, t.shape, {}}, *t.type);
    if (want_t.empty()) continue;
    ASSERT_EQ(std::memcmp(mapped->data(k), want_t.data(), want_t.size()), 0) << t.name;
  }
  fs::remove_all(dir);
}

TEST_F(LoaderTest, AReadInPartsGatheredAsTheyArriveFillsTheSameBuffer) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  for (int dp : {2, 3}) {
    for (bool ring : {false, true}) {
      for (std::uint32_t parts : {1u, 3u, 7u}) {
        SCOPED_TRACE("dp " + std::to_string(dp) + (ring ? " ring" : "") + ", " +
                     std::to_string(parts) + " parts");
        FlattenOptions o = load_options();
        o.layout.dp = static_cast<std::uint64_t>(dp);
        o.read.through_ring = ring;
        o.read.ring_chunk_bytes = 16384;
        o.tier = Tier::kLoad;
        const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
        on_ranks(dp, [&](int r, Communicator* comm) {
          FlattenOptions mine = o;
          // The ranks take the fewest parts any of them asks for.
          mine.execute.gather_parts = parts + (parts > 1 ? static_cast<std::uint32_t>(r) : 0);
          std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
          const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, mine);
          ASSERT_TRUE(res.complete()) << res.execution.error;
          ASSERT_GE(res.input.layout.partition_bytes(), parts * (64u << 10));
          EXPECT_EQ(res.execution.gather_parts, parts);
          EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
          if (parts == 1) EXPECT_EQ(res.execution.overlapped_gather_seconds, 0.0);
        });
      }
    }
  }
  // A fault injected at the read: every rank rolls back, none waits for a part.
  const std::vector<std::string> errors =
      errors_on_ranks(2, [&](int r, Communicator* c, Device& dev) {
        FlattenOptions o = load_options();
        o.layout.dp = 2;
        o.tier = Tier::kLoad;
        o.execute.gather_parts = 4;
        const std::vector<Step> steps =
            load_steps(layout_of(params, o.layout), static_cast<std::uint64_t>(r), 0, Tier::kLoad);
        for (std::size_t k = 0; k < steps.size(); ++k) {
          if (steps[k].op == Op::kRead && r == 1) o.execute.fault_step = k;
        }
        const FlattenResult res = load(ck, params, LoadPlacement::flat(), dev, c, o);
        if (!res.complete()) throw Error(res.execution.error);
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("failed on rank 1"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rolled back"), std::string::npos) << errors[r];
  }
  // A read that fails in its third part, after more bytes than any one part holds: the count is
  // the step's, and every rank fails, none waiting for a part.
  const std::vector<std::string> late =
      errors_on_ranks(2, [&](int r, Communicator* c, Device& dev) {
        FlattenOptions o = load_options();
        o.layout.dp = 2;
        o.tier = Tier::kLoad;
        o.execute.gather_parts = 4;
        const std::uint64_t slice = layout_of(params, o.layout).partition_bytes();
        if (r == 1) o.read.fail_after_bytes = slice * 3 / 4;
        load(ck, params, LoadPlacement::flat(), dev, c, o);
      });
  EXPECT_NE(late[1].find("bytes ["), std::string::npos) << late[1];
  EXPECT_NE(late[0].find("rank 1"), std::string::npos) << late[0];
}

TEST_F(LoaderTest, TheMasterPartitionIsBuiltAsTheSliceIsRead) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  for (int dp : {1, 2, 3}) {
    for (std::uint32_t parts : {1u, 4u}) {
      SCOPED_TRACE("dp " + std::to_string(dp) + ", " + std::to_string(parts) + " parts");
      FlattenOptions o = load_options();
      o.layout.dp = static_cast<std::uint64_t>(dp);
      o.tier = Tier::kLoad;
      o.master = true;
      o.execute.gather_parts = parts;
      const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
      on_ranks(dp, [&](int r, Communicator* comm) {
        std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
        const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, o);
        ASSERT_TRUE(res.complete()) << res.execution.error;
        const Layout& l = res.group().layout;
        ASSERT_GE(l.partition_bytes(), parts * (64u << 10));
        EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
        // The partition's elements up-cast, padding included.
        std::vector<float> master(l.partition_numel());
        detail::upcast_range(master.data(), want.data() + r * l.partition_bytes(), DType::kBF16,
                             master.size());
        ASSERT_TRUE(res.master);
        ASSERT_EQ(res.master.num_bytes(), master.size() * 4);
        EXPECT_EQ(std::memcmp(res.master.data(), master.data(), master.size() * 4), 0);
        // Built inside the run, beside the buffer, as predicted.
        EXPECT_EQ(res.execution.measured_peak_device_bytes, res.predicted_peak_device_bytes);
        EXPECT_GE(res.execution.measured_peak_device_bytes,
                  l.flat_bytes() + res.master.num_bytes());
      });
    }
  }
  // A read that fails in its third part: every rank rolls back, and nothing of the master is
  // left held.
  const std::vector<std::string> errors =
      errors_on_ranks(2, [&](int r, Communicator* c, Device& dev) {
        FlattenOptions o = load_options();
        o.layout.dp = 2;
        o.tier = Tier::kLoad;
        o.master = true;
        o.execute.gather_parts = 4;
        const std::uint64_t slice = layout_of(params, o.layout).partition_bytes();
        if (r == 1) o.read.fail_after_bytes = slice * 3 / 4;
        const FlattenResult res = load(ck, params, LoadPlacement::flat(), dev, c, o);
        EXPECT_FALSE(res.master);
        EXPECT_EQ(dev.memory_info().allocated_bytes, 0u);
        if (!res.complete()) throw Error(res.execution.error);
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rolled back"), std::string::npos) << errors[r];
  }
}

// Passes every collective on to a rank's communicator; each part all-gather first waits a
// while (a slow network), then notes how many bytes the rank had read by its end.
class SlowPartGathers : public Communicator {
 public:
  SlowPartGathers(Communicator* inner, const ReadProgress* progress)
      : inner_(inner), progress_(progress) {}
  std::string name() const override { return inner_->name(); }
  int rank() const noexcept override { return inner_->rank(); }
  int size() const noexcept override { return inner_->size(); }
  void all_gather_inplace(void* b, std::uint64_t sb, Device& d) override {
    inner_->all_gather_inplace(b, sb, d);
  }
  bool gathers_parts(const Device& d) const noexcept override { return inner_->gathers_parts(d); }
  void all_gather_part(void* b, std::uint64_t sb, std::uint64_t offset, std::uint64_t bytes,
                       Device& d) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(40));
    inner_->all_gather_part(b, sb, offset, bytes, d);
    parts.push_back({offset, progress_->done.load()});
  }
  void all_reduce_min(std::span<std::uint64_t> v) override { inner_->all_reduce_min(v); }
  void all_reduce_max(std::span<std::uint64_t> v) override { inner_->all_reduce_max(v); }
  void barrier() override { inner_->barrier(); }
  void abort(const std::string& why) noexcept override { inner_->abort(why); }

  // Each part all-gather's offset in the slice, and the bytes read when it ended.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> parts;

 private:
  Communicator* inner_;
  const ReadProgress* progress_;
};

TEST_F(LoaderTest, AReadRunsAtMostTwoPartsAheadOfTheirAllGathers) {
  // Ranks that share a storage then read at one pace: a rank that is ahead waits for the
  // others' parts to be gathered instead of taking the storage from them.
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  FlattenOptions o = load_options();
  o.layout.dp = 2;
  o.tier = Tier::kLoad;
  o.execute.gather_parts = 6;
  const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
  // The same slice read in one part: its reads, which parts do not change (a tensor cut by a
  // parts' edge is still one read).
  std::vector<std::uint64_t> whole_reads(2, 0);
  on_ranks(2, [&](int r, Communicator* comm) {
    FlattenOptions one = o;
    one.execute.gather_parts = 1;
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
    const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, comm, one);
    ASSERT_TRUE(res.complete()) << res.execution.error;
    whole_reads[r] = res.read->reads;
  });
  on_ranks(2, [&](int r, Communicator* comm) {
    FlattenOptions mine = o;
    mine.read.progress = std::make_shared<ReadProgress>();
    SlowPartGathers slow(comm, mine.read.progress.get());
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
    const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, &slow, mine);
    ASSERT_TRUE(res.complete()) << res.execution.error;
    EXPECT_EQ(res.execution.gather_parts, 6u);
    EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
    EXPECT_EQ(res.read->reads, whole_reads[r]);
    // Five parts gathered during the read, the last by the all-gather step: when part i's
    // gather ended, nothing of part i + 2 had been read.
    ASSERT_EQ(slow.parts.size(), 6u);
    const std::uint64_t slice = res.input.layout.partition_bytes();
    for (std::size_t i = 0; i < slow.parts.size(); ++i) {
      const std::uint64_t part_after_next =
          i + 2 < slow.parts.size() ? slow.parts[i + 2].first : slice;
      EXPECT_LE(slow.parts[i].second, part_after_next) << "part " << i;
      EXPECT_GE(slow.parts[i].second, i + 1 < slow.parts.size() ? slow.parts[i + 1].first : slice)
          << "part " << i;
    }
  });
}

TEST_F(LoaderTest, AReadThatFailsMidwayFailsEveryRankAndKeepsNothing) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  for (bool ring : {false, true}) {
    for (std::uint32_t parts : {1u, 4u}) {
      SCOPED_TRACE(std::string(ring ? "ring" : "direct") + ", " + std::to_string(parts) + " parts");
      const std::vector<std::string> errors =
          errors_on_ranks(3, [&](int r, Communicator* c, Device& dev) {
            FlattenOptions o = load_options();
            o.layout.dp = 3;
            o.read.through_ring = ring;
            o.read.ring_chunk_bytes = 16384;
            o.tier = Tier::kLoad;  // the other ranks learn of the failure at the all-gather
            o.execute.gather_parts = parts;
            if (r == 1) o.read.fail_after_bytes = 100'000;
            load(ck, params, LoadPlacement::flat(), dev, c, o);
          });
      // The failing rank names the file, the tensor and the byte range; the others name it.
      EXPECT_NE(errors[1].find(".safetensors"), std::string::npos) << errors[1];
      EXPECT_NE(errors[1].find("tensor '"), std::string::npos) << errors[1];
      EXPECT_NE(errors[1].find("bytes ["), std::string::npos) << errors[1];
      for (int r : {0, 2}) {
        EXPECT_NE(errors[r].find("rank 1"), std::string::npos) << errors[r];
        EXPECT_EQ(errors[r].find("InvalidArgument"), std::string::npos) << errors[r];
      }
    }
  }
}

TEST(Loader, TheSeedsFortyEightLayersRehearsedOnEightSimulatedH100s) {
  const ModelSpec m = catalog_model("qwen3-30b-a3b", ModelOverrides{48, std::nullopt});
  const CheckpointIndex ck =
      pattern_checkpoint_index(m, DType::kBF16, "(rehearsal)", 5'000'000'000);
  std::vector<LoadParam> params;
  for (const TensorSpec& t : m.tensors) params.push_back(LoadParam{t.name, t.shape, {}});
  std::uint64_t total = 0;
  for (const CheckpointTensor& t : ck.tensors) total += t.bytes;
  // The flat buffer on every rank, and ZeRO-3's partitions (each rank's own buffer).
  for (bool partitions : {false, true}) {
    SCOPED_TRACE(partitions ? "partitions" : "flat");
    std::vector<std::uint64_t> read(8, 0);
    on_ranks(8, [&](int r, Communicator* comm) {
      std::unique_ptr<Device> dev = make_device("sim:h100-80gb", DeviceOptions{1, true});
      FlattenOptions o = load_options();
      o.layout.dp = 8;
      o.probe.local_ranks = 8;
      const FlattenResult res =
          load(ck, params, partitions ? LoadPlacement::partitions() : LoadPlacement::flat(), *dev,
               comm, o);
      ASSERT_TRUE(res.feasible()) << res.plan.reason;
      EXPECT_EQ(res.execution.measured_peak_device_bytes, res.predicted_peak_device_bytes);
      // The buffer alone on the device: no second copy, ever.
      EXPECT_EQ(res.predicted_peak_device_bytes, res.group().layout.flat_bytes());
      EXPECT_EQ(res.execution.measured_peak_host_bytes, res.chosen().profile.peak_host_bytes);
      EXPECT_GT(res.chosen().profile.peak_host_bytes, 0u);  // the staging ring
      EXPECT_EQ(res.chosen().profile.read_bytes, res.group().layout.partition_bytes());
      if (partitions) {
        EXPECT_EQ(res.chosen().tier, Tier::kLoadPartitions);
        EXPECT_EQ(res.chosen().profile.comm_bytes, 0u);
        // Its partitions: about 1/8 of the model.
        EXPECT_LT(res.group().layout.flat_bytes(), total / 8 + 8 * params.size());
      }
      read[r] = res.read->bytes;
    });
    std::uint64_t sum = 0;
    for (std::uint64_t b : read) sum += b;
    EXPECT_EQ(sum, total);
  }
  EXPECT_GT(total, 60'000'000'000u);
}

TEST(Loader, ABufferThatDoesNotFitIsReportedWithNothingAllocated) {
  const ModelSpec m = catalog_model("qwen3-30b-a3b", ModelOverrides{4, std::nullopt});
  const CheckpointIndex ck =
      pattern_checkpoint_index(m, DType::kBF16, "(rehearsal)", 5'000'000'000);
  std::vector<LoadParam> params;
  for (const TensorSpec& t : m.tensors) params.push_back(LoadParam{t.name, t.shape, {}});
  std::unique_ptr<Device> dev = make_device("sim:1GiB", DeviceOptions{1, true});
  const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, nullptr, load_options());
  EXPECT_FALSE(res.feasible());
  EXPECT_NE(res.plan.reason.find("exceeds"), std::string::npos) << res.plan.reason;
  EXPECT_EQ(dev->memory_info().peak_allocated_bytes, 0u);
}

TEST_F(LoaderTest, TheCeilingReadsTheBytesAskedForAndVerifyCatchesACorruptByte) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  std::uint64_t total = 0;
  for (const CheckpointTensor& t : ck.tensors) total += t.bytes;
  const ReadCeiling c = measure_read_ceiling(ck, total - 1000, 5000, 2, false);
  EXPECT_EQ(c.bytes, 5000u);  // wrapped around the end
  EXPECT_GT(c.seconds, 0.0);
  EXPECT_EQ(measure_read_ceiling(ck, 0, total * 2, 1, false).bytes, total);
  const std::vector<LoadParam> params = params_of(ck);
  std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
  const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, nullptr, load_options());
  ASSERT_EQ(verify_load(ck, params, LoadPlacement::flat(), *dev, res.group(), 1, 0), "");
  static_cast<unsigned char*>(res.group().flat.data())[res.group().layout.offsets()[5] * 2 + 3] ^=
      1;
  const std::string m = verify_load(ck, params, LoadPlacement::flat(), *dev, res.group(), 1, 0);
  EXPECT_NE(m.find(params[5].name), std::string::npos) << m;
  // A cached file reads as cached.
  EXPECT_GT(cached_fraction(ck.files.front(), 0, ck.file_bytes.front()), 0.5);
}

// ZeRO-3: what rank r's buffer must hold: elements [r * p, min((r + 1) * p, n)) of each
// parameter's values, then zeros up to p, the parameters' partitions back to back.
std::vector<unsigned char> expected_partitions(const CheckpointIndex& ck,
                                               const std::vector<LoadParam>& params, DType dtype,
                                               std::uint64_t world, std::uint64_t r) {
  const std::uint64_t es = element_size(dtype);
  std::vector<unsigned char> buffer;
  for (const LoadParam& p : params) {
    const std::uint64_t n = shape_numel(p.shape);
    const std::uint64_t part = (n + world - 1) / world;
    const std::vector<unsigned char> whole = values_of(ck, p, dtype);
    std::vector<unsigned char> slice(part * es, 0);
    for (std::uint64_t e = r * part; e < std::min((r + 1) * part, n); ++e) {
      std::memcpy(slice.data() + (e - r * part) * es, whole.data() + e * es, es);
    }
    buffer.insert(buffer.end(), slice.begin(), slice.end());
  }
  return buffer;
}

TEST_F(LoaderTest, ZeRO3EveryRankReadsOnlyItsPartitionsIntoTheStage3Buffer) {
  for (const std::string* dir : {bf16_dir_, fp32_dir_}) {
    const CheckpointIndex ck = open_checkpoint(*dir);
    std::vector<LoadParam> params = params_of(ck);
    // A tied weight and a fused parameter, as the Python loader hands them.
    params.push_back(LoadParam{"tied", ck.tensors[0].shape, {ck.tensors[0].name}});
    params.push_back(
        LoadParam{"fused",
                  {static_cast<std::int64_t>(ck.tensors[1].numel + ck.tensors[2].numel)},
                  {ck.tensors[1].name, ck.tensors[2].name}});
    std::uint64_t total = 0;
    for (const LoadParam& p : params) {
      std::vector<std::string> names = p.sources;
      if (names.empty()) names.push_back(p.name);
      for (const std::string& n : names) total += ck.find(n)->bytes;
    }
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      for (int world = 1; world <= 3; ++world) {
        for (bool ring : {false, true}) {
          SCOPED_TRACE(*dir + " -> " + std::string(dtype_name(dtype)) + " world " +
                       std::to_string(world) + (ring ? " ring" : ""));
          FlattenOptions o = load_options();
          o.layout.dp = static_cast<std::uint64_t>(world);
          o.layout.dtype = dtype;
          o.read.through_ring = ring;
          o.read.ring_chunk_bytes = 8192;
          o.read.ring_depth = 2;
          o.read.threads = 2;
          o.master = true;
          std::vector<std::uint64_t> read(world, 0);
          on_ranks(world, [&](int r, Communicator* comm) {
            const std::vector<unsigned char> want =
                expected_partitions(ck, params, dtype, world, r);
            std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
            const FlattenResult res = load(ck, params, LoadPlacement::partitions(), *dev, comm, o);
            ASSERT_TRUE(res.feasible()) << res.plan.reason;
            EXPECT_EQ(res.chosen().tier, Tier::kLoadPartitions);
            for (const Step& s : res.chosen().steps) EXPECT_NE(s.op, Op::kAllGather);
            ASSERT_EQ(res.group().layout.flat_bytes(), want.size());
            EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
            EXPECT_EQ(
                verify_load(ck, params, LoadPlacement::partitions(), *dev, res.group(), world, r),
                "");
            // The views are the partitions, at the Stage 3 offsets.
            std::vector<std::uint64_t> numels;
            for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
            const Zero3Layout z = Zero3Layout::compute(
                std::vector<std::vector<std::uint64_t>>{numels},
                Zero3Options{static_cast<std::uint64_t>(world), kDefaultSubGroupSize, dtype});
            for (std::size_t i = 0; i < params.size(); ++i) {
              EXPECT_EQ(res.group().views[i].numel, z.partition_numels()[i]);
              EXPECT_EQ(res.group().views[i].data,
                        static_cast<const unsigned char*>(res.group().flat.data()) +
                            z.offsets()[i] * element_size(dtype));
            }
            EXPECT_EQ(res.read->bytes, load_read_bytes(ck, params, LoadPlacement::partitions(),
                                                       world_layout(world), r));
            read[r] = res.read->bytes;
            EXPECT_EQ(res.execution.measured_peak_device_bytes, res.predicted_peak_device_bytes);
            EXPECT_EQ(res.execution.measured_peak_host_bytes, res.chosen().profile.peak_host_bytes);
            EXPECT_EQ(res.master.num_bytes(), z.buffer_numel() * 4);
          });
          // Together the ranks read every source byte once.
          std::uint64_t sum = 0;
          for (std::uint64_t b : read) sum += b;
          EXPECT_EQ(sum, total);
        }
      }
    }
  }
}

// A mesh of the DTensor tests: 1-D with Shard(0) (FSDP2) or, where a tensor has two dimensions,
// Shard(1) (strided runs); or 2 x 2 HSDP (Replicate(), Shard(0)). Its spec over params.
struct ShardCase {
  std::vector<std::uint64_t> mesh;
  bool hsdp, strided;
};
ShardSpec shard_spec(const std::vector<LoadParam>& params, const ShardCase& c) {
  const MeshPlacement rep{MeshPlacement::Kind::kReplicate, 0};
  const MeshPlacement s0{MeshPlacement::Kind::kShard, 0};
  const MeshPlacement s1{MeshPlacement::Kind::kShard, 1};
  ShardSpec spec;
  spec.mesh = c.mesh;
  std::uint64_t world = 1;
  for (std::uint64_t n : c.mesh) world *= n;
  for (std::uint64_t r = 0; r < world; ++r) {
    spec.coords.push_back(c.hsdp ? std::vector<std::uint64_t>{r / 2, r % 2}
                                 : std::vector<std::uint64_t>{r});
  }
  for (const LoadParam& p : params) {
    if (c.hsdp) {
      spec.placements.push_back({rep, s0});
    } else {
      spec.placements.push_back({c.strided && p.shape.size() == 2 ? s1 : s0});
    }
  }
  return spec;
}

// DTensor shards: each rank's buffer holds its local shard of every parameter (the elements the
// shard's runs name, in order, then zeros up to the padded size), read from its shards' bytes
// only; 1-D meshes of 1 to 4 ranks with Shard(0) (FSDP2), 2 x 2 (HSDP: Replicate(), Shard(0)),
// and Shard(1) (strided runs) where a tensor has two dimensions.
TEST_F(LoaderTest, DTensorShardsEveryRankReadsOnlyItsLocalShards) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  const MeshPlacement s0{MeshPlacement::Kind::kShard, 0};
  std::uint64_t total = 0;
  for (const CheckpointTensor& t : ck.tensors) total += t.bytes;
  for (const ShardCase& c : {ShardCase{{1}, false, false}, ShardCase{{2}, false, false},
                             ShardCase{{3}, false, false}, ShardCase{{4}, false, false},
                             ShardCase{{3}, false, true}, ShardCase{{2, 2}, true, false}}) {
    const ShardSpec spec = shard_spec(params, c);
    const std::uint64_t world = spec.coords.size();
    for (DType dtype : {DType::kBF16, DType::kFP32}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " on " + std::to_string(world) + " ranks" +
                   (c.hsdp ? " (HSDP)" : "") + (c.strided ? " (Shard(1))" : ""));
      FlattenOptions o = load_options();
      o.layout.dp = world;
      o.layout.dtype = dtype;
      o.read.threads = 2;
      std::vector<std::uint64_t> read(world, 0);
      on_ranks(static_cast<int>(world), [&](int r, Communicator* comm) {
        const std::uint64_t es = element_size(dtype);
        std::vector<unsigned char> want;
        for (std::size_t i = 0; i < params.size(); ++i) {
          const LocalShard sh = local_shard(params[i].shape, spec.mesh, spec.placements[i],
                                            spec.coords[static_cast<std::size_t>(r)]);
          const std::vector<unsigned char> whole = values_of(ck, params[i], dtype);
          std::vector<unsigned char> part(sh.padded_numel * es, 0);
          std::uint64_t at = 0;
          for (const ElementRun& run : sh.runs) {
            std::memcpy(part.data() + at * es, whole.data() + run.first * es, run.numel * es);
            at += run.numel;
          }
          want.insert(want.end(), part.begin(), part.end());
        }
        std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
        const FlattenResult res = load(ck, params, LoadPlacement::sharded(spec), *dev, comm, o);
        ASSERT_TRUE(res.feasible()) << res.plan.reason;
        EXPECT_EQ(res.chosen().tier, Tier::kLoadPartitions);
        ASSERT_EQ(res.group().layout.flat_bytes(), want.size());
        EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), want.size()), 0);
        EXPECT_EQ(res.read->bytes, load_read_bytes(ck, params, LoadPlacement::sharded(spec),
                                                   LayoutOptions{}, static_cast<std::uint64_t>(r)));
        read[static_cast<std::size_t>(r)] = res.read->bytes;
      });
      std::uint64_t sum = 0;
      for (std::uint64_t b : read) sum += b;
      // Every source byte read once per replica.
      EXPECT_EQ(sum, total * (c.hsdp ? 2 : 1));
    }
  }
  // A spec for another world is refused on every rank before anything is read.
  ShardSpec bad;
  bad.mesh = {3};
  bad.coords = {{0}, {1}, {2}};
  for (std::size_t i = 0; i < params.size(); ++i) bad.placements.push_back({s0});
  FlattenOptions o = load_options();
  o.layout.dp = 2;
  on_ranks(2, [&](int, Communicator* comm) {
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
    EXPECT_THROW(load(ck, params, LoadPlacement::sharded(bad), *dev, comm, o), InvalidArgument);
    EXPECT_EQ(dev->memory_info().allocated_bytes, 0u);
  });
}

// Shards used in place (loader.h): shard_file_ranges names the same parameters on every rank
// (Shard(0) and Replicate() of the file's dtype; none where a conversion or strided runs need a
// read), each rank's range holds exactly its shard's bytes, map_file_ranges maps them with those
// values, counts them, and a write to the memory leaves the file as it was.
// One load for every placement (loader.h's LoadPlacement): on each rank the reads planned_reads
// lists before the load are exactly the bytes the load reports, load_read_bytes agrees, the
// planned reads land inside the rank's buffer, verify_load finds the buffer equal to the tensors
// read whole, and finds a byte changed in it; the bytes the copies check reads are counted
// (copy_check_read_bytes), and none without the check.
TEST_F(LoaderTest, EveryPlacementIsOneLoadWhosePlannedReadsAreWhatItReadsAndVerified) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  struct Case {
    LoadPlacement where;
    std::uint64_t world;
  };
  const std::vector<Case> cases = {
      {LoadPlacement::flat(), 2},
      {LoadPlacement::slice(), 3},
      {LoadPlacement::partitions(), 3},
      {LoadPlacement::sharded(shard_spec(params, ShardCase{{2}, false, false})), 2},
      {LoadPlacement::sharded(shard_spec(params, ShardCase{{3}, false, true})), 3},
      {LoadPlacement::sharded(shard_spec(params, ShardCase{{2, 2}, true, false})), 4}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(load_placement_name(c.where.kind)) + " on " +
                 std::to_string(c.world) + " ranks");
    FlattenOptions o = load_options();
    o.layout.dp = c.world;
    o.read.threads = 2;
    // The flat buffer's reads are planned for kLoad (each rank its slice, then the all-gather).
    if (c.where.kind == LoadPlacement::Kind::kFlat) o.tier = Tier::kLoad;
    on_ranks(static_cast<int>(c.world), [&](int r, Communicator* comm) {
      const auto rank = static_cast<std::uint64_t>(r);
      const std::vector<PlannedRead> planned = planned_reads(ck, params, c.where, o.layout, rank);
      std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
      const FlattenResult res = load(ck, params, c.where, *dev, comm, o);
      ASSERT_TRUE(res.feasible()) << res.plan.reason;
      ASSERT_TRUE(res.read);
      std::uint64_t bytes = 0;
      const std::uint64_t es = element_size(o.layout.dtype);
      for (const PlannedRead& x : planned) {
        bytes += x.bytes;
        EXPECT_LE((x.dest + x.numel) * es, res.group().flat.num_bytes());
      }
      EXPECT_EQ(bytes, res.read->bytes);
      EXPECT_EQ(bytes, load_read_bytes(ck, params, c.where, o.layout, rank));
      EXPECT_GT(bytes, 0u);
      // The copies check (sampled) read other ranks' windows from this rank's copy: counted
      // beside bytes_read, at most 16 windows of 64 KiB per read range of each other rank.
      EXPECT_GT(res.read->copy_check_read_bytes, 0u);
      EXPECT_LE(res.read->copy_check_read_bytes, res.read->copy_check_bytes);
      EXPECT_EQ(verify_load(ck, params, c.where, *dev, res.group(), c.world, rank), "");
      // A byte of the rank's first planned read changed: verify names a difference.
      ASSERT_FALSE(planned.empty());
      auto* p = static_cast<unsigned char*>(res.group().flat.data()) + planned.front().dest * es;
      *p = static_cast<unsigned char>(*p ^ 0x5a);
      EXPECT_NE(verify_load(ck, params, c.where, *dev, res.group(), c.world, rank), "");
      *p = static_cast<unsigned char>(*p ^ 0x5a);
    });
  }
  FlattenOptions off = load_options();
  off.layout.dp = 2;
  off.read.copies = CopyCheck::kOff;
  on_ranks(2, [&](int, Communicator* comm) {
    std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{2});
    const FlattenResult res = load(ck, params, LoadPlacement::partitions(), *dev, comm, off);
    ASSERT_TRUE(res.read);
    EXPECT_EQ(res.read->copy_check_read_bytes, 0u);
    EXPECT_EQ(res.read->copy_check_bytes, 0u);
  });
}

// read_ahead (what a resume asks of the kernel before its loads) asks for a rank's planned reads,
// merged by file in file order: at least their bytes and no more than the files hold; a file
// gone since the index was read is skipped, never an error (the load reports it).
TEST_F(LoaderTest, ReadAheadAsksForTheRanksReadsAndSkipsWhatItCannotOpen) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  std::uint64_t files = 0;
  for (const std::string& f : ck.files) files += fs::file_size(f);
  const auto ranges = [](const CheckpointIndex& index, const std::vector<PlannedRead>& reads) {
    std::vector<detail::PathRange> out;
    for (const PlannedRead& r : reads) out.push_back({index.files[r.file], r.offset, r.bytes});
    return out;
  };
  for (std::uint64_t r = 0; r < 3; ++r) {
    const std::vector<PlannedRead> reads =
        planned_reads(ck, params, LoadPlacement::partitions(), world_layout(3), r);
    std::uint64_t bytes = 0;
    for (const PlannedRead& x : reads) bytes += x.bytes;
    const std::uint64_t asked = detail::read_ahead(ranges(ck, reads));
    EXPECT_GE(asked, bytes);
    EXPECT_LE(asked, files);
  }
  EXPECT_EQ(detail::read_ahead({}), 0u);
  CheckpointIndex gone = ck;
  for (std::string& f : gone.files) f += ".missing";
  EXPECT_EQ(detail::read_ahead(ranges(
                gone, planned_reads(ck, params, LoadPlacement::flat(), world_layout(2), 0))),
            0u);
}

TEST_F(LoaderTest, ShardsThatLieInTheFilesAreMappedInPlace) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  const MeshPlacement s0{MeshPlacement::Kind::kShard, 0};
  for (const ShardCase& c :
       {ShardCase{{1}, false, false}, ShardCase{{2}, false, false}, ShardCase{{3}, false, false},
        ShardCase{{3}, false, true}, ShardCase{{2, 2}, true, false}}) {
    SCOPED_TRACE(std::to_string(c.mesh.size()) + "-D mesh of " + std::to_string(c.mesh[0]) +
                 (c.strided ? ", Shard(1)" : ""));
    const ShardSpec spec = shard_spec(params, c);
    const std::uint64_t world = spec.coords.size();
    std::vector<bool> chosen;
    for (std::uint64_t r = 0; r < world; ++r) {
      // Another dtype than the file's: every shard is read (converted).
      for (const auto& x : shard_file_ranges(ck, params, spec, r, DType::kFP32)) {
        EXPECT_FALSE(x.has_value());
      }
      const auto ranges = shard_file_ranges(ck, params, spec, r, DType::kBF16);
      ASSERT_EQ(ranges.size(), params.size());
      std::vector<FileRange> asked;
      std::vector<std::vector<unsigned char>> want;
      for (std::size_t i = 0; i < params.size(); ++i) {
        const bool strided = c.strided && params[i].shape.size() == 2 && params[i].shape[0] > 1;
        EXPECT_EQ(ranges[i].has_value(), !strided) << params[i].name;
        if (r == 0) chosen.push_back(ranges[i].has_value());
        EXPECT_EQ(ranges[i].has_value(), chosen[i]) << params[i].name << ": ranks disagree";
        if (!ranges[i]) continue;
        const LocalShard sh =
            local_shard(params[i].shape, spec.mesh, spec.placements[i], spec.coords[r]);
        EXPECT_EQ(ranges[i]->bytes, sh.numel * 2) << params[i].name;
        const std::vector<unsigned char> whole = values_of(ck, params[i], DType::kBF16);
        want.emplace_back();
        for (const ElementRun& run : sh.runs) {
          want.back().insert(want.back().end(), whole.begin() + run.first * 2,
                             whole.begin() + (run.first + run.numel) * 2);
        }
        asked.push_back(*ranges[i]);
      }
      ReadProgress progress;
      const MappedRanges m = map_file_ranges(ck, asked, {2, &progress, world == 1, r == 0});
      ASSERT_EQ(m.size(), asked.size());
      std::uint64_t bytes = 0;
      for (std::size_t k = 0; k < asked.size(); ++k) {
        bytes += asked[k].bytes;
        if (asked[k].bytes == 0) {
          EXPECT_EQ(m.data(k), nullptr);
          continue;
        }
        ASSERT_EQ(want[k].size(), asked[k].bytes);
        EXPECT_EQ(std::memcmp(m.data(k), want[k].data(), want[k].size()), 0) << k;
      }
      EXPECT_EQ(m.bytes(), bytes);
      EXPECT_EQ(progress.done.load(), bytes);
      EXPECT_EQ(progress.planned.load(), bytes);
    }
  }
  // Private: a write to the memory stays in the process; the mapping outlives the object that
  // made it while a handle keeps it.
  const CheckpointTensor& t = ck.tensors.front();
  std::shared_ptr<const void> keep;
  unsigned char* data = nullptr;
  {
    const FileRange whole{t.file, t.offset, t.bytes};
    const MappedRanges m = map_file_ranges(ck, std::span<const FileRange>(&whole, 1), {1});
    keep = m.keep(0);
    data = m.data(0);
  }
  const unsigned char before = data[0];
  data[0] = static_cast<unsigned char>(before ^ 0xff);
  std::ifstream in(ck.files[t.file], std::ios::binary);
  in.seekg(static_cast<std::streamoff>(t.offset));
  EXPECT_EQ(static_cast<unsigned char>(in.get()), before);
  keep.reset();
  // A tensor at a byte that is no multiple of its element size is read, not mapped.
  CheckpointIndex odd = ck;
  odd.tensors.front().offset += 1;
  ShardSpec one{{1}, {{0}}, {}};
  for (std::size_t i = 0; i < params.size(); ++i) one.placements.push_back({s0});
  const auto ranges = shard_file_ranges(odd, params, one, 0, DType::kBF16);
  EXPECT_FALSE(ranges.front().has_value());
  EXPECT_TRUE(ranges.back().has_value());
}

// What ranks took outside a load (shards used in place, values read whole) is compared by the
// library as a load compares its reads: equal copies pass, and the file bytes read to compare
// are the other ranks' (every byte of them under "full"); a changed byte in one rank's copy, or
// a value one rank read otherwise, is every rank's InvalidArgument, the finder naming the file
// and the parameter.
TEST_F(LoaderTest, TakenCopiesAreComparedLikeALoadsReads) {
  constexpr int kRanks = 3;
  const std::string same = temp_dir("taken_same");
  const std::string other = temp_dir("taken_other");
  fs::copy(*bf16_dir_, same, fs::copy_options::recursive);
  fs::copy(*bf16_dir_, other, fs::copy_options::recursive);
  // Rank q takes every third tensor from q on, whole, in the order of the index.
  auto ranges_of = [](const CheckpointIndex& ck, int q) {
    std::vector<FileRange> out;
    for (std::size_t i = q; i < ck.tensors.size(); i += kRanks) {
      out.push_back({ck.tensors[i].file, ck.tensors[i].offset, ck.tensors[i].bytes});
    }
    return out;
  };
  struct Outcome {
    std::uint64_t read = 0;
    std::string error;
  };
  // Rank 2 reads the copy in `other`; `value_of(q)` is the value rank q read whole.
  auto run = [&](CopyCheck mode, const std::function<std::string(int)>& value_of) {
    LocalGroup group(kRanks, std::chrono::seconds(30));
    std::vector<Outcome> out(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        std::unique_ptr<Communicator> comm = group.rank(r);
        try {
          const CheckpointIndex ck = open_checkpoint(r == 2 ? other : same);
          TakenBytes taken;
          std::vector<std::vector<unsigned char>> held;
          for (int q = 0; q < kRanks; ++q) {
            taken.ranges.push_back(ranges_of(ck, q));
            taken.what.emplace_back();
            for (const FileRange& f : taken.ranges.back()) {
              taken.what.back().push_back("tensor at " + std::to_string(f.offset));
            }
          }
          for (const FileRange& f : taken.ranges[r]) {
            held.emplace_back(f.bytes);
            detail::File(ck.files[f.file]).read_at(held.back().data(), f.bytes, f.offset);
            taken.mine.push_back(held.back().data());
          }
          const std::string value = value_of(r);
          taken.value_names = {"buffer 'counts'"};
          taken.values = {std::span<const unsigned char>(
              reinterpret_cast<const unsigned char*>(value.data()), value.size())};
          out[r].read = check_taken_copies(ck, taken, *comm, mode);
        } catch (const InvalidArgument& e) {
          out[r].error = e.what();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return out;
  };
  const CheckpointIndex ck = open_checkpoint(same);
  auto total = [&](int q) {
    std::uint64_t n = 0;
    for (const FileRange& f : ranges_of(ck, q)) n += f.bytes;
    return n;
  };
  auto alike = [](int) { return std::string("1234"); };
  for (CopyCheck mode : {CopyCheck::kSampled, CopyCheck::kFull}) {
    const std::vector<Outcome> ok = run(mode, alike);
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(ok[r].error, "") << "rank " << r;
      std::uint64_t others = 0;
      for (int q = 0; q < kRanks; ++q) others += q == r ? 0 : total(q);
      if (mode == CopyCheck::kFull) EXPECT_EQ(ok[r].read, others) << "rank " << r;
      EXPECT_GT(ok[r].read, 0u) << "rank " << r;
      EXPECT_LE(ok[r].read, others) << "rank " << r;
    }
  }
  // A value one rank read otherwise.
  const std::vector<Outcome> value =
      run(CopyCheck::kSampled, [](int q) { return std::string(q == 1 ? "1235" : "1234"); });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_NE(value[r].error.find("hold different bytes"), std::string::npos) << value[r].error;
    EXPECT_NE(value[r].error.find("buffer 'counts' as the ranks read it"), std::string::npos)
        << value[r].error;
  }
  // One byte of rank 0's first tensor changed in rank 2's copy.
  const FileRange first = ranges_of(ck, 0).front();
  {
    const std::string path = other + "/" + fs::path(ck.files[first.file]).filename().string();
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(first.offset));
    const char c = static_cast<char>(f.get());
    f.seekp(static_cast<std::streamoff>(first.offset));
    f.put(static_cast<char>(c ^ 0x5a));
  }
  const std::vector<Outcome> bad = run(CopyCheck::kFull, alike);
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_NE(bad[r].error.find("hold different bytes"), std::string::npos) << bad[r].error;
  }
  EXPECT_NE(bad[2].error.find("rank 0 used"), std::string::npos) << bad[2].error;
  EXPECT_NE(bad[2].error.find("tensor at " + std::to_string(first.offset)), std::string::npos)
      << bad[2].error;
  fs::remove_all(same);
  fs::remove_all(other);
}

// Mapping is refused, nothing left mapped: a range outside its file, a file replaced since its
// headers were read (its bytes would be another run's).
TEST_F(LoaderTest, MappingRefusesRangesOutsideTheFileAndReplacedFiles) {
  const std::string dir = temp_dir("mapped_replaced");
  fs::copy(*bf16_dir_, dir, fs::copy_options::recursive);
  const CheckpointIndex ck = open_checkpoint(dir);
  const FileRange outside{0, ck.file_bytes[0] - 2, 4};
  try {
    (void)map_file_ranges(ck, std::span<const FileRange>(&outside, 1), {1});
    ADD_FAILURE() << "a range past the file's end was mapped";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(ck.files[0]), std::string::npos) << e.what();
  }
  // Another file of the same size renamed over it.
  const CheckpointTensor& t = ck.tensors.front();
  const std::string other = ck.files[t.file] + ".other";
  fs::copy_file(ck.files[t.file], other);
  fs::rename(other, ck.files[t.file]);
  const FileRange r{t.file, t.offset, t.bytes};
  try {
    (void)map_file_ranges(ck, std::span<const FileRange>(&r, 1), {1});
    ADD_FAILURE() << "a replaced file was mapped";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("replaced"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// Boxes of tensors (the DCP reader's requests): each box's elements in its row-major order,
// converted, from its runs' bytes only; a box outside its tensor, a tensor the checkpoint lacks
// and a missing destination are refused before anything is read.
TEST_F(LoaderTest, BoxesOfTensorsAreTheirElementsAndOnlyTheirBytes) {
  for (const std::string* dir : {bf16_dir_, fp32_dir_}) {
    const CheckpointIndex ck = open_checkpoint(*dir);
    for (DType to : {DType::kBF16, DType::kFP32}) {
      const std::uint64_t es = element_size(to);
      std::vector<BoxRead> boxes;
      std::vector<std::vector<unsigned char>> outs, wants;
      std::uint64_t want_bytes = 0;
      for (const CheckpointTensor& t : ck.tensors) {
        if (t.shape.empty()) continue;
        // The middle of every dimension: rows 1/3 to 2/3 (at least one), all else whole.
        BoxRead b;
        b.name = t.name;
        b.to = to;
        for (std::size_t d = 0; d < t.shape.size(); ++d) {
          const auto n = static_cast<std::uint64_t>(t.shape[d]);
          const std::uint64_t lo = d + 1 == t.shape.size() ? n / 3 : 0;
          const std::uint64_t len = d + 1 == t.shape.size() ? std::max<std::uint64_t>(1, n / 3) : n;
          b.offsets.push_back(std::min(lo, n - 1));
          b.sizes.push_back(n == 0 ? 0 : std::min(len, n - std::min(lo, n - 1)));
        }
        const std::vector<unsigned char> whole = values_of(ck, LoadParam{t.name, t.shape, {}}, to);
        std::vector<unsigned char> want;
        std::uint64_t elems = 0;
        for (const ElementRun& r : box_runs(t.shape, b.offsets, b.sizes)) {
          want.insert(want.end(), whole.begin() + static_cast<std::ptrdiff_t>(r.first * es),
                      whole.begin() + static_cast<std::ptrdiff_t>((r.first + r.numel) * es));
          elems += r.numel;
        }
        want_bytes += elems * element_size(*t.type);
        wants.push_back(std::move(want));
        outs.emplace_back(wants.back().size(), 0xAB);
        boxes.push_back(std::move(b));
      }
      for (std::size_t k = 0; k < boxes.size(); ++k) boxes[k].dst = outs[k].data();
      EXPECT_EQ(read_checkpoint_boxes(ck, boxes, 2), want_bytes);
      for (std::size_t k = 0; k < boxes.size(); ++k) EXPECT_EQ(outs[k], wants[k]) << boxes[k].name;
    }
    const CheckpointTensor& t = ck.tensors[0];
    std::vector<unsigned char> out(shape_numel(t.shape) * 4);
    BoxRead outside{
        t.name, std::vector<std::uint64_t>(t.shape.size(), 1), {}, out.data(), DType::kFP32};
    for (std::int64_t n : t.shape) outside.sizes.push_back(static_cast<std::uint64_t>(n));
    EXPECT_THROW(read_checkpoint_boxes(ck, std::vector<BoxRead>{outside}, 1), InvalidArgument);
    BoxRead missing{"no.such.tensor", {0}, {1}, out.data(), DType::kFP32};
    EXPECT_THROW(read_checkpoint_boxes(ck, std::vector<BoxRead>{missing}, 1), InvalidArgument);
    BoxRead nowhere{
        t.name, std::vector<std::uint64_t>(t.shape.size(), 0), {}, nullptr, DType::kFP32};
    for (std::int64_t n : t.shape) nowhere.sizes.push_back(static_cast<std::uint64_t>(n));
    EXPECT_THROW(read_checkpoint_boxes(ck, std::vector<BoxRead>{nowhere}, 1), InvalidArgument);
  }
}

// A safetensors file of F32 tensors, each `rows` rows of 1 MiB (every byte 1), in order.
void write_rows_file(const std::filesystem::path& file,
                     const std::vector<std::pair<std::string, std::uint64_t>>& tensors) {
  constexpr std::uint64_t kRow = std::uint64_t{1} << 20;
  nlohmann::json h = nlohmann::json::object();
  std::uint64_t at = 0;
  for (const auto& [name, rows] : tensors) {
    h[name] = {
        {"dtype", "F32"}, {"shape", {rows, kRow / 4}}, {"data_offsets", {at, at + rows * kRow}}};
    at += rows * kRow;
  }
  const std::string header = h.dump();
  std::ofstream out(file, std::ios::binary);
  const std::uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header;
  const std::vector<char> row(kRow, '\x01');
  for (std::uint64_t r = 0; r < at / kRow; ++r) {
    out.write(row.data(), static_cast<std::streamsize>(kRow));
  }
}

// Drops a file's pages; false where they stay (a directory in memory: tmpfs).
bool dropped(const std::filesystem::path& file) {
  const int fd = ::open(file.c_str(), O_RDONLY);
  if (fd < 0) return false;
  (void)::fdatasync(fd);
  (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return cached_fraction(file.string(), 0, std::filesystem::file_size(file)) < 0.05;
}

// A box of rows in the middle of a large tensor, read cold: exactly its bytes come from the
// disk, none past its end (read_checkpoint_boxes turns the kernel's read-ahead off as the
// loader's own reads do; it had been left on, reading up to several MB into other ranks' rows).
TEST(ReadCheckpointBoxes, ReadNoBytePastTheBoxCold) {
  namespace fs = std::filesystem;
  const fs::path file = fs::path(::testing::TempDir()) /
                        ("zf_boxes_cold_" + std::to_string(getpid()) + ".safetensors");
  constexpr std::uint64_t kRow = std::uint64_t{1} << 20;
  write_rows_file(file, {{"w", 96}});
  const CheckpointIndex ck = open_checkpoint(file.string());
  const std::uint64_t data = ck.file_bytes[0] - 96 * kRow;
  if (!dropped(file)) {
    fs::remove(file);
    GTEST_SKIP() << ::testing::TempDir() << " keeps its files in memory (tmpfs): nothing to drop";
  }
  std::vector<float> out(24 * kRow / 4);
  const BoxRead box{"w", {16, 0}, {24, kRow / 4}, out.data(), DType::kFP32};
  EXPECT_EQ(read_checkpoint_boxes(ck, std::vector<BoxRead>{box}, 1), 24 * kRow);
  EXPECT_GT(cached_fraction(file.string(), data + 16 * kRow, 24 * kRow), 0.99);
  // Nothing of the next 32 rows (several read-ahead windows of any disk) nor of the 8 before.
  EXPECT_LT(cached_fraction(file.string(), data + 40 * kRow, 32 * kRow), 0.01);
  EXPECT_LT(cached_fraction(file.string(), data + 8 * kRow, 8 * kRow), 0.01);
  // A caller that is the file's only reader (a job of one rank) keeps the kernel's read-ahead.
  ASSERT_TRUE(dropped(file));
  EXPECT_EQ(read_checkpoint_boxes(ck, std::vector<BoxRead>{box}, 1, true), 24 * kRow);
  EXPECT_GT(cached_fraction(file.string(), data + 40 * kRow, 32 * kRow), 0.02);
  fs::remove(file);
}

// Exact read-ahead where another rank reads the file, the kernel's where no other rank does (a
// rank's own optimizer file when a DeepSpeed checkpoint resumes at its world): two ranks, each
// its slice of [a, b], a first in a.safetensors, b in b.safetensors, each followed by a tensor
// nobody reads. Read cold, the kernel's read-ahead runs on past a rank's own run; with the
// group [a] alone, whose halves the two ranks read from one file, nothing past a is read.
TEST(LoadSlice, FilesNoOtherRankReadsAreReadWithTheKernelsReadAhead) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("zf_own_files_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  constexpr std::uint64_t kRow = std::uint64_t{1} << 20;
  write_rows_file(dir / "a.safetensors", {{"a", 16}, {"u", 32}});
  write_rows_file(dir / "b.safetensors", {{"b", 16}, {"v", 32}});
  const CheckpointIndex ck = open_checkpoint(dir.string());
  if (!dropped(dir / "a.safetensors")) {
    fs::remove_all(dir);
    GTEST_SKIP() << ::testing::TempDir() << " keeps its files in memory (tmpfs): nothing to drop";
  }
  const CheckpointTensor& u = *ck.find("u");
  const std::string a_file = ck.files[u.file];
  const auto after_a = [&] { return cached_fraction(a_file, u.offset, 32 * kRow); };
  for (const bool both : {true, false}) {
    SCOPED_TRACE(both ? "[a, b]: each rank its own file" : "[a]: one file, two ranks");
    std::vector<LoadParam> params = {LoadParam{"a", Shape{16, kRow / 4}}};
    if (both) params.push_back(LoadParam{"b", Shape{16, kRow / 4}});
    FlattenOptions o = load_options();
    o.layout.dp = 2;
    o.layout.dtype = DType::kFP32;
    o.read.cold = true;  // every file dropped before the reads
    o.read.copies = CopyCheck::kOff;
    on_ranks(2, [&](int, Communicator* comm) {
      std::unique_ptr<Device> dev = make_device("cpu", DeviceOptions{1});
      const FlattenResult res = load(ck, params, LoadPlacement::slice(), *dev, comm, o);
      ASSERT_TRUE(res.complete()) << res.plan.reason << res.execution.error;
    });
    if (both) {
      EXPECT_GT(after_a(), 0.02);  // the kernel's read-ahead went on into u
    } else {
      EXPECT_LT(after_a(), 0.01);
    }
  }
  fs::remove_all(dir);
}

TEST_F(LoaderTest, ZeRO3ErrorsAreRaisedOnEveryRankWithNothingKept) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> good = params_of(ck);
  std::vector<LoadParam> missing = good;
  missing.push_back(LoadParam{"no.such.weight", {4}, {}});
  // A tensor one rank lacks: InvalidArgument on every rank, the failing one naming it.
  std::vector<std::string> e = errors_on_ranks(3, [&](int r, Communicator* c, Device& dev) {
    FlattenOptions o = load_options();
    o.layout.dp = 3;
    load(ck, r == 2 ? missing : good, LoadPlacement::partitions(), dev, c, o);
  });
  for (int r = 0; r < 3; ++r) EXPECT_NE(e[r].find("InvalidArgument"), std::string::npos) << e[r];
  EXPECT_NE(e[2].find("no.such.weight"), std::string::npos) << e[2];
  // Options no Stage 3 buffer has, and a read plan of the flat placement.
  e = errors_on_ranks(2, [&](int, Communicator* c, Device& dev) {
    FlattenOptions o = load_options();
    o.layout.dp = 2;
    o.layout.round_robin = true;
    load(ck, good, LoadPlacement::partitions(), dev, c, o);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(e[r].find("round-robin"), std::string::npos) << e[r];
  e = errors_on_ranks(2, [&](int, Communicator* c, Device& dev) {
    FlattenOptions o = load_options();
    o.layout.dp = 2;
    o.tier = Tier::kLoad;
    load(ck, good, LoadPlacement::partitions(), dev, c, o);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(e[r].find("load-partitions"), std::string::npos) << e[r];
  // Ranks of which one loads partitions and one the flat buffer disagree before any read.
  e = errors_on_ranks(2, [&](int r, Communicator* c, Device& dev) {
    FlattenOptions o = load_options();
    o.layout.dp = 2;
    load(ck, good, r == 0 ? LoadPlacement::partitions() : LoadPlacement::flat(), dev, c, o);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(e[r].find("InvalidArgument"), std::string::npos) << e[r];
  // A read that fails midway on rank 1: every rank fails, no buffer or ring is kept.
  for (bool ring : {false, true}) {
    e = errors_on_ranks(3, [&](int r, Communicator* c, Device& dev) {
      FlattenOptions o = load_options();
      o.layout.dp = 3;
      o.read.through_ring = ring;
      o.read.ring_chunk_bytes = 16384;
      if (r == 1) o.read.fail_after_bytes = 50'000;
      load(ck, good, LoadPlacement::partitions(), dev, c, o);
    });
    EXPECT_NE(e[1].find(".safetensors"), std::string::npos) << e[1];
    EXPECT_NE(e[1].find("bytes ["), std::string::npos) << e[1];
    for (int r : {0, 2}) {
      EXPECT_NE(e[r].find("rank 1"), std::string::npos) << e[r];
      EXPECT_EQ(e[r].find("InvalidArgument"), std::string::npos) << e[r];
    }
  }
}

}  // namespace
}  // namespace zeroflat

namespace zeroflat {
namespace {

// The ring on a simulated device whose host link is slow, from a simulated slow disk: the team
// reads several windows at once (one thread per window would read at one thread's pace: a
// window is one piece), and the copies to the device run beside the reads, so that the load
// takes about the longer of the two, not their sum. Times are slept, not computed: they hold on
// a loaded machine.
TEST_F(LoaderTest, TheRingReadsWindowsInParallelAndOverlapsThemWithTheCopies) {
  const CheckpointIndex ck = open_checkpoint(*bf16_dir_);
  const std::vector<LoadParam> params = params_of(ck);
  constexpr unsigned kThreads = 4;
  constexpr double kThreadRead = 4e6;  // bytes per second, each reader thread
  constexpr std::uint64_t kWindow = 64 << 10;
  constexpr double kLatency = 0.002;
  FlattenOptions o = load_options();
  o.tier = Tier::kLoad;
  o.read.through_ring = true;
  o.read.ring_chunk_bytes = kWindow;
  o.read.ring_depth = 16;
  o.read.threads = kThreads;
  o.read.simulated_read_bytes_per_second = kThreadRead;
  const std::vector<unsigned char> want = expected_flat(ck, params, o.layout);
  const std::uint64_t n = want.size();
  const std::uint64_t windows = (n + kWindow - 1) / kWindow;
  ASSERT_GE(windows, 16u);
  // The link: as slow as the team's reads together, so that neither hides the other.
  const double link = kThreadRead * kThreads;
  auto load_seconds = [&](double link_bytes_per_second, double latency) {
    DeviceOptions d{kThreads};
    d.link_bytes_per_second = link_bytes_per_second;
    d.link_latency_seconds = latency;
    std::unique_ptr<Device> dev = make_device("sim:h100-80gb", d);
    const auto t0 = std::chrono::steady_clock::now();
    const FlattenResult res = load(ck, params, LoadPlacement::flat(), *dev, nullptr, o);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(res.feasible());
    EXPECT_EQ(std::memcmp(res.group().flat.data(), want.data(), n), 0);
    return s;
  };
  std::uint64_t file_bytes = 0;
  for (const CheckpointTensor& t : ck.tensors) file_bytes += t.bytes;
  const double reads = static_cast<double>(file_bytes) / kThreadRead;  // at one thread's pace
  const double read_only = load_seconds(0, 0);
  const double copies = static_cast<double>(windows) * kLatency + static_cast<double>(n) / link;
  const double both = load_seconds(link, kLatency);
  // Every thread reading: about a quarter of one thread's time (at most 60% of it).
  EXPECT_LT(read_only, 0.6 * reads) << "reads " << reads << " s at one thread's pace";
  // Overlapped: about the longer of the two (at most 80% of their sum).
  EXPECT_LT(both, 0.8 * (read_only + copies))
      << "read only " << read_only << " s, copies " << copies << " s, both " << both << " s";
  EXPECT_GT(both, copies);  // the copies took their time
}

}  // namespace
}  // namespace zeroflat
