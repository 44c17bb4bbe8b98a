// The zip reader of torch.save archives (zip.h): end records, central directory, local headers.
#include "model/zip.h"

#include <algorithm>
#include <cstring>

#include "zeroflat/common.h"

namespace zeroflat::detail {
namespace {

constexpr std::uint32_t kLocalSig = 0x04034b50;
constexpr std::uint32_t kCentralSig = 0x02014b50;
constexpr std::uint32_t kEndSig = 0x06054b50;
constexpr std::uint32_t kEnd64Sig = 0x06064b50;
constexpr std::uint32_t kLocator64Sig = 0x07064b50;
constexpr std::uint64_t kEndBytes = 22;
constexpr std::uint64_t kLocatorBytes = 20;
constexpr std::uint64_t kEnd64Bytes = 56;
constexpr std::uint64_t kCentralBytes = 46;
constexpr std::uint64_t kLocalBytes = 30;
constexpr std::uint64_t kMaxComment = 65535;

std::uint64_t le(const unsigned char* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

std::string hex32(std::uint64_t v) {
  static const char* digits = "0123456789abcdef";
  std::string out = "0x";
  for (int i = 28; i >= 0; i -= 4) out += digits[(v >> i) & 0xf];
  return out;
}

// What a file that is not a zip archive starts with, for the message.
std::string not_zip_reason(const ByteSource& src) {
  unsigned char head[4] = {0, 0, 0, 0};
  const std::uint64_t n = std::min<std::uint64_t>(src.size(), 4);
  if (n > 0) src.read(head, n, 0);
  if (n >= 2 && head[0] == 0x80 && head[1] <= 5) {
    return "it starts with a pickle (protocol " + std::to_string(head[1]) +
           "): torch.save's legacy format (torch before 1.6, or "
           "_use_new_zipfile_serialization=False), which zeroflat does not read; save it again "
           "with a current torch.save";
  }
  if (src.size() >= 262) {
    char magic[6] = {};
    src.read(magic, 5, 257);
    if (std::memcmp(magic, "ustar", 5) == 0) {
      return "it is a tar archive: torch.save's oldest format, which zeroflat does not read";
    }
  }
  if (n >= 4 && le(head, 4) == kLocalSig) {
    return "it starts like a zip archive but has no end-of-central-directory record: a "
           "truncated file";
  }
  return "no end-of-central-directory record in its last " +
         std::to_string(std::min<std::uint64_t>(src.size(), kEndBytes + kMaxComment)) +
         " bytes: not a zip archive, or a truncated one";
}

}  // namespace

void MemorySource::read(void* out, std::uint64_t n, std::uint64_t offset) const {
  if (offset > bytes_.size() || n > bytes_.size() - offset) {
    throw InvalidArgument(printable(name_, 200) + ": bytes [" + std::to_string(offset) + ", " +
                          std::to_string(offset) + " + " + std::to_string(n) +
                          ") lie past the end of its " + std::to_string(bytes_.size()) +
                          " bytes");
  }
  if (n > 0) std::memcpy(out, bytes_.data() + offset, n);
}

const ZipEntry* ZipArchive::find(std::string_view name) const {
  auto it = std::lower_bound(by_name.begin(), by_name.end(), name,
                             [&](std::uint32_t i, std::string_view n) { return entries[i].name < n; });
  if (it == by_name.end() || entries[*it].name != name) return nullptr;
  return &entries[*it];
}

ZipArchive read_zip(const ByteSource& src) {
  const std::string file = printable(src.name(), 200);
  auto fail = [&](const std::string& why) { return InvalidArgument(file + ": " + why); };
  const std::uint64_t size = src.size();

  // The end record: 22 bytes and a comment of at most 64 KiB, the last thing in the file.
  // torch.save writes no comment: when the last 22 bytes are an end record without one, the
  // search below would take exactly it, so only they are read (an archive inside a DCP file
  // then costs no read of its tensor's last 64 KiB).
  std::uint64_t tail_bytes = std::min<std::uint64_t>(size, kEndBytes + kMaxComment);
  if (size >= kEndBytes) {
    unsigned char last[kEndBytes];
    src.read(last, kEndBytes, size - kEndBytes);
    if (le(last, 4) == kEndSig && le(last + 20, 2) == 0) tail_bytes = kEndBytes;
  }
  std::vector<unsigned char> tail(tail_bytes);
  if (tail_bytes > 0) src.read(tail.data(), tail_bytes, size - tail_bytes);
  std::uint64_t end_at = UINT64_MAX;  // in the file
  for (std::uint64_t i = tail_bytes >= kEndBytes ? tail_bytes - kEndBytes + 1 : 0; i-- > 0;) {
    const unsigned char* p = tail.data() + i;
    if (le(p, 4) == kEndSig && i + kEndBytes + le(p + 20, 2) == tail_bytes) {
      end_at = size - tail_bytes + i;
      break;
    }
  }
  if (end_at == UINT64_MAX) throw fail("not a torch.save archive: " + not_zip_reason(src));
  // Another end record's signature after the one taken (inside its comment) is one that other
  // readers (torch's among them take the last signature in the file) would follow instead: two
  // readers would see two archives, so the file is refused.
  for (std::uint64_t i = end_at - (size - tail_bytes) + 1; i + 4 <= tail_bytes; ++i) {
    if (le(tail.data() + i, 4) == kEndSig) {
      throw fail("a second end-of-central-directory signature at offset " +
                 std::to_string(size - tail_bytes + i) + ", inside the comment of the end " +
                 "record at " + std::to_string(end_at) +
                 ": zip readers disagree on which archive this is");
    }
  }
  const unsigned char* end = tail.data() + (end_at - (size - tail_bytes));
  std::uint64_t disk = le(end + 4, 2), cd_disk = le(end + 6, 2);
  std::uint64_t count_here = le(end + 8, 2), count = le(end + 10, 2);
  std::uint64_t cd_bytes = le(end + 12, 4), cd_offset = le(end + 16, 4);
  std::uint64_t records_at = end_at;  // where the end records begin: the directory ends there

  // ZIP64: a locator right before the end record points at the 64-bit end record. torch.save
  // always writes them; they are required when a field of the end record is saturated.
  const bool saturated = count == 0xffff || count_here == 0xffff || cd_bytes == 0xffffffff ||
                         cd_offset == 0xffffffff || disk == 0xffff || cd_disk == 0xffff;
  bool has_locator = false;
  if (end_at >= kLocatorBytes) {
    unsigned char loc[kLocatorBytes];
    src.read(loc, kLocatorBytes, end_at - kLocatorBytes);
    if (le(loc, 4) == kLocator64Sig) {
      has_locator = true;
      if (le(loc + 4, 4) != 0 || le(loc + 16, 4) != 1) {
        throw fail("the ZIP64 locator names disk " + std::to_string(le(loc + 4, 4)) + " of " +
                   std::to_string(le(loc + 16, 4)) +
                   ": a split archive (expected one file, as torch.save writes)");
      }
      const std::uint64_t at = le(loc + 8, 8);
      if (at > end_at - kLocatorBytes || end_at - kLocatorBytes - at < kEnd64Bytes) {
        throw fail("the ZIP64 end record's offset " + std::to_string(at) +
                   " leaves no room for it before the locator at " +
                   std::to_string(end_at - kLocatorBytes) + " (truncated or corrupt archive)");
      }
      unsigned char e64[kEnd64Bytes];
      src.read(e64, kEnd64Bytes, at);
      if (le(e64, 4) != kEnd64Sig) {
        throw fail("no ZIP64 end record at offset " + std::to_string(at) + " (signature " +
                   hex32(le(e64, 4)) + ", expected " + hex32(kEnd64Sig) + ")");
      }
      disk = le(e64 + 16, 4);
      cd_disk = le(e64 + 20, 4);
      count_here = le(e64 + 24, 8);
      count = le(e64 + 32, 8);
      cd_bytes = le(e64 + 40, 8);
      cd_offset = le(e64 + 48, 8);
      records_at = at;
    }
  }
  if (saturated && !has_locator) {
    throw fail("the end record says the archive needs ZIP64 records, but there is no ZIP64 "
               "locator before it (truncated or corrupt archive)");
  }
  if (disk != 0 || cd_disk != 0 || count_here != count) {
    throw fail("the archive is split over several disks (expected one file, as torch.save "
               "writes)");
  }
  if (count == 0) throw fail("the zip archive lists no entries (expected data.pkl at least)");
  if (count > kMaxZipEntries) {
    throw fail("the archive lists " + format_count(count) + " entries; at most " +
               format_count(kMaxZipEntries) + " are read");
  }
  if (cd_offset > records_at || cd_bytes > records_at - cd_offset) {
    throw fail("the central directory [" + std::to_string(cd_offset) + ", +" +
               std::to_string(cd_bytes) + ") runs past the end records at " +
               std::to_string(records_at) + " (truncated or corrupt archive)");
  }
  if (cd_bytes > kMaxZipDirectoryBytes) {
    throw fail("the central directory takes " + format_bytes(cd_bytes) + "; at most " +
               format_bytes(kMaxZipDirectoryBytes) + " are read");
  }
  if (cd_bytes / kCentralBytes < count) {
    throw fail("the central directory's " + std::to_string(cd_bytes) + " bytes cannot hold the " +
               std::to_string(count) + " entries the end record lists");
  }

  std::vector<unsigned char> cd(cd_bytes);
  if (cd_bytes > 0) src.read(cd.data(), cd_bytes, cd_offset);
  ZipArchive out;
  out.entries.reserve(count);
  std::uint64_t pos = 0;
  for (std::uint64_t i = 0; i < count; ++i) {
    auto bad = [&](const std::string& why) {
      return fail("central directory entry " + std::to_string(i) + ": " + why);
    };
    if (cd_bytes - pos < kCentralBytes) throw bad("truncated (the directory ends inside it)");
    const unsigned char* c = cd.data() + pos;
    if (le(c, 4) != kCentralSig) {
      throw bad("bad signature " + hex32(le(c, 4)) + " (expected " + hex32(kCentralSig) + ")");
    }
    const std::uint64_t flags = le(c + 8, 2), method = le(c + 10, 2);
    std::uint64_t packed = le(c + 20, 4), unpacked = le(c + 24, 4);
    const std::uint64_t name_len = le(c + 28, 2), extra_len = le(c + 30, 2);
    const std::uint64_t comment_len = le(c + 32, 2);
    std::uint64_t entry_disk = le(c + 34, 2);
    std::uint64_t header = le(c + 42, 4);
    if (cd_bytes - pos - kCentralBytes < name_len + extra_len + comment_len) {
      throw bad("its name, extra field and comment run past the end of the directory");
    }
    ZipEntry e;
    e.name.assign(reinterpret_cast<const char*>(c + kCentralBytes), name_len);
    const std::string shown = std::string("'").append(printable(e.name, 120)).append("'");
    auto bad_entry = [&](const std::string& why) {
      return fail("entry " + shown + ": " + why);
    };
    if (e.name.empty()) throw bad("an entry has an empty name");
    // ZIP64 extra field: the 64-bit values of the saturated 32-bit ones, in this order.
    const unsigned char* x = c + kCentralBytes + name_len;
    for (std::uint64_t at = 0; at + 4 <= extra_len;) {
      const std::uint64_t id = le(x + at, 2), len = le(x + at + 2, 2);
      if (at + 4 + len > extra_len) throw bad_entry("an extra field runs past its extra data");
      if (id == 0x0001) {
        const unsigned char* v = x + at + 4;
        std::uint64_t left = len;
        auto take = [&](std::uint64_t* field, std::uint64_t saturated_value, int width) {
          if (*field != saturated_value) return;
          if (left < static_cast<std::uint64_t>(width)) {
            throw bad_entry("the ZIP64 extra field is too short for the values it must hold");
          }
          *field = le(v, width);
          v += width;
          left -= static_cast<std::uint64_t>(width);
        };
        take(&unpacked, 0xffffffff, 8);
        take(&packed, 0xffffffff, 8);
        take(&header, 0xffffffff, 8);
        take(&entry_disk, 0xffff, 4);
      }
      at += 4 + len;
    }
    if (entry_disk != 0) throw bad_entry("lies on disk " + std::to_string(entry_disk));
    if (flags & 0x1) throw bad_entry("is encrypted (torch.save never encrypts)");
    if (method != 0) {
      throw bad_entry("is compressed (method " + std::to_string(method) +
                      "); torch.save stores every entry uncompressed (method 0), so that its "
                      "tensors can be read in place");
    }
    if (packed != unpacked) {
      throw bad_entry("is stored, yet its size in the archive (" + std::to_string(packed) +
                      ") differs from its size (" + std::to_string(unpacked) + ")");
    }
    e.header = header;
    e.bytes = packed;
    out.entries.push_back(std::move(e));
    pos += kCentralBytes + name_len + extra_len + comment_len;
  }

  // Local headers: the same name and method, and where the data starts.
  for (ZipEntry& e : out.entries) {
    const std::string shown = std::string("'").append(printable(e.name, 120)).append("'");
    auto bad_entry = [&](const std::string& why) { return fail("entry " + shown + ": " + why); };
    if (e.header > cd_offset || cd_offset - e.header < kLocalBytes) {
      throw bad_entry("its local header at " + std::to_string(e.header) +
                      " does not lie before the central directory at " +
                      std::to_string(cd_offset));
    }
    unsigned char h[kLocalBytes];
    src.read(h, kLocalBytes, e.header);
    if (le(h, 4) != kLocalSig) {
      throw bad_entry("bad local header signature " + hex32(le(h, 4)) + " at offset " +
                      std::to_string(e.header) + " (expected " + hex32(kLocalSig) + ")");
    }
    if (le(h + 8, 2) != 0) {
      throw bad_entry("its local header says method " + std::to_string(le(h + 8, 2)) +
                      " (compressed); expected 0 (stored), as the directory says");
    }
    const std::uint64_t name_len = le(h + 26, 2), extra_len = le(h + 28, 2);
    const std::uint64_t data = e.header + kLocalBytes + name_len + extra_len;
    if (data > cd_offset) {
      throw bad_entry("its local header runs into the central directory");
    }
    std::string name(name_len, '\0');
    if (name_len > 0) src.read(name.data(), name_len, e.header + kLocalBytes);
    if (name != e.name) {
      throw bad_entry("its local header names it '" + printable(name, 120) +
                      "' (the central directory and the local header must agree)");
    }
    if (e.bytes > cd_offset - data) {
      throw bad_entry("its " + std::to_string(e.bytes) + " bytes at offset " +
                      std::to_string(data) + " run past the start of the central directory at " +
                      std::to_string(cd_offset) + " (truncated or corrupt archive)");
    }
    e.offset = data;
  }

  // No two entries share bytes, and no name is listed twice.
  std::vector<std::uint32_t> by_header(out.entries.size());
  for (std::uint32_t i = 0; i < by_header.size(); ++i) by_header[i] = i;
  std::sort(by_header.begin(), by_header.end(), [&](std::uint32_t a, std::uint32_t b) {
    return out.entries[a].header < out.entries[b].header;
  });
  for (std::size_t k = 1; k < by_header.size(); ++k) {
    const ZipEntry& prev = out.entries[by_header[k - 1]];
    const ZipEntry& next = out.entries[by_header[k]];
    if (next.header < prev.offset + prev.bytes) {
      throw fail("entries '" + printable(prev.name, 120) + "' (bytes [" +
                 std::to_string(prev.header) + ", " + std::to_string(prev.offset + prev.bytes) +
                 ")) and '" + printable(next.name, 120) + "' (from " +
                 std::to_string(next.header) + ") overlap");
    }
  }
  out.by_name.resize(out.entries.size());
  for (std::uint32_t i = 0; i < out.by_name.size(); ++i) out.by_name[i] = i;
  std::sort(out.by_name.begin(), out.by_name.end(), [&](std::uint32_t a, std::uint32_t b) {
    return out.entries[a].name < out.entries[b].name;
  });
  for (std::size_t k = 1; k < out.by_name.size(); ++k) {
    if (out.entries[out.by_name[k]].name == out.entries[out.by_name[k - 1]].name) {
      throw fail("entry '" + printable(out.entries[out.by_name[k]].name, 120) +
                 "' is listed twice");
    }
  }
  // Nor twice in two cases: torch's reader finds a name whatever its case, taking the first
  // such entry, where by_name takes the exact one; two readers must not read two files.
  std::vector<std::pair<std::string, std::uint32_t>> folded(out.entries.size());
  for (std::uint32_t i = 0; i < folded.size(); ++i) {
    std::string f = out.entries[i].name;
    for (char& c : f) {
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
    }
    folded[i] = {std::move(f), i};
  }
  std::sort(folded.begin(), folded.end());
  for (std::size_t k = 1; k < folded.size(); ++k) {
    if (folded[k].first == folded[k - 1].first) {
      throw fail("entries '" + printable(out.entries[folded[k - 1].second].name, 120) +
                 "' and '" + printable(out.entries[folded[k].second].name, 120) +
                 "' differ only in case (torch's reader takes them for one name)");
    }
  }
  return out;
}

}  // namespace zeroflat::detail
