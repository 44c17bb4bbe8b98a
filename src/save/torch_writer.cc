// torch.save's file format written from bytes staged in memory (save.h): one zip archive of
// stored (uncompressed) records, each record's data at a 64-byte boundary, with the zip64 end
// records torch writes. Data first, at offsets laid out in advance, while a second thread
// computes the records' CRC-32s; then the headers and the central directory.
#include <algorithm>
#include <cerrno>
#include <optional>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

#include "common/thread_pool.h"
#include "save/save_io.h"
#include "zeroflat/save.h"

namespace zeroflat {
namespace {

using save_io::io_error;

constexpr std::uint64_t kAlign = 64;
constexpr std::uint64_t k32Max = 0xFFFFFFFFu;
constexpr std::uint64_t kPieceBytes = std::uint64_t{64} << 20;

struct Entry {
  std::string name;
  const std::byte* data = nullptr;
  std::uint64_t size = 0;
  std::uint64_t header_offset = 0;  // its local header
  std::uint64_t data_offset = 0;
  std::uint16_t pad = 0;  // bytes of the padding extra field's value
  std::uint32_t crc = 0;
  bool zip64() const { return size >= k32Max; }
  std::uint64_t local_header_bytes() const {
    return 30 + name.size() + (zip64() ? 20 : 0) + 4 + pad;
  }
};

class Bytes {
 public:
  void u16(std::uint64_t v) { le(v, 2); }
  void u32(std::uint64_t v) { le(v, 4); }
  void u64(std::uint64_t v) { le(v, 8); }
  void text(const std::string& s) { out_.append(s); }
  void fill(char c, std::size_t n) { out_.append(n, c); }
  const std::string& str() const { return out_; }

 private:
  void le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
  }
  std::string out_;
};

std::string archive_name(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::size_t dot = base.rfind('.');
  if (dot != std::string::npos) base.resize(dot);
  return base.empty() ? std::string("archive") : base;
}

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}


// 40 decimal digits that follow from the records' contents (their CRCs and sizes), so that the
// same object saved twice gives the same file, as torch's own id does.
std::string serialization_id(const std::vector<Entry>& entries) {
  std::uint64_t a = 0x243f6a8885a308d3ULL, b = 0x13198a2e03707344ULL;
  for (const Entry& e : entries) {
    a = mix(a ^ e.crc ^ (e.size << 32));
    b = mix(b + e.crc + e.size * 0x9e3779b97f4a7c15ULL);
  }
  std::string id;
  for (int i = 0; i < 20; ++i) {
    id.push_back(static_cast<char>('0' + a % 10));
    a /= 10;
  }
  for (int i = 0; i < 20; ++i) {
    id.push_back(static_cast<char>('0' + b % 10));
    b /= 10;
  }
  return id;
}

struct Layout {
  std::vector<Entry> entries;
  std::string id;  // .data/serialization_id's bytes (owned here)
  std::uint64_t central_offset = 0;
};

const std::string kFormatVersion = "1";
const std::string kAlignment = "64";
const std::string kByteOrder = "little";
const std::string kVersion = "3\n";

// need_bytes: whether every storage must have its bytes (a layout to write, not only offsets).
// direct_base (kDirectAlign-aligned): where the archive starts in its file, when its large
// records' data are to start at the same offset within a page as their bytes in memory, so
// that their whole pages go with O_DIRECT (each still at a 64-byte boundary of the archive:
// only where the memory is 64-byte aligned).
Layout make_layout(const StagedFile& file, bool need_bytes = true,
                   std::optional<std::uint64_t> direct_base = std::nullopt) {
  Layout l;
  l.id.assign(40, '0');  // its digits once the other records' CRCs are known
  const std::string prefix = archive_name(file.path) + "/";
  auto add = [&](std::string name, const void* data, std::uint64_t size) {
    Entry e;
    e.name = prefix + name;
    e.data = static_cast<const std::byte*>(data);
    e.size = size;
    l.entries.push_back(std::move(e));
  };
  add("data.pkl", file.pickle.data(), file.pickle.size());
  add(".format_version", kFormatVersion.data(), kFormatVersion.size());
  add(".storage_alignment", kAlignment.data(), kAlignment.size());
  add("byteorder", kByteOrder.data(), kByteOrder.size());
  for (const StagedStorage& s : file.storages) {
    if (s.key.empty() || s.key.find('/') != std::string::npos) {
      throw InvalidArgument("a storage's key is a plain name, got '" + printable(s.key, 80) + "'");
    }
    if (need_bytes && s.size > 0 && s.data == nullptr) throw InvalidArgument("storage '" + s.key + "' has no bytes");
    add("data/" + s.key, s.data, s.size);
  }
  add("version", kVersion.data(), kVersion.size());
  add(".data/serialization_id", nullptr, 0);
  l.entries.back().data = reinterpret_cast<const std::byte*>(l.id.data());
  l.entries.back().size = l.id.size();
  std::uint64_t at = 0;
  for (Entry& e : l.entries) {
    e.header_offset = at;
    const std::uint64_t bare = 30 + e.name.size() + (e.zip64() ? 20 : 0) + 4;
    const auto phase = reinterpret_cast<std::uintptr_t>(e.data) % kDirectAlign;
    if (direct_base && e.size >= kDirectMinBytes && phase % kAlign == 0) {
      const std::uint64_t here = (*direct_base + at + bare) % kDirectAlign;
      e.pad = static_cast<std::uint16_t>((phase + kDirectAlign - here) % kDirectAlign);
    } else {
      e.pad = static_cast<std::uint16_t>((kAlign - (at + bare) % kAlign) % kAlign);
    }
    e.data_offset = at + bare + e.pad;
    at = e.data_offset + e.size;
  }
  l.central_offset = at;
  return l;
}

std::string local_header(const Entry& e) {
  Bytes b;
  b.u32(0x04034b50);
  b.u16(e.zip64() ? 45 : 20);  // version needed
  b.u16(0x0800);               // names are UTF-8
  b.u16(0);                    // stored
  b.u16(0);                    // time
  b.u16(0x21);                 // date: 1980-01-01
  b.u32(e.crc);
  b.u32(e.zip64() ? k32Max : e.size);
  b.u32(e.zip64() ? k32Max : e.size);
  b.u16(e.name.size());
  b.u16((e.zip64() ? 20 : 0) + 4 + e.pad);
  b.text(e.name);
  if (e.zip64()) {
    b.u16(0x0001);
    b.u16(16);
    b.u64(e.size);
    b.u64(e.size);
  }
  b.u16(0x4246);  // "FB": padding to the data's alignment, as torch writes it
  b.u16(e.pad);
  b.fill('Z', e.pad);
  return b.str();
}

std::string central_directory(const Layout& l) {
  Bytes b;
  for (const Entry& e : l.entries) {
    const bool big_offset = e.header_offset >= k32Max;
    const std::uint64_t extra = (e.zip64() ? 16 : 0) + (big_offset ? 8 : 0);
    b.u32(0x02014b50);
    b.u16(45);  // made by
    b.u16(e.zip64() || big_offset ? 45 : 20);
    b.u16(0x0800);
    b.u16(0);
    b.u16(0);
    b.u16(0x21);
    b.u32(e.crc);
    b.u32(e.zip64() ? k32Max : e.size);
    b.u32(e.zip64() ? k32Max : e.size);
    b.u16(e.name.size());
    b.u16(extra ? extra + 4 : 0);
    b.u16(0);  // comment
    b.u16(0);  // disk
    b.u16(0);  // internal attributes
    b.u32(0);  // external attributes
    b.u32(big_offset ? k32Max : e.header_offset);
    b.text(e.name);
    if (extra) {
      b.u16(0x0001);
      b.u16(extra);
      if (e.zip64()) {
        b.u64(e.size);
        b.u64(e.size);
      }
      if (big_offset) b.u64(e.header_offset);
    }
  }
  const std::uint64_t central_bytes = b.str().size();
  const std::uint64_t zip64_end = l.central_offset + central_bytes;
  const std::uint64_t n = l.entries.size();
  b.u32(0x06064b50);  // zip64 end of central directory
  b.u64(44);
  b.u16(45);
  b.u16(45);
  b.u32(0);
  b.u32(0);
  b.u64(n);
  b.u64(n);
  b.u64(central_bytes);
  b.u64(l.central_offset);
  b.u32(0x07064b50);  // its locator
  b.u32(0);
  b.u64(zip64_end);
  b.u32(1);
  b.u32(0x06054b50);  // end of central directory
  b.u16(0);
  b.u16(0);
  b.u16(std::min<std::uint64_t>(n, 0xFFFF));
  b.u16(std::min<std::uint64_t>(n, 0xFFFF));
  b.u32(std::min(central_bytes, k32Max));
  b.u32(std::min(l.central_offset, k32Max));
  b.u16(0);
  return b.str();
}

}  // namespace

ShareRange share_range(std::uint64_t size, unsigned parts, unsigned k) {
  const detail::Range r = detail::split_range(size, parts, k, 4096);
  return {r.begin, r.end};
}

namespace {

// One run of a record's bytes: [begin, end) of the file from `data` on; its whole pages with
// O_DIRECT where `direct` (an fd open with it) is given and they qualify (kDirectAlign), the
// rest through `fd` with write-back started behind it. A direct write the file system refuses
// (EINVAL) closes `direct` (reset) and goes through the page cache, as does the rest of the file.
class RecordWrites {
 public:
  RecordWrites(int fd, std::optional<save_io::Fd>* direct, const std::string& path,
               std::atomic<std::uint64_t>* written)
      : fd_(fd), direct_(direct), path_(path), written_(written) {}

  void write(const std::byte* data, std::uint64_t begin, std::uint64_t end) {
    std::uint64_t a = (begin + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    std::uint64_t b = end / kDirectAlign * kDirectAlign;
    const bool direct = direct_->has_value() && b > a && b - a >= kDirectMinBytes &&
                        reinterpret_cast<std::uintptr_t>(data + (a - begin)) % kDirectAlign == 0;
    if (!direct) a = b = end;
    buffered(data, begin, a);
    if (a < b) a = direct_write(data + (a - begin), a, b);
    buffered(data + (a - begin), a, end);
  }
  std::uint64_t direct_bytes() const { return direct_bytes_; }

 private:
  void buffered(const std::byte* data, std::uint64_t begin, std::uint64_t end) {
    for (std::uint64_t off = begin; off < end; off += kPieceBytes) {
      const std::uint64_t n = std::min(kPieceBytes, end - off);
      save_io::pwrite_all(fd_, data + (off - begin), n, off, "write", path_);
      // Write-back starts now, so that the fsync after has less left to do.
      (void)::sync_file_range(fd_, static_cast<off_t>(off), static_cast<off_t>(n), SYNC_FILE_RANGE_WRITE);
      if (written_ != nullptr) written_->fetch_add(n, std::memory_order_relaxed);
    }
  }
  // Returns where the direct writes stopped (end, or the first byte the file system refused).
  std::uint64_t direct_write(const std::byte* data, std::uint64_t begin, std::uint64_t end) {
    const int fd = (*direct_)->get();
    for (std::uint64_t off = begin; off < end;) {
      const std::size_t want = static_cast<std::size_t>(std::min(kPieceBytes, end - off));
      const ssize_t got = ::pwrite(fd, data + (off - begin), want, static_cast<off_t>(off));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0 && errno == EINVAL) {  // alignment or O_DIRECT this file system will not take
        direct_->reset();
        return off;
      }
      if (got < 0) throw io_error("write", path_, errno);
      // A short direct write (the disk full) leaves the rest to the page cache, which says why.
      if (got == 0 || static_cast<std::uint64_t>(got) % kDirectAlign != 0) {
        if (got > 0) account(static_cast<std::uint64_t>(got));
        direct_->reset();
        return off + static_cast<std::uint64_t>(std::max<ssize_t>(got, 0));
      }
      account(static_cast<std::uint64_t>(got));
      off += static_cast<std::uint64_t>(got);
    }
    return end;
  }
  void account(std::uint64_t n) {
    direct_bytes_ += n;
    if (written_ != nullptr) written_->fetch_add(n, std::memory_order_relaxed);
  }

  int fd_;
  std::optional<save_io::Fd>* direct_;
  const std::string& path_;
  std::atomic<std::uint64_t>* written_;
  std::uint64_t direct_bytes_ = 0;
};

// Opens `out` on the file at `path` (already created) with O_DIRECT, or leaves it empty where
// the file system refuses O_DIRECT (or the test fault hook says "write.direct:unsupported").
void open_direct(const std::string& path, std::optional<save_io::Fd>& out) {
  if (save_io::fault_point("write.direct", path)) return;
  try {
    out.emplace(path, O_WRONLY | O_DIRECT, "write (O_DIRECT)");
  } catch (const IoError& e) {
    if (e.code() != EINVAL) throw;  // refused: through the page cache
    out.reset();
  }
}

}  // namespace

std::vector<std::uint64_t> torch_file_data_offsets(const StagedFile& file) {
  const Layout l = make_layout(file, false);
  std::vector<std::uint64_t> out;
  for (std::size_t i = 0; i < file.storages.size(); ++i) out.push_back(l.entries[i + 4].data_offset);
  return out;
}

struct TorchFileWriter::State {
  Layout layout;
  std::uint64_t direct = 0;  // of mine, written with O_DIRECT
  std::uint64_t mine = 0;  // bytes this rank wrote
  std::vector<std::size_t> shared;  // entries written in parts, in the file's order
  std::vector<std::uint64_t> part0;  // bytes of each one this rank writes (part 0)
  std::optional<save_io::Fd> fd;
};

TorchFileWriter::TorchFileWriter(const StagedFile& file) : file_(file), state_(std::make_unique<State>()) {
  state_->layout = make_layout(file);
  for (std::size_t i = 0; i < file.storages.size(); ++i) {
    const StagedStorage& s = file.storages[i];
    if (s.parts < 1) throw InvalidArgument("storage '" + s.key + "': parts must be at least 1");
    if (s.parts > 1) {
      state_->shared.push_back(i + 4);  // after data.pkl and the three small records
      state_->part0.push_back(share_range(s.size, s.parts, 0).end);
    }
  }
}

TorchFileWriter::~TorchFileWriter() = default;

std::vector<std::uint64_t> TorchFileWriter::data_offsets() const {
  std::vector<std::uint64_t> out;
  for (std::size_t i = 0; i < file_.storages.size(); ++i) out.push_back(state_->layout.entries[i + 4].data_offset);
  return out;
}

std::size_t TorchFileWriter::shared_records() const { return state_->shared.size(); }

std::uint64_t TorchFileWriter::bytes_written() const { return state_->mine; }

std::uint64_t TorchFileWriter::direct_bytes() const { return state_->direct; }

void TorchFileWriter::write_data(std::atomic<std::uint64_t>* written, std::optional<bool> direct) {
  Layout& l = state_->layout;
  // Other ranks write into this file too when it has shared records: never truncated then (the
  // file is new: a save's folder starts empty).
  state_->fd.emplace(file_.path, O_WRONLY | O_CREAT | (state_->shared.empty() ? O_TRUNC : 0), "write",
                     0644);
  const int fd = state_->fd->get();
  // How much of each entry this rank writes: all of it, or part 0 of a shared one.
  std::vector<std::uint64_t> mine(l.entries.size());
  for (std::size_t i = 0; i < l.entries.size(); ++i) mine[i] = l.entries[i].size;
  for (std::size_t j = 0; j < state_->shared.size(); ++j) mine[state_->shared[j]] = state_->part0[j];
  for (std::uint64_t n : mine) state_->mine += n;
  // The CRCs beside the writes: both read the staged bytes, neither changes them.
  std::exception_ptr crc_error;
  std::thread crcs = detail::start_thread(0, [&] {
    try {
      for (std::size_t i = 0; i + 1 < l.entries.size(); ++i) l.entries[i].crc = crc32(0, l.entries[i].data, mine[i]);
    } catch (...) {
      crc_error = std::current_exception();
    }
  });
  struct Join {
    std::thread& t;
    ~Join() {
      if (t.joinable()) t.join();
    }
  } join{crcs};
  if (!direct) direct = runtime_env().save_io == RuntimeEnv::SaveIo::kDirect;
  std::optional<save_io::Fd> direct_fd;
  if (*direct && std::any_of(mine.begin(), mine.end(), [](std::uint64_t n) { return n >= kDirectMinBytes; })) {
    open_direct(file_.path, direct_fd);
  }
  RecordWrites writes(fd, &direct_fd, file_.path, written);
  for (std::size_t i = 0; i + 1 < l.entries.size(); ++i) {
    const Entry& e = l.entries[i];
    writes.write(e.data, e.data_offset, e.data_offset + mine[i]);
  }
  state_->direct = writes.direct_bytes();
  if (direct_fd) direct_fd->close("write (O_DIRECT)", file_.path);
  crcs.join();
  if (crc_error) std::rethrow_exception(crc_error);
}

std::uint64_t TorchFileWriter::finish(const std::vector<std::vector<std::uint32_t>>& other_parts) {
  Layout& l = state_->layout;
  if (!state_->fd) throw Error("internal: finish() before write_data()");
  const int fd = state_->fd->get();
  for (std::size_t j = 0; j < state_->shared.size(); ++j) {
    Entry& e = l.entries[state_->shared[j]];
    const StagedStorage& s = file_.storages[state_->shared[j] - 4];
    if (other_parts.size() < s.parts - 1) {
      throw Error("internal: the CRCs of " + std::to_string(s.parts - 1) + " ranks' parts expected");
    }
    for (unsigned k = 1; k < s.parts; ++k) {
      const std::vector<std::uint32_t>& crcs = other_parts[k - 1];
      if (crcs.size() != state_->shared.size()) {
        throw Error("rank " + std::to_string(k) + " reported " + std::to_string(crcs.size()) +
                    " parts' CRCs, not " + std::to_string(state_->shared.size()));
      }
      const ShareRange part = share_range(s.size, s.parts, k);
      e.crc = crc32_combine(e.crc, crcs[j], part.end - part.begin);
    }
  }
  Entry& id = l.entries.back();  // .data/serialization_id, last
  l.id = serialization_id(l.entries);
  id.crc = crc32(0, l.id.data(), l.id.size());
  save_io::pwrite_all(fd, l.id.data(), l.id.size(), id.data_offset, "write", file_.path);
  for (const Entry& e : l.entries) {
    const std::string h = local_header(e);
    if (h.size() != e.local_header_bytes()) throw Error("internal: a zip header's size changed");
    save_io::pwrite_all(fd, h.data(), h.size(), e.header_offset, "write", file_.path);
  }
  const std::string tail = central_directory(l);
  save_io::pwrite_all(fd, tail.data(), tail.size(), l.central_offset, "write", file_.path);
  state_->fd->close("write", file_.path);
  state_->fd.reset();
  std::uint64_t headers = tail.size();
  for (const Entry& e : l.entries) headers += e.local_header_bytes();
  state_->mine += headers;
  return l.central_offset + tail.size();
}

std::uint32_t write_shared_part(const SharedPart& part, std::atomic<std::uint64_t>* written) {
  save_io::Fd fd(part.path, O_WRONLY | O_CREAT, "write (a shared part)", 0644);
  std::uint32_t crc = 0;
  for (std::uint64_t off = 0; off < part.size; off += kPieceBytes) {
    const std::uint64_t n = std::min(kPieceBytes, part.size - off);
    crc = crc32(crc, part.data + off, n);
    save_io::pwrite_all(fd.get(), part.data + off, n, part.offset + off, "write (a shared part)", part.path);
    if (written != nullptr) written->fetch_add(n, std::memory_order_relaxed);
  }
  if (::fsync(fd.get()) != 0) throw save_io::io_error("write (a shared part: fsync)", part.path, errno);
  fd.close("write (a shared part)", part.path);
  return crc;
}

namespace {

// Records at most this big travel in the buffer of the headers around them (one write for a
// small archive); bigger ones are written from where they are.
constexpr std::uint64_t kInlineBytes = std::uint64_t{64} << 10;
// Write-back is started behind every this many bytes written.
constexpr std::uint64_t kWriteBackBytes = std::uint64_t{8} << 20;

class AppendingFile {
 public:
  // direct: the large runs' whole pages written with O_DIRECT where the file system takes it.
  AppendingFile(const std::string& path, std::atomic<std::uint64_t>* written, bool direct)
      : path_(path), fd_(path, O_WRONLY | O_CREAT | O_TRUNC, "write", 0644), written_(written) {
    if (direct) open_direct(path_, direct_);
  }

  std::uint64_t at() const { return at_ + buf_.size(); }
  bool direct() const { return direct_.has_value(); }
  void add(const void* data, std::uint64_t n) {
    if (n <= kInlineBytes) {
      buf_.append(static_cast<const char*>(data), n);
      if (buf_.size() >= kPieceBytes) flush();
      return;
    }
    flush();
    const auto* p = static_cast<const std::byte*>(data);
    if (direct_) {
      RecordWrites writes(fd_.get(), &direct_, path_, written_);
      writes.write(p, at_, at_ + n);
      at_ += n;
      return;
    }
    for (std::uint64_t off = 0; off < n; off += kPieceBytes) put(p + off, std::min(kPieceBytes, n - off));
  }
  void add(const std::string& s) { add(s.data(), s.size()); }
  // Zeros up to the next multiple of `align` (a gap between two items).
  void pad_to(std::uint64_t align) { buf_.append((align - at() % align) % align, '\0'); }
  void flush() {
    const std::string b = std::move(buf_);
    buf_.clear();
    if (!b.empty()) put(b.data(), b.size());
  }
  void finish(bool sync) {
    flush();
    if (direct_) direct_->close("write (O_DIRECT)", path_);
    if (sync && ::fsync(fd_.get()) != 0) throw io_error("write (fsync)", path_, errno);
    fd_.close("write", path_);
  }

 private:
  void put(const void* data, std::uint64_t n) {
    save_io::pwrite_all(fd_.get(), data, n, at_, "write", path_);
    at_ += n;
    unsynced_ += n;
    if (unsynced_ >= kWriteBackBytes) {
      (void)::sync_file_range(fd_.get(), static_cast<off_t>(at_ - unsynced_), static_cast<off_t>(unsynced_),
                              SYNC_FILE_RANGE_WRITE);
      unsynced_ = 0;
    }
    if (written_ != nullptr) written_->fetch_add(n, std::memory_order_relaxed);
  }

  std::string path_;
  save_io::Fd fd_;
  std::optional<save_io::Fd> direct_;
  std::atomic<std::uint64_t>* written_;
  std::uint64_t at_ = 0;
  std::uint64_t unsynced_ = 0;
  std::string buf_;
};

std::uint32_t storage_crc(const StagedStorage& st) {
  return st.size > 0 && st.data != nullptr ? crc32(0, st.data, st.size) : 0;
}

bool has_large_storage(const StagedFile& file) {
  return std::any_of(file.storages.begin(), file.storages.end(),
                     [](const StagedStorage& st) { return st.size >= kDirectMinBytes; });
}

// The CRC-32s of every archive's storages, computed by a thread of their own ahead of the
// writes (the writer waits only where it catches up with it).
class StorageCrcs {
 public:
  StorageCrcs(const std::vector<AppendedItem>& items, WritePriority priority)
      : crcs_(items.size()) {
    thread_ = detail::start_thread(0, [this, &items, priority] {
      if (priority != WritePriority::kNormal) set_thread_write_priority(priority);
      try {
        for (std::size_t i = 0; i < items.size(); ++i) {
          if (items[i].archive != nullptr) {
            for (const StagedStorage& st : items[i].archive->storages) {
              if (stop_.load(std::memory_order_relaxed)) return;
              crcs_[i].push_back(storage_crc(st));
            }
          }
          const std::lock_guard<std::mutex> lock(mutex_);
          done_ = i + 1;
          ready_.notify_all();
        }
      } catch (...) {
        const std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
        done_ = crcs_.size();
        ready_.notify_all();
      }
    });
  }
  ~StorageCrcs() {
    stop_.store(true, std::memory_order_relaxed);
    if (thread_.joinable()) thread_.join();
  }
  // Item i's storages' CRCs, once computed.
  const std::vector<std::uint32_t>& of(std::size_t i) {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return done_ > i; });
    if (error_) std::rethrow_exception(error_);
    return crcs_[i];
  }

 private:
  std::vector<std::vector<std::uint32_t>> crcs_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::size_t done_ = 0;
  std::exception_ptr error_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// One archive at the file's end, its offsets counted from its own start (as torch.save writes
// into a stream), its storages' CRCs given. Returns its size.
std::uint64_t append_archive(AppendingFile& out, const StagedFile& file,
                             const std::vector<std::uint32_t>& storage_crcs) {
  const std::uint64_t base = out.at();
  Layout l = make_layout(file, true, out.direct() && base % kDirectAlign == 0
                                         ? std::optional<std::uint64_t>(base) : std::nullopt);
  for (std::size_t i = 0; i + 1 < l.entries.size(); ++i) {
    const bool storage = i >= 4 && i - 4 < file.storages.size();
    const Entry& e = l.entries[i];
    l.entries[i].crc = storage ? storage_crcs.at(i - 4) : crc32(0, e.data, e.size);
  }
  l.id = serialization_id(l.entries);
  Entry& id = l.entries.back();
  id.data = reinterpret_cast<const std::byte*>(l.id.data());
  id.crc = crc32(0, l.id.data(), l.id.size());
  for (const Entry& e : l.entries) {
    if (out.at() != base + e.header_offset) throw Error("internal: an archive's layout and its writes disagree");
    out.add(local_header(e));
    out.add(e.data, e.size);
  }
  out.add(central_directory(l));
  return out.at() - base;
}

std::vector<ItemSpan> append_items(const std::string& path, const std::vector<AppendedItem>& items, bool sync,
                                   WritePriority priority, std::atomic<std::uint64_t>* written) {
  const bool large = std::any_of(items.begin(), items.end(), [](const AppendedItem& item) {
    return item.archive != nullptr && has_large_storage(*item.archive);
  });
  AppendingFile out(path, written, large && runtime_env().save_io == RuntimeEnv::SaveIo::kDirect);
  std::optional<StorageCrcs> crcs;
  if (large) crcs.emplace(items, priority);
  std::vector<ItemSpan> spans;
  spans.reserve(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) {
    const AppendedItem& item = items[i];
    // An archive with a large storage starts at a page (a gap of zeros before it, which no
    // item's span covers), so that its storage's pages can go with O_DIRECT.
    if (item.archive != nullptr && out.direct() && has_large_storage(*item.archive)) {
      out.pad_to(kDirectAlign);
    }
    const std::uint64_t begin = out.at();
    if (item.archive) {
      std::vector<std::uint32_t> own;
      if (!crcs) {
        for (const StagedStorage& st : item.archive->storages) {
          own.push_back(storage_crc(st));
        }
      }
      append_archive(out, *item.archive, crcs ? crcs->of(i) : own);
    } else {
      if (item.size > 0 && item.data == nullptr) throw InvalidArgument("an appended item has no bytes");
      out.add(item.data, item.size);
    }
    spans.push_back({begin, out.at() - begin});
  }
  out.finish(sync);
  return spans;
}

}  // namespace

std::vector<ItemSpan> write_appended(const std::string& path, const std::vector<AppendedItem>& items, bool sync,
                                     WritePriority priority, std::atomic<std::uint64_t>* written) {
  if (priority == WritePriority::kNormal) return append_items(path, items, sync, priority, written);
  std::vector<ItemSpan> spans;
  std::exception_ptr error;
  std::thread writer = detail::start_thread(0, [&] {
    set_thread_write_priority(priority);
    try {
      spans = append_items(path, items, sync, priority, written);
    } catch (...) {
      error = std::current_exception();
    }
  });
  writer.join();
  if (error) std::rethrow_exception(error);
  return spans;
}

std::uint64_t write_torch_file(const StagedFile& file, std::atomic<std::uint64_t>* written) {
  TorchFileWriter w(file);
  if (w.shared_records() != 0) throw InvalidArgument("write_torch_file: a file with shared records needs TorchFileWriter");
  w.write_data(written);
  return w.finish({});
}

}  // namespace zeroflat
