// `zeroflat layout`: the flat layout of one parameter group, as a table or as JSON.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>
#include <streambuf>
#include <string>

#include "cli/common.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"

namespace zeroflat::cli {
namespace {

// "0 1 2 ... 17 18 (19 in all)" for long lists.
std::string list_text(const std::vector<std::uint64_t>& v, std::size_t keep = 8) {
  std::string out;
  auto add = [&](std::uint64_t x) {
    if (!out.empty()) out += ' ';
    out += std::to_string(x);
  };
  if (v.empty()) return "-";
  if (v.size() <= 2 * keep) {
    for (std::uint64_t x : v) add(x);
    return out;
  }
  for (std::size_t i = 0; i < keep; ++i) add(v[i]);
  out += " ...";
  for (std::size_t i = v.size() - keep; i < v.size(); ++i) add(v[i]);
  return out + " (" + format_count(v.size()) + " in all)";
}

// Passes every character on to `sink` but the last, which it holds: a field can then be added
// before a document's closing brace without keeping the document (it may be gigabytes).
class HoldLastChar : public std::streambuf {
 public:
  explicit HoldLastChar(std::streambuf* sink) : sink_(sink) {}
  std::optional<char> held() const { return held_; }

 protected:
  int_type overflow(int_type c) override {
    if (traits_type::eq_int_type(c, traits_type::eof())) return traits_type::not_eof(c);
    if (!flush_held()) return traits_type::eof();
    held_ = traits_type::to_char_type(c);
    return c;
  }
  std::streamsize xsputn(const char* s, std::streamsize n) override {
    if (n <= 0) return 0;
    if (!flush_held()) return 0;
    if (n > 1 && sink_->sputn(s, n - 1) != n - 1) return 0;
    held_ = s[n - 1];
    return n;
  }

 private:
  bool flush_held() {
    if (!held_) return true;
    const bool ok = !traits_type::eq_int_type(sink_->sputc(*held_), traits_type::eof());
    held_.reset();
    return ok;
  }
  std::streambuf* sink_;
  std::optional<char> held_;
};

// zeroflat's own layout document (layout.md's shape) with "deepspeed": null added at its end,
// so that every document says whose rules it follows.
void write_own_layout_json(const Layout& layout, std::optional<std::uint64_t> rank) {
  HoldLastChar hold(std::cout.rdbuf());
  std::ostream out(&hold);
  layout.write_json(out, rank);
  if (hold.held() == '}') {
    std::cout << ",\"deepspeed\":null}";
  } else if (hold.held()) {
    std::cout << *hold.held();
  }
}

// With a release, parameters are named by their input index and each rank's padding is the
// release's own record. rules: which rules the layout follows.
void print_table(const Layout& l, const std::string& source, std::optional<std::uint64_t> only,
                 const std::string& rules, const ReleaseLayout* release = nullptr) {
  const LayoutOptions& o = l.options();
  auto named = [&](const std::vector<std::uint64_t>& v) {
    if (release == nullptr) return v;
    std::vector<std::uint64_t> out;
    for (std::uint64_t i : v) out.push_back(release->kept[i]);
    return out;
  };
  const std::uint64_t es = l.element_size();
  std::printf("layout: %s parameters (%s), %s elements of %s\n",
              format_count(l.num_params()).c_str(), printable(source).c_str(),
              format_count(l.numel()).c_str(), std::string(dtype_name(o.dtype)).c_str());
  std::printf(
      "  dp %llu%s, alignment %llu elements (factor %llu x dp)%s\n",
      static_cast<unsigned long long>(o.dp), o.round_robin ? ", round-robin order" : "",
      static_cast<unsigned long long>(l.alignment()),
      static_cast<unsigned long long>(o.alignment_factor),
      o.param_align_bytes
          ? (", parameters aligned to " + std::to_string(o.param_align_bytes) + " bytes").c_str()
          : "");
  std::printf("  flat buffer  %s elements, %s, of which %s padding\n",
              format_count(l.flat_numel()).c_str(), format_bytes(l.flat_bytes()).c_str(),
              format_count(l.padding()).c_str());
  std::printf("  partition    %s elements, %s per rank\n",
              format_count(l.partition_numel()).c_str(),
              format_bytes(l.partition_numel() * es).c_str());
  std::string left;
  if (release != nullptr) {
    for (const auto& [i, why] : release->left_out) {
      left += left.empty() ? "; left out: " : ", ";
      left += std::to_string(i) + " (" + std::string(left_out_name(why)) + ")";
    }
  }
  std::printf("  rules        %s%s\n", rules.c_str(), left.c_str());
  std::printf("  order        %s\n", list_text(named(l.order())).c_str());
  if (release == nullptr) {
    std::printf("  offsets      %s\n\n", list_text(l.offsets()).c_str());
  } else {
    std::vector<std::uint64_t> by_input(release->num_inputs, 0);
    std::string text;
    for (std::uint64_t k = 0; k < release->kept.size(); ++k)
      by_input[release->kept[k]] = l.offsets()[k];
    for (std::uint64_t i = 0; i < release->num_inputs && i < 16; ++i) {
      const bool in =
          std::find(release->kept.begin(), release->kept.end(), i) != release->kept.end();
      text += (i ? " " : "") + (in ? std::to_string(by_input[i]) : std::string("-"));
    }
    if (release->num_inputs > 16) text += " ... (" + format_count(release->num_inputs) + " in all)";
    std::printf("  offsets      %s\n\n", text.c_str());
  }
  std::printf("%6s %14s %14s %12s %12s  %s\n", "rank", "start", "end", "padding", "first_off",
              "params in partition");
  const std::uint64_t max_rows = 64;
  for (std::uint64_t r = only.value_or(0); r < (only ? *only + 1 : o.dp); ++r) {
    if (!only && o.dp > max_rows && r == max_rows / 2) {
      std::printf("%6s (%llu ranks not shown; --json lists every rank)\n", "...",
                  static_cast<unsigned long long>(o.dp - max_rows));
      r = o.dp - max_rows / 2;
    }
    RankLayout rl = l.rank(r, /*list_not_in_partition=*/false);
    std::printf("%6llu %14llu %14llu %12llu %12llu  %s\n", static_cast<unsigned long long>(r),
                static_cast<unsigned long long>(rl.start), static_cast<unsigned long long>(rl.end),
                static_cast<unsigned long long>(release ? release->rank_padding(r) : rl.padding),
                static_cast<unsigned long long>(rl.first_offset),
                list_text(named(rl.params_in_partition), 4).c_str());
  }
}

// --rank R, checked against the layout's ranks; none without it.
std::optional<std::uint64_t> rank_option(const Args& args, std::uint64_t ranks) {
  const std::optional<std::string> v = args.get("rank");
  if (!v) return std::nullopt;
  const std::uint64_t rank = parse_u64(*v, "--rank");
  if (rank >= ranks) {
    throw InvalidArgument("--rank " + std::to_string(rank) + ": the layout has ranks 0 to " +
                          std::to_string(ranks - 1));
  }
  return rank;
}

// --frozen LIST as one flag per input parameter (empty without it); only a release's rules
// leave parameters out.
std::vector<bool> frozen_option(const Args& args, std::uint64_t inputs, bool release) {
  const std::optional<std::string> v = args.get("frozen");
  if (!v) return {};
  if (!release) {
    throw UsageError(
        "--frozen names parameters a DeepSpeed release leaves out; zeroflat's own layout "
        "(--deepspeed none, or options no release builds) has none: leave them out of "
        "--numels");
  }
  std::vector<bool> frozen(inputs, false);
  for (std::uint64_t i : parse_numels(*v)) {
    if (i >= inputs) {
      throw InvalidArgument("--frozen " + std::to_string(i) + ": the group has parameters 0 to " +
                            std::to_string(inputs - 1));
    }
    frozen[i] = true;
  }
  return frozen;
}

// --stage 3's groups: --numels split at '/' into optimizer groups ("10,6/7,4,11"), a file's
// list as one group, or the model's tensors as one group.
std::vector<std::vector<std::uint64_t>> zero3_groups(const std::string& text) {
  if (text.empty() || text[0] == '@') return {parse_numels(text)};
  std::vector<std::vector<std::uint64_t>> groups;
  for (std::size_t at = 0;;) {
    const std::size_t slash = text.find('/', at);
    groups.push_back(parse_numels(text.substr(at, slash - at)));
    if (slash == std::string::npos) break;
    at = slash + 1;
  }
  return groups;
}

// A ZeRO-3 layout as a table: the buffer, each parameter's partition (the first and last 32
// when there are many), the sub-groups, and each rank's data (or only rank R's).
void print_zero3_table(const Zero3Layout& l, const std::string& source,
                       std::optional<std::uint64_t> only, const std::string& rules,
                       const std::vector<std::uint64_t>& inputs) {
  const Zero3Options& o = l.options();
  const std::uint64_t es = l.element_size();
  std::printf("layout: ZeRO-3, %s parameters (%s) in %s group(s), %s elements of %s\n",
              format_count(l.num_params()).c_str(), printable(source).c_str(),
              format_count(l.num_groups()).c_str(), format_count(l.numel()).c_str(),
              std::string(dtype_name(o.dtype)).c_str());
  std::printf(
      "  world %llu: each parameter partitioned on its own, ceil(n / %llu) elements per "
      "rank, the padding zero at the end of the last ranks' slices\n",
      static_cast<unsigned long long>(o.world), static_cast<unsigned long long>(o.world));
  std::printf("  rank buffer  %s elements, %s, on every rank (the partitions back to back)\n",
              format_count(l.buffer_numel()).c_str(), format_bytes(l.buffer_bytes()).c_str());
  std::printf("  sub-groups   %s, cut at sub_group_size %s partition elements\n",
              format_count(l.sub_groups().size()).c_str(), format_count(o.sub_group_size).c_str());
  std::printf("  rules        %s\n\n", rules.c_str());
  // Parameters are numbered as laid out (sub-groups and paddings name them so); "input" is the
  // index in the groups as given, before the release left any out.
  std::printf("%8s %8s %6s %14s %12s %8s %14s\n", "param", "input", "group", "numel", "partition",
              "padding", "offset");
  const std::uint64_t n = l.num_params();
  for (std::uint64_t i = 0; i < n; ++i) {
    if (n > 64 && i == 32) {
      std::printf("%8s (%s parameters not shown; --json lists every one)\n", "...",
                  format_count(n - 64).c_str());
      i = n - 32;
    }
    std::printf("%8llu %8llu %6llu %14llu %12llu %8llu %14llu\n",
                static_cast<unsigned long long>(i),
                static_cast<unsigned long long>(inputs.empty() ? i : inputs[i]),
                static_cast<unsigned long long>(l.groups()[i]),
                static_cast<unsigned long long>(l.numels()[i]),
                static_cast<unsigned long long>(l.partition_numels()[i]),
                static_cast<unsigned long long>(l.padding(i)),
                static_cast<unsigned long long>(l.offsets()[i]));
  }
  std::printf("\n%9s %6s %16s %14s %14s %12s\n", "sub-group", "group", "params", "offset", "numel",
              "bytes");
  const std::vector<Zero3SubGroup>& subs = l.sub_groups();
  for (std::size_t k = 0; k < subs.size(); ++k) {
    if (subs.size() > 64 && k == 32) {
      std::printf("%9s (%s sub-groups not shown)\n", "...", format_count(subs.size() - 64).c_str());
      k = subs.size() - 32;
    }
    const Zero3SubGroup& g = subs[k];
    const std::string params = std::to_string(g.first_param) + " +" + std::to_string(g.num_params);
    std::printf("%9zu %6llu %16s %14llu %14llu %12s\n", k, static_cast<unsigned long long>(g.group),
                params.c_str(), static_cast<unsigned long long>(g.offset),
                static_cast<unsigned long long>(g.numel), format_bytes(g.numel * es).c_str());
  }
  std::printf("\n%6s %14s %14s  %s\n", "rank", "data", "padding", "groups_padding (nonzero)");
  for (std::uint64_t r = only.value_or(0); r < (only ? *only + 1 : o.world); ++r) {
    if (!only && o.world > 16 && r == 8) {
      std::printf("%6s (%llu ranks not shown)\n", "...",
                  static_cast<unsigned long long>(o.world - 16));
      r = o.world - 8;
    }
    const std::uint64_t data = l.data_numel(r);
    std::string pads;
    const std::vector<std::vector<std::uint64_t>> gp = l.groups_padding(r);
    std::uint64_t shown = 0;
    for (std::size_t k = 0; k < gp.size(); ++k) {
      for (std::size_t j = 0; j < gp[k].size(); ++j) {
        if (gp[k][j] == 0) continue;
        if (++shown > 8) continue;
        // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on the chain.
        if (!pads.empty()) pads.append(" ");
        pads.append("param ").append(std::to_string(subs[k].first_param + j));
        pads.append(": ").append(std::to_string(gp[k][j]));
      }
    }
    if (shown > 8) pads += " ... (" + format_count(shown) + " in all)";
    std::printf("%6llu %14llu %14llu  %s\n", static_cast<unsigned long long>(r),
                static_cast<unsigned long long>(data),
                static_cast<unsigned long long>(l.buffer_numel() - data),
                pads.empty() ? "-" : pads.c_str());
  }
}

// `zeroflat layout --stage 3`: the groups (the release's selection applied to every one), then
// the table or the document with the rules it follows and what was left out.
int layout_zero3(const Args& args, const StageChoice& stage) {
  std::vector<std::vector<std::uint64_t>> groups;
  std::string source;
  ModelSpec model;
  if (args.has("numels")) {
    groups = zero3_groups(*args.get("numels"));
    source = "from --numels";
  } else {
    model = model_from_args(args, "");
    groups = {model.numels()};
    source = model.name;
  }
  const LayoutOptions options =
      layout_options_from_args(args, args.has("model") ? &model : nullptr);
  const std::optional<ReleaseRules> rules = release_from_args(args, options);
  // The release's selection over every input (numbered flat over the groups): frozen ones, and
  // zero-element ones where the release leaves them out.
  std::vector<std::uint64_t> flat;
  for (const auto& g : groups) flat.insert(flat.end(), g.begin(), g.end());
  const std::vector<bool> frozen = frozen_option(args, flat.size(), rules.has_value());
  std::vector<std::uint64_t> inputs;  // input index of each parameter laid out
  std::vector<std::pair<std::uint64_t, LeftOut>> left_out;
  if (rules) {
    ReleaseSelection sel = select_for_release(flat, frozen, *rules);
    inputs = std::move(sel.kept);
    left_out = std::move(sel.left_out);
    std::vector<std::vector<std::uint64_t>> kept(groups.size());
    std::uint64_t i = 0, k = 0;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (std::size_t j = 0; j < groups[g].size(); ++j, ++i) {
        if (k < inputs.size() && inputs[k] == i) {
          kept[g].push_back(flat[i]);
          ++k;
        }
      }
    }
    groups = std::move(kept);
  }
  const Zero3Layout layout =
      Zero3Layout::compute(groups, Zero3Options{options.dp, stage.sub_group_size, options.dtype});
  const std::optional<std::uint64_t> rank = rank_option(args, options.dp);
  if (!args.has("json")) {
    std::string rules_line = rules_text(rules) + kZero3RulesNote;
    std::string left;
    for (const auto& [i, why] : left_out) {
      left += (left.empty() ? "; left out: " : ", ") + std::to_string(i) + " (" +
              std::string(left_out_name(why)) + ")";
    }
    print_zero3_table(layout, source, rank, rules_line + left, inputs);
    return kExitOk;
  }
  // The document, with what says whose rules it follows and which inputs it holds appended.
  HoldLastChar hold(std::cout.rdbuf());
  std::ostream out(&hold);
  try {
    layout.write_json(out, rank);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(std::string(e.what()) + " with --rank R");
  }
  nlohmann::ordered_json tail;
  tail["deepspeed"] = rules_doc(rules);
  nlohmann::ordered_json left = nlohmann::ordered_json::array();
  for (const auto& [i, why] : left_out) {
    left.push_back({{"param", i}, {"why", std::string(left_out_name(why))}});
  }
  tail["left_out"] = std::move(left);
  tail["inputs"] = inputs.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(inputs);
  // The document's closing brace is held back: the tail's fields close it.
  std::cout << ','
            << tail.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace).substr(1)
            << '\n';
  return kExitOk;
}

}  // namespace

int subcommand_layout(const std::vector<std::string>& argv) {
  Parser p("layout", "(--numels LIST | --model NAME) [options]",
           "Prints the ZeRO-1/2 flat layout of one parameter group: the order, each parameter's\n"
           "offset, the padding, and each rank's partition and bookkeeping, exactly as\n"
           "DeepSpeed's DeepSpeedZeroOptimizer builds it: by default as the newest supported\n"
           "release does (--deepspeed latest; from 0.19.8 zero-element parameters are left out\n"
           "of the group), or as --deepspeed V does. --deepspeed none prints zeroflat's own\n"
           "layout (docs/layout.md: every parameter in place, zero-element ones included).\n"
           "With --stage 3, prints ZeRO-3's instead: each parameter partitioned on its own\n"
           "(p = ceil(n / dp) elements per rank, the padding zero at the end), every rank's\n"
           "partitions back to back as DeepSpeedZeroOptimizer_Stage3's buffer, its sub-groups\n"
           "(cut at --sub-group-size partition elements, as _create_fp16_sub_groups cuts\n"
           "them) and each rank's groups_padding; --numels 10,6/7,4,11 gives optimizer groups.\n"
           "Every printout says which rules it follows.");
  p.option("numels", "LIST",
           "element counts in group order: 5,7,3 or @FILE (one per line, or a "
           "JSON list)");
  add_model_options(p, "");
  add_layout_options(p);
  add_stage_options(p);
  p.option("frozen", "LIST",
           "with --deepspeed: the indices of frozen parameters (requires_grad False), which "
           "DeepSpeed leaves out of the group: 1,4 or @FILE");
  p.option("rank", "R", "only rank R's bookkeeping (the table's row, the document's \"ranks\")",
           "every rank");
  p.flag("json", "print one JSON document (the shape of docs/cli.md)");
  p.epilog(
      "examples:\n"
      "  zeroflat layout --numels 5,7,3 --dp 4\n"
      "  zeroflat layout --numels 5,7,3,4,6 --dp 2 --round-robin --json\n"
      "  zeroflat layout --numels 8,0,24 --dp 2 --deepspeed none --json\n"
      "  zeroflat layout --model tiny-moe --dp 8 --param-align-bytes 16\n"
      "  zeroflat layout --numels 10,6/7,4,11 --dp 2 --stage 3 --sub-group-size 8\n"
      "  zeroflat layout --model qwen3-30b-a3b --layers 2 --dp 8 --stage 3 --rank 7 --json");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  const bool numels_given = args.has("numels");
  const bool model_given = args.has("model");
  if (numels_given == model_given) {
    throw UsageError(numels_given ? "give --numels or --model, not both"
                                  : "give the group's element counts with --numels or --model");
  }
  if (!model_given && (args.has("layers") || args.has("experts"))) {
    throw UsageError("--layers and --experts go with --model");
  }
  const StageChoice stage = stage_from_args(args);
  if (stage.zero3) return layout_zero3(args, stage);
  std::vector<std::uint64_t> numels;
  std::string source;
  ModelSpec model;
  if (numels_given) {
    numels = parse_numels(*args.get("numels"));
    source = "from --numels";
  } else {
    model = model_from_args(args, "");
    numels = model.numels();
    source = model.name;
  }
  LayoutOptions options = layout_options_from_args(args, model_given ? &model : nullptr);
  const std::optional<ReleaseRules> rules = release_from_args(args, options);
  std::string rules_line = rules_text(rules);
  if (!rules && !args.has("deepspeed")) {
    // The options asked for a layout of zeroflat's own: say which one no release builds.
    try {
      check_release_options(options, default_deepspeed_rules());
    } catch (const InvalidArgument& e) {
      rules_line = "zeroflat's own layout: no DeepSpeed release builds this one (" +
                   std::string(e.what()) + ")";
    }
  }
  const std::vector<bool> frozen = frozen_option(args, numels.size(), rules.has_value());
  std::optional<ReleaseLayout> release;
  if (rules) release = layout_for_release(numels, frozen, options, *rules);
  const Layout layout = release ? release->layout : Layout::compute(numels, options);
  const std::optional<std::uint64_t> rank = rank_option(args, options.dp);
  if (args.has("json")) {
    try {
      if (release) {
        release->write_json(std::cout, rank);
      } else {
        write_own_layout_json(layout, rank);
      }
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(std::string(e.what()) + " with --rank R");
    }
    std::cout << '\n';
  } else {
    print_table(layout, source, rank, rules_line, release ? &*release : nullptr);
  }
  return kExitOk;
}

}  // namespace zeroflat::cli
