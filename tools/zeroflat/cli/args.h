// A small command-line parser: declared options, --name value and --name=value, generated help.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace zeroflat::cli {

// Thrown for bad command lines; main() prints it with a pointer to --help and exits 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  bool has(const std::string& name) const { return flags_.count(name) + values_.count(name) > 0; }
  std::optional<std::string> get(const std::string& name) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  friend class Parser;
  std::set<std::string> flags_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positionals_;
};

class Parser {
 public:
  Parser(std::string command, std::string usage, std::string summary);

  // A boolean switch: --name.
  Parser& flag(std::string name, std::string help);
  // An option with a value: --name VALUE or --name=VALUE. default_text is shown in --help.
  Parser& option(std::string name, std::string metavar, std::string help,
                 std::string default_text = "");
  // A free-form paragraph appended to --help (examples, notes).
  Parser& epilog(std::string text);
  Parser& allow_positionals(std::size_t max);

  // Throws UsageError for an unknown option (with the closest known one), a missing value or an
  // option given twice. "--help" / "-h" set the flag "help".
  Args parse(const std::vector<std::string>& argv) const;
  std::string help() const;
  // parse(), and for --help prints help() on stdout and returns nothing: the command is done.
  std::optional<Args> parse_or_help(const std::vector<std::string>& argv) const;

 private:
  struct Opt {
    std::string name;
    std::string metavar;  // empty for a flag
    std::string help;
    std::string default_text;
  };
  const Opt* find(const std::string& name) const;

  std::string command_;
  std::string usage_;
  std::string summary_;
  std::vector<Opt> opts_;
  std::vector<std::string> epilogs_;
  std::size_t max_positionals_ = 0;
};

}  // namespace zeroflat::cli
