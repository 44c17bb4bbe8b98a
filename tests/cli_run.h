// Runs the zeroflat command for the CLI tests: exit code, stdout and stderr.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>

namespace {

struct Result {
  int code = -1;
  std::string out;  // stdout
  std::string err;  // stderr
};

// `args` go to the command after its path; `env` ("A=1 B=2") before it; `prefix` (a launcher
// such as mpirun) before that.
Result run(const std::string& args, const std::string& env = "", const std::string& prefix = "") {
  // Tests run as parallel processes: each needs its own file.
  static int calls = 0;
  const std::string err_path = ::testing::TempDir() + "zeroflat_cli_stderr." +
                               std::to_string(getpid()) + "." + std::to_string(calls++) + ".txt";
  const std::string cmd = env + (env.empty() ? "" : " ") + prefix + (prefix.empty() ? "" : " ") +
                          ZEROFLAT_CLI_PATH + " " + args + " 2>" + err_path;
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

}  // namespace
