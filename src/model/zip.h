// The zip archives torch.save writes, read from their central directory: each entry's name and
// the byte range of its (stored, uncompressed) data in the file, every header checked.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "model/files.h"

namespace zeroflat::detail {

// Where an archive's bytes come from: a file (read piecewise, never whole) or memory.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual std::uint64_t size() const = 0;
  // Exactly n bytes at offset into out; throws InvalidArgument when they are not there.
  virtual void read(void* out, std::uint64_t n, std::uint64_t offset) const = 0;
  // The file's name in messages.
  virtual const std::string& name() const = 0;
};

// Bytes held by the caller (they must outlive the source).
class MemorySource final : public ByteSource {
 public:
  MemorySource(std::span<const unsigned char> bytes, std::string name)
      : bytes_(bytes), name_(std::move(name)) {}
  std::uint64_t size() const override { return bytes_.size(); }
  void read(void* out, std::uint64_t n, std::uint64_t offset) const override;
  const std::string& name() const override { return name_; }

 private:
  std::span<const unsigned char> bytes_;
  std::string name_;
};

// A regular file, read with pread (files.h: no FIFO or device is ever waited on).
class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::string& path) : file_(path) {}
  std::uint64_t size() const override { return file_.size(); }
  void read(void* out, std::uint64_t n, std::uint64_t offset) const override {
    file_.read_at(out, n, offset);
  }
  const std::string& name() const override { return file_.path(); }
  FileStamp stamp() const { return file_.stamp(); }

 private:
  File file_;
};

struct ZipEntry {
  std::string name;              // full name in the archive ("archive/data/0")
  std::uint64_t header = 0;      // offset of its local header
  std::uint64_t offset = 0;      // of its first data byte in the file
  std::uint64_t bytes = 0;       // of data (stored: compressed size = uncompressed size)
};

// The most entries an archive may list (a checkpoint has one per storage, and a few more).
inline constexpr std::uint64_t kMaxZipEntries = 4'000'000;
// The largest central directory read (about 100 bytes per entry).
inline constexpr std::uint64_t kMaxZipDirectoryBytes = std::uint64_t{512} << 20;

struct ZipArchive {
  std::vector<ZipEntry> entries;  // in central-directory order
  // The entry of that exact name, or null. O(log n).
  const ZipEntry* find(std::string_view name) const;
  std::vector<std::uint32_t> by_name;  // indices of entries sorted by name
};

// Reads the end records (ZIP64 ones too), the central directory and every entry's local
// header. Throws InvalidArgument naming the source and the entry: no end record (not a zip
// archive: the message says what the file starts with, the legacy torch format above all), a
// truncated archive, bad signatures, an archive split over disks, an encrypted or compressed
// entry (method other than 0, STORED), a local header that disagrees with the directory
// (name, method), duplicate names, entries whose bytes overlap each other or the directory or
// run past the end of the file.
ZipArchive read_zip(const ByteSource& source);

}  // namespace zeroflat::detail
