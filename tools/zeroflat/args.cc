// The command-line parser.
#include "cli/args.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "zeroflat/common.h"

namespace zeroflat::cli {
namespace {

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

std::optional<std::string> Args::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

Parser::Parser(std::string command, std::string usage, std::string summary)
    : command_(std::move(command)), usage_(std::move(usage)), summary_(std::move(summary)) {}

Parser& Parser::flag(std::string name, std::string help) {
  opts_.push_back(Opt{std::move(name), "", std::move(help), ""});
  return *this;
}

Parser& Parser::option(std::string name, std::string metavar, std::string help,
                       std::string default_text) {
  opts_.push_back(
      Opt{std::move(name), std::move(metavar), std::move(help), std::move(default_text)});
  return *this;
}

Parser& Parser::epilog(std::string text) {
  epilogs_.push_back(std::move(text));
  return *this;
}

Parser& Parser::allow_positionals(std::size_t max) {
  max_positionals_ = max;
  return *this;
}

const Parser::Opt* Parser::find(const std::string& name) const {
  for (const Opt& o : opts_) {
    if (o.name == name) return &o;
  }
  return nullptr;
}

Args Parser::parse(const std::vector<std::string>& argv) const {
  Args args;
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "-h" || a == "--help") {
      args.flags_.insert("help");
      continue;
    }
    if (a.rfind("--", 0) != 0 || a == "--") {
      if (a.size() > 1 && a[0] == '-' && a != "-") {
        throw UsageError("unknown option '" + printable(a) + "' (options are spelled --name)");
      }
      if (args.positionals_.size() >= max_positionals_) {
        throw UsageError("unexpected argument '" + printable(a) + "'");
      }
      args.positionals_.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::optional<std::string> inline_value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      inline_value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    const Opt* opt = find(name);
    if (opt == nullptr) {
      std::string best;
      std::size_t best_d = 3;
      for (const Opt& o : opts_) {
        std::size_t d = edit_distance(name, o.name);
        if (d < best_d) {
          best_d = d;
          best = o.name;
        }
      }
      throw UsageError("unknown option '--" + printable(name) + "'" +
                       (best.empty() ? "" : "; did you mean '--" + best + "'?"));
    }
    if (args.has(name)) throw UsageError("option '--" + name + "' is given twice");
    if (opt->metavar.empty()) {
      if (inline_value) throw UsageError("option '--" + name + "' takes no value");
      args.flags_.insert(name);
      continue;
    }
    if (inline_value) {
      args.values_[name] = *inline_value;
    } else {
      if (i + 1 >= argv.size()) {
        throw UsageError("option '--" + name + "' needs a value (" + opt->metavar + ")");
      }
      args.values_[name] = argv[++i];
    }
  }
  return args;
}

std::optional<Args> Parser::parse_or_help(const std::vector<std::string>& argv) const {
  Args args = parse(argv);
  if (args.has("help")) {
    std::fputs(help().c_str(), stdout);
    return std::nullopt;
  }
  return args;
}

std::string Parser::help() const {
  std::ostringstream out;
  out << "usage: zeroflat " << command_ << " " << usage_ << "\n\n" << summary_ << "\n\noptions:\n";
  std::size_t width = 0;
  auto left = [](const Opt& o) {
    return "--" + o.name + (o.metavar.empty() ? "" : " " + o.metavar);
  };
  for (const Opt& o : opts_) width = std::max(width, left(o).size());
  for (const Opt& o : opts_) {
    std::string l = left(o);
    out << "  " << l << std::string(width - l.size() + 2, ' ') << o.help;
    if (!o.default_text.empty()) out << " [default: " << o.default_text << "]";
    out << "\n";
  }
  out << "  -h, --help" << std::string(width > 8 ? width - 8 : 2, ' ') << "show this help\n";
  for (const std::string& e : epilogs_) out << "\n" << e << "\n";
  return out.str();
}

}  // namespace zeroflat::cli
