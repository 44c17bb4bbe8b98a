// The zeroflat command: exit codes, messages, JSON documents, layout vectors through the CLI,
// and `run` giving the same verified checksum with any thread count. Past 700 lines on purpose:
// the command line is one contract (docs/cli.md), and its cases share the helpers that run the
// binary and read its documents.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "zeroflat/common.h"
#include "zeroflat/loader.h"
#include "zeroflat/probe.h"
#include "cli_run.h"
#include "sanitizers.h"

namespace {

using nlohmann::json;

std::string write_temp(const std::string& name, const std::string& content) {
  const std::string path = ::testing::TempDir() + std::to_string(getpid()) + "." + name;
  std::ofstream(path) << content;
  return path;
}

TEST(Cli, HelpAndVersion) {
  Result r = run("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("layout"), std::string::npos);
  for (const char* cmd : {"layout", "run"}) {
    Result h = run(std::string(cmd) + " --help");
    EXPECT_EQ(h.code, 0) << cmd;
    EXPECT_NE(h.out.find("usage: zeroflat " + std::string(cmd)), std::string::npos);
    EXPECT_NE(h.out.find("examples:"), std::string::npos);
  }
  EXPECT_EQ(run("").code, 2);
  EXPECT_EQ(run("frobnicate").code, 2);
  EXPECT_EQ(run("--version").code, 0);
}

// The spec's vectors are zeroflat's own layout (every parameter in place, zero-element ones
// included): --deepspeed none prints it, saying so with "deepspeed": null.
TEST(Cli, LayoutMatchesEveryVector) {
  std::ifstream in(std::string(ZEROFLAT_TEST_DATA_DIR) + "/layout-vectors.json");
  json vectors = json::parse(in);
  for (std::size_t k = 0; k < vectors.size(); ++k) {
    const json& c = vectors[k]["case"];
    // Through a JSON file, the way long lists are passed.
    const std::string file = write_temp("numels.json", c["numels"].dump());
    std::string args = "layout --numels @" + file + " --dp " + c["dp"].dump() +
                       " --alignment-factor " + c["alignment_factor"].dump() + " --dtype " +
                       c["dtype"].get<std::string>() + " --param-align-bytes " +
                       c["param_align_bytes"].dump() + (c["round_robin"] ? " --round-robin" : "") +
                       " --deepspeed none --json";
    Result r = run(args);
    ASSERT_EQ(r.code, 0) << args << "\n" << r.err;
    json doc = json::parse(r.out);
    ASSERT_TRUE(doc.contains("deepspeed")) << args;
    EXPECT_TRUE(doc["deepspeed"].is_null()) << args;
    doc.erase("deepspeed");
    EXPECT_TRUE(doc == vectors[k]["expect"]) << args;
  }
}

// Without --deepspeed, a layout is the newest supported release's (0.19.8: zero-element
// parameters are left out of the group), and says so; options no release builds keep
// zeroflat's own layout, and say that.
TEST(Cli, LayoutDefaultsToTheNewestReleasesRulesAndNamesThem) {
  std::ifstream in(std::string(ZEROFLAT_TEST_DATA_DIR) + "/layout-vectors.json");
  json vectors = json::parse(in);
  std::size_t with_zeros = 0;
  for (std::size_t k = 0; k < vectors.size(); ++k) {
    const json& c = vectors[k]["case"];
    const std::string file = write_temp("numels.json", c["numels"].dump());
    const std::string args = "layout --numels @" + file + " --dp " + c["dp"].dump() +
                             " --alignment-factor " + c["alignment_factor"].dump() + " --dtype " +
                             c["dtype"].get<std::string>() + " --param-align-bytes " +
                             c["param_align_bytes"].dump() +
                             (c["round_robin"] ? " --round-robin" : "") + " --json";
    Result r = run(args);
    ASSERT_EQ(r.code, 0) << args << "\n" << r.err;
    const json doc = json::parse(r.out);
    const bool release_builds_it =
        c["alignment_factor"] == 2 && (c["param_align_bytes"] == 0 || c["param_align_bytes"] == 16);
    if (!release_builds_it) {
      EXPECT_TRUE(doc["deepspeed"].is_null()) << args;
      continue;
    }
    ASSERT_TRUE(doc["deepspeed"].is_object()) << args;
    EXPECT_EQ(doc["deepspeed"]["rules"], "0.19.8") << args;
    Result named = run(args + " --deepspeed 0.19.8");
    ASSERT_EQ(named.code, 0) << named.err;
    EXPECT_TRUE(json::parse(named.out) == doc) << args;
    bool zeros = false;
    for (const json& n : c["numels"]) zeros = zeros || n == 0;
    if (zeros) {
      ++with_zeros;
      EXPECT_FALSE(doc["left_out"].empty()) << args;
      EXPECT_TRUE(doc != vectors[k]["expect"]) << args;
    }
  }
  EXPECT_GT(with_zeros, 2u);  // the vectors do hold groups with zero-element parameters
  // DeepSpeed 0.19.8's own bookkeeping for 8,0,24 on two ranks, by hand: parameter 1 is not in
  // the group, so the buffer is 8 + 24 = 32 elements and parameter 2 starts at 8.
  Result r = run("layout --numels 8,0,24 --dp 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  EXPECT_EQ(doc["deepspeed"]["release"], "0.19.8");
  EXPECT_EQ(doc["flat_numel"], 32);
  EXPECT_EQ(doc["offsets"], json::parse("[0, null, 8]"));
  EXPECT_EQ(doc["left_out"], json::parse(R"([{"param": 1, "why": "zero elements"}])"));
  EXPECT_EQ(doc["ranks"][0]["params_in_partition"], json::parse("[0, 2]"));
  EXPECT_EQ(doc["ranks"][1]["params_in_partition"], json::parse("[2]"));
  EXPECT_EQ(doc["ranks"][1]["first_offset"], 8);
  // Text printouts say which rules too.
  Result text = run("layout --numels 8,0,24 --dp 2");
  EXPECT_NE(text.out.find("rules        DeepSpeed 0.19.8's rules"), std::string::npos) << text.out;
  Result own = run("layout --numels 8,0,24 --dp 2 --deepspeed none");
  EXPECT_NE(own.out.find("rules        zeroflat's own layout"), std::string::npos) << own.out;
  Result padded = run("layout --numels 8,0,24 --dp 2 --alignment-factor 4");
  EXPECT_NE(padded.out.find("no DeepSpeed release builds this one"), std::string::npos)
      << padded.out;
  EXPECT_NE(padded.out.find("alignment factor 4"), std::string::npos) << padded.out;
  // A release named outright must build the layout asked for.
  Result refused = run("layout --numels 8,0,24 --dp 2 --alignment-factor 4 --deepspeed latest");
  EXPECT_EQ(refused.code, 2);
  EXPECT_NE(refused.err.find("--deepspeed none"), std::string::npos) << refused.err;
}

TEST(Cli, LayoutInputForms) {
  Result a = run("layout --numels 5,7,3 --dp 4 --json");
  Result b = run("layout --numels '5 7\n3' --dp 4 --json");
  Result c = run("layout --numels @" + write_temp("numels.txt", "5\n7\n\n3\n") + " --dp 4 --json");
  ASSERT_EQ(a.code, 0);
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out, c.out);
  Result m = run("layout --model tiny-moe --layers 1 --experts 2 --dp 3 --json");
  ASSERT_EQ(m.code, 0) << m.err;
  EXPECT_EQ(json::parse(m.out)["offsets"].size(), 1u + 6 + 1 + 6 + 2 + 2);
  Result table = run("layout --numels 5,7,3 --dp 4");
  EXPECT_EQ(table.code, 0);
  EXPECT_NE(table.out.find("partition"), std::string::npos);
}

TEST(Cli, LayoutBadInputExits2WithTheValueNamed) {
  struct Case {
    std::string args;
    std::string says;
  };
  const std::string bad_file = write_temp("bad.txt", "5\n-3\n");
  const std::string bad_json = write_temp("bad.json", "[5, 2.5]");
  const Case cases[] = {
      {"layout --numels ''", "--numels is empty"},
      {"layout --numels ,", "--numels is empty"},
      {"layout --numels 5,x,3", "'x'"},
      {"layout --numels 5,-1", "'-1'"},
      {"layout --numels 5 --dp 0", "--dp 0"},
      {"layout --numels 5 --dp -2", "'-2'"},
      {"layout --numels 5 --dp two", "'two'"},
      {"layout --numels 5 --alignment-factor 0", "--alignment-factor 0"},
      {"layout --numels 5 --param-align-bytes 12", "--param-align-bytes = 12"},
      {"layout --numels 5 --param-align-bytes 2 --dtype fp32", "at least the element size"},
      {"layout --numels 5 --dtype fp8", "'fp8'"},
      {"layout --model nope", "'nope'"},
      {"layout --numels 18446744073709551615,1", "overflows"},
      {"layout --numels 99999999999999999999", "does not fit"},
      {"layout --numels @/nonexistent/file", "cannot open"},
      {"layout --numels @" + bad_file, "'-3'"},
      {"layout --numels @" + bad_json, "2.5"},
      {"layout --dp 2", "--numels or --model"},
      {"layout --numels 5 --model tiny-moe", "not both"},
      {"layout --numels 5 --frobnicate", "unknown option"},
      {"layout --numels", "needs a value"},
      {"layout --numels 1 --dp 2 --dp 3", "given twice"},
      {"layout --model tiny-moe --layers 0", "--layers 0"},
      {"layout --model llama-3.1-8b --experts 2", "dense"},
  };
  for (const Case& c : cases) {
    Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args;
    EXPECT_TRUE(r.out.empty()) << c.args << " printed to stdout: " << r.out;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.args << "\nstderr: " << r.err;
  }
  // A zero-element parameter is valid input.
  EXPECT_EQ(run("layout --numels 0 --dp 2").code, 0);
  EXPECT_EQ(run("layout --numels 8,0,24 --dp 2").code, 0);
}

TEST(Cli, RunVerifiesWithTheSameChecksumForAnyThreadCount) {
  std::string checksum;
  for (const char* threads : {"1", "2", "3"}) {
    Result r = run("run --model tiny-moe --verify --json --repeat 1",
                   std::string("ZEROFLAT_NUM_THREADS=") + threads);
    ASSERT_EQ(r.code, 0) << r.err;
    json doc = json::parse(r.out);
    const json& rank = doc["ranks"][0];
    EXPECT_EQ(rank["threads"], std::stoi(threads));
    EXPECT_EQ(rank["verified"], true);
    EXPECT_EQ(rank["predicted_peak_device_bytes"], rank["measured_peak_device_bytes"]);
    EXPECT_GT(rank["flatten_gbps"].get<double>(), 0.0);
    EXPECT_GT(doc["ceiling"]["memcpy_gbps"].get<double>(), 0.0);
    if (checksum.empty()) checksum = rank["checksum"];
    EXPECT_EQ(rank["checksum"], checksum) << threads << " threads";
    EXPECT_EQ(checksum.size(), 16u);
  }
  // --threads and layout options change the buffer (and so the checksum) as they should.
  Result t = run("run --model tiny-moe --threads 2 --verify --json --repeat 1 --quiet");
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_EQ(json::parse(t.out)["ranks"][0]["checksum"], checksum);
  EXPECT_TRUE(t.err.empty()) << "--quiet printed: " << t.err;
  Result aligned =
      run("run --model tiny-moe --param-align-bytes 64 --dtype fp16 --verify --json --repeat 1");
  ASSERT_EQ(aligned.code, 0) << aligned.err;
  EXPECT_NE(json::parse(aligned.out)["ranks"][0]["checksum"], checksum);
  // Progress goes to stderr, the document alone to stdout.
  Result plain = run("run --model tiny-moe --repeat 1");
  EXPECT_EQ(plain.code, 0);
  EXPECT_NE(plain.err.find("[zeroflat] materialize"), std::string::npos);
  EXPECT_NE(plain.out.find("checksum"), std::string::npos);
}

TEST(Cli, RunBadInputExits2BeforeAnyWork) {
  struct Case {
    std::string args;
    std::string says;
  };
  const Case cases[] = {
      {"run --model nope", "'nope'"},
      {"run --device gpu", "unknown device 'gpu'"},
      {"run --dp 0", "--dp 0"},
      {"run --tier warp", "'warp'"},
      {"run --comm smoke", "'smoke'"},
      {"run --comm nccl", "cuda devices"},
      {"run --no-data", "sim devices"},
      {"run --device sim:1GiB --no-data --verify", "needs data"},
      {"run --device sim:", "capacity"},
      {"run --dp 3 --inject-fault 2@3", "outside dp 3"},
      {"run --inject-fault x", "--inject-fault"},
      {"run --timeout 0", "--timeout 0"},
      {"run --threads 0", "--threads 0"},
      {"run --repeat 0", "--repeat 0"},
      {"run --dtype int8", "'int8'"},
  };
  for (const Case& c : cases) {
    Result r = run(c.args);
    EXPECT_EQ(r.code, 2) << c.args;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.args << "\nstderr: " << r.err;
    EXPECT_EQ(r.err.find("materialize"), std::string::npos) << c.args << " started work";
  }
  Result env = run("run --model tiny-moe", "ZEROFLAT_NUM_THREADS=lots");
  EXPECT_EQ(env.code, 2);
  EXPECT_NE(env.err.find("ZEROFLAT_NUM_THREADS='lots'"), std::string::npos) << env.err;
  Result ahead = run("run --model tiny-moe", "ZEROFLAT_READ_AHEAD=some");
  EXPECT_EQ(ahead.code, 2);
  EXPECT_NE(ahead.err.find("ZEROFLAT_READ_AHEAD='some'"), std::string::npos) << ahead.err;
}

}  // namespace

namespace {

json plan_json(const std::string& args, int want_code) {
  Result r = run("plan --model qwen3-30b-a3b " + args + " --json");
  EXPECT_EQ(r.code, want_code) << args << "\n" << r.err;
  return r.out.empty() ? json() : json::parse(r.out);
}

TEST(CliPlan, TheSeedScenarios) {
  struct Case {
    std::string args;
    std::string tier;
  };
  const Case cases[] = {
      {"--layers 32 --dp 8 --device h100-80gb", "device"}, {"--dp 8 --device h100-80gb", "sharded"},
      {"--dp 8 --device h100-80gb --free 4GiB", "staged"}, {"--dp 1 --device h200", "device"},
      {"--dp 1 --device h100-80gb --free 2GiB", "staged"},
  };
  for (const Case& c : cases) {
    json doc = plan_json(c.args, 0);
    EXPECT_EQ(doc["tier"], c.tier) << c.args;
    EXPECT_EQ(doc["feasible"], true);
    ASSERT_EQ(doc["candidates"].size(), 4u);
    std::set<std::string> tiers;
    for (const json& cand : doc["candidates"]) {
      tiers.insert(cand["tier"].get<std::string>());
      EXPECT_EQ(cand["feasible"].get<bool>(), cand["why_not"].is_null()) << c.args;
      for (const char* key : {"peak_device_bytes", "host_bytes", "pcie_bytes", "comm_bytes",
                              "predicted_seconds", "steps"}) {
        EXPECT_TRUE(cand.contains(key)) << key;
      }
      if (cand["tier"] == c.tier) {
        EXPECT_LE(cand["peak_device_bytes"].get<std::uint64_t>(),
                  doc["device"]["capacity_bytes"].get<std::uint64_t>() -
                      doc["margin_bytes"].get<std::uint64_t>());
      }
    }
    EXPECT_EQ(tiers, (std::set<std::string>{"device", "sharded", "staged", "host"}));
    for (const char* key : {"model", "dp", "device", "free_bytes", "margin_bytes", "flat_bytes",
                            "partition_bytes", "reason", "after_init"}) {
      EXPECT_TRUE(doc.contains(key)) << key;
    }
  }
  json seed = plan_json("--layers 32 --dp 8 --device h100-80gb", 0);
  EXPECT_EQ(seed["model"]["tensors"], 12579);
  EXPECT_EQ(seed["model"]["numel"], 20562192384ull);
  EXPECT_EQ(seed["model"]["bytes"], 41124384768ull);
  EXPECT_EQ(seed["device"]["capacity_bytes"], 85520809984ull);
}

TEST(CliPlan, NoFeasiblePlanExits3WithTheNumbers) {
  json doc = plan_json("--dp 8 --device a100-40gb", 3);
  EXPECT_EQ(doc["feasible"], false);
  EXPECT_TRUE(doc["tier"].is_null());
  EXPECT_NE(doc["reason"].get<std::string>().find("61.1 GB"), std::string::npos);
  json forced = plan_json("--dp 8 --device h100-80gb --tier device", 3);
  EXPECT_NE(forced["reason"].get<std::string>().find("forced"), std::string::npos);
  Result table = run("plan --model qwen3-30b-a3b --dp 8 --device a100-40gb");
  EXPECT_EQ(table.code, 3);
  EXPECT_NE(table.out.find("NO PLAN"), std::string::npos);
}

TEST(CliPlan, WarnsWhenTrainingWillNotFitAndDrawsTheSvg) {
  const std::string svg = ::testing::TempDir() + std::to_string(getpid()) + ".plan.svg";
  Result r = run("plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --svg " + svg);
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.err.find("training needs"), std::string::npos) << r.err;
  std::ifstream in(svg);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content.rfind("<svg", 0), 0u);
  EXPECT_NE(content.find("</svg>"), std::string::npos);
  for (const char* tier : {">device", ">sharded (chosen)", ">staged", ">host"}) {
    EXPECT_NE(content.find(tier), std::string::npos) << tier;
  }
  EXPECT_NE(content.find("capacity - margin"), std::string::npos);
  // A FIFO is refused, not waited on; a link is refused, its target untouched; a regular file
  // is replaced whole, nothing left beside it.
  const std::string fifo = svg + ".fifo", link = svg + ".link";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(symlink(svg.c_str(), link.c_str()), 0);
  for (const std::string& bad : {fifo, link}) {
    Result b = run("plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --svg " + bad);
    EXPECT_EQ(b.code, 2) << b.err;
    EXPECT_NE(b.err.find("is not a regular file"), std::string::npos) << b.err;
  }
  std::ifstream again(svg);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(again)), std::istreambuf_iterator<char>()),
            content);
  // Replaced, it keeps its mode.
  ASSERT_EQ(chmod(svg.c_str(), 0640), 0);
  EXPECT_EQ(run("plan --model qwen3-30b-a3b --dp 4 --device h100-80gb --svg " + svg).code, 0);
  struct stat st {};
  ASSERT_EQ(stat(svg.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  std::remove(fifo.c_str());
  std::remove(link.c_str());
  std::remove(svg.c_str());
  // A name of 250 bytes (NAME_MAX 255 leaves no room for a suffix) is written too.
  const std::string longest = ::testing::TempDir() + std::string(250, 'p');
  EXPECT_EQ(run("plan --model qwen3-30b-a3b --dp 4 --device h100-80gb --svg " + longest).code, 0);
  EXPECT_TRUE(std::filesystem::is_regular_file(longest));
  std::remove(longest.c_str());
  // Nothing left beside it (the CLI writes .zeroflat-svg-<its pid> first, then renames it).
  const std::filesystem::path folder = std::filesystem::path(svg).parent_path();
  for (const auto& e : std::filesystem::directory_iterator(folder)) {
    EXPECT_NE(e.path().filename().string().rfind(".zeroflat-svg-", 0), 0u) << e.path();
  }
}

TEST(CliPlan, BadInputExits2) {
  const std::pair<std::string, std::string> cases[] = {
      {"plan --dp 8 --device h100-80gb", "--model is required"},
      {"plan --model qwen3-30b-a3b --dp 8", "--device is required"},
      {"plan --model qwen3-30b-a3b --dp 8 --device h900", "'h900'"},
      {"plan --model qwen3-30b-a3b --dp 8 --device 0", "capacity"},
      {"plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --free 90GiB", "more than"},
      {"plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --free 30GiB", "less than the model"},
      {"plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --free lots", "'lots'"},
      {"plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --tier fastest", "'fastest'"},
      {"plan --model qwen3-30b-a3b --dp 0 --device h100-80gb", "--dp 0"},
      {"plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --svg /nonexistent/x.svg",
       "cannot write"},
  };
  for (const auto& [args, says] : cases) {
    Result r = run(args);
    EXPECT_EQ(r.code, 2) << args;
    EXPECT_NE(r.err.find(says), std::string::npos) << args << "\n" << r.err;
  }
}

}  // namespace

namespace {

std::string safetensors_file(const std::string& header, std::size_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\x02');
}

TEST(CliInspect, ReadsARealFileAndRejectsMalformedOnesWithExit2) {
  const std::string good = write_temp(
      "good.safetensors",
      safetensors_file(R"({"w": {"dtype": "BF16", "shape": [3, 4], "data_offsets": [0, 24]},)"
                       R"( "b": {"dtype": "F32", "shape": [5], "data_offsets": [24, 44]}})",
                       44));
  Result r = run("inspect " + good + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  json doc = json::parse(r.out);
  EXPECT_EQ(doc["tensors"], 2);
  EXPECT_EQ(doc["numel"], 17);
  EXPECT_EQ(doc["bytes"], 44);
  EXPECT_EQ(doc["dtypes"], (json{{"bf16", 24}, {"fp32", 20}}));
  EXPECT_EQ(doc["largest"][0]["name"], "w");
  EXPECT_EQ(run("inspect " + good).code, 0);
  // The model of a checkpoint file plans and lays out like any other.
  EXPECT_EQ(run("layout --model " + good + " --dp 2").code, 0);
  // What the file holds decides, not its name: a safetensors file named .bin (or with no
  // extension) is read as one, not as a config.json or a torch.save file.
  for (const char* name : {"model.bin", "weights"}) {
    std::ifstream in(good, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string renamed = write_temp(name, bytes);
    Result n = run("inspect " + renamed + " --json");
    ASSERT_EQ(n.code, 0) << name << "\n" << n.err;
    const json d = json::parse(n.out);
    EXPECT_EQ(d["source"], "safetensors") << name;
    EXPECT_EQ(d["tensors"], 2) << name;
    EXPECT_EQ(d["bytes"], 44) << name;
    EXPECT_EQ(run("layout --model " + renamed + " --dp 2").code, 0) << name;
    std::remove(renamed.c_str());
  }

  const std::pair<std::string, std::string> bad[] = {
      {"short", "too short"},
      {safetensors_file("{\"w\": 1", 0), "not valid JSON"},
      {safetensors_file(R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}})", 8),
       "needs 6"},
      {safetensors_file(R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 6]}})", 2),
       "truncated"},
  };
  int k = 0;
  for (const auto& [content, says] : bad) {
    const std::string path = write_temp("bad" + std::to_string(k++) + ".safetensors", content);
    Result b = run("inspect " + path);
    EXPECT_EQ(b.code, 2) << says;
    EXPECT_NE(b.err.find(path), std::string::npos) << b.err;
    EXPECT_NE(b.err.find(says), std::string::npos) << b.err;
  }
  EXPECT_EQ(run("inspect /nonexistent/model").code, 2);
  EXPECT_EQ(run("inspect").code, 2);
}

TEST(CliInspect, ConfigJsonThroughInspectPlanAndLayout) {
  const std::string cfg = write_temp("config.json", R"({"architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256})");
  Result r = run("inspect " + cfg + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["numel"], 8030261248ull);
  Result p = run("plan --model " + cfg + " --layers 4 --dp 2 --device h100-80gb --json");
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_EQ(json::parse(p.out)["tier"], "device");
  // The config's dtype, under the key Transformers 5 writes ("dtype") and the older one.
  for (const std::string key : {"dtype", "torch_dtype"}) {
    const std::string typed = write_temp(key + ".json", R"({"architectures": ["LlamaForCausalLM"],
      "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, ")" +
                                                            key + R"(": "float32"})");
    Result t = run("layout --model " + typed + " --dp 2 --json");
    ASSERT_EQ(t.code, 0) << t.err;
    EXPECT_EQ(json::parse(t.out)["dtype"], "fp32") << key;
  }
  const std::string broken =
      write_temp("broken.json", R"({"architectures": ["LlamaForCausalLM"]})");
  Result b = run("plan --model " + broken + " --dp 2 --device h100-80gb");
  EXPECT_EQ(b.code, 2);
  EXPECT_NE(b.err.find("'hidden_size' is missing"), std::string::npos) << b.err;
}

}  // namespace

namespace {

TEST(CliProbe, CpuAnswersAndCudaSaysWhyNot) {
  Result cpu = run("probe --json");
  ASSERT_EQ(cpu.code, 0) << cpu.err;
  json doc = json::parse(cpu.out);
  EXPECT_EQ(doc["device"], "cpu");
  EXPECT_EQ(doc["available"], true);
  EXPECT_GT(doc["free_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(doc["sources"][0]["source"], "MemAvailable");
  Result shared = run("probe --local-ranks 2 --json");
  ASSERT_EQ(shared.code, 0);
  EXPECT_NE(json::parse(shared.out)["notes"].dump().find("shared among 2 ranks"),
            std::string::npos);
  // No GPU on the machines the suite runs on: exit 2, with the reason from the sources.
  Result gpu = run("probe --device cuda:0");
  if (gpu.code == 0) GTEST_SKIP() << "a GPU answered: " << gpu.out;
  EXPECT_EQ(gpu.code, 2);
  EXPECT_NE(gpu.out.find("cuda:0: not available here"), std::string::npos) << gpu.out;
  EXPECT_NE(gpu.out.find("CUDA runtime"), std::string::npos) << gpu.out;
  EXPECT_EQ(run("probe --device tpu:0").code, 2);
  EXPECT_EQ(run("probe --device cuda:x").code, 2);
}

}  // namespace

namespace {

TEST(CliRun, VerifyCatchesACorruptedByte) {
  Result r = run("run --model tiny-moe --verify --repeat 1 --quiet --inject-corruption 1001");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find(" NO\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("verification failed: flat buffer"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("verification failed"), std::string::npos) << r.err;
  Result j = run("run --model tiny-moe --verify --repeat 1 --quiet --json --inject-corruption 0");
  EXPECT_EQ(j.code, 1);
  EXPECT_EQ(json::parse(j.out)["ranks"][0]["verified"], false);
  EXPECT_EQ(run("run --model tiny-moe --inject-corruption 99999999999").code, 2);
}

TEST(CliRun, ARunThatCannotFitIsRefusedBeforeAnyAllocation) {
  // A 2 TB flat buffer (an absurd alignment) on any test machine.
  Result r = run("run --model tiny-moe --alignment-factor 1000000000000");
  EXPECT_EQ(r.code, 3);
  EXPECT_NE(r.err.find("no feasible plan"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Nothing was allocated"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("materialize"), std::string::npos) << "work started: " << r.err;
  Result huge = run("run --model tiny-moe --layers 99999999999");
  EXPECT_EQ(huge.code, 2);
  EXPECT_NE(huge.err.find("limit"), std::string::npos) << huge.err;
}

// Every tier, 3 ranks as threads: one checksum for all ranks and tiers, every byte verified,
// and each rank's measured peak equal to the memory model's.
TEST(CliRun, EveryTierOnThreeLocalRanksGivesOneChecksum) {
  std::string checksum;
  for (const char* device : {"cpu", "sim:6MB"}) {
    for (const char* tier : {"device", "sharded", "staged", "host"}) {
      if (std::string(device) == "sim:6MB" &&
          (std::string(tier) == "device" || std::string(tier) == "sharded")) {
        // 6 MB holds the 5 MB model and a staged slice, not a second copy: exit 3.
        Result no = run(std::string("run --model tiny-moe --dp 3 --quiet --device ") + device +
                        " --tier " + tier);
        EXPECT_EQ(no.code, 3) << no.err;
        continue;
      }
      Result r = run(std::string("run --model tiny-moe --dp 3 --verify --json --repeat 1 "
                                 "--quiet --device ") +
                     device + " --tier " + tier);
      ASSERT_EQ(r.code, 0) << device << " " << tier << "\n" << r.err;
      json doc = json::parse(r.out);
      EXPECT_EQ(doc["tier"], tier);
      ASSERT_EQ(doc["ranks"].size(), 3u);
      for (const json& rank : doc["ranks"]) {
        EXPECT_EQ(rank["outcome"], "done");
        EXPECT_EQ(rank["verified"], true) << rank.dump();
        EXPECT_EQ(rank["originals_intact"], true);
        EXPECT_EQ(rank["predicted_peak_device_bytes"], rank["measured_peak_device_bytes"])
            << device << " " << tier;
        EXPECT_EQ(rank["predicted_host_bytes"], rank["host_bytes"]) << device << " " << tier;
        if (checksum.empty()) checksum = rank["checksum"];
        EXPECT_EQ(rank["checksum"], checksum) << device << " " << tier;
      }
    }
  }
  // The planner picks staged on the small sim device, with part of each slice on the host.
  Result a = run("run --model tiny-moe --dp 3 --json --quiet --device sim:6MB");
  ASSERT_EQ(a.code, 0) << a.err;
  json doc = json::parse(a.out);
  EXPECT_EQ(doc["tier"], "staged");
  EXPECT_GT(doc["ranks"][0]["host_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_NE(doc["ranks"][0]["master_error"].get<std::string>().find("does not fit"),
            std::string::npos);
}

// The seed's scenarios at full size on 8 simulated H100s: 32 layers flatten on the device,
// 48 layers need the sharded tier; each rank's measured peak is the predicted one.
TEST(CliRun, SeedScenariosRehearsedOnEightSimulatedH100s) {
  for (const auto& [layers, tier] : {std::pair{"32", "device"}, std::pair{"48", "sharded"}}) {
    Result r = run(std::string("run --model qwen3-30b-a3b --layers ") + layers +
                   " --device sim:h100-80gb --no-data --dp 8 --json --quiet");
    ASSERT_EQ(r.code, 0) << r.err;
    json doc = json::parse(r.out);
    EXPECT_EQ(doc["tier"], tier) << layers << " layers";
    ASSERT_EQ(doc["ranks"].size(), 8u);
    for (const json& rank : doc["ranks"]) {
      EXPECT_EQ(rank["outcome"], "done");
      EXPECT_EQ(rank["predicted_peak_device_bytes"], rank["measured_peak_device_bytes"]);
      EXPECT_LE(rank["measured_peak_device_bytes"].get<std::uint64_t>(),
                doc["plan"]["capacity_bytes"].get<std::uint64_t>() -
                    doc["plan"]["margin_bytes"].get<std::uint64_t>());
      EXPECT_TRUE(rank["checksum"].is_null());
    }
  }
}

// A fault at every step of the tiers that talk, on a non-zero rank: exit 4, an error naming
// the step, and every rank's parameters intact.
TEST(CliRun, InjectedFaultsExit4WithTheOriginalsIntact) {
  for (const char* tier : {"sharded", "host"}) {
    for (int k = 0; k < 8; ++k) {
      const std::string args = std::string(
                                   "run --model tiny-moe --dp 3 --json --quiet --repeat 1 "
                                   "--tier ") +
                               tier + " --inject-fault " + std::to_string(k) + "@1";
      Result r = run(args);
      json doc = json::parse(r.out);
      const std::size_t steps = doc["plan"]["steps"].size();
      if (static_cast<std::size_t>(k) >= steps) {
        EXPECT_EQ(r.code, 0) << args;  // past the last step: nothing changes
        continue;
      }
      EXPECT_EQ(r.code, 4) << args << "\n" << r.err;
      EXPECT_NE(doc["error"].get<std::string>().find("step " + std::to_string(k)),
                std::string::npos)
          << doc["error"];
      for (const json& rank : doc["ranks"]) {
        EXPECT_EQ(rank["originals_intact"], true) << args << ": " << rank.dump();
        EXPECT_EQ(rank["failed_rank"], 1);
      }
    }
  }
  Result human = run("run --model tiny-moe --dp 2 --tier sharded --inject-fault 1@1 --quiet");
  EXPECT_EQ(human.code, 4);
  EXPECT_NE(human.out.find("rolled back"), std::string::npos) << human.out;
  EXPECT_NE(human.err.find("execution failed: step 1"), std::string::npos) << human.err;
}

TEST(CliRun, OutputThatCannotBeWrittenIsAFailure) {
  EXPECT_EQ(run("layout --numels 5,7,3 --dp 4 --json > /dev/full").code, 1);
  EXPECT_EQ(run("probe > /dev/full").code, 1);
}

TEST(CliLayout, EmptyItemsAndOddFiles) {
  for (const char* list : {"5,,7", ",5", "5,"}) {
    Result r = run(std::string("layout --numels '") + list + "'");
    EXPECT_EQ(r.code, 2) << list;
    EXPECT_NE(r.err.find("is empty"), std::string::npos) << r.err;
  }
  const std::string bom = write_temp("bom.txt",
                                     "\xEF\xBB\xBF"
                                     "5\n7\n");
  EXPECT_EQ(run("layout --numels @" + bom).code, 0);
  Result zero = run("layout --numels @/dev/zero");  // a device, never read
  EXPECT_EQ(zero.code, 2);
  EXPECT_NE(zero.err.find("not a regular file"), std::string::npos) << zero.err;
  const std::string huge = write_temp("huge.txt", "");
  ASSERT_EQ(truncate(huge.c_str(), (std::int64_t{256} << 20) + 1), 0);  // sparse: 256 MiB + 1
  Result large = run("layout --numels @" + huge);
  EXPECT_EQ(large.code, 2);
  EXPECT_NE(large.err.find("too large"), std::string::npos) << large.err;
  const std::string big = write_temp("big.json", "[18446744073709551616]");
  Result b = run("layout --numels @" + big);
  EXPECT_EQ(b.code, 2);
  EXPECT_NE(b.err.find("does not fit in 64 bits"), std::string::npos) << b.err;
}

}  // namespace

namespace {

// A rehearsal is planned against the simulated node's host memory, never this machine's: the
// full 48-layer model on eight 61 GiB devices stages a part of each slice through the host
// (8 x 4.3 GB, more than a small test machine has), and every rank's measured peaks are the
// predicted ones. --host sets the node's memory: with too little, no tier fits (exit 3), and the
// JSON document still comes, with the plan.
TEST(CliRun, RehearsalsStageThroughTheSimulatedNodesHost) {
  const std::string base =
      "run --model qwen3-30b-a3b --layers 48 --device sim:61GiB --no-data --dp 8 --quiet --json";
  Result r = run(base);
  ASSERT_EQ(r.code, 0) << r.err;
  json doc = json::parse(r.out);
  EXPECT_EQ(doc["tier"], "staged");
  for (const json& rank : doc["ranks"]) {
    EXPECT_EQ(rank["predicted_peak_device_bytes"], rank["measured_peak_device_bytes"]);
    EXPECT_EQ(rank["predicted_host_bytes"], rank["host_bytes"]);
    EXPECT_GT(rank["host_bytes"].get<std::uint64_t>(), 4'000'000'000u);
  }
  Result tight = run(base + " --host 8GiB");
  EXPECT_EQ(tight.code, 3) << tight.err;
  json no = json::parse(tight.out);
  EXPECT_TRUE(no["tier"].is_null());
  EXPECT_EQ(no["plan"]["feasible"], false);
  EXPECT_EQ(no["plan"]["host_free_bytes"], (std::uint64_t{8} << 30) / 8);
  EXPECT_NE(no["error"].get<std::string>().find("no feasible plan"), std::string::npos);
  EXPECT_EQ(run("run --model tiny-moe --host 1GiB").code, 2);  // cpu: this machine's host
}

// A model that does not fit the device at all is "no feasible plan" (exit 3), found before
// anything is allocated, not an allocation failure.
TEST(CliRun, AModelLargerThanTheDeviceExits3) {
  Result r = run("run --model tiny-moe --device sim:1MB --json --quiet");
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_NE(r.err.find("more than the device's capacity"), std::string::npos) << r.err;
  EXPECT_EQ(json::parse(r.out)["plan"]["feasible"], false);
}

TEST(CliPlan, HostSetsTheNodesMemory) {
  const std::string base =
      "plan --model qwen3-30b-a3b --dp 8 --device h100-80gb --free 4GiB --json";
  json preset = json::parse(run(base).out);
  EXPECT_EQ(preset["host_free_bytes"], zeroflat::find_preset("h100-80gb")->host_bytes_per_node / 8);
  json small = json::parse(run(base + " --host 16GiB").out);
  EXPECT_EQ(small["host_free_bytes"], (std::uint64_t{16} << 30) / 8);
  EXPECT_EQ(run(base + " --host 16GiB --host-free 1GiB").code, 3);  // no tier fits
}

// The probe of a simulated device is its accounting, in the same document shape.
TEST(CliProbe, SimDevicesReportTheirAccounting) {
  Result r = run("probe --device sim:h100-80gb --json");
  ASSERT_EQ(r.code, 0) << r.err;
  json doc = json::parse(r.out);
  EXPECT_EQ(doc["used"], "sim accounting");
  EXPECT_EQ(doc["total_bytes"], std::uint64_t{81559} << 20);
}

}  // namespace

namespace {

// Hostile and careless input, each refused where it enters: the same way on every path.
TEST(CliHostile, NumelsFilesAreBoundedAndNeverBlock) {
  const std::string deep = write_temp("deep.json", std::string(100000, '[') + "1");
  Result r = run("layout --numels @" + deep);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("nested deeper"), std::string::npos) << r.err;
  const std::string fifo = ::testing::TempDir() + std::to_string(getpid()) + ".fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  Result f = run("layout --numels @" + fifo);  // nobody writes it: must not wait
  EXPECT_EQ(f.code, 2);
  EXPECT_NE(f.err.find("not a regular file"), std::string::npos) << f.err;
  std::remove(fifo.c_str());
  EXPECT_EQ(run("layout --numels @/dev/zero").code, 2);
  EXPECT_EQ(run("layout --numels @/nonexistent").code, 2);
}

TEST(CliHostile, LayoutDocumentsAreBounded) {
  Result huge = run("layout --numels 5,7,3 --dp 4294967296 --json");
  EXPECT_EQ(huge.code, 2);
  // The error document of --json, and nothing more.
  EXPECT_LT(huge.out.size(), 400u);
  const json err = json::parse(huge.out);
  EXPECT_EQ(err["exit"], 2);
  EXPECT_EQ(err["command"], "layout");
  EXPECT_NE(err["error"].get<std::string>().find("1 to 1048576"), std::string::npos) << huge.out;
  EXPECT_NE(huge.err.find("1 to 1048576"), std::string::npos) << huge.err;
  // 65,536 ranks x 18,867 tensors: too many entries for one document; one rank's is fine.
  const std::string model = "layout --model qwen3-30b-a3b --dp 65536 --json";
  Result all = run(model);
  EXPECT_EQ(all.code, 2);
  EXPECT_LT(all.out.size(), 1000u);
  EXPECT_EQ(json::parse(all.out)["error_kind"], "invalid input") << all.out;
  EXPECT_NE(all.err.find("--rank"), std::string::npos) << all.err;
  Result one = run(model + " --rank 65535");
  ASSERT_EQ(one.code, 0) << one.err;
  json doc = json::parse(one.out);
  ASSERT_EQ(doc["ranks"].size(), 1u);
  EXPECT_EQ(doc["ranks"][0]["rank"], 65535);
  EXPECT_EQ(run("layout --numels 5,7,3 --dp 4 --rank 4").code, 2);
}

TEST(CliHostile, MessagesNeverEchoAHugeArgument) {
  const std::string big(100000, 'x');
  for (const std::string& args : {"layout --numels " + big, "run --model " + big,
                                  "plan --model tiny-moe --dp 1 --device " + big,
                                  "layout --numels 5 --" + big, "run --dtype " + big}) {
    Result r = run(args);
    EXPECT_EQ(r.code, 2) << args.substr(0, 30);
    EXPECT_LT(r.err.size(), 2000u) << args.substr(0, 30) << ": " << r.err.substr(0, 200);
  }
}

TEST(CliHostile, InspectPrintsNamesFromFilesAsPrintableText) {
  const std::string header = std::string(R"({"evil\u001b[31mred\u0007": {"dtype": "BF16",)") +
                             R"( "shape": [2], "data_offsets": [0, 4]}})";
  const std::string path = write_temp("ansi.safetensors", safetensors_file(header, 4));
  Result r = run("inspect " + path);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find('\x07'), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("evil?[31mred?"), std::string::npos) << r.out;
  // The JSON document keeps the exact name (escaped by JSON itself).
  EXPECT_EQ(json::parse(run("inspect " + path + " --json").out)["largest"][0]["name"],
            "evil\x1b[31mred\x07");
}

#if !ZEROFLAT_TEST_ASAN
// (Builds nine million tensor specs: a minute under AddressSanitizer, which adds nothing here.)
TEST(CliHostile, AConfigWhoseSizesOverflowIsRefused) {
  const std::string cfg =
      write_temp("overflow.json",
                 R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 1048576,
          "num_hidden_layers": 3000, "num_attention_heads": 1024, "num_key_value_heads": 1024,
          "head_dim": 1024, "intermediate_size": 1048576, "moe_intermediate_size": 1048576,
          "num_experts": 1000, "vocab_size": 1048576, "torch_dtype": "float32"})");
  Result r = run("inspect " + cfg);  // 9 million tensors of 2^40 elements: no wrapped sums
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(r.out.empty()) << r.out.substr(0, 200);
  EXPECT_NE(r.err.find("64 bits"), std::string::npos) << r.err;
}
#endif

// A long mlp_only_layers list is parsed and applied in time linear in the input: four times the
// layers and four times the list take about four times as long (layers x list would take 16).
TEST(CliHostile, LongMlpOnlyLayersListsParseInLinearTime) {
  auto config = [](int layers, int listed) {
    std::string list;
    for (int i = 0; i < listed; ++i) list += (i ? "," : "") + std::to_string(i % layers);
    return write_temp("mlp_only_" + std::to_string(layers) + ".json",
                      R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8,
                          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
                          "intermediate_size": 8, "moe_intermediate_size": 4, "num_experts": 1,
                          "vocab_size": 16, "num_hidden_layers": )" +
                          std::to_string(layers) + R"(, "mlp_only_layers": [)" + list + "]}");
  };
  const std::string small = config(2500, 250000);
  const std::string large = config(10000, 1000000);
  // The children's CPU time, not the wall clock: other work on the machine (a busy 2-core CI
  // host) stretches the wall clock of either run, not the work each one does.
  auto children_cpu_seconds = [] {
    rusage u{};
    getrusage(RUSAGE_CHILDREN, &u);
    return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
  };
  auto best_of_three = [&](const std::string& path) {
    double best = 1e9;
    for (int i = 0; i < 3; ++i) {
      const double t0 = children_cpu_seconds();
      Result r = run("inspect " + path + " --json");
      EXPECT_EQ(r.code, 0) << r.err;
      best = std::min(best, children_cpu_seconds() - t0);
    }
    return best;
  };
  const double ratio = best_of_three(large) / best_of_three(small);
  EXPECT_LT(ratio, 8.0) << "4x the input took " << ratio << "x as long";
}

TEST(CliHostile, AMalformedLocalRankCountIsAnErrorEverywhere) {
  for (const char* cmd : {"probe", "run --model tiny-moe --quiet",
                          "plan --model tiny-moe "
                          "--dp 1 --device 1GiB"}) {
    Result r = run(cmd, "ZEROFLAT_LOCAL_RANKS=two");
    if (std::string(cmd) == "plan --model tiny-moe --dp 1 --device 1GiB") {
      EXPECT_EQ(r.code, 0);  // plan describes a node by hand: it reads no launcher variable
      continue;
    }
    EXPECT_EQ(r.code, 2) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find("ZEROFLAT_LOCAL_RANKS"), std::string::npos) << r.err;
  }
}

TEST(CliHostile, ACorruptedBufferIsNeverASuccessEvenUnverified) {
  Result r = run("run --model tiny-moe --repeat 1 --quiet --json --inject-corruption 1001");
  EXPECT_EQ(r.code, 1) << r.err;
  json doc = json::parse(r.out);
  EXPECT_EQ(doc["ranks"][0]["originals_intact"], false);
  EXPECT_EQ(doc["ranks"][0]["verified"], false);
}

#if !ZEROFLAT_TEST_ASAN
// A process whose threads the system refuses (an address-space limit here; a process limit in
// containers): exit 1 with the reason, after the threads already started are joined: never a
// hang, never an abort. (AddressSanitizer needs more address space than this limit leaves.)
TEST(CliHostile, ThreadsTheSystemRefusesAreAnErrorNotAHangOrAnAbort) {
  for (const std::string& args : {"run --model tiny-moe --threads 1024 --quiet",
                                  "run --model tiny-moe --dp 200 --threads 8 --quiet"}) {
    Result r = run(args, "", "ulimit -v 2000000; timeout 120");
    EXPECT_EQ(r.code, 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find("cannot start"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("terminate called"), std::string::npos) << r.err;
  }
}
#endif

}  // namespace

namespace {

TEST(CliLayout, DeepSpeedReleaseRules) {
  Result r =
      run("layout --numels 6,40299,4,4,0,5,29911,3 --dp 2 --round-robin "
          "--param-align-bytes 16 --deepspeed 0.19.8 --frozen 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  json doc = json::parse(r.out);
  EXPECT_EQ(doc["deepspeed"]["rules"], "0.19.8");
  EXPECT_EQ(doc["deepspeed"]["tested"], true);
  EXPECT_TRUE(doc["offsets"][2].is_null());
  EXPECT_TRUE(doc["offsets"][4].is_null());
  EXPECT_EQ(doc["left_out"], json::parse(R"([{"param": 2, "why": "frozen"},
                                             {"param": 4, "why": "zero elements"}])"));
  for (const json& rank : doc["ranks"]) {
    for (const json& p : rank["params_in_partition"]) {
      EXPECT_NE(p, 2);
      EXPECT_NE(p, 4);
    }
  }
  Result table = run("layout --numels 5,0,3 --dp 2 --deepspeed 0.19.8");
  EXPECT_NE(table.out.find("left out: 1 (zero elements)"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("offsets      0 - 5"), std::string::npos) << table.out;
  EXPECT_EQ(run("layout --numels 5,7 --frozen 1 --deepspeed none").code, 2);  // needs a release
  EXPECT_EQ(run("layout --numels 5,7 --frozen 1 --alignment-factor 4").code, 2);
  EXPECT_EQ(run("layout --numels 5,7 --frozen 1 --json").code, 0);  // the newest release's
  EXPECT_EQ(run("layout --numels 5,7 --deepspeed 0.19.8 --frozen 2").code, 2);
  EXPECT_EQ(run("layout --numels 5,7 --deepspeed 0.13.0").code, 2);
  EXPECT_EQ(run("layout --numels 5,7 --deepspeed 0.18.6 --param-align-bytes 16").code, 2);
  EXPECT_EQ(run("plan --model tiny-moe --dp 2 --device 1GiB --deepspeed 0.19.8 "
                "--alignment-factor 4")
                .code,
            2);
  EXPECT_EQ(run("plan --model tiny-moe --dp 2 --device 1GiB --deepspeed 0.19.8").code, 0);
}

// --- load and write-checkpoint ----------------------------------------------------------------

// A fresh directory name under the test's temporary directory.
std::string temp_path(const std::string& name) {
  const std::string p =
      ::testing::TempDir() + "zeroflat_cli_" + std::to_string(getpid()) + "_" + name;
  std::system(("rm -rf '" + p + "'").c_str());
  return p;
}

std::string checkpoint(const std::string& name, const std::string& args) {
  const std::string dir = temp_path(name);
  Result w = run("write-checkpoint " + dir + " --model tiny-moe --shard-size 2MB --quiet " + args);
  EXPECT_EQ(w.code, 0) << w.err;
  return dir;
}

json checksums_of_run(const std::string& args) {
  Result r = run("run " + args + " --repeat 1 --json --quiet");
  EXPECT_EQ(r.code, 0) << args << "\n" << r.err;
  return json::parse(r.out)["ranks"][0]["checksum"];
}

// inspect --dp / --mesh on a safetensors checkpoint: each rank's reads of the load as the loader
// plans them, equal to what `zeroflat load` reports reading (ZeRO-1/2's slices before the
// all-gather, ZeRO-3's partitions) and, for FSDP2's and HSDP's shards, to the library's
// load_read_bytes, every byte read once per replica; bad combinations are usage errors.
TEST(CliInspect, EachRanksReadsOfALoadAreWhatTheLoadReads) {
  using namespace zeroflat;  // NOLINT: the library's own figures, beside the command's
  const std::string dir = checkpoint("inspect_reads", "--dtype bf16");
  const std::pair<std::string, std::string> zero[] = {{"--dp 2", "--dp 2 --read-plan load"},
                                                      {"--dp 3 --stage 3", "--dp 3 --stage 3"}};
  for (const auto& [inspect, load] : zero) {
    SCOPED_TRACE(inspect);
    Result shown = run("inspect " + dir + " " + inspect + " --json");
    ASSERT_EQ(shown.code, 0) << shown.err;
    Result loaded = run("load " + dir + " " + load + " --json --quiet");
    ASSERT_EQ(loaded.code, 0) << loaded.err;
    const json doc = json::parse(shown.out)["load"];
    const json ranks = json::parse(loaded.out)["ranks"];
    ASSERT_EQ(doc["ranks"].size(), ranks.size());
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      EXPECT_EQ(doc["ranks"][r]["bytes"], ranks[r]["bytes_read"]) << r;
      EXPECT_GT(doc["ranks"][r]["bytes"].get<std::uint64_t>(), 0u);
    }
  }
  const CheckpointIndex ck = open_checkpoint(dir);
  std::vector<LoadParam> params;
  std::uint64_t total = 0;
  for (const CheckpointTensor& t : ck.tensors) {
    params.push_back(LoadParam{t.name, t.shape, {}});
    total += t.bytes;
  }
  const MeshPlacement rep{MeshPlacement::Kind::kReplicate, 0};
  const MeshPlacement s0{MeshPlacement::Kind::kShard, 0};
  for (const std::string mesh : {"3", "2x2"}) {
    SCOPED_TRACE("--mesh " + mesh);
    Result shown = run("inspect " + dir + " --mesh " + mesh + " --json");
    ASSERT_EQ(shown.code, 0) << shown.err;
    const json doc = json::parse(shown.out)["load"];
    ShardSpec spec;
    spec.mesh = mesh == "3" ? std::vector<std::uint64_t>{3} : std::vector<std::uint64_t>{2, 2};
    for (std::uint64_t r = 0; r < doc["world"].get<std::uint64_t>(); ++r) {
      spec.coords.push_back(mesh == "3" ? std::vector<std::uint64_t>{r}
                                        : std::vector<std::uint64_t>{r / 2, r % 2});
    }
    spec.placements.assign(params.size(), mesh == "3" ? std::vector<MeshPlacement>{s0}
                                                      : std::vector<MeshPlacement>{rep, s0});
    std::uint64_t sum = 0;
    for (std::size_t r = 0; r < spec.coords.size(); ++r) {
      const std::uint64_t bytes = doc["ranks"][r]["bytes"].get<std::uint64_t>();
      EXPECT_EQ(bytes, load_read_bytes(ck, params, LoadPlacement::sharded(spec), LayoutOptions{},
                                       r));
      EXPECT_EQ(doc["ranks"][r]["coord"], json(spec.coords[r]));
      sum += bytes;
    }
    EXPECT_EQ(sum, total * (mesh == "3" ? 1 : 2));  // once per replica
  }
  // One rank, each read listed: they add up to its bytes.
  Result one = run("inspect " + dir + " --mesh 2 --rank 1 --json");
  ASSERT_EQ(one.code, 0) << one.err;
  const json rank1 = json::parse(one.out)["load"]["ranks"];
  ASSERT_EQ(rank1.size(), 1u);
  std::uint64_t listed = 0;
  for (const json& x : rank1[0]["read_list"]) listed += x["bytes"].get<std::uint64_t>();
  EXPECT_EQ(listed, rank1[0]["bytes"].get<std::uint64_t>());
  Result text = run("inspect " + dir + " --mesh 2x2");
  EXPECT_EQ(text.code, 0);
  EXPECT_NE(text.out.find("rank 3:"), std::string::npos) << text.out;
  for (const std::string bad :
       {"--mesh 2 --dp 2", "--mesh 0", "--mesh 2x", "--mesh 2 --rank 2", "--stage 3",
        "--dp 2 --stage 4", "--mesh 2 --tag x"}) {
    EXPECT_EQ(run("inspect " + dir + " " + bad).code, 2) << bad;
  }
}

TEST(CliLoad, EveryRankHoldsWhatRunFlattensAndReadsOnlyItsPartition) {
  const std::string bf16 = checkpoint("load_bf16", "--dtype bf16");
  const std::string fp32_of_bf16 = checkpoint("load_fp32b", "--dtype fp32 --values bf16");
  const std::string fp32_of_fp16 = checkpoint("load_fp32h", "--dtype fp32 --values fp16");
  struct Case {
    std::string dir, dtype;
  };
  const Case cases[] = {{bf16, "bf16"}, {fp32_of_bf16, "bf16"}, {fp32_of_fp16, "fp16"}};
  for (const Case& c : cases) {
    for (int dp = 1; dp <= 3; ++dp) {
      for (const char* rr : {"", " --round-robin"}) {
        const std::string opts = " --dtype " + c.dtype + " --dp " + std::to_string(dp) + rr;
        SCOPED_TRACE(c.dir + opts);
        Result r = run("load " + c.dir + opts + " --read-plan load --verify --json --quiet");
        ASSERT_EQ(r.code, 0) << r.err;
        const json doc = json::parse(r.out);
        // The same tensors through `zeroflat run --model CHECKPOINT`: the same bytes.
        const json want = checksums_of_run("--model " + c.dir + opts);
        ASSERT_EQ(doc["ranks"].size(), static_cast<std::size_t>(dp));
        std::uint64_t read = 0;
        const std::uint64_t file_es = c.dir == bf16 ? 2 : 4;
        for (const json& e : doc["ranks"]) {
          EXPECT_EQ(e["checksum"], want);
          EXPECT_EQ(e["verified"], true) << e.dump();
          EXPECT_EQ(e["predicted_peak_device_bytes"], e["measured_peak_device_bytes"]);
          // No more than its partition, at the file's element size.
          EXPECT_LE(e["bytes_read"].get<std::uint64_t>(),
                    doc["partition_bytes"].get<std::uint64_t>() / 2 * file_es);
          EXPECT_GT(e["read_gbps"].get<double>(), 0.0);
          EXPECT_TRUE(e["page_cache"] == "warm" || e["page_cache"] == "cold" ||
                      e["page_cache"] == "partly");
          read += e["bytes_read"].get<std::uint64_t>();
        }
        EXPECT_EQ(read, doc["checkpoint_bytes"].get<std::uint64_t>());  // each byte once
        EXPECT_GT(doc["ceiling"]["read_gbps"].get<double>(), 0.0);
        EXPECT_TRUE(doc["vs_ceiling"].is_number());
      }
    }
  }
  // On one host the cost model has every rank read the whole buffer from the page cache: the
  // same bytes, no all-gather (separate hosts sharing storage read slices: the loader test's).
  {
    Result whole = run("load " + bf16 + " --dp 2 --verify --json --quiet");
    ASSERT_EQ(whole.code, 0) << whole.err;
    const json doc = json::parse(whole.out);
    Result slices = run("load " + bf16 + " --dp 2 --read-plan load --json --quiet");
    ASSERT_EQ(slices.code, 0) << slices.err;
    for (int r = 0; r < 2; ++r) {
      const json& e = doc["ranks"][r];
      EXPECT_EQ(e["tier"], "load-whole") << doc["plan"].dump();
      EXPECT_EQ(e["verified"], true);
      EXPECT_EQ(e["bytes_read"], doc["checkpoint_bytes"]);
      EXPECT_EQ(e["checksum"], json::parse(slices.out)["ranks"][r]["checksum"]);
    }
    EXPECT_EQ(doc["plan"]["candidates"].size(), 2u);
    // Threads are ranks of one host: shared storage does not change that one host reads it once.
    const json shared =
        json::parse(run("load " + bf16 + " --dp 2 --storage 100MB --json --quiet").out);
    EXPECT_EQ(shared["ranks"][0]["tier"], "load-whole") << shared.dump();
    EXPECT_EQ(run("load " + bf16 + " --read-plan sideways --quiet").code, 2);
    EXPECT_EQ(run("load " + bf16 + " --copies maybe --quiet").code, 2);
  }
  // bf16 files into fp16 buffers (rounded), cold: verified against every tensor read whole.
  Result r = run("load " + bf16 + " --dtype fp16 --dp 2 --cold --verify --json --quiet");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(json::parse(r.out)["ranks"][1]["verified"], true);
  Result human = run("load " + bf16 + " --dp 2 --verify --quiet");
  EXPECT_EQ(human.code, 0) << human.err;
  EXPECT_NE(human.out.find("verified: yes, every rank"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("ceiling"), std::string::npos) << human.out;
  // Progress: rank 0's reads in the library's words, while reading (a line every interval, off
  // a terminal) and at the end, every byte it read.
  Result shown = run("load " + bf16 + " --dp 2 --read-plan load --json",
                     "ZEROFLAT_PROGRESS_SECONDS=0.0001");
  ASSERT_EQ(shown.code, 0) << shown.err;
  const std::uint64_t read0 = json::parse(shown.out)["ranks"][0]["bytes_read"];
  const std::string all =
      zeroflat::format_bytes(read0) + " of " + zeroflat::format_bytes(read0) + " (100%)";
  EXPECT_NE(shown.err.find("[zeroflat] rank 0: load done in "), std::string::npos) << shown.err;
  EXPECT_NE(shown.err.find(": read " + all), std::string::npos) << shown.err;
  EXPECT_EQ(run("load " + bf16 + " --dp 2 --quiet", "ZEROFLAT_PROGRESS_SECONDS=0.0001").err, "");
  // An interval past what a clock's deadline holds is the longest one, not a wait that never
  // waits (a line per loop turn, the load never ending).
  Result huge = run("load " + bf16 + " --dp 2 --json", "ZEROFLAT_PROGRESS_SECONDS=1e300");
  EXPECT_EQ(huge.code, 0) << huge.err.substr(0, 2000);
  EXPECT_LT(huge.err.size(), 4096u) << huge.err.substr(0, 2000);
  for (const std::string& d : {bf16, fp32_of_bf16, fp32_of_fp16})
    std::system(("rm -rf " + d).c_str());
}

TEST(CliLoad, NoFeasiblePlanGivesTheKeysOfEveryStoppedCommand) {
  Result r = run("load --model qwen3-30b-a3b --layers 2 --device sim:1GiB --no-data --json");
  EXPECT_EQ(r.code, 3) << r.err;
  const json doc = json::parse(r.out);
  EXPECT_EQ(doc["command"], "load");
  EXPECT_EQ(doc["exit"], 3);
  EXPECT_EQ(doc["error_kind"], "no feasible plan");
  EXPECT_NE(doc["error"].get<std::string>().find("does not fit"), std::string::npos);
  EXPECT_EQ(doc["plan"]["feasible"], false);
}

// A rehearsal's ranks keep their bookkeeping (plans, header entries, reads) on the host even on
// a sim device: 600k tensors at 256 ranks in one process is ~150 GB. Refused before any rank
// starts, with the document every stopped command gives (it was OOM-killed, and --json printed
// nothing for a host shortfall).
TEST(CliLoad, ARehearsalWhoseBookkeepingCannotFitIsRefusedWithItsDocument) {
  Result r = run("load --model tiny-moe --layers 3000 --experts 64 --device sim:h100-80gb "
                 "--no-data --dp 256 --json");
  EXPECT_EQ(r.code, 3) << r.err;
  const json doc = json::parse(r.out);
  EXPECT_EQ(doc["command"], "load");
  EXPECT_EQ(doc["exit"], 3);
  EXPECT_EQ(doc["error_kind"], "no feasible plan");
  const std::string error = doc["error"];
  EXPECT_NE(error.find("the bookkeeping of 603,003 tensors"), std::string::npos) << error;
  EXPECT_NE(error.find("Nothing was allocated"), std::string::npos) << error;
  EXPECT_NE(r.err.find("256 rank(s) here"), std::string::npos) << r.err;
}

TEST(CliHostile, APathWithATerminalSequenceReachesNoTerminal) {
  // A folder whose name holds ESC [31m: the messages that quote it (a failed read, an invalid
  // path) show '?' for the ESC, in the human output and on stderr alike.
  const std::string dir = checkpoint("esc_name", "");
  const std::string odd = dir + "\x1b[31m";
  ASSERT_EQ(std::rename(dir.c_str(), odd.c_str()), 0);
  for (const std::string& args :
       {std::string("load '") + odd + "' --dp 2 --inject-read-error 10000@1 --quiet",
        std::string("load '") + odd + "/nothing-here' --quiet",
        std::string("inspect '") + odd + "/nothing-here'"}) {
    Result r = run(args);
    EXPECT_NE(r.code, 0) << args;
    EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << args << "\n" << r.err;
    EXPECT_NE((r.out + r.err).find("?[31m"), std::string::npos) << args << "\n" << r.err;
  }
  std::system(("rm -rf '" + odd + "'").c_str());
}

TEST(CliLoad, AFolderNamedLatestBesideSafetensorsIsNoDeepSpeedCheckpoint) {
  // A 'latest' folder (or a link to one, as training scripts leave) beside a model's files: the
  // folder is a safetensors checkpoint still, for inspect and load alike.
  const std::string dir = checkpoint("latest_dir", "");
  ASSERT_EQ(::mkdir((dir + "/latest").c_str(), 0755), 0);
  Result shown = run("inspect " + dir + " --json");
  EXPECT_EQ(shown.code, 0) << shown.err;
  EXPECT_GT(json::parse(shown.out)["tensors"].get<std::uint64_t>(), 0u) << shown.out;
  EXPECT_EQ(run("load " + dir + " --dp 2 --quiet").code, 0);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(CliBench, EveryRowWithItsRatiosAndTargets) {
  Result r = run("bench --quick --size 4MiB --rounds 1 --no-gpu --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  std::set<std::uint64_t> counts;
  bool layout = false, plan = false;
  for (const json& row : doc["rows"]) {
    ASSERT_FALSE(row.contains("skipped")) << row.dump();
    EXPECT_GT(row["seconds"].get<double>(), 0) << row.dump();
    EXPECT_GT(row["vs_ceiling"].get<double>(), 0) << row.dump();
    if (row["what"] == "flatten (copy only)" && row["device"] == "cpu") {
      counts.insert(row["tensors"].get<std::uint64_t>());
      EXPECT_GT(row["vs_peer"].get<double>(), 0) << row.dump();
    }
    layout = layout || row["what"] == "layout of 1M parameters";
    plan = plan || row["what"].get<std::string>().rfind("plan of the seed model", 0) == 0;
    if (row["what"] == "layout of 1M parameters") EXPECT_EQ(row["tensors"], 1000000u);
  }
  EXPECT_EQ(counts, (std::set<std::uint64_t>{1, 1000, 100000}));
  EXPECT_TRUE(layout && plan) << r.out;
  EXPECT_EQ(run("bench --size 1KiB").code, 2);
  EXPECT_EQ(run("bench --rounds 0").code, 2);
}

TEST(CliLoad, APathThatIsNotUtf8StillGivesAJsonDocument) {
  const std::string dir = checkpoint("load_utf8", "");
  const std::string odd = dir + "\xff";
  ASSERT_EQ(std::rename(dir.c_str(), odd.c_str()), 0);
  // The path's byte shows as U+FFFD in the document; the load and its outcome are as for any
  // other name (before: a complete load ended in a JSON library error, exit 1).
  Result ok = run("load '" + odd + "' --dp 2 --json --quiet");
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_EQ(json::parse(ok.out)["ranks"].size(), 2u) << ok.out;
  Result fail = run("load '" + odd + "' --dp 2 --inject-read-error 10000@1 --json --quiet");
  EXPECT_EQ(fail.code, 4) << fail.err;
  EXPECT_EQ(json::parse(fail.out)["ranks"].size(), 2u) << fail.out;
  Result layout = run("layout --model '" + odd + "' --dp 2 --json");
  EXPECT_EQ(layout.code, 0) << layout.err;
  json parsed;
  EXPECT_NO_THROW(parsed = json::parse(layout.out)) << layout.out.substr(0, 400);
  std::system(("rm -rf '" + odd + "'").c_str());
}

TEST(CliLoad, BadCheckpointsExit2AndAFailedReadExits4OnEveryRank) {
  const std::string dir = checkpoint("load_bad", "");
  EXPECT_EQ(run("load " + dir + "/nothing-here --quiet").code, 2);
  EXPECT_EQ(run("load --quiet").code, 2);
  Result again = run("write-checkpoint " + dir + " --quiet");
  EXPECT_EQ(again.code, 2);
  EXPECT_NE(again.err.find("holds a checkpoint already"), std::string::npos) << again.err;
  Result no_data = run("load --model tiny-moe --quiet");
  EXPECT_EQ(no_data.code, 2);
  EXPECT_NE(no_data.err.find("--no-data"), std::string::npos) << no_data.err;
  // A failed read midway: every rank reports, the failing one names file, tensor and bytes.
  Result fail = run("load " + dir + " --dp 3 --inject-read-error 10000@1 --json --quiet");
  EXPECT_EQ(fail.code, 4) << fail.err;
  const json doc = json::parse(fail.out);
  ASSERT_EQ(doc["ranks"].size(), 3u);
  const std::string e1 = doc["ranks"][1]["error"].get<std::string>();
  EXPECT_NE(e1.find(".safetensors"), std::string::npos) << e1;
  EXPECT_NE(e1.find("tensor '"), std::string::npos) << e1;
  EXPECT_NE(e1.find("bytes ["), std::string::npos) << e1;
  EXPECT_NE(doc["ranks"][0]["error"].get<std::string>().find("rank 1"), std::string::npos);
  EXPECT_EQ(doc["ranks"][2]["buffer_kept"], false);
  // A shard the index names is gone: exit 2, naming it, before anything is read.
  const std::string shard = dir + "/model-00002-of-00003.safetensors";
  ASSERT_EQ(std::rename(shard.c_str(), (shard + ".away").c_str()), 0);
  Result missing = run("load " + dir + " --quiet");
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("model-00002-of-00003.safetensors"), std::string::npos) << missing.err;
  ASSERT_EQ(std::rename((shard + ".away").c_str(), shard.c_str()), 0);
  // A file shorter than its header says.
  ASSERT_EQ(truncate(shard.c_str(), 1000), 0);
  Result shorter = run("load " + dir + " --quiet");
  EXPECT_EQ(shorter.code, 2);
  EXPECT_NE(shorter.err.find("model-00002-of-00003.safetensors"), std::string::npos) << shorter.err;
  std::system(("rm -rf " + dir).c_str());
}

// --from deepspeed's options, checked before any file is opened (a resume of a real checkpoint
// saved by DeepSpeed: python/tests/test_cli_resume.py).
TEST(CliLoad, DeepSpeedOptionsAreCheckedAndAFolderOfDeepSpeedsNeedsFrom) {
  const std::string dir = temp_path("ds_folder");
  ASSERT_EQ(std::system(("mkdir -p '" + dir + "/step2' && echo step2 > '" + dir + "/latest'").c_str()),
            0);
  // A safetensors load of a DeepSpeed folder says how to resume it.
  Result plain = run("load " + dir + " --dp 3 --quiet");
  EXPECT_EQ(plain.code, 2);
  EXPECT_NE(plain.err.find("--from deepspeed"), std::string::npos) << plain.err;
  // The folder holds no checkpoint's files: named, exit 2.
  Result empty = run("load " + dir + " --from deepspeed --dp 3 --quiet");
  EXPECT_EQ(empty.code, 2);
  EXPECT_NE(empty.err.find("no DeepSpeed checkpoint"), std::string::npos) << empty.err;
  for (const std::string& bad :
       {std::string("--from torch"), std::string("--tag step2"), std::string("--states none"),
        std::string("--from deepspeed --dtype fp16"), std::string("--from deepspeed --round-robin"),
        std::string("--from deepspeed --model tiny-moe"), std::string("--from deepspeed --dp 0")}) {
    Result r = run("load " + dir + " " + bad + " --quiet");
    EXPECT_EQ(r.code, 2) << bad << "\n" << r.err;
    const std::string option = bad.substr(bad.rfind("--"), bad.find(' ', bad.rfind("--")) -
                                                              bad.rfind("--"));
    EXPECT_NE(r.err.find(option), std::string::npos) << bad << "\n" << r.err;
  }
  EXPECT_EQ(run("load --from deepspeed --quiet").code, 2);
  Result help = run("load --help");
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--from deepspeed --dp"), std::string::npos) << help.out;
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(CliLoad, TheSeedsFortyEightLayersRehearsedOnEightSimulatedH100s) {
  // The flat buffer on every rank, and ZeRO-3's partitions (each rank's own buffer).
  for (const std::string stage : {"", " --stage 3"}) {
    SCOPED_TRACE(stage);
    Result r =
        run("load --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data --dp 8" +
            stage + " --json --quiet");
    ASSERT_EQ(r.code, 0) << r.err;
    const json doc = json::parse(r.out);
    ASSERT_EQ(doc["ranks"].size(), 8u);
    std::uint64_t read = 0;
    for (const json& e : doc["ranks"]) {
      EXPECT_EQ(e["predicted_peak_device_bytes"], e["measured_peak_device_bytes"]);
      EXPECT_EQ(e["measured_peak_device_bytes"], doc["flat_bytes"]);  // never a second copy
      EXPECT_EQ(e["predicted_host_bytes"], e["host_bytes"]);
      read += e["bytes_read"].get<std::uint64_t>();
    }
    EXPECT_EQ(read, doc["checkpoint_bytes"].get<std::uint64_t>());
    EXPECT_GT(doc["checkpoint_bytes"].get<std::uint64_t>(), 60'000'000'000u);
    EXPECT_EQ(doc["plan"]["tier"], stage.empty() ? "load" : "load-partitions");
    if (!stage.empty()) {
      // Each rank's buffer is its partitions: an eighth of the model.
      EXPECT_LT(doc["flat_bytes"].get<std::uint64_t>(),
                doc["checkpoint_bytes"].get<std::uint64_t>() / 8 + 100'000);
    }
  }
  Result human =
      run("load --stage 3 --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb "
          "--no-data --dp 8 --quiet");
  EXPECT_NE(human.out.find("load-partitions"), std::string::npos) << human.out;
  EXPECT_NE(human.out.find("7.63 GB / 7.63 GB"), std::string::npos) << human.out;
}

TEST(CliZero3, LayoutPrintsPartitionsSubGroupsAndEachRanksPadding) {
  // W = 2: partitions 5 3 | 4 2 6, cut at 8: [5 3] [4 2 6]; paddings 0 0 | 1 0 1.
  Result r = run("layout --numels 10,6/7,4,11 --dp 2 --stage 3 --sub-group-size 8 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  json doc = json::parse(r.out);
  EXPECT_EQ(doc["stage"], 3);
  EXPECT_EQ(doc["buffer_numel"], 20);
  EXPECT_EQ(doc["sub_groups"], json::parse(R"([{"group":0,"params":[0,2],"offset":0,"numel":8},
                                             {"group":1,"params":[2,3],"offset":8,"numel":12}])"));
  EXPECT_EQ(doc["ranks"][1]["groups_padding"], json::parse("[[0,0],[1,0,1]]"));
  EXPECT_EQ(doc["ranks"][0]["groups_padding"], json::parse("[[0,0],[0,0,0]]"));
  EXPECT_EQ(doc["deepspeed"]["rules"], "0.19.8");
  // The release's selection: frozen parameters, and from 0.19.8 zero-element ones, are left out.
  r = run("layout --numels 10,0,6/7,4,11 --dp 3 --stage 3 --frozen 3 --rank 2 --json");
  ASSERT_EQ(r.code, 0) << r.err;
  doc = json::parse(r.out);
  EXPECT_EQ(doc["inputs"], json::parse("[0,2,4,5]"));
  EXPECT_EQ(doc["left_out"][0], json::parse(R"({"param":1,"why":"zero elements"})"));
  EXPECT_EQ(doc["left_out"][1], json::parse(R"({"param":3,"why":"frozen"})"));
  EXPECT_EQ(doc["ranks"].size(), 1u);
  EXPECT_EQ(doc["ranks"][0]["groups_padding"], json::parse("[[2,0],[2,1]]"));
  r = run("layout --numels 10,0,6 --dp 3 --stage 3 --deepspeed 0.18.9 --json");
  EXPECT_EQ(json::parse(r.out)["params"].size(), 3u);  // before 0.19.8: zero-element kept
  // The table names the rules and the sub-groups.
  r = run("layout --model tiny-moe --dp 4 --stage 3 --sub-group-size 100000");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("layout: ZeRO-3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ZeRO-3: partitions and sub-groups"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("groups_padding"), std::string::npos) << r.out;
  // Options of the flat buffer, and a sub-group size without stage 3: exit 2, named.
  for (const char* bad : {"--stage 3 --round-robin", "--stage 3 --alignment-factor 4",
                          "--stage 3 --param-align-bytes 16", "--sub-group-size 5", "--stage 4",
                          "--stage 3 --rank 2"}) {
    Result b = run(std::string("layout --numels 5,6 --dp 2 ") + bad);
    EXPECT_EQ(b.code, 2) << bad;
    EXPECT_NE(b.err.find(std::string(bad).substr(std::string(bad).rfind("--") + 2, 5)),
              std::string::npos)
        << bad << ": " << b.err;
  }
}

TEST(CliZero3, LoadReadsEachRanksPartitionsAndVerifiesThem) {
  const std::string dir = checkpoint("zero3", "--dtype fp32 --values bf16");
  std::uint64_t buffer = 0;
  for (int dp = 1; dp <= 3; ++dp) {
    SCOPED_TRACE("dp " + std::to_string(dp));
    Result r = run("load " + dir + " --stage 3 --dtype bf16 --dp " + std::to_string(dp) +
                   " --verify --no-ceiling --json --quiet");
    ASSERT_EQ(r.code, 0) << r.err;
    const json doc = json::parse(r.out);
    EXPECT_EQ(doc["stage"], 3);
    EXPECT_EQ(doc["plan"]["tier"], "load-partitions");
    std::uint64_t read = 0;
    for (const json& e : doc["ranks"]) {
      EXPECT_EQ(e["verified"], true) << e.dump();
      EXPECT_EQ(e["predicted_peak_device_bytes"], e["measured_peak_device_bytes"]);
      EXPECT_EQ(e["flat_bytes"], doc["flat_bytes"]);  // the same buffer size on every rank
      read += e["bytes_read"].get<std::uint64_t>();
    }
    EXPECT_EQ(read, doc["checkpoint_bytes"].get<std::uint64_t>());  // each byte once
    if (dp == 1) buffer = doc["flat_bytes"].get<std::uint64_t>();
    EXPECT_LE(doc["flat_bytes"].get<std::uint64_t>(),
              buffer / dp + 2 * doc["tensors"].get<std::uint64_t>());
  }
  // A failed read on rank 1: exit 4 on every rank; the flat placement's plans are refused.
  Result fail = run("load " + dir +
                    " --stage 3 --dp 3 --inject-read-error 10000@1 --no-ceiling "
                    "--json --quiet");
  EXPECT_EQ(fail.code, 4) << fail.err;
  EXPECT_NE(json::parse(fail.out)["ranks"][0]["error"].get<std::string>().find("rank 1"),
            std::string::npos);
  EXPECT_EQ(run("load " + dir + " --stage 3 --dp 2 --read-plan load --quiet").code, 2);
  Result hint = run("load " + dir + " --dp 2 --read-plan load-partitions --quiet");
  EXPECT_EQ(hint.code, 2);
  EXPECT_NE(hint.err.find("--stage 3"), std::string::npos) << hint.err;
  std::system(("rm -rf " + dir).c_str());
}

// The per-rank entries of run and load are the library's result documents (report.h), with the
// command's own fields added; every document names its layout rules.
TEST(CliReport, RunAndLoadEntriesAreTheLibrarysResultDocuments) {
  Result r = run("run --model tiny-moe --dp 2 --repeat 1 --json --quiet");
  ASSERT_EQ(r.code, 0) << r.err;
  const json doc = json::parse(r.out);
  EXPECT_EQ(doc["deepspeed"]["rules"], "0.19.8");
  EXPECT_EQ(doc["plan"]["feasible"], true);
  for (const json& e : doc["ranks"]) {
    for (const char* key :
         {"rank", "tier", "outcome", "feasible", "reason", "flat_bytes", "seconds", "step_seconds",
          "predicted_peak_device_bytes", "measured_peak_device_bytes", "predicted_host_bytes",
          "host_bytes", "master_bytes", "probe", "host_probe", "checksum", "threads"}) {
      EXPECT_TRUE(e.contains(key)) << key << " in " << e.dump();
    }
    EXPECT_FALSE(e.contains("plan")) << "the plan is the document's, once";
    EXPECT_EQ(e["outcome"], "done");
    EXPECT_EQ(e["probe"]["device"], doc["ranks"][0]["probe"]["device"]);
    EXPECT_EQ(e["flat_bytes"], doc["flat_bytes"]);
  }
  const std::string dir = temp_path("report_ck");
  ASSERT_EQ(run("write-checkpoint " + dir + " --model tiny-moe --quiet").code, 0);
  Result l = run("load " + dir + " --dp 2 --json --quiet");
  ASSERT_EQ(l.code, 0) << l.err;
  const json ld = json::parse(l.out);
  EXPECT_EQ(ld["deepspeed"]["rules"], "0.19.8");
  // Two ranks of one host: each reads the whole buffer from the page cache (the read plan).
  EXPECT_EQ(ld["plan"]["tier"], "load-whole");
  for (const json& e : ld["ranks"]) {
    for (const char* key :
         {"rank", "tier", "outcome", "bytes_read", "reads", "read_gbps", "page_cache",
          "cached_fraction", "predicted_host_bytes", "host_bytes", "probe", "ceiling", "checksum",
          "reason", "copy_check_bytes", "total_seconds", "allgather_seconds"}) {
      EXPECT_TRUE(e.contains(key)) << key << " in " << e.dump();
    }
    EXPECT_EQ(e["outcome"], "done");
    EXPECT_EQ(e["tier"], "load-whole");
    EXPECT_EQ(e["reason"], ld["plan"]["reason"]);
  }
  EXPECT_EQ(ld["plan"]["candidates"].size(), 2u);
  // Without data nothing is read: no rate, no page cache.
  Result sim = run("load --model tiny-moe --device sim:1GiB --no-data --dp 2 --json --quiet");
  ASSERT_EQ(sim.code, 0) << sim.err;
  const json sim_doc = json::parse(sim.out);  // kept: the loop walks into it
  for (const json& e : sim_doc["ranks"]) {
    EXPECT_TRUE(e["read_gbps"].is_null()) << e.dump();
    EXPECT_TRUE(e["page_cache"].is_null()) << e.dump();
  }
  Result plan = run("plan --model tiny-moe --dp 2 --device 1GiB --json");
  ASSERT_EQ(plan.code, 0) << plan.err;
  EXPECT_EQ(json::parse(plan.out)["deepspeed"]["rules"], "0.19.8");
  Result own = run("plan --model tiny-moe --dp 2 --device 1GiB --json --deepspeed none");
  ASSERT_EQ(own.code, 0) << own.err;
  EXPECT_TRUE(json::parse(own.out)["deepspeed"].is_null());
  std::system(("rm -rf " + dir).c_str());
}

// --- write-checkpoint: files of its own, and in time linear in the tensors -------------------

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(CliWriteCheckpoint, AShardNameThatIsALinkIsNeverWrittenThrough) {
  const std::string dir = temp_path("wc_link");
  const std::string outside = temp_path("wc_link_outside.txt");
  std::ofstream(outside) << "not a checkpoint";
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  const std::string shard = dir + "/model-00001-of-00003.safetensors";
  ASSERT_EQ(symlink(outside.c_str(), shard.c_str()), 0);
  Result r = run("write-checkpoint " + dir + " --model tiny-moe --shard-size 2MB --quiet");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("model-00001-of-00003.safetensors exists already"), std::string::npos)
      << r.err;
  EXPECT_EQ(read_all(outside), "not a checkpoint");
  // Nothing else was written either: the names were checked before the first byte.
  struct stat st;
  EXPECT_NE(lstat((dir + "/model-00002-of-00003.safetensors").c_str(), &st), 0);
  EXPECT_EQ(lstat(shard.c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));
  std::system(("rm -rf " + dir + " " + outside).c_str());
}

TEST(CliWriteCheckpoint, ADanglingLinkCreatesNoFileOutsideTheDirectory) {
  for (const char* name :
       {"model.safetensors", "model.safetensors.index.json", "model-00003-of-00003.safetensors"}) {
    SCOPED_TRACE(name);
    const std::string dir = temp_path("wc_dangling");
    const std::string target = temp_path("wc_dangling_target");
    ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
    ASSERT_EQ(symlink(target.c_str(), (dir + "/" + name).c_str()), 0);
    const std::string shards = std::string(name) == "model.safetensors" ? "" : " --shard-size 2MB";
    Result r = run("write-checkpoint " + dir + " --model tiny-moe --quiet" + shards);
    EXPECT_EQ(r.code, 2) << r.err;
    struct stat st;
    EXPECT_NE(lstat(target.c_str(), &st), 0) << target << " was created";
    std::system(("rm -rf " + dir + " " + target).c_str());
  }
}

TEST(CliWriteCheckpoint, AFailedWriteRemovesOnlyWhatItCreated) {
  // A file-size limit of 1 MiB: the first 2 MB shard fails midway (EFBIG).
  const std::string dir = temp_path("wc_fail");
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  std::ofstream(dir + "/notes.txt") << "mine";
  Result r = run("write-checkpoint " + dir + " --model tiny-moe --shard-size 2MB --quiet", "",
                 "ulimit -f 1024;");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("writing failed"), std::string::npos) << r.err;
  EXPECT_EQ(read_all(dir + "/notes.txt"), "mine");
  struct stat st;
  EXPECT_NE(lstat((dir + "/model-00001-of-00003.safetensors").c_str(), &st), 0);
  // A shard name taken by a file of someone else's: refused before anything is written, and the
  // file survives (a failed run used to remove it).
  std::ofstream(dir + "/model-00002-of-00003.safetensors") << "theirs";
  Result taken = run("write-checkpoint " + dir + " --model tiny-moe --shard-size 2MB --quiet");
  EXPECT_EQ(taken.code, 2) << taken.err;
  EXPECT_EQ(read_all(dir + "/model-00002-of-00003.safetensors"), "theirs");
  EXPECT_NE(lstat((dir + "/model-00001-of-00003.safetensors").c_str(), &st), 0);
  // A directory the run made itself goes too, when nothing else is in it.
  const std::string fresh = temp_path("wc_fail_fresh");
  Result gone =
      run("write-checkpoint " + fresh + " --model tiny-moe --quiet", "", "ulimit -f 1024;");
  EXPECT_EQ(gone.code, 1) << gone.err;
  EXPECT_NE(lstat(fresh.c_str(), &st), 0);
  std::system(("rm -rf " + dir).c_str());
}

// A config of L layers of 400 tiny experts: about 1,200 L tensors.
std::string many_tensors_config(int layers) {
  return write_temp("many" + std::to_string(layers) + ".json",
                    R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8,
    "num_hidden_layers": )" +
                        std::to_string(layers) +
                        R"(, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "moe_intermediate_size": 4, "num_experts": 400, "vocab_size": 16})");
}

// The processor time (user and system) of a write: unlike the wall clock, it does not grow when
// other processes share the cores, so the comparison below holds on a busy machine.
double cpu_seconds_to_write(const std::string& config, const std::string& dir, std::string& said) {
  auto children = [] {
    rusage u{};
    getrusage(RUSAGE_CHILDREN, &u);
    auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
    return s(u.ru_utime) + s(u.ru_stime);
  };
  const double before = children();
  // Bounded: the quadratic writer would take many minutes for the large one. (Generous: the
  // sanitizers' build, beside other tests, is many times slower; the ratio below is the check.)
  Result r = run("write-checkpoint " + dir + " --model " + config, "", "timeout 600");
  EXPECT_EQ(r.code, 0) << r.err;
  said = r.out;
  return children() - before;
}

// 300,000 tensors took more than two minutes (a header built in time quadratic in its tensors).
TEST(CliWriteCheckpoint, ThreeHundredThousandTensorsInLinearTime) {
  const std::string small = temp_path("wc_small"), large = temp_path("wc_large");
  // "wrote DIR: N tensors of ...": N.
  auto tensors = [](const std::string& said) {
    const auto end = said.find(" tensors of ");
    auto begin = end;
    while (begin != std::string::npos && begin > 0 &&
           std::isdigit(static_cast<unsigned char>(said[begin - 1])))
      --begin;
    return end == std::string::npos ? 0 : std::stoull(said.substr(begin, end - begin));
  };
  std::string said;
  const double t_small = cpu_seconds_to_write(many_tensors_config(25), small, said);
  EXPECT_GT(tensors(said), 30'000u) << said;
  const double t_large = cpu_seconds_to_write(many_tensors_config(250), large, said);
  EXPECT_GT(tensors(said), 300'000u) << said;
  // Ten times the tensors: about ten times the time when linear, a hundred when quadratic.
  EXPECT_LT(t_large, 40 * std::max(t_small, 0.05)) << t_small << " s, then " << t_large << " s";
  std::system(("rm -rf " + small + " " + large).c_str());
}

// --- load: names, hub ids ---------------------------------------------------------------------

// "layers.0.w" and "layers.00.w" compare equal in natural name order: the load used to crash
// on them. Either it loads both, correctly, or it says which names it cannot tell apart.
TEST(CliLoad, NamesEqualInNaturalOrderAreNeverACrash) {
  const std::string file =
      write_temp("equal_names.safetensors",
                 safetensors_file(
                     R"({"layers.0.w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},)"
                     R"( "layers.00.w": {"dtype": "BF16", "shape": [2], "data_offsets": [8, 12]}})",
                     12));
  for (const char* dp : {"1", "2"}) {
    Result r = run("load " + file + " --dp " + dp + " --verify --json --quiet");
    ASSERT_TRUE(r.code == 0 || r.code == 2) << "exit " << r.code << "\n" << r.err;
    if (r.code == 0) {
      const json doc = json::parse(r.out);
      EXPECT_EQ(doc["tensors"], 2);
      for (const json& e : doc["ranks"]) EXPECT_EQ(e["verified"], true) << e.dump();
    } else {
      EXPECT_NE(r.err.find("layers.00.w"), std::string::npos) << r.err;
      EXPECT_NE(r.err.find("layers.0.w"), std::string::npos) << r.err;
    }
  }
}

// A Hugging Face hub id resolves in the local hub cache (models--ORG--NAME/refs/main and
// snapshots/REVISION/) for the weights as for a config, and nothing is downloaded.
TEST(CliLoad, AHubIdResolvesInTheLocalHubCache) {
  const std::string cache = temp_path("hub");
  const std::string repo = cache + "/models--acme--tiny";
  const std::string snapshot = repo + "/snapshots/0123abcd";
  ASSERT_EQ(std::system(("mkdir -p " + repo + "/refs " + repo + "/blobs " + snapshot).c_str()), 0);
  std::ofstream(repo + "/refs/main") << "0123abcd";
  // As huggingface_hub lays it out: the snapshot's files are links into blobs/.
  const std::string staging = temp_path("hub_staging");
  ASSERT_EQ(run("write-checkpoint " + staging + " --model tiny-moe --shard-size 2MB --quiet").code,
            0);
  ASSERT_EQ(std::system(("for f in " + staging + "/*; do b=$(basename $f); mv $f " + repo +
                         "/blobs/$b.blob; ln -s ../../blobs/$b.blob " + snapshot + "/$b; done")
                            .c_str()),
            0);
  const std::string env = "HF_HUB_CACHE=" + cache;
  Result by_id = run("load acme/tiny --dp 2 --verify --json --quiet", env);
  ASSERT_EQ(by_id.code, 0) << by_id.err;
  const json doc = json::parse(by_id.out);
  EXPECT_EQ(doc["checkpoint"], "acme/tiny");
  EXPECT_EQ(doc["ranks"][1]["verified"], true);
  Result by_path = run("load " + snapshot + " --dp 2 --json --quiet");
  ASSERT_EQ(by_path.code, 0) << by_path.err;
  EXPECT_EQ(json::parse(by_path.out)["ranks"][0]["checksum"], doc["ranks"][0]["checksum"]);
  // The model options find it the same way; HF_HOME/hub is the cache too.
  Result layout = run("layout --model acme/tiny --dp 2 --rank 0", env);
  EXPECT_EQ(layout.code, 0) << layout.err;
  ASSERT_EQ(
      std::system(
          ("mkdir -p " + cache + "_home && ln -s " + cache + " " + cache + "_home/hub").c_str()),
      0);
  EXPECT_EQ(
      run("load acme/tiny --quiet --no-ceiling", "env -u HF_HUB_CACHE HF_HOME=" + cache + "_home")
          .code,
      0);
  // An id that is not in the cache: exit 2, saying where it looked and that nothing is fetched.
  Result missing = run("load acme/absent --quiet", env);
  EXPECT_EQ(missing.code, 2);
  EXPECT_NE(missing.err.find("models--acme--absent"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("downloads nothing"), std::string::npos) << missing.err;
  std::system(("rm -rf " + cache + " " + cache + "_home " + staging).c_str());
}

}  // namespace
