// A checkpoint's tensors as the pipeline's source (source.h).
#include "source/checkpoint/source.h"

#include <algorithm>
#include <cstring>

#include "common/clock.h"
#include "zeroflat/agree.h"
#include "zeroflat/common.h"

namespace zeroflat::detail {
namespace {

// Calls fn(tensor, first element of the tensor, elements, first element of the parameter) for
// each piece of the parameter's elements [lo, lo + n) held by its sources.
template <typename Fn>
void for_pieces(const std::vector<const CheckpointTensor*>& src, std::uint64_t lo, std::uint64_t n,
                Fn fn) {
  std::uint64_t at = 0;
  for (const CheckpointTensor* t : src) {
    const std::uint64_t a = std::max(at, lo);
    const std::uint64_t b = std::min(at + t->numel, lo + n);
    if (a < b) fn(*t, a - at, b - a, a);
    at += t->numel;
    if (at >= lo + n) break;
  }
}

}  // namespace

std::vector<std::string> header_entries(const CheckpointIndex& ck) {
  std::vector<std::string> out;
  out.reserve(ck.files.size() + ck.tensors.size());
  for (std::size_t f = 0; f < ck.files.size(); ++f) {
    const std::string name = ck.files[f].substr(ck.files[f].find_last_of('/') + 1);
    out.push_back("file " + printable(name) + " of " + std::to_string(ck.file_bytes[f]) + " bytes");
  }
  for (const CheckpointTensor& t : ck.tensors) {
    const std::string file = ck.files[t.file].substr(ck.files[t.file].find_last_of('/') + 1);
    out.push_back("tensor '" + printable(t.name) + "' " + printable(t.dtype) + " " +
                  shape_to_string(t.shape) + " at bytes [" + std::to_string(t.offset) + ", " +
                  std::to_string(t.offset + t.bytes) + ") of " + printable(file));
  }
  return out;
}

std::vector<const CheckpointTensor*> resolve(const CheckpointIndex& ck, const LoadParam& p,
                                             std::vector<std::string>& missing) {
  std::vector<std::string> names = p.sources;
  if (names.empty()) names.push_back(p.name);
  if (!p.source_shapes.empty() && p.source_shapes.size() != names.size()) {
    throw InvalidArgument("parameter '" + printable(p.name) + "' names " +
                          std::to_string(names.size()) + " source tensors but " +
                          std::to_string(p.source_shapes.size()) + " expected shapes");
  }
  std::vector<const CheckpointTensor*> out;
  std::uint64_t numel = 0;
  for (std::size_t k = 0; k < names.size(); ++k) {
    const CheckpointTensor* t = ck.find(names[k]);
    if (t == nullptr) {
      missing.push_back(printable(names[k]));
      continue;
    }
    if (!t->type) {
      throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(t->name) + "' is " +
                            printable(t->dtype) + ": the loader reads BF16, F16 and F32");
    }
    if (!p.source_shapes.empty() && t->shape != p.source_shapes[k]) {
      throw InvalidArgument(ck.files[t->file] + ": tensor '" + printable(t->name) + "' has shape " +
                            shape_to_string(t->shape) + ", but parameter '" + printable(p.name) +
                            "' takes it as " + shape_to_string(p.source_shapes[k]) +
                            " (a tensor stored transposed or reshaped would load as garbage)");
    }
    out.push_back(t);
    numel += t->numel;
  }
  if (out.size() != names.size()) return {};
  if (out.size() == 1 && out.front()->shape != p.shape) {
    const CheckpointTensor& t = *out.front();
    throw InvalidArgument(ck.files[t.file] + ": tensor '" + printable(t.name) + "' has shape " +
                          shape_to_string(t.shape) + ", but parameter '" + printable(p.name) +
                          "' is " + shape_to_string(p.shape));
  }
  if (numel != shape_numel(p.shape)) {
    throw InvalidArgument("the " + std::to_string(out.size()) + " tensors of parameter '" +
                          printable(p.name) + "' (" + printable(names.front()) + ", ...) hold " +
                          std::to_string(numel) + " elements, but it is " +
                          shape_to_string(p.shape) + " (" + std::to_string(shape_numel(p.shape)) +
                          " elements)");
  }
  return out;
}

Sources resolve_all(const CheckpointIndex& ck, std::span<const LoadParam> params) {
  Sources sources;
  sources.reserve(params.size());
  std::vector<std::string> missing;
  for (const LoadParam& p : params) sources.push_back(resolve(ck, p, missing));
  if (!missing.empty()) {
    const std::size_t n = missing.size();
    if (n > 8) {
      missing.resize(8);
      missing.push_back("...");
    }
    throw InvalidArgument(ck.path + " has no tensor named " + join(missing) + " (" +
                          std::to_string(n) + " missing; the checkpoint holds " +
                          std::to_string(ck.tensors.size()) + " tensors)");
  }
  return sources;
}

std::vector<Read> reads_for(const Layout& layout, const Sources& sources, const SourceRuns& runs,
                            std::uint64_t lo, std::uint64_t hi) {
  const std::uint64_t es = layout.element_size();
  std::vector<Read> reads;
  for (const Fragment& f : layout.fragments_in(lo / es, hi / es)) {
    // The fragment's entry elements [a, b) come from source elements [first, first + n).
    const auto add = [&](std::uint64_t a, std::uint64_t first, std::uint64_t n) {
      for_pieces(sources[f.param], first, n,
                 [&](const CheckpointTensor& t, std::uint64_t tensor_first, std::uint64_t k,
                     std::uint64_t source_first) {
                   const std::uint64_t fes = element_size(*t.type);
                   const std::uint64_t entry = a + (source_first - first);
                   reads.push_back(Read{t.file, t.offset + tensor_first * fes, k * fes,
                                        (f.partition_offset + entry - f.param_offset) * es,
                                        *t.type});
                 });
    };
    const std::uint64_t end = f.param_offset + f.numel;
    if (runs.empty()) {
      add(f.param_offset, f.param_offset, f.numel);
      continue;
    }
    std::uint64_t at = 0;  // the entry element where the run starts
    for (const ElementRun& r : runs[f.param]) {
      if (at >= end) break;
      const std::uint64_t a = std::max(at, f.param_offset);
      const std::uint64_t b = std::min(at + r.numel, end);
      if (a < b) add(a, r.first + (a - at), b - a);
      at += r.numel;
    }
  }
  std::sort(reads.begin(), reads.end(), [](const Read& a, const Read& b) {
    return a.file != b.file ? a.file < b.file : a.src < b.src;
  });
  std::vector<Read> merged;
  for (const Read& r : reads) {
    if (!merged.empty()) {
      Read& m = merged.back();
      if (m.file == r.file && m.from == r.from && m.src + m.src_bytes == r.src &&
          m.dst + dst_bytes(m, es) == r.dst) {
        m.src_bytes += r.src_bytes;
        continue;
      }
    }
    merged.push_back(r);
  }
  return merged;
}

CheckpointSource::CheckpointSource(const CheckpointIndex& ck, std::span<const LoadParam> params,
                                   Device& device, const FlattenOptions& options)
    : ck_(ck), params_(params), device_(device), options_(options), files_(ck) {
  const ReadOptions& r = options.read;
  if (r.through_ring || !device.host_accessible()) {
    ring_bytes_ = std::uint64_t{r.ring_depth} * (r.ring_chunk_bytes / 64 * 64);
  }
}

void CheckpointSource::check(std::span<const TensorRef> views, const Layout& layout,
                             const Device& device) const {
  for (std::size_t i = 0; i < views.size(); ++i) {
    if (views[i].data != nullptr || views[i].device != &device ||
        views[i].dtype != layout.options().dtype) {
      throw InvalidArgument("parameter " + std::to_string(i) +
                            " of a group read from a checkpoint must have no data yet, be on " +
                            device.name() + " and have the group's dtype");
    }
  }
}

void CheckpointSource::prepare(std::span<const TensorRef>, const Layout& layout,
                               const Placement& placement, std::uint64_t world, std::uint64_t rank,
                               Device& device) {
  const ReadOptions& r = options_.read;
  if (ring_bytes_ > 0 && (r.ring_depth == 0 || r.ring_depth > 64 || r.ring_chunk_bytes < 4096 ||
                          r.ring_chunk_bytes > (std::uint64_t{1} << 32))) {
    throw InvalidArgument("a staging ring of " + std::to_string(r.ring_depth) + " chunks of " +
                          format_bytes(r.ring_chunk_bytes) +
                          ": expected 1 to 64 chunks of 4 KiB to 4 GiB");
  }
  sources_ = resolve_all(ck_, params_);
  numels_.clear();
  for (const LoadParam& p : params_) numels_.push_back(shape_numel(p.shape));
  layout_ = layout;
  placement_ = &placement;
  world_ = world;
  rank_ = rank;
  runs_ = placement.runs(numels_, world, rank);
  threads_ =
      r.threads > 0 ? r.threads : default_num_threads(std::max(1u, local_ranks(options_, world)));
  if (device.keeps_data()) {
    check_files_present(ck_);
    // Before the ranks agree, so that every rank's drop precedes every rank's reads.
    if (r.cold) drop_all_from_cache(files_);
  }
}

// The checkpoint's own entries are compared one by one after the options (agree()), so that a
// difference is named by its tensor.
std::vector<std::string> CheckpointSource::describe() const {
  return {"ring " + std::to_string(ring_bytes_) + " B",
          "copies check " + std::string(copy_check_name(options_.read.copies))};
}

// The ranks compare their copies' headers: one all-reduce of the whole digest in the
// agreement's options would not name the entry; here, the entries themselves, digests first.
void CheckpointSource::agree(Communicator* comm) {
  if (comm == nullptr || comm->size() <= 1) return;
  const std::optional<Difference> d = first_difference(header_entries(ck_), *comm);
  if (!d) return;
  throw InvalidArgument("the ranks read different checkpoints at " + ck_.path + ": " +
                        describe_difference(*d, "the entry", comm->rank()) +
                        " differs between the ranks' copies; every rank must read an identical "
                        "copy");
}

Plan CheckpointSource::plan(const PlanInput& input, const Placement& placement) const {
  return plan_reads(input, ring_bytes_, input.forced, placement.read_plans());
}

void CheckpointSource::read(void* dst, std::uint64_t flat_offset, std::uint64_t bytes, void* stage,
                            std::uint64_t stage_bytes) {
  const std::uint64_t es = layout_->element_size();
  const std::vector<Read> reads =
      reads_for(*layout_, sources_, runs_, flat_offset, flat_offset + bytes);
  auto* at = static_cast<unsigned char*>(dst);
  // A read that continues the one before it, in the buffer as in the layout (the executor reads
  // a slice in parts while it gathers the parts read), is the same read: one range, one report.
  const bool continues = !read_.empty() && read_.back().hi == flat_offset &&
                         read_.back().dst + (read_.back().hi - read_.back().lo) == at;
  if (continues) {
    read_.back().hi += bytes;
  } else {
    read_.push_back(ReadRange{flat_offset, flat_offset + bytes, at});
    report_.reads = 0;
    report_.bytes = 0;
    report_.seconds = 0;
  }
  const std::uint64_t part_bytes = source_bytes(reads);
  if (!own_found_ && device_.keeps_data()) find_own_files();
  if (!continues || flat_offset + bytes > planned_to_) {
    // The first part of a step plans the step: what the page cache holds of it, what progress
    // counts on.
    std::uint64_t hi = flat_offset + bytes;
    for (const auto& [lo, end] : read_ranges(rank_)) {
      if (lo <= flat_offset && flat_offset < end) hi = std::max(hi, end);
    }
    const std::vector<Read> step =
        hi == flat_offset + bytes ? reads : reads_for(*layout_, sources_, runs_, flat_offset, hi);
    planned_to_ = hi;
    if (device_.keeps_data()) {
      report_.cached_fraction = cached_fraction_of(ck_, step);
      report_.page_cache = page_cache_word(report_.cached_fraction);
      if (options_.read.progress) {
        options_.read.progress->planned.fetch_add(source_bytes(step), std::memory_order_relaxed);
      }
    }
  }
  // An injected read error counts the step's bytes, not the part's.
  std::optional<std::uint64_t> fail_after = options_.read.fail_after_bytes;
  if (fail_after) *fail_after -= std::min(*fail_after, report_.bytes);
  // A tensor cut by the parts' edge is one read of the step, not one per part.
  std::uint64_t cut = 0;
  if (continues) {
    for (const Read& r : reads) {
      cut += std::binary_search(read_ends_.begin(), read_ends_.end(),
                                std::make_tuple(r.file, r.src, flat_offset + r.dst));
    }
  }
  read_ends_.clear();
  for (const Read& r : reads) {
    read_ends_.emplace_back(r.file, r.src + r.src_bytes, flat_offset + r.dst + dst_bytes(r, es));
  }
  std::sort(read_ends_.begin(), read_ends_.end());
  report_.reads += reads.size() - cut;
  report_.bytes += part_bytes;
  if (!device_.keeps_data()) return;
  // The kernel's read-ahead would read past the end of each range into bytes another rank
  // reads: off by default, and under ZEROFLAT_READ_AHEAD=kernel still off for many short ranges
  // (a slice of every tensor).
  files_.advise_reads(reads.size() > 1 && part_bytes / reads.size() < (8u << 20));
  const auto t0 = Clock::now();
  ReadProgress* progress = options_.read.progress.get();
  Reader reader(files_, layout_->options().dtype, threads_, fail_after, progress,
                options_.read.simulated_read_bytes_per_second);
  if (stage == nullptr) {
    reader.fill(at, bytes, reads);
  } else {
    fill_through_ring(reader, device_, at, bytes, reads, static_cast<unsigned char*>(stage),
                      stage_bytes, options_.read.ring_depth, es);
  }
  reader.rethrow();
  report_.seconds += seconds_since(t0);
}

void CheckpointSource::report(FlattenResult& result) const {
  result.read = report_;
}

std::string CheckpointSource::where(std::uint64_t b, std::uint64_t owner) const {
  const std::uint64_t es = layout_->element_size();
  const std::uint64_t e = b / es;
  const auto& offs = layout_->offsets();
  const std::string text =
      "layout byte " + std::to_string(b) + " (read by rank " + std::to_string(owner) + ")";
  const SourceRuns runs = placement_->runs(numels_, world_, owner);
  // Round-robin layouts do not keep offsets sorted: a scan.
  for (std::size_t p = 0; p < offs.size(); ++p) {
    if (offs[p] > e || e >= offs[p] + layout_->numels()[p]) continue;
    std::uint64_t at = e - offs[p];
    if (!runs.empty()) {  // the entry element's source element (padding: none)
      std::uint64_t entry = 0;
      bool found = false;
      for (const ElementRun& r : runs[p]) {
        if (at < entry + r.numel) {
          at = r.first + (at - entry);
          found = true;
          break;
        }
        entry += r.numel;
      }
      if (!found) return text + ", padding of parameter " + std::to_string(p);
    }
    for (const CheckpointTensor* t : sources_[p]) {
      if (at < t->numel) {
        return text + ", tensor '" + printable(t->name) + "' of " + ck_.files[t->file] +
               " at file byte " + std::to_string(t->offset + at * element_size(*t->type));
      }
      at -= t->numel;
    }
    return text;
  }
  return text;
}

void CheckpointSource::find_own_files() {
  own_found_ = true;
  if (!files_.exact() || world_ > kOwnFilesWorld) return;
  // Per file: 1, this rank reads it; 2, another rank does.
  std::vector<unsigned char> who(ck_.files.size(), 0);
  for (std::uint64_t q = 0; q < world_; ++q) {
    const SourceRuns runs = q == rank_ ? runs_ : placement_->runs(numels_, world_, q);
    for (const auto& [lo, hi] : read_ranges(q)) {
      for (const Read& r : reads_for(*layout_, sources_, runs, lo, hi)) {
        who[r.file] |= q == rank_ ? 1 : 2;
      }
    }
  }
  std::vector<bool> own(who.size());
  bool any = false;
  for (std::size_t f = 0; f < who.size(); ++f) any |= (own[f] = who[f] == 1);
  if (any) files_.own_files(std::move(own));
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> CheckpointSource::read_ranges(
    std::uint64_t q) const {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const Step& s : load_steps(*layout_, placement_->slot(q), ring_bytes_, chosen_)) {
    if (s.op == Op::kRead) out.emplace_back(s.flat_offset, s.flat_offset + s.bytes);
  }
  return out;
}

}  // namespace zeroflat::detail

namespace zeroflat {

std::uint64_t checkpoint_header_digest(const CheckpointIndex& ck) {
  std::string digests;
  for (const std::string& entry : detail::header_entries(ck)) {
    const std::uint64_t d = checksum_serial(entry.data(), entry.size());
    digests.append(reinterpret_cast<const char*>(&d), sizeof d);
  }
  return checksum_serial(digests.data(), digests.size());
}

}  // namespace zeroflat
