// The zeroflat command: exit codes, messages, JSON documents, layout vectors through the CLI,
// and `run` giving the same verified checksum with any thread count.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

using nlohmann::json;

struct Result {
  int code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

Result run(const std::string& args, const std::string& env = "") {
  // Tests run as parallel processes: each needs its own file.
  static int calls = 0;
  const std::string err_path = ::testing::TempDir() + "zeroflat_cli_stderr." +
                               std::to_string(getpid()) + "." + std::to_string(calls++) + ".txt";
  const std::string cmd =
      env + (env.empty() ? "" : " ") + ZEROFLAT_CLI_PATH + " " + args + " 2>" + err_path;
  Result r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  int status = pclose(pipe);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  {
    std::ifstream e(err_path);
    r.err.assign(std::istreambuf_iterator<char>(e), std::istreambuf_iterator<char>());
  }
  std::remove(err_path.c_str());
  return r;
}

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
                       " --json";
    Result r = run(args);
    ASSERT_EQ(r.code, 0) << args << "\n" << r.err;
    EXPECT_EQ(json::parse(r.out), vectors[k]["expect"]) << args;
  }
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
      {"layout --numels @/nonexistent/file", "cannot read"},
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
      {"run --dp 3", "single rank"},
      {"run --tier sharded", "device tier only"},
      {"run --tier warp", "'warp'"},
      {"run --comm mpi", "--comm mpi"},
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
}

}  // namespace
