// The loader's front door (loader.h): the checkpoint as the source of the one pipeline, for any
// placement (the flat buffer, its slice, ZeRO-3's partitions, DTensor shards); and what a rank
// would read, known before it reads.
#include <map>
#include <memory>

#include "common/convert.h"
#include "source/checkpoint/source.h"
#include "zeroflat/common.h"
#include "zeroflat/layout.h"
#include "zeroflat/loader.h"

namespace zeroflat {
namespace {

// The checkpoint as the pipeline's source, for any placement.
FlattenResult load_group(const CheckpointIndex& ck, std::span<const LoadParam> params,
                         Device& device, Communicator* comm, const FlattenOptions& options,
                         detail::Placement& placement) {
  // The group as the pipeline sees it: shapes and dtype, no data yet.
  FlattenOptions o = options;
  std::vector<TensorRef> refs;
  refs.reserve(params.size());
  o.names.clear();
  for (const LoadParam& p : params) {
    refs.push_back(TensorRef{nullptr, shape_numel(p.shape), p.shape, o.layout.dtype, &device});
    o.names.push_back("parameter '" + printable(p.name) + "'");
  }
  detail::CheckpointSource source(ck, params, device, o);
  FlattenResult res = detail::run_pipeline(refs, device, comm, o, source, placement);
  if (!res.feasible() || res.complete()) return res;  // the same verdict on every rank
  // A failed load keeps nothing (the checkpoint is untouched): the failure is thrown.
  const Execution& ex = res.execution;
  const std::vector<Step>& steps = res.chosen().steps;
  if (ex.failed_step && *ex.failed_step < steps.size() &&
      steps[*ex.failed_step].op == Op::kAllocate) {
    throw OutOfMemory(ex.error);
  }
  throw Error(ex.error);
}

// The file bytes rank `rank` of `world` reads for `placement` laid out by options: its first
// read plan's kRead steps.
std::uint64_t read_bytes(const CheckpointIndex& ck, std::span<const LoadParam> params,
                         const FlattenOptions& options, const detail::Placement& placement,
                         std::uint64_t world, std::uint64_t rank) {
  if (rank >= world) {
    throw InvalidArgument("rank " + std::to_string(rank) + " of " + std::to_string(world));
  }
  const detail::Sources sources = detail::resolve_all(ck, params);
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
  const Layout layout = placement.layout(numels, options);
  const detail::SourceRuns runs = placement.runs(numels, world, rank);
  std::uint64_t bytes = 0;
  for (const Step& s : load_steps(layout, placement.slot(rank), 0, placement.read_plans()[0])) {
    if (s.op != Op::kRead) continue;
    bytes += detail::source_bytes(
        detail::reads_for(layout, sources, runs, s.flat_offset, s.flat_offset + s.bytes));
  }
  return bytes;
}

std::vector<Shape> shapes_of(std::span<const LoadParam> params) {
  std::vector<Shape> out;
  out.reserve(params.size());
  for (const LoadParam& p : params) out.push_back(p.shape);
  return out;
}

// The pipeline's placement for a load's.
std::unique_ptr<detail::Placement> placement_of(const LoadPlacement& where,
                                                std::span<const LoadParam> params) {
  switch (where.kind) {
    case LoadPlacement::Kind::kFlat:
      return std::make_unique<detail::FlatPlacement>();
    case LoadPlacement::Kind::kSlice:
      return std::make_unique<detail::SlicePlacement>();
    case LoadPlacement::Kind::kPartitions:
      return std::make_unique<detail::PartitionsPlacement>();
    case LoadPlacement::Kind::kShards:
      return std::make_unique<detail::ShardsPlacement>(where.shards, shapes_of(params));
  }
  throw InvalidArgument("a load placement of no known kind");
}

// The ranks of a load with `layout` under `where` (the spec's for shards).
std::uint64_t world_of(const LoadPlacement& where, const LayoutOptions& layout) {
  return where.kind == LoadPlacement::Kind::kShards ? where.shards.coords.size() : layout.dp;
}

}  // namespace

std::string_view load_placement_name(LoadPlacement::Kind kind) noexcept {
  switch (kind) {
    case LoadPlacement::Kind::kFlat:
      return "flat";
    case LoadPlacement::Kind::kSlice:
      return "slice";
    case LoadPlacement::Kind::kPartitions:
      return "partitions";
    case LoadPlacement::Kind::kShards:
      return "shards";
  }
  return "?";
}

LoadPlacement::Kind parse_load_placement(std::string_view text, std::string_view what) {
  for (LoadPlacement::Kind k : {LoadPlacement::Kind::kFlat, LoadPlacement::Kind::kSlice,
                                LoadPlacement::Kind::kPartitions, LoadPlacement::Kind::kShards}) {
    if (text == load_placement_name(k)) return k;
  }
  throw InvalidArgument(std::string(what) + " '" + printable(std::string(text)) +
                        "': expected flat, slice, partitions or shards");
}

FlattenResult load(const CheckpointIndex& ck, std::span<const LoadParam> params,
                   const LoadPlacement& where, Device& device, Communicator* comm,
                   const FlattenOptions& options) {
  FlattenOptions o = options;
  if (where.kind == LoadPlacement::Kind::kShards) {
    // What every rank must hold identically: the mesh, each rank's coordinate, each placement.
    const ShardSpec& spec = where.shards;
    std::string mesh = "shards mesh";
    for (std::uint64_t n : spec.mesh) mesh += " " + std::to_string(n);
    o.must_match.push_back(mesh);
    for (std::size_t r = 0; r < spec.coords.size(); ++r) {
      std::string c = "shards rank " + std::to_string(r) + " at";
      for (std::uint64_t x : spec.coords[r]) c += " " + std::to_string(x);
      o.must_match.push_back(c);
    }
    for (std::size_t p = 0; p < spec.placements.size(); ++p) {
      std::string c = "shards parameter " + std::to_string(p);
      for (const MeshPlacement& m : spec.placements[p]) c += " " + placement_name(m);
      o.must_match.push_back(c);
    }
  }
  const std::unique_ptr<detail::Placement> placement = placement_of(where, params);
  return load_group(ck, params, device, comm, o, *placement);
}

std::uint64_t load_read_bytes(const CheckpointIndex& ck, std::span<const LoadParam> params,
                              const LoadPlacement& where, const LayoutOptions& layout,
                              std::uint64_t rank) {
  FlattenOptions o;
  o.layout = layout;
  o.layout.dp = world_of(where, layout);
  return read_bytes(ck, params, o, *placement_of(where, params), o.layout.dp, rank);
}

std::vector<PlannedRead> planned_reads(const CheckpointIndex& ck, std::span<const LoadParam> params,
                                       const LoadPlacement& where, const LayoutOptions& layout,
                                       std::uint64_t rank) {
  const std::uint64_t world = world_of(where, layout);
  if (rank >= world) {
    throw InvalidArgument("rank " + std::to_string(rank) + " of " + std::to_string(world));
  }
  const std::unique_ptr<detail::Placement> placement = placement_of(where, params);
  FlattenOptions o;
  o.layout = layout;
  o.layout.dp = world;
  const detail::Sources sources = detail::resolve_all(ck, params);
  std::vector<std::uint64_t> numels;
  for (const LoadParam& p : params) numels.push_back(shape_numel(p.shape));
  const Layout l = placement->layout(numels, o);
  const detail::SourceRuns runs = placement->runs(numels, world, rank);
  const std::uint64_t es = l.element_size();
  // Where the rank's buffer starts in the layout: the whole layout (ZeRO-1/2's flat buffer,
  // the rank's own ZeRO-3 or shard buffer), or its slot alone (a slice).
  const std::uint64_t base =
      (placement->slot(rank) - placement->buffer_slot(rank)) * l.partition_bytes();
  std::vector<PlannedRead> out;
  for (const Step& s : load_steps(l, placement->slot(rank), 0, placement->read_plans()[0])) {
    if (s.op != Op::kRead) continue;
    for (const detail::Read& r :
         detail::reads_for(l, sources, runs, s.flat_offset, s.flat_offset + s.bytes)) {
      PlannedRead x;
      x.file = r.file;
      x.offset = r.src;
      x.bytes = r.src_bytes;
      x.numel = r.src_bytes / element_size(r.from);
      x.dest = (s.flat_offset + r.dst - base) / es;
      out.push_back(x);
    }
  }
  return out;
}

std::string_view copy_check_name(CopyCheck check) noexcept {
  switch (check) {
    case CopyCheck::kOff:
      return "off";
    case CopyCheck::kSampled:
      return "sampled";
    case CopyCheck::kFull:
      return "full";
  }
  return "?";
}

CopyCheck parse_copy_check(std::string_view text, std::string_view what) {
  for (CopyCheck c : {CopyCheck::kOff, CopyCheck::kSampled, CopyCheck::kFull}) {
    if (text == copy_check_name(c)) return c;
  }
  throw InvalidArgument(std::string(what) + " '" + printable(std::string(text)) +
                        "': expected off, sampled or full");
}

void read_checkpoint_tensor(const CheckpointIndex& ck, const std::string& name,
                            std::optional<DType> to, void* dst) {
  const CheckpointTensor* t = ck.find(name);
  if (t == nullptr) {
    throw InvalidArgument(ck.path + " has no tensor named '" + printable(name) + "'");
  }
  if (to && !t->type) {
    throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(name) + "' is " +
                          printable(t->dtype) + ": the loader converts BF16, F16 and F32");
  }
  const detail::File file(ck.files[t->file]);
  if (!to || *to == *t->type) {
    file.read_at(dst, t->bytes, t->offset);
    return;
  }
  std::vector<unsigned char> raw(t->bytes);
  file.read_at(raw.data(), t->bytes, t->offset);
  detail::convert_range(dst, *to, raw.data(), *t->type, t->numel);
}

std::uint64_t read_checkpoint_boxes(const CheckpointIndex& ck, std::span<const BoxRead> boxes,
                                    unsigned threads, bool sole_reader) {
  // Every box's reads, checked before the first is issued.
  std::vector<std::vector<detail::Read>> reads(boxes.size());
  std::vector<std::uint64_t> bytes(boxes.size(), 0);
  for (std::size_t b = 0; b < boxes.size(); ++b) {
    const BoxRead& box = boxes[b];
    const CheckpointTensor* t = ck.find(box.name);
    if (t == nullptr) {
      throw InvalidArgument(ck.path + " has no tensor named '" + printable(box.name) + "'");
    }
    if (!t->type) {
      throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(box.name) + "' is " +
                            printable(t->dtype) + ": the loader converts BF16, F16 and F32");
    }
    const std::uint64_t fes = element_size(*t->type);
    const std::uint64_t es = element_size(box.to);
    std::uint64_t at = 0;
    for (const ElementRun& r : box_runs(t->shape, box.offsets, box.sizes)) {
      reads[b].push_back(
          detail::Read{t->file, t->offset + r.first * fes, r.numel * fes, at * es, *t->type});
      at += r.numel;
    }
    bytes[b] = at * es;
    if (at > 0 && box.dst == nullptr) {
      throw InvalidArgument("box of tensor '" + printable(box.name) + "': no destination");
    }
  }
  // Per target dtype, every box in one pass of the team, in file order (the runs cover each
  // box: nothing to zero).
  detail::OpenFiles files(ck);
  const unsigned n = threads > 0 ? threads : default_num_threads();
  std::map<DType, std::vector<detail::Reader::Destination>> by_dtype;
  std::uint64_t read = 0;
  std::size_t runs = 0;
  for (std::size_t b = 0; b < boxes.size(); ++b) {
    if (bytes[b] == 0) continue;
    by_dtype[boxes[b].to].push_back({static_cast<unsigned char*>(boxes[b].dst), &reads[b]});
    read += detail::source_bytes(reads[b]);
    runs += reads[b].size();
  }
  // As the loader's reads (CheckpointSource): the kernel's read-ahead off (exact read-ahead),
  // or under ZEROFLAT_READ_AHEAD=kernel for many short runs (a box of rows of every tensor).
  if (sole_reader) files.own_files(std::vector<bool>(ck.files.size(), true));
  files.advise_reads(runs > 1 && read / runs < (8u << 20));
  for (const auto& [to, destinations] : by_dtype) {
    detail::Reader reader(files, to, n, std::nullopt);
    reader.fill_many(destinations);
    reader.rethrow();
  }
  return read;
}

void check_checkpoint_files(const CheckpointIndex& ck) {
  std::vector<bool> used(ck.files.size(), false);
  for (const CheckpointTensor& t : ck.tensors) {
    if (t.file < used.size()) used[t.file] = true;
  }
  detail::check_files_present(ck, used);
}

std::string page_cache_word(double fraction) {
  return fraction < 0.1 ? "cold" : fraction > 0.9 ? "warm" : "partly";
}

double cached_fraction(const std::string& file, std::uint64_t offset, std::uint64_t length) {
  return detail::resident_fraction(file, offset, length);
}

}  // namespace zeroflat
