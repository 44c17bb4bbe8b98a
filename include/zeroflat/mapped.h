// A rank's shards used where they lie in the checkpoint's files: mapped, not read. A DTensor's
// local shard whose elements follow one another in one tensor of the file, stored in the dtype
// the model holds, is one byte range of that file; a private (copy-on-write) mapping of it is
// the shard, with no copy into fresh memory. The pages are brought in during the load (the page
// cache's pages mapped where they are there, the file read where they are not), so the first
// touch afterwards faults nothing; a write to the memory (a training step) copies the page it
// writes, and the file is never changed.
//
// What a mapping costs the caller: the memory stays tied to the file. A file truncated while
// mapped (a checkpoint rewritten in place, not replaced by a rename) makes the pages past its
// new end unreadable (SIGBUS on access); a file rewritten in place changes the values of the
// pages not yet written. Replacing the file by a rename, as checkpoint writers do, changes
// nothing of a mapping.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"
#include "zeroflat/dtensor.h"
#include "zeroflat/loader.h"

namespace zeroflat {

// One byte range of one checkpoint file.
struct FileRange {
  std::uint32_t file = 0;  // index into CheckpointIndex::files
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  bool operator==(const FileRange&) const = default;
};

// Per parameter, rank `rank`'s local shard under spec as one byte range of one file, where the
// parameter can be used in place: every rank's shard one run of consecutive elements of one
// checkpoint tensor (a shard of whole rows, as Shard(0) and Replicate() make: each sharded
// dimension has only dimensions of size 1 before it), stored as `dtype` (no conversion), from a
// byte of the file that is a multiple of the element size, the tensor stored whole (not a piece
// of a DCP-sharded file). A rank whose shard is empty gets a range of 0 bytes. Else none: the
// loader reads it (a conversion, a shard of several runs, a parameter several tensors make up).
// Which parameters have a range depends on the checkpoint, shapes and placements only: the same
// on every rank, so that the ranks' loads of the rest agree. Throws InvalidArgument as
// load_read_bytes does for the shards.
std::vector<std::optional<FileRange>> shard_file_ranges(const CheckpointIndex& checkpoint,
                                                        std::span<const LoadParam> params,
                                                        const ShardSpec& spec, std::uint64_t rank,
                                                        DType dtype);

// How map_file_ranges brings the pages in.
struct MapOptions {
  unsigned threads = 0;  // 0: default_num_threads()
  // Counts each piece brought in (planned, then done); may be null.
  ReadProgress* progress = nullptr;
  // No other rank reads the files: the kernel's read-ahead, which then reads nothing another
  // rank needs, even under exact read-ahead.
  bool sole_reader = false;
  // Drop the files from the page cache first (ReadOptions::cold: a cold load measured without
  // root).
  bool cold = false;
};

// Ranges of a checkpoint's files, mapped. Each file is mapped once, over the pages its ranges
// span; a range's mapping lives while this object or any handle from keep() does.
class MappedRanges {
 public:
  MappedRanges() = default;
  std::size_t size() const noexcept { return data_.size(); }
  // Range k's first byte (writable: the mapping is private); null for a range of 0 bytes.
  unsigned char* data(std::size_t k) const { return data_.at(k); }
  // A handle that keeps range k's mapping alive (for a tensor's deleter).
  std::shared_ptr<const void> keep(std::size_t k) const { return keep_.at(k); }
  // The ranges' bytes (what was brought in: file bytes read where they were not cached).
  std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  friend MappedRanges map_file_ranges(const CheckpointIndex&, std::span<const FileRange>,
                                      const MapOptions&);
  std::vector<unsigned char*> data_;
  std::vector<std::shared_ptr<const void>> keep_;
  std::uint64_t bytes_ = 0;
};

// Maps `ranges` (each within its file, as the headers say; one of 0 bytes maps nothing)
// privately and brings every page of them in on options.threads threads. Each file is checked to
// be the one whose headers were read, as the loader checks before reading. Under exact
// read-ahead (common.h) the pages are asked for exactly, the kernel's read-around off for the
// mappings, unless options.sole_reader. Throws InvalidArgument for a range outside its file, a file
// replaced, truncated or not mappable, naming it; Error naming the file and byte range where a page
// cannot be read (an I/O error). Nothing stays mapped when it throws.
MappedRanges map_file_ranges(const CheckpointIndex& checkpoint, std::span<const FileRange> ranges,
                             const MapOptions& options = {});

}  // namespace zeroflat
