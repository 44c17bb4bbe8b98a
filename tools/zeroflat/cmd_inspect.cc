// `zeroflat inspect`: what a checkpoint, a .safetensors file, a config.json, a torch.save file
// or a DeepSpeed checkpoint folder holds.
#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "cli/common.h"
#include "model/torch_file.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"
#include "zeroflat/dcp_checkpoint.h"
#include "zeroflat/deepspeed_checkpoint.h"
#include "zeroflat/loader.h"
#include "zeroflat/resume.h"

namespace zeroflat::cli {
namespace {

using Json = nlohmann::ordered_json;

void print_json(const Json& doc) {
  std::printf("%s\n", doc.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
}

std::string hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 0xf];
  }
  return out;
}

// A saved state as JSON: dicts keyed by their path segments, tensors by index.
Json value_json(const TorchValue& v, const TorchFile& f) {
  switch (v.kind) {
    case TorchKind::kNone:
      return nullptr;
    case TorchKind::kBool:
      return v.boolean;
    case TorchKind::kInt:
      return v.integer;
    case TorchKind::kFloat:
      return v.real;
    case TorchKind::kString:
      return v.text;
    case TorchKind::kBytes:
      return Json{{"bytes", hex(v.text)}};
    case TorchKind::kList:
    case TorchKind::kTuple: {
      Json a = Json::array();
      for (const TorchValue& i : v.items) a.push_back(value_json(i, f));
      if (v.text == "set" || v.text == "frozenset") return Json{{v.text, a}};
      return a;
    }
    case TorchKind::kDict: {
      Json o = Json::object();
      for (const auto& [k, x] : v.entries) o[torch_path_segment(k)] = value_json(x, f);
      return o;
    }
    case TorchKind::kTensor:
      return Json{{"tensor", v.integer}};
    case TorchKind::kStorage:
      return Json{{"storage", f.storages[static_cast<std::uint64_t>(v.integer)].key}};
    case TorchKind::kObject: {
      Json o{{"object", v.text}};
      Json args = Json::array();
      for (const TorchValue& i : v.items) args.push_back(value_json(i, f));
      o["args"] = args;
      Json state = Json::object();
      for (const auto& [k, x] : v.entries) state[torch_path_segment(k)] = value_json(x, f);
      o["state"] = state;
      return o;
    }
    case TorchKind::kEnum:
      return Json{{"enum", v.text}, {"value", v.integer}};
    case TorchKind::kGlobal:
      return Json{{"global", v.text}};
  }
  return nullptr;
}

Json tensor_json(const TorchTensor& t, const TorchFile& f) {
  return Json{{"path", t.path},
              {"dtype", t.dtype},
              {"shape", t.shape},
              {"stride", t.stride},
              {"storage_offset", t.storage_offset},
              {"storage", f.storages[t.storage].key},
              {"numel", t.numel},
              {"contiguous", t.contiguous},
              {"requires_grad", t.requires_grad},
              {"offset", t.offset},
              {"bytes", t.bytes},
              {"extent_bytes", t.extent_bytes}};
}

int inspect_torch(const std::string& path, bool json, std::uint64_t largest) {
  const TorchFile f = read_torch_file(path);
  std::uint64_t numel = 0, bytes = 0;
  std::map<std::string, std::uint64_t> by_dtype;
  for (const TorchTensor& t : f.tensors) {
    numel += t.numel;
    by_dtype[t.dtype] += t.numel * t.element_size;
    bytes += t.numel * t.element_size;
  }
  if (json) {
    Json doc;
    doc["path"] = path;
    doc["source"] = "torch";
    doc["file_bytes"] = f.file_bytes;
    doc["archive"] = f.archive;
    doc["byteorder"] = f.byteorder;
    doc["version"] = f.version;
    doc["storage_alignment"] = f.storage_alignment;
    doc["protocol"] = f.protocol;
    doc["pickle_bytes"] = f.pickle_bytes;
    doc["globals"] = f.globals;
    doc["numel"] = numel;
    doc["bytes"] = bytes;
    doc["dtypes"] = Json::object();
    for (const auto& [d, b] : by_dtype) doc["dtypes"][d] = b;
    doc["storages"] = Json::array();
    for (const TorchStorage& s : f.storages) {
      doc["storages"].push_back(Json{{"key", s.key},
                                     {"dtype", s.dtype},
                                     {"numel", s.numel},
                                     {"location", s.location},
                                     {"entry", s.entry},
                                     {"offset", s.offset},
                                     {"bytes", s.bytes}});
    }
    doc["tensors"] = Json::array();
    for (const TorchTensor& t : f.tensors) doc["tensors"].push_back(tensor_json(t, f));
    doc["state"] = value_json(f.root, f);
    print_json(doc);
    return kExitOk;
  }
  std::printf(
      "%s (torch.save archive '%s', pickle protocol %llu): %s tensors in %s storages, "
      "%s elements, %s\n",
      printable(path, 200).c_str(), printable(f.archive).c_str(),
      static_cast<unsigned long long>(f.protocol), format_count(f.tensors.size()).c_str(),
      format_count(f.storages.size()).c_str(), format_count(numel).c_str(),
      format_bytes(bytes).c_str());
  for (const auto& [d, b] : by_dtype) {
    std::printf("  %-8s %s\n", printable(d).c_str(), format_bytes(b).c_str());
  }
  std::printf("globals: %s\n", printable(join(f.globals), 400).c_str());
  std::vector<const TorchTensor*> order;
  for (const TorchTensor& t : f.tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [](const TorchTensor* a, const TorchTensor* b) {
    return a->numel * a->element_size > b->numel * b->element_size;
  });
  if (order.size() > largest) order.resize(largest);
  if (!order.empty()) std::printf("largest:\n");
  for (const TorchTensor* t : order) {
    std::printf("  %-56s %-6s %-16s %s at byte %llu%s\n", printable(t->path, 53).c_str(),
                printable(t->dtype).c_str(), shape_to_string(t->shape).c_str(),
                format_bytes(t->numel * t->element_size).c_str(),
                static_cast<unsigned long long>(t->offset),
                t->contiguous ? "" : (" (strided " + shape_to_string(t->stride) + ")").c_str());
  }
  return kExitOk;
}

// A DCP folder (dcp_checkpoint.h): its index, read without running it.
int inspect_dcp(const std::string& path, bool json, std::uint64_t largest) {
  const DcpCheckpoint ck = open_dcp_checkpoint(path);
  // Sums the reader bounded: each item's bytes and their total fit in 64 bits, and the
  // elements are at most as many as the bytes.
  std::uint64_t numel = 0, values = 0, file_bytes = 0;
  std::map<std::string, std::uint64_t> by_dtype;
  std::vector<const DcpItem*> tensors;
  for (const DcpItem& it : ck.items) {
    if (it.is_bytes) {
      ++values;
      continue;
    }
    numel += it.numel;
    by_dtype[it.dtype] += it.bytes;
    tensors.push_back(&it);
  }
  for (std::uint64_t b : ck.file_bytes) file_bytes += b;  // sizes of real files
  const std::uint64_t bytes = ck.tensor_bytes, chunks = ck.chunks;
  auto bytes_of = [](const DcpItem* it) { return it->bytes; };
  std::stable_sort(tensors.begin(), tensors.end(),
                   [&](const DcpItem* a, const DcpItem* b) { return bytes_of(a) > bytes_of(b); });
  if (tensors.size() > largest) tensors.resize(largest);
  if (json) {
    Json doc;
    doc["path"] = path;
    doc["source"] = "dcp";
    doc["version"] = ck.version;
    doc["files"] = ck.files.size();
    doc["file_bytes"] = file_bytes;
    doc["metadata_bytes"] = ck.metadata_bytes;
    doc["tensors"] = ck.items.size() - values;
    doc["values"] = values;
    doc["chunks"] = chunks;
    doc["numel"] = numel;
    doc["bytes"] = bytes;
    doc["dtypes"] = Json::object();
    for (const auto& [d, b] : by_dtype) doc["dtypes"][d] = b;
    doc["largest"] = Json::array();
    for (const DcpItem* it : tensors) {
      doc["largest"].push_back(Json{{"name", it->fqn},
                                    {"dtype", it->dtype},
                                    {"shape", it->size},
                                    {"chunks", it->chunks.size()},
                                    {"bytes", bytes_of(it)}});
    }
    print_json(doc);
    return kExitOk;
  }
  std::printf("%s (DCP checkpoint, version %s, %s file%s of %s): %s tensors in %s chunks, %s "
              "elements, %s; %s values saved as bytes\n",
              printable(path, 200).c_str(), ck.version.empty() ? "-" : ck.version.c_str(),
              format_count(ck.files.size()).c_str(), ck.files.size() == 1 ? "" : "s",
              format_bytes(file_bytes).c_str(), format_count(ck.items.size() - values).c_str(),
              format_count(chunks).c_str(), format_count(numel).c_str(),
              format_bytes(bytes).c_str(), format_count(values).c_str());
  for (const auto& [d, b] : by_dtype) {
    std::printf("  %-8s %s\n", printable(d).c_str(), format_bytes(b).c_str());
  }
  if (!tensors.empty()) std::printf("largest:\n");
  for (const DcpItem* it : tensors) {
    std::printf("  %-56s %-8s %-16s %s in %zu chunk%s\n", printable(it->fqn, 53).c_str(),
                printable(it->dtype).c_str(), shape_to_string(it->size).c_str(),
                format_bytes(bytes_of(it)).c_str(), it->chunks.size(),
                it->chunks.size() == 1 ? "" : "s");
  }
  return kExitOk;
}

Json ds_tensor_json(const DeepSpeedTensor& t) {
  return Json{{"file", t.file},   {"path", t.path},     {"dtype", t.dtype}, {"shape", t.shape},
              {"numel", t.numel}, {"offset", t.offset}, {"bytes", t.bytes}};
}

// A file of the checkpoint as its path below the tag folder.
std::string below(const std::string& path, const std::string& dir) {
  std::string prefix = dir;
  if (!prefix.empty() && prefix.back() != '/') prefix += '/';
  return path.compare(0, prefix.size(), prefix) == 0 ? path.substr(prefix.size()) : path;
}

// One rank of a resume, as inspect shows it: the reads the loader issues for each buffer, the
// small tensors read whole, and their bytes per file.
struct RankView {
  ResumeRank figures;
  std::map<std::uint32_t, std::uint64_t> files;  // file index -> bytes
  std::uint64_t bytes = 0;                        // buffers' reads and small tensors
};

// The most (ranks shown x parameters of every buffer) one inspect lays out: past it, name one
// rank with --rank (the work and the document grow with both).
constexpr std::uint64_t kMaxInspectRankParams = std::uint64_t{1} << 20;

int inspect_deepspeed(const std::string& path, const std::optional<std::string>& tag, bool json,
                      std::optional<std::uint64_t> dp, std::optional<std::uint64_t> only_rank) {
  const DeepSpeedCheckpoint ck = open_deepspeed_checkpoint(path, tag);
  // The resume at dp ranks, as load --from deepspeed and the drop-in plan it (resume.h); without
  // --dp, at one rank, not shown: what every resume of the folder would refuse (a state some
  // partitions hold and others lack, a tensor of a dtype it does not read) is refused here too.
  ResumeOptions ro;
  ro.world = dp.value_or(1);
  if (ck.zero_stage == 3) {
    for (const DeepSpeedFrozen& fz : ck.frozen) {
      ro.frozen.push_back(fz.name);
      ro.frozen_numels.push_back(fz.numel);
    }
  }
  ResumePlan checked = plan_resume(ck, ro);
  std::optional<ResumePlan> plan;
  std::vector<RankView> views;
  if (dp) {
    plan = std::move(checked);
    if (only_rank && *only_rank >= *dp) {
      throw UsageError("--rank " + std::to_string(*only_rank) + ": outside --dp " +
                       std::to_string(*dp));
    }
    std::uint64_t params = 0;
    for (const ResumeBuffer& b : plan->buffers) params += b.numels.size();
    const std::uint64_t shown = only_rank ? 1 : *dp;
    if (shown > kMaxInspectRankParams / std::max<std::uint64_t>(params, 1)) {
      throw UsageError("--dp " + std::to_string(*dp) + " without --rank lays out " +
                       std::to_string(*dp) + " ranks x " + std::to_string(params) +
                       " parameters, more than the " + format_count(kMaxInspectRankParams) +
                       " one inspect takes: name one rank with --rank R");
    }
    const std::uint64_t first = only_rank.value_or(0);
    const std::uint64_t end = only_rank ? *only_rank + 1 : *dp;
    for (std::uint64_t r = first; r < end; ++r) {
      RankView v;
      v.figures = resume_rank(*plan, r);
      for (const ResumeRankBuffer& b : v.figures.buffers) {
        for (const PlannedRead& x : b.reads) v.files[x.file] += x.bytes;
      }
      for (const ResumeSmall& sm : plan->small) v.files[sm.tensor.file] += sm.tensor.bytes;
      v.bytes = v.figures.read_bytes + v.figures.small_bytes;
      views.push_back(std::move(v));
    }
  }
  std::uint64_t file_bytes = 0;
  for (const DeepSpeedFile& f : ck.files) file_bytes += f.file_bytes;
  // The optimizer states of a partition: name -> (dtype, partitioned).
  std::map<std::string, std::pair<std::string, bool>> states;
  for (const DeepSpeedSubGroup& sg : ck.sub_groups) {
    for (const DeepSpeedPartition& p : sg.ranks) {
      for (const DeepSpeedState& s : p.states) {
        states[s.name] = {s.tensor.dtype, deepspeed_state_partitioned(s, p, sg)};
      }
    }
  }
  for (const DeepSpeedUniversalParam& u : ck.universal) {
    for (const DeepSpeedState& s : u.tensors) {
      if (s.name != "fp32") states[s.name] = {s.tensor.dtype, s.name != "step"};
    }
  }
  if (json) {
    Json doc;
    doc["path"] = path;
    doc["source"] = "deepspeed";
    doc["format"] = deepspeed_format_name(ck.format);
    doc["dir"] = ck.dir;
    doc["tag"] = ck.tag;
    doc["zero_stage"] = ck.zero_stage;
    doc["world"] = ck.world;
    doc["mp_world"] = ck.mp_world;
    doc["ds_version"] = ck.ds_version;
    doc["dtype"] = ck.dtype;
    doc["round_robin"] = ck.round_robin;
    doc["parameter_alignment"] = ck.parameter_alignment;
    doc["sub_group_size"] = ck.sub_group_size;
    doc["files"] = Json::array();
    for (const DeepSpeedFile& f : ck.files) {
      doc["files"].push_back(Json{{"path", f.path},
                                  {"role", f.role},
                                  {"rank", f.rank},
                                  {"bytes", f.file_bytes},
                                  {"tensors", f.tensors},
                                  {"globals", f.globals}});
    }
    doc["groups"] = Json::array();
    for (const DeepSpeedGroup& g : ck.groups) {
      Json params = Json::array();
      for (const DeepSpeedParam& p : g.params) {
        params.push_back(Json{{"name", p.name},
                              {"shape", p.shape},
                              {"numel", p.numel},
                              {"sub_group", p.sub_group},
                              {"offset", p.offset}});
      }
      doc["groups"].push_back(Json{{"numel", g.numel},
                                   {"flat_numel", g.flat_numel},
                                   {"sub_groups", g.sub_groups},
                                   {"params", params}});
    }
    doc["sub_groups"] = Json::array();
    for (const DeepSpeedSubGroup& sg : ck.sub_groups) {
      Json ranks = Json::array();
      for (const DeepSpeedPartition& p : sg.ranks) {
        Json st = Json::array();
        for (const DeepSpeedState& s : p.states) {
          st.push_back(Json{{"name", s.name}, {"tensor", ds_tensor_json(s.tensor)}});
        }
        ranks.push_back(
            Json{{"fp32", ds_tensor_json(p.fp32)}, {"padding", p.padding}, {"states", st}});
      }
      doc["sub_groups"].push_back(Json{{"group", sg.group},
                                       {"first_param", sg.first_param},
                                       {"num_params", sg.num_params},
                                       {"partition_numel", sg.partition_numel},
                                       {"ranks", ranks}});
    }
    doc["optimizer_states"] = Json::object();
    for (const auto& [name, info] : states) {
      doc["optimizer_states"][name] = Json{{"dtype", info.first}, {"partitioned", info.second}};
    }
    doc["frozen"] = Json::array();
    for (const DeepSpeedFrozen& fz : ck.frozen) {
      Json frags = Json::array();
      for (const DeepSpeedTensor& t : fz.fragments) frags.push_back(ds_tensor_json(t));
      doc["frozen"].push_back(
          Json{{"name", fz.name}, {"shape", fz.shape}, {"numel", fz.numel}, {"fragments", frags}});
    }
    doc["buffers"] = ck.buffer_names;
    doc["module"] = Json::array();
    for (const DeepSpeedTensor& t : ck.module) doc["module"].push_back(ds_tensor_json(t));
    doc["universal"] = Json::array();
    for (const DeepSpeedUniversalParam& u : ck.universal) {
      Json ts = Json::array();
      for (const DeepSpeedState& s : u.tensors) {
        ts.push_back(Json{{"name", s.name}, {"tensor", ds_tensor_json(s.tensor)}});
      }
      doc["universal"].push_back(
          Json{{"name", u.name}, {"shape", u.shape}, {"numel", u.numel}, {"tensors", ts}});
    }
    doc["bookkeeping"] = Json{{"global_steps", ck.global_steps},
                              {"global_samples", ck.global_samples},
                              {"skipped_steps", ck.skipped_steps},
                              {"loss_scale", ck.loss_scale},
                              {"dynamic_loss_scale", ck.dynamic_loss_scale},
                              {"clip_grad", ck.clip_grad},
                              {"lr_scheduler", ck.has_lr_scheduler}};
    if (plan) {
      auto group_json = [](const std::optional<std::uint64_t>& g) { return g ? Json(*g) : Json(); };
      Json buffers = Json::array();
      for (const ResumeBuffer& b : plan->buffers) {
        buffers.push_back(Json{{"target", b.target},
                               {"group", group_json(b.group)},
                               {"placement", b.placement.kind == LoadPlacement::Kind::kSlice
                                                 ? "load-slice"
                                                 : "load-partitions"},
                               {"dtype", std::string(dtype_name(b.layout.dtype))},
                               {"params", b.numels.size()}});
      }
      Json small = Json::array();
      for (const ResumeSmall& sm : plan->small) {
        small.push_back(Json{{"target", sm.target},
                             {"group", group_json(sm.group)},
                             {"name", sm.name},
                             {"file", sm.tensor.file},
                             {"offset", sm.tensor.offset},
                             {"bytes", sm.tensor.bytes},
                             {"numel", sm.tensor.numel}});
      }
      Json ranks = Json::array();
      for (const RankView& v : views) {
        Json files = Json::array();
        for (const auto& [f, b] : v.files) {
          files.push_back(Json{{"file", f}, {"path", ck.files[f].path}, {"bytes", b}});
        }
        Json reads = Json::array();
        Json per_buffer = Json::array();
        for (std::size_t i = 0; i < plan->buffers.size(); ++i) {
          const ResumeBuffer& b = plan->buffers[i];
          const ResumeRankBuffer& f = v.figures.buffers[i];
          per_buffer.push_back(Json{{"target", b.target},
                                    {"group", group_json(b.group)},
                                    {"partition_numel", f.partition_numel},
                                    {"data_numel", f.data_numel},
                                    {"kept_bytes", f.kept_bytes},
                                    {"share_bytes", f.share_bytes},
                                    {"read_bytes", f.read_bytes}});
          for (const PlannedRead& x : f.reads) {
            reads.push_back(Json{{"file", x.file},
                                 {"offset", x.offset},
                                 {"bytes", x.bytes},
                                 {"target", b.target},
                                 {"group", group_json(b.group)},
                                 {"dest", x.dest},
                                 {"numel", x.numel}});
          }
        }
        ranks.push_back(Json{{"rank", v.figures.rank},
                             {"bytes", v.bytes},
                             {"read_bytes", v.figures.read_bytes},
                             {"small_bytes", v.figures.small_bytes},
                             {"share_bytes", v.figures.share_bytes},
                             {"kept_bytes", v.figures.kept_bytes},
                             {"files", files},
                             {"buffers", per_buffer},
                             {"reads", reads}});
      }
      Json left = Json::array();
      for (const std::string& l : plan->left_out) left.push_back(l);
      doc["resume"] = Json{{"world", *dp},
                           {"stage", plan->stage},
                           {"targets", plan->targets},
                           {"left_out", left},
                           {"buffers", buffers},
                           {"small", small},
                           {"ranks", ranks}};
    }
    print_json(doc);
    return kExitOk;
  }

  std::printf(
      "%s: DeepSpeed %s checkpoint, tag '%s': ZeRO stage %d, saved by %llu rank%s, "
      "DeepSpeed %s, %s\n",
      printable(path, 200).c_str(), std::string(deepspeed_format_name(ck.format)).c_str(),
      printable(ck.tag).c_str(), ck.zero_stage, static_cast<unsigned long long>(ck.world),
      ck.world == 1 ? "" : "s", printable(ck.ds_version).c_str(), ck.dtype.c_str());
  std::printf(
      "  %s files, %s; global steps %lld, samples %lld, skipped %lld; loss scale %g%s; "
      "clip_grad %g%s\n",
      format_count(ck.files.size()).c_str(), format_bytes(file_bytes).c_str(),
      static_cast<long long>(ck.global_steps), static_cast<long long>(ck.global_samples),
      static_cast<long long>(ck.skipped_steps), ck.loss_scale,
      ck.dynamic_loss_scale ? " (dynamic)" : "", ck.clip_grad,
      ck.has_lr_scheduler ? "; lr scheduler saved" : "");
  if (ck.round_robin || ck.parameter_alignment) {
    std::printf("  %s%s\n", ck.round_robin ? "round_robin_gradients " : "",
                ck.parameter_alignment ? "parameter_alignment" : "");
  }
  std::printf("groups:\n");
  for (std::size_t g = 0; g < ck.groups.size(); ++g) {
    const DeepSpeedGroup& group = ck.groups[g];
    std::uint64_t per_rank = 0;
    for (std::uint64_t s : group.sub_groups) per_rank += ck.sub_groups[s].partition_numel;
    std::string layout = "one file per parameter and state";
    if (ck.format != DeepSpeedFormat::kUniversal) {
      layout = "flat " + format_count(group.flat_numel) + ", " + format_count(per_rank) +
               " per rank (" + format_bytes(per_rank * 4) + " in fp32)";
      if (group.sub_groups.size() > 1) {
        layout += ", " + std::to_string(group.sub_groups.size()) + " sub-groups";
      }
    }
    std::printf("  %zu: %s parameters, %s elements (%s in %s), %s\n", g,
                format_count(group.params.size()).c_str(), format_count(group.numel).c_str(),
                format_bytes(group.numel * (ck.dtype == "fp32" ? 4 : 2)).c_str(), ck.dtype.c_str(),
                layout.c_str());
    const std::size_t show = std::min<std::size_t>(group.params.size(), 4);
    for (std::size_t i = 0; i < show; ++i) {
      std::printf("     %-50s %s\n", printable(group.params[i].name, 48).c_str(),
                  shape_to_string(group.params[i].shape).c_str());
    }
    if (group.params.size() > show) {
      std::printf("     ... %s more\n", format_count(group.params.size() - show).c_str());
    }
  }
  if (!states.empty()) {
    std::printf("optimizer states:");
    for (const auto& [name, info] : states) {
      std::printf(" %s (%s%s)", printable(name).c_str(), info.first.c_str(),
                  info.second ? ", per element" : ", whole");
    }
    std::printf("\n");
  }
  std::printf("frozen parameters: %s", ck.frozen.empty() ? "none" : "");
  for (std::size_t i = 0; i < ck.frozen.size(); ++i) {
    std::printf("%s%s %s", i ? ", " : "", printable(ck.frozen[i].name).c_str(),
                shape_to_string(ck.frozen[i].shape).c_str());
  }
  std::printf("\nbuffers: %s", ck.buffer_names.empty() ? "none" : "");
  for (std::size_t i = 0; i < ck.buffer_names.size(); ++i) {
    std::printf("%s%s", i ? ", " : "", printable(ck.buffer_names[i]).c_str());
  }
  std::printf("\n");
  if (plan) {
    std::printf("resumed by %llu ranks (%s%s, ZeRO-%d):\n", static_cast<unsigned long long>(*dp),
                join(plan->targets).c_str(),
                ck.frozen.empty() && ck.buffer_names.empty() ? "" : ", frozen parameters, buffers",
                plan->stage);
    for (const RankView& v : views) {
      const auto& files = v.files;
      std::printf("  rank %llu reads %s from %zu file%s (its share %s):",
                  static_cast<unsigned long long>(v.figures.rank), format_bytes(v.bytes).c_str(),
                  files.size(), files.size() == 1 ? "" : "s",
                  format_bytes(v.figures.share_bytes).c_str());
      std::size_t shown = 0;
      for (const auto& [f, b] : files) {
        if (shown++ == 4) {
          std::printf(" ...");
          break;
        }
        std::printf(" %s %s", printable(below(ck.files[f].path, ck.dir), 60).c_str(),
                    format_bytes(b).c_str());
      }
      std::printf("\n");
    }
  }
  return kExitOk;
}

// --mesh: "N" (FSDP2: Shard(0) over N ranks) or "A x B x ..." (the last dimension shards with
// Shard(0), the others replicate: HSDP's "RxS").
std::vector<std::uint64_t> parse_mesh(const std::string& text) {
  std::vector<std::uint64_t> mesh;
  std::size_t at = 0;
  std::uint64_t ranks = 1;
  while (true) {
    const std::size_t x = text.find('x', at);
    const std::uint64_t n = parse_u64(text.substr(at, x - at), "--mesh");
    if (n == 0 || n > kMaxDp || ranks > kMaxDp / n) {
      throw UsageError("--mesh " + printable(text) + ": expected sizes of 1 or more whose " +
                       "product is at most " + std::to_string(kMaxDp) + " ranks");
    }
    ranks *= n;
    mesh.push_back(n);
    if (x == std::string::npos) break;
    at = x + 1;
  }
  if (mesh.size() > 8) throw UsageError("--mesh " + printable(text) + ": at most 8 dimensions");
  return mesh;
}

// The load whose reads inspect lists: ZeRO's on --dp ranks (stage 3: the partitions), or
// FSDP2's shards on a --mesh.
struct ReadsAsked {
  std::optional<std::uint64_t> dp;
  std::optional<std::uint64_t> stage;
  std::optional<std::vector<std::uint64_t>> mesh;
};

// That load's placement for `params` on its `world` ranks: a mesh's ranks at their row-major
// coordinates (as torch's mesh numbers them), each parameter Shard(0) on the mesh's last
// dimension and Replicate() on the others.
LoadPlacement placement_asked(const ReadsAsked& asked, std::size_t params, std::uint64_t world) {
  if (!asked.mesh) {
    return asked.stage.value_or(2) == 3 ? LoadPlacement::partitions() : LoadPlacement::flat();
  }
  const std::vector<std::uint64_t>& mesh = *asked.mesh;
  ShardSpec spec;
  spec.mesh = mesh;
  for (std::uint64_t r = 0; r < world; ++r) {
    std::vector<std::uint64_t> coord(mesh.size());
    std::uint64_t rest = r;
    for (std::size_t d = mesh.size(); d-- > 0;) {
      coord[d] = rest % mesh[d];
      rest /= mesh[d];
    }
    spec.coords.push_back(std::move(coord));
  }
  std::vector<MeshPlacement> per(mesh.size(), MeshPlacement{});
  per.back() = MeshPlacement{MeshPlacement::Kind::kShard, 0};
  spec.placements.assign(params, per);
  return LoadPlacement::sharded(std::move(spec));
}

// What each rank of a load of the checkpoint at `path` reads: the group `zeroflat load` loads
// (every bf16, fp16 and fp32 tensor, in natural name order, in the dtype holding most of its
// bytes) placed as `asked` says, each rank's reads as the loader plans them (planned_reads:
// what the load reports as bytes_read).
Json load_reads(const std::string& path, const ReadsAsked& asked,
                std::optional<std::uint64_t> only_rank, bool text) {
  const CheckpointIndex ck = open_checkpoint(path);
  std::vector<LoadParam> params;
  std::map<DType, std::uint64_t> by_type;
  for (const CheckpointTensor& t : ck.tensors) {
    if (t.alias || !t.type) continue;
    params.push_back(LoadParam{t.name, t.shape, {}});
    by_type[*t.type] += t.bytes;
  }
  if (params.empty()) throw InvalidArgument(path + " holds no bf16, fp16 or fp32 tensor to load");
  std::uint64_t world = asked.dp.value_or(1);
  if (asked.mesh) {
    for (std::uint64_t m : *asked.mesh) world *= m;
  }
  const LoadPlacement where = placement_asked(asked, params.size(), world);
  LayoutOptions layout;
  layout.dp = world;
  std::uint64_t most = 0;
  for (const auto& [type, b] : by_type) {
    if (b > most) {
      most = b;
      layout.dtype = type;
    }
  }
  if (only_rank && *only_rank >= world) {
    throw UsageError("--rank " + std::to_string(*only_rank) + ": outside the " +
                     std::to_string(world) + " ranks");
  }
  if (!only_rank && world > kMaxInspectRankParams / std::max<std::uint64_t>(params.size(), 1)) {
    throw UsageError(std::to_string(world) + " ranks x " + std::to_string(params.size()) +
                     " parameters is more than the " + format_count(kMaxInspectRankParams) +
                     " one inspect lays out: name one rank with --rank R");
  }
  Json doc{{"placement", std::string(load_placement_name(where.kind))},
           {"world", world},
           {"dtype", std::string(dtype_name(layout.dtype))},
           {"params", params.size()}};
  if (where.kind == LoadPlacement::Kind::kShards) {
    doc["mesh"] = where.shards.mesh;
    Json pl = Json::array();
    for (const MeshPlacement& m : where.shards.placements.front()) pl.push_back(placement_name(m));
    doc["placements"] = pl;
  }
  if (text) {
    std::string how = "ZeRO";
    if (where.kind == LoadPlacement::Kind::kShards) {
      how = "mesh";
      for (std::size_t d = 0; d < where.shards.mesh.size(); ++d) {
        how += (d == 0 ? " " : " x ") + std::to_string(where.shards.mesh[d]);
      }
    }
    std::printf("%s load on %llu rank%s (%s), %s parameters in %s: each rank's reads\n",
                std::string(load_placement_name(where.kind)).c_str(),
                static_cast<unsigned long long>(world), world == 1 ? "" : "s", how.c_str(),
                format_count(params.size()).c_str(),
                std::string(dtype_name(layout.dtype)).c_str());
  }
  Json ranks = Json::array();
  const std::uint64_t first = only_rank.value_or(0);
  const std::uint64_t end = only_rank ? *only_rank + 1 : world;
  for (std::uint64_t r = first; r < end; ++r) {
    const std::vector<PlannedRead> reads = planned_reads(ck, params, where, layout, r);
    std::map<std::uint32_t, std::uint64_t> files;
    std::uint64_t bytes = 0;
    for (const PlannedRead& x : reads) {
      files[x.file] += x.bytes;
      bytes += x.bytes;
    }
    Json e{{"rank", r}, {"bytes", bytes}, {"reads", reads.size()}};
    if (where.kind == LoadPlacement::Kind::kShards) e["coord"] = where.shards.coords[r];
    Json fs = Json::array();
    for (const auto& [f, b] : files) {
      fs.push_back(Json{{"file", f}, {"path", ck.files[f]}, {"bytes", b}});
    }
    e["files"] = fs;
    if (only_rank) {
      Json list = Json::array();
      for (const PlannedRead& x : reads) {
        list.push_back(Json{{"file", x.file},
                            {"offset", x.offset},
                            {"bytes", x.bytes},
                            {"dest", x.dest},
                            {"numel", x.numel}});
      }
      e["read_list"] = list;
    }
    if (text) {
      std::printf("  rank %llu: %s read%s, %s from %s file%s\n",
                  static_cast<unsigned long long>(r), format_count(reads.size()).c_str(),
                  reads.size() == 1 ? "" : "s", format_bytes(bytes).c_str(),
                  format_count(files.size()).c_str(), files.size() == 1 ? "" : "s");
    }
    ranks.push_back(std::move(e));
  }
  doc["ranks"] = std::move(ranks);
  return doc;
}

}  // namespace

int subcommand_inspect(const std::vector<std::string>& argv) {
  Parser p("inspect",
           "PATH [--json] [--largest N] [--tag TAG] [--dp N [--stage S] | --mesh N|AxB] "
           "[--rank R]",
           "Reads a checkpoint directory (*.safetensors, optionally with\n"
           "model.safetensors.index.json), a single .safetensors file, or a Hugging Face\n"
           "config.json, headers only, and reports the tensor count, parameter count, bytes per\n"
           "dtype and the largest tensors. A torch.save file (.pt, .bin) is listed without\n"
           "running its pickle: every tensor's place, dtype, shape and byte range. A DeepSpeed\n"
           "checkpoint folder (the one holding 'latest', or a tag folder) reports the saving\n"
           "run's stage, world size and release, its groups, optimizer states, frozen parameters\n"
           "and buffers; with --dp N, which files and bytes each rank of a world of N would read.\n"
           "For a safetensors checkpoint, --dp N (ZeRO) or --mesh (FSDP2, HSDP) lists each\n"
           "rank's reads of the load, as the loader plans them: what the load reports reading.\n"
           "A PyTorch DCP folder (the '.metadata' and '.distcp' files torch.distributed.\n"
           "checkpoint.save writes) is read by the same restricted reader: its tensors, chunks,\n"
           "bytes per dtype and the values it saved as bytes.\n"
           "Every field of an untrusted file is checked: a malformed one is exit 2 with the file\n"
           "and the problem named.");
  p.option("largest", "N", "how many of the largest tensors to list", "5");
  p.option("tag", "TAG", "DeepSpeed: the tag folder to read (default: the one 'latest' names)");
  p.option("dp", "N", "DeepSpeed: the reads of each rank of a new world of N ranks, as the "
           "resume issues them; a safetensors checkpoint: each rank's reads of a ZeRO load on "
           "N ranks (`zeroflat load --dp N`)");
  p.option("stage", "S", "with --dp on a safetensors checkpoint: 1 or 2 (the flat buffer, each "
           "rank its slice before the all-gather) or 3 (each rank its partitions)", "2");
  p.option("mesh", "N|AxB", "a safetensors checkpoint: each rank's reads of an FSDP2 load on a "
           "mesh of N ranks (Shard(0)), or of HSDP's AxB (Replicate() over A, Shard(0) over B)");
  p.option("rank", "R", "with --dp or --mesh: only rank R's reads (a large world's), each read "
           "listed");
  p.flag("json", "print one JSON document");
  p.allow_positionals(1);
  p.epilog(
      "examples:\n  zeroflat inspect model.safetensors\n  zeroflat inspect ./Qwen3-30B-A3B/\n"
      "  zeroflat inspect config.json --json\n  zeroflat inspect "
      "ckpt/step2/mp_rank_00_model_states.pt\n"
      "  zeroflat inspect ckpt/ --dp 4\n  zeroflat inspect dcp_checkpoint/\n"
      "  zeroflat inspect ./Qwen3-30B-A3B/ --mesh 2x8 --rank 3");
  std::optional<Args> parsed = p.parse_or_help(argv);
  if (!parsed) return kExitOk;
  const Args& args = *parsed;
  if (args.positionals().empty()) throw UsageError("give the PATH to inspect");
  std::uint64_t largest = 5;
  if (auto v = args.get("largest")) largest = parse_u64(*v, "--largest");
  const std::string path = args.positionals()[0];
  std::optional<std::uint64_t> dp;
  if (auto v = args.get("dp")) {
    dp = parse_u64(*v, "--dp");
    if (*dp == 0 || *dp > kMaxDp) {
      throw UsageError("--dp " + *v + ": expected 1 to " + std::to_string(kMaxDp) + " ranks");
    }
  }
  std::optional<std::string> tag = args.get("tag");
  std::optional<std::vector<std::uint64_t>> mesh;
  if (auto v = args.get("mesh")) {
    if (dp) throw UsageError("--dp and --mesh: give one (ZeRO's ranks, or FSDP2's mesh)");
    mesh = parse_mesh(*v);
  }
  std::optional<std::uint64_t> rank;
  if (auto v = args.get("rank")) {
    if (!dp && !mesh) throw UsageError("--rank " + printable(*v) + " needs --dp or --mesh");
    rank = parse_u64(*v, "--rank");
  }
  std::optional<std::uint64_t> stage;
  if (auto v = args.get("stage")) {
    if (!dp) throw UsageError("--stage " + printable(*v) + " needs --dp");
    stage = parse_u64(*v, "--stage");
    if (*stage < 1 || *stage > 3) throw UsageError("--stage " + printable(*v) + ": 1, 2 or 3");
  }
  // With --tag, a folder whose tag folder holds DeepSpeed's files is one, 'latest' or not (as
  // load --from deepspeed --tag reads it).
  if (is_deepspeed_checkpoint(path) ||
      (tag && tag->find('/') == std::string::npos && is_deepspeed_checkpoint(path + "/" + *tag))) {
    if (mesh || stage) {
      throw UsageError("--mesh and --stage apply to safetensors checkpoints; a DeepSpeed folder "
                       "resumes at --dp N ranks under its own stage");
    }
    return inspect_deepspeed(path, tag, args.has("json"), dp, rank);
  }
  if (tag) {
    throw UsageError("--tag applies to DeepSpeed checkpoint folders; " + printable(path, 200) +
                     " is not one");
  }
  const bool reads = dp || mesh;
  if (reads && (is_torch_file(path) || is_dcp_checkpoint(path) ||
                is_dcp_checkpoint(path, "__0.metadata"))) {
    throw UsageError("--dp and --mesh list a load's reads of a safetensors checkpoint (or a "
                     "DeepSpeed folder's resume with --dp); " + printable(path, 200) +
                     " is a torch.save file or a DCP folder");
  }
  if (is_torch_file(path)) return inspect_torch(path, args.has("json"), largest);
  if (is_dcp_checkpoint(path)) return inspect_dcp(path, args.has("json"), largest);
  if (is_dcp_checkpoint(path, "__0.metadata")) {
    throw InvalidArgument(printable(path, 200) +
                          ": a DCP checkpoint saved without collectives (each rank's own "
                          "__<rank>.metadata, no global .metadata); inspect reads the global "
                          "index: load it through DCP's load (zeroflat.dcp.Reader reads it)");
  }
  Inspection in = inspect_path(path);
  if (reads && in.source == "config") {
    throw UsageError("--dp and --mesh list a load's reads of a checkpoint; " +
                     printable(path, 200) + " is a config.json");
  }
  const ReadsAsked asked{dp, stage, mesh};
  std::vector<const TensorInfo*> order;
  for (const TensorInfo& t : in.tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(),
                   [](const TensorInfo* a, const TensorInfo* b) { return a->bytes > b->bytes; });
  if (order.size() > largest) order.resize(largest);
  if (args.has("json")) {
    nlohmann::ordered_json doc;
    doc["path"] = path;
    doc["source"] = in.source;
    doc["files"] = in.files;
    doc["tensors"] = in.tensors.size();
    doc["numel"] = in.numel;
    doc["bytes"] = in.bytes;
    doc["dtypes"] = nlohmann::ordered_json::object();
    for (const auto& [d, b] : in.bytes_by_dtype) doc["dtypes"][d] = b;
    doc["largest"] = nlohmann::ordered_json::array();
    for (const TensorInfo* t : order) {
      doc["largest"].push_back({{"name", t->name},
                                {"dtype", t->dtype},
                                {"shape", t->shape},
                                {"numel", t->numel},
                                {"bytes", t->bytes}});
    }
    if (reads) doc["load"] = load_reads(path, asked, rank, false);
    std::printf("%s\n",
                doc.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace).c_str());
    return kExitOk;
  }
  std::printf("%s (%s, %llu file%s): %s tensors, %s parameters, %s\n", printable(path, 200).c_str(),
              in.source.c_str(), static_cast<unsigned long long>(in.files),
              in.files == 1 ? "" : "s", format_count(in.tensors.size()).c_str(),
              format_count(in.numel).c_str(), format_bytes(in.bytes).c_str());
  for (const auto& [d, b] : in.bytes_by_dtype) {
    std::printf("  %-8s %s\n", printable(d).c_str(), format_bytes(b).c_str());
  }
  if (!order.empty()) std::printf("largest:\n");
  for (const TensorInfo* t : order) {
    // Names come from the file: printable characters only, whatever it holds.
    std::printf("  %-56s %-6s %-20s %s\n", printable(t->name, 53).c_str(),
                printable(t->dtype).c_str(), shape_to_string(t->shape).c_str(),
                format_bytes(t->bytes).c_str());
  }
  if (reads) load_reads(path, asked, rank, true);
  return kExitOk;
}

}  // namespace zeroflat::cli
