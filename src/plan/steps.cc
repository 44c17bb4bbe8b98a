// Step lists of the four tiers, and the memory model that runs them against counters.
#include <algorithm>
#include <string>

#include "common/saturate.h"
#include "zeroflat/common.h"
#include "zeroflat/plan.h"

namespace zeroflat {

std::string_view tier_name(Tier tier) noexcept {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kSharded:
      return "sharded";
    case Tier::kStaged:
      return "staged";
    case Tier::kHost:
      return "host";
    case Tier::kLoad:
      return "load";
    case Tier::kLoadWhole:
      return "load-whole";
    case Tier::kLoadPartitions:
      return "load-partitions";
    case Tier::kLoadSlice:
      return "load-slice";
  }
  return "?";
}

std::optional<Tier> try_parse_tier(std::string_view text) noexcept {
  for (Tier t : kAllTiers) {
    if (tier_name(t) == text) return t;
  }
  return std::nullopt;
}

std::optional<Tier> parse_tier_choice(std::string_view text, std::string_view what) {
  if (text == "auto") return std::nullopt;
  if (std::optional<Tier> t = try_parse_tier(text)) return t;
  throw InvalidArgument(std::string(what) + " '" + printable(text) +
                        "': expected auto, device, sharded, staged or host");
}

std::string_view buffer_name(Buffer buffer) noexcept {
  switch (buffer) {
    case Buffer::kNone:
      return "-";
    case Buffer::kOriginals:
      return "originals";
    case Buffer::kFlat:
      return "flat";
    case Buffer::kPartition:
      return "partition";
    case Buffer::kHostStage:
      return "host stage";
  }
  return "?";
}

bool on_host(Buffer buffer) noexcept {
  return buffer == Buffer::kHostStage;
}

std::string_view op_name(Op op) noexcept {
  switch (op) {
    case Op::kAllocate:
      return "allocate";
    case Op::kGather:
      return "gather";
    case Op::kCopy:
      return "copy";
    case Op::kReleaseOriginals:
      return "release originals";
    case Op::kAllGather:
      return "all-gather";
    case Op::kRepoint:
      return "re-point";
    case Op::kRelease:
      return "release";
    case Op::kRead:
      return "read";
  }
  return "?";
}

std::string Step::describe() const {
  const std::string b(buffer_name(buffer));
  switch (op) {
    case Op::kAllocate:
      return "allocate " + b + " (" + format_bytes(bytes) +
             (on_host(buffer) ? ", pinned host)" : ")");
    case Op::kGather:
      return "gather layout bytes [" + format_bytes(flat_offset) + ", " +
             format_bytes(flat_offset + bytes) + ") from the originals into " + b +
             (on_host(buffer) ? " (device to host)" : "");
    case Op::kCopy:
      return "copy " + format_bytes(bytes) + " from " + std::string(buffer_name(source)) +
             " into " + b + (on_host(buffer) != on_host(source) ? " (over the host link)" : "");
    case Op::kReleaseOriginals:
      return "release the original parameters";
    case Op::kAllGather:
      return "all-gather " + format_bytes(bytes) + " into " + b +
             (source == buffer ? " (in place)" : " from " + std::string(buffer_name(source)));
    case Op::kRepoint:
      return "re-point parameters as views into flat";
    case Op::kRelease:
      return "release " + b;
    case Op::kRead:
      return "read layout bytes [" + format_bytes(flat_offset) + ", " +
             format_bytes(flat_offset + bytes) + ") from the checkpoint into " + b +
             (on_host(buffer) ? " (host)" : "");
  }
  return "?";
}

namespace {

Step allocate(Buffer b, std::uint64_t bytes) {
  return Step{Op::kAllocate, b, Buffer::kNone, bytes};
}
Step release(Buffer b) {
  return Step{Op::kRelease, b};
}
Step gather(Buffer b, std::uint64_t dst_offset, std::uint64_t flat_offset, std::uint64_t bytes) {
  return Step{Op::kGather, b, Buffer::kOriginals, bytes, flat_offset, dst_offset, 0};
}
Step copy(Buffer dst, std::uint64_t dst_offset, Buffer src, std::uint64_t src_offset,
          std::uint64_t bytes) {
  return Step{Op::kCopy, dst, src, bytes, 0, dst_offset, src_offset};
}

}  // namespace

std::vector<Step> tier_steps(Tier tier, const Layout& layout, std::uint64_t rank,
                             std::uint64_t staged_device_bytes) {
  if (rank >= layout.options().dp) {
    throw InvalidArgument("rank " + std::to_string(rank) + " is outside [0, " +
                          std::to_string(layout.options().dp) + ")");
  }
  const std::uint64_t fb = layout.flat_bytes();
  const std::uint64_t sb = layout.partition_bytes();
  const std::uint64_t slice = rank * sb;
  std::vector<Step> s;
  switch (tier) {
    case Tier::kDevice:
      s = {allocate(Buffer::kFlat, fb), gather(Buffer::kFlat, 0, 0, fb), Step{Op::kRepoint},
           Step{Op::kReleaseOriginals}};
      break;
    case Tier::kSharded:
      s = {allocate(Buffer::kPartition, sb),
           gather(Buffer::kPartition, 0, slice, sb),
           Step{Op::kReleaseOriginals},
           allocate(Buffer::kFlat, fb),
           Step{Op::kAllGather, Buffer::kFlat, Buffer::kPartition, fb},
           Step{Op::kRepoint},
           release(Buffer::kPartition)};
      break;
    case Tier::kStaged: {
      // The first x bytes of the rank's slice stay on the device, the rest waits on the host
      // while the originals are freed and the flat buffer is allocated.
      // Whole elements only: the split point is a byte offset into the layout.
      const std::uint64_t es = layout.element_size();
      const std::uint64_t x = (staged_device_bytes < sb ? staged_device_bytes : sb) / es * es;
      const std::uint64_t h = sb - x;
      if (x > 0) s.push_back(allocate(Buffer::kPartition, x));
      if (h > 0) s.push_back(allocate(Buffer::kHostStage, h));
      if (x > 0) s.push_back(gather(Buffer::kPartition, 0, slice, x));
      if (h > 0) s.push_back(gather(Buffer::kHostStage, 0, slice + x, h));
      s.push_back(Step{Op::kReleaseOriginals});
      s.push_back(allocate(Buffer::kFlat, fb));
      if (x > 0) {
        s.push_back(copy(Buffer::kFlat, slice, Buffer::kPartition, 0, x));
        s.push_back(release(Buffer::kPartition));
      }
      if (h > 0) {
        s.push_back(copy(Buffer::kFlat, slice + x, Buffer::kHostStage, 0, h));
        s.push_back(release(Buffer::kHostStage));
      }
      s.push_back(Step{Op::kAllGather, Buffer::kFlat, Buffer::kFlat, fb, 0, 0, slice});
      s.push_back(Step{Op::kRepoint});
      break;
    }
    case Tier::kHost:
      s = {allocate(Buffer::kHostStage, fb),
           gather(Buffer::kHostStage, 0, 0, fb),
           Step{Op::kReleaseOriginals},
           allocate(Buffer::kFlat, fb),
           copy(Buffer::kFlat, 0, Buffer::kHostStage, 0, fb),
           release(Buffer::kHostStage),
           Step{Op::kRepoint}};
      break;
    case Tier::kLoad:
    case Tier::kLoadWhole:
    case Tier::kLoadPartitions:
    case Tier::kLoadSlice:
      throw InvalidArgument("the read plan '" + std::string(tier_name(tier)) +
                            "' reads a checkpoint: its steps are load_steps()");
  }
  return s;
}

StepMachine::StepMachine(std::uint64_t resident_device_bytes, std::uint64_t original_bytes) noexcept
    : device_(resident_device_bytes), original_bytes_(original_bytes) {}

bool StepMachine::live(Buffer buffer) const noexcept {
  return live_[static_cast<std::size_t>(buffer)];
}

std::uint64_t StepMachine::size(Buffer buffer) const noexcept {
  return live(buffer) ? sizes_[static_cast<std::size_t>(buffer)] : 0;
}

void StepMachine::check(const Step& st) const {
  auto bad = [](const std::string& why) { return InternalError(why); };
  auto need = [&](Buffer b) {
    if (!live(b)) throw bad(std::string(buffer_name(b)) + " is not allocated");
  };
  auto inside = [&](Buffer b, std::uint64_t offset, std::uint64_t bytes) {
    need(b);
    if (offset > size(b) || bytes > size(b) - offset) {
      throw bad("bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                ") lie outside " + std::string(buffer_name(b)) + " (" + std::to_string(size(b)) +
                " bytes)");
    }
  };
  switch (st.op) {
    case Op::kAllocate:
      if (st.buffer == Buffer::kNone || st.buffer == Buffer::kOriginals) {
        throw bad("not a buffer a step list allocates");
      }
      if (live(st.buffer)) throw bad("buffer already allocated");
      break;
    case Op::kRelease:
      need(st.buffer);
      break;
    case Op::kReleaseOriginals:
      if (released_) throw bad("originals already released");
      break;
    case Op::kGather:
      if (released_) throw bad("reads the originals after they were released");
      inside(st.buffer, st.dst_offset, st.bytes);
      break;
    case Op::kRead:
      inside(st.buffer, st.dst_offset, st.bytes);
      break;
    case Op::kCopy:
      inside(st.buffer, st.dst_offset, st.bytes);
      inside(st.source, st.src_offset, st.bytes);
      break;
    case Op::kAllGather:
      inside(st.buffer, 0, st.bytes);
      need(st.source);
      break;
    case Op::kRepoint:
      need(Buffer::kFlat);
      break;
  }
}

void StepMachine::apply(const Step& st) noexcept {
  const auto b = static_cast<std::size_t>(st.buffer);
  // The counters saturate: a list whose buffers add up past 64 bits must read as needing more
  // than any device holds, never wrap to a small peak that fits. A saturated counter stays so
  // (what it held is unknown), which keeps every later account and the peak "too large".
  switch (st.op) {
    case Op::kAllocate: {
      live_[b] = true;
      sizes_[b] = st.bytes;
      std::uint64_t& counter = on_host(st.buffer) ? host_ : device_;
      counter = detail::sat_add(counter, st.bytes);
      break;
    }
    case Op::kRelease: {
      std::uint64_t& counter = on_host(st.buffer) ? host_ : device_;
      if (counter != detail::kSaturated) counter -= std::min(counter, sizes_[b]);
      live_[b] = false;
      sizes_[b] = 0;
      break;
    }
    case Op::kReleaseOriginals:
      released_ = true;
      if (device_ != detail::kSaturated) device_ -= std::min(device_, original_bytes_);
      break;
    case Op::kGather:
    case Op::kCopy:
    case Op::kAllGather:
    case Op::kRepoint:
    case Op::kRead:
      break;
  }
}

std::vector<Step> load_steps(const Layout& layout, std::uint64_t rank, std::uint64_t ring_bytes,
                             Tier plan) {
  if (plan != Tier::kLoad && plan != Tier::kLoadWhole && plan != Tier::kLoadPartitions &&
      plan != Tier::kLoadSlice) {
    throw InvalidArgument("'" + std::string(tier_name(plan)) + "' is not a read plan");
  }
  const std::uint64_t sb = layout.partition_bytes();
  const std::uint64_t fb = layout.flat_bytes();
  // What this rank reads: its slice (kLoad, kLoadSlice) or the whole layout (kLoadWhole;
  // kLoadPartitions, whose layout is the rank's own buffer); the buffer it keeps: the whole
  // layout, or only its slice (kLoadSlice). Only a slice depends on the rank.
  const bool slice = plan == Tier::kLoad || plan == Tier::kLoadSlice;
  if (slice && rank >= layout.options().dp) {
    throw InvalidArgument("rank " + std::to_string(rank) + " is outside [0, " +
                          std::to_string(layout.options().dp) + ")");
  }
  const bool keeps_slice = plan == Tier::kLoadSlice;
  std::vector<Step> s = {allocate(Buffer::kFlat, keeps_slice ? sb : fb)};
  if (ring_bytes > 0) s.push_back(allocate(Buffer::kHostStage, ring_bytes));
  s.push_back(Step{Op::kRead, Buffer::kFlat, Buffer::kNone, slice ? sb : fb,
                   slice ? rank * sb : 0, keeps_slice ? 0 : (slice ? rank * sb : 0), 0});
  if (ring_bytes > 0) s.push_back(release(Buffer::kHostStage));
  if (plan == Tier::kLoad) {
    s.push_back(Step{Op::kAllGather, Buffer::kFlat, Buffer::kFlat, fb, 0, 0, rank * sb});
  }
  // A slice is no whole parameter: nothing to re-point.
  if (!keeps_slice) s.push_back(Step{Op::kRepoint});
  return s;
}

std::uint64_t Profile::peak_from(std::uint64_t resident) const noexcept {
  if (peak_device_bytes == detail::kSaturated) return detail::kSaturated;
  return detail::sat_add(resident,
                         peak_device_bytes - std::min(peak_device_bytes, start_device_bytes));
}

Profile simulate(const std::vector<Step>& steps, std::uint64_t resident_device_bytes,
                 std::uint64_t original_bytes, std::uint64_t dp) {
  if (original_bytes > resident_device_bytes) {
    throw InternalError("simulate: originals (" + std::to_string(original_bytes) +
                        " bytes) exceed what is resident (" +
                        std::to_string(resident_device_bytes) + ")");
  }
  Profile p;
  StepMachine m(resident_device_bytes, original_bytes);
  p.start_device_bytes = resident_device_bytes;
  p.peak_device_bytes = m.device_bytes();
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const Step& st = steps[k];
    try {
      m.check(st);
    } catch (const InternalError& e) {
      throw InternalError("step " + std::to_string(k) + " (" + st.describe() + "): " + e.what());
    }
    m.apply(st);
    // Traffic saturates too (two passes over a buffer of 2^63 bytes do not add up to 0).
    auto add = [](std::uint64_t& total, std::uint64_t bytes) {
      total = detail::sat_add(total, bytes);
    };
    switch (st.op) {
      case Op::kGather:
        add(on_host(st.buffer) ? p.pcie_bytes : p.device_copy_bytes, st.bytes);
        break;
      case Op::kRead:
        add(p.read_bytes, st.bytes);
        break;
      case Op::kCopy:
        add(on_host(st.buffer) != on_host(st.source) ? p.pcie_bytes : p.device_copy_bytes,
            st.bytes);
        break;
      case Op::kAllGather:
        if (dp > 1) {
          add(p.comm_bytes, st.bytes / dp * (dp - 1));
        } else if (st.source != st.buffer) {
          add(p.device_copy_bytes, st.bytes);  // one rank: the all-gather is a copy
        }
        break;
      default:
        break;
    }
    p.peak_device_bytes = std::max(p.peak_device_bytes, m.device_bytes());
    p.peak_host_bytes = std::max(p.peak_host_bytes, m.host_bytes());
    p.after_step.push_back(StepAccount{m.device_bytes(), m.host_bytes()});
  }
  return p;
}

}  // namespace zeroflat
