// safetensors headers: 8 bytes of little-endian length n, then n bytes of JSON, then the data.
#include <fcntl.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "model/files.h"
#include "model/strict_json.h"
#include "zeroflat/checkpoint.h"
#include "zeroflat/common.h"

namespace zeroflat {
namespace {

// A safetensors file's first 8 bytes: its JSON header's length, little-endian.
std::uint64_t header_length(const unsigned char* head) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | head[i];
  return n;
}

bool get_u64(const nlohmann::json& v, std::uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<std::uint64_t>();
    return true;
  }
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) {
    *out = static_cast<std::uint64_t>(v.get<std::int64_t>());
    return true;
  }
  return false;
}

// What the first bytes of a file that is not a safetensors file look like, for the message: a
// text file (JSON above all: an index or config.json given where a checkpoint was expected) or
// binary bytes.
std::string looks_like(std::span<const unsigned char> head) {
  const std::size_t n = std::min<std::size_t>(head.size(), 8);
  bool text = n > 0;
  std::string shown;
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char c = head[i];
    if (c == '\n' || c == '\r' || c == '\t') {
      shown += ' ';
    } else if (c >= 0x20 && c < 0x7f) {
      shown += static_cast<char>(c);
    } else {
      text = false;
    }
  }
  if (!text) return "";
  const std::size_t first = shown.find_first_not_of(' ');
  const bool json = first != std::string::npos && (shown[first] == '{' || shown[first] == '[');
  return std::string(" (it starts with the text '") + shown + "'" +
         (json ? ": a JSON file, such as an index or a config.json?)" : ": a text file?)");
}

}  // namespace

std::uint64_t safetensors_dtype_size(std::string_view dtype) noexcept {
  struct Entry {
    const char* name;
    std::uint64_t size;
  };
  static constexpr Entry kTypes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"I64", 8}, {"U64", 8}, {"F64", 8},
  };
  for (const Entry& e : kTypes) {
    if (dtype == e.name) return e.size;
  }
  return 0;
}

SafetensorsHeader parse_safetensors_header(std::span<const unsigned char> head,
                                           std::uint64_t file_size, const std::string& source) {
  auto fail = [&](const std::string& why) { return InvalidArgument(source + ": " + why); };
  if (file_size < 8 || head.size() < 8) {
    throw fail("too short for a safetensors file (" + std::to_string(file_size) +
               " bytes; the header length alone takes 8)");
  }
  const std::uint64_t n = header_length(head.data());
  // A file of another kind fails here, on a length that is its first 8 bytes read as a number:
  // say what a safetensors file holds there, and what this one seems to be.
  if (n > kMaxHeaderBytes) {
    throw fail("not a safetensors file: it must start with the length of its JSON header, 8 "
               "little-endian bytes of at most " + format_count(kMaxHeaderBytes) +
               " (the format's limit), but its first 8 bytes read as " + format_count(n) +
               looks_like(head));
  }
  if (n > file_size - 8) {
    throw fail("header length " + std::to_string(n) + " runs past the end of the " +
               std::to_string(file_size) +
               "-byte file: a truncated safetensors file, or not one" + looks_like(head));
  }
  if (n < 2) throw fail("header length " + std::to_string(n) + " is too short for JSON");
  if (head.size() < 8 + n) throw fail("header is truncated");
  std::string_view text(reinterpret_cast<const char*>(head.data() + 8), n);
  if (text.find('\0') != std::string_view::npos) throw fail("header holds a NUL byte");
  if (text.front() != '{') {
    throw fail("not a safetensors file: its header must be a JSON object ('{' first), but "
               "starts with '" + printable(text.substr(0, 8)) + "'");
  }
  nlohmann::json doc = detail::parse_strict_json(text, source + " header", 8);
  if (!doc.is_object()) throw fail("header is not a JSON object");

  SafetensorsHeader h;
  h.header_bytes = n;
  h.data_bytes = file_size - 8 - n;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) throw fail("__metadata__ is not an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          throw fail("__metadata__ entry '" + printable(m.key()) + "' is not a string");
        }
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& why) {
      return fail("tensor '" + printable(name) + "': " + why);
    };
    if (name.empty()) throw fail("a tensor has an empty name");
    if (!v.is_object()) throw bad("entry is not an object");
    for (auto f = v.begin(); f != v.end(); ++f) {
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets") {
        throw bad("unknown field '" + printable(f.key()) + "'");
      }
    }
    SafetensorsTensor t;
    t.name = name;
    if (!v.contains("dtype") || !v["dtype"].is_string()) throw bad("dtype missing or not a string");
    t.dtype = v["dtype"].get<std::string>();
    const std::uint64_t esize = safetensors_dtype_size(t.dtype);
    if (esize == 0) throw bad("unknown dtype '" + printable(t.dtype) + "'");
    if (!v.contains("shape") || !v["shape"].is_array()) throw bad("shape missing or not a list");
    if (v["shape"].size() > 16) throw bad("shape has more than 16 dimensions");
    for (const nlohmann::json& d : v["shape"]) {
      std::uint64_t dim = 0;
      if (!get_u64(d, &dim) || dim > (std::uint64_t{1} << 62)) {
        throw bad("shape " + v["shape"].dump().substr(0, 80) +
                  " holds something other than a non-negative integer");
      }
      t.shape.push_back(static_cast<std::int64_t>(dim));
    }
    try {
      t.numel = shape_numel(t.shape);
    } catch (const InvalidArgument&) {
      throw bad("shape " + shape_to_string(t.shape) + " has more elements than fit in 64 bits");
    }
    std::uint64_t bytes = 0;
    if (__builtin_mul_overflow(t.numel, esize, &bytes)) {
      throw bad("shape " + shape_to_string(t.shape) + " has more bytes than fit in 64 bits");
    }
    const nlohmann::json& off = v.contains("data_offsets") ? v["data_offsets"] : nlohmann::json();
    if (!off.is_array() || off.size() != 2 || !get_u64(off[0], &t.begin) ||
        !get_u64(off[1], &t.end)) {
      throw bad("data_offsets must be [begin, end], two non-negative integers");
    }
    if (t.begin > t.end) {
      throw bad("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                "] end before they begin");
    }
    if (t.end - t.begin != bytes) {
      throw bad("data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                "] hold " + std::to_string(t.end - t.begin) + " bytes, but " + t.dtype + " " +
                shape_to_string(t.shape) + " needs " + std::to_string(bytes));
    }
    if (t.end > h.data_bytes) {
      throw bad("data_offsets end at " + std::to_string(t.end) + ", past the " +
                std::to_string(h.data_bytes) + " bytes of data the file holds (truncated?)");
    }
    h.tensors.push_back(std::move(t));
  }
  // Tensors tile the data section: sorted by offset, no overlap, no gap.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t cursor = 0;
  for (const SafetensorsTensor& t : h.tensors) {
    if (t.begin < cursor) {
      throw fail("tensor '" + printable(t.name) +
                 "' overlaps the tensor before it (data_offsets [" + std::to_string(t.begin) +
                 ", " + std::to_string(t.end) + "], previous ends at " + std::to_string(cursor) +
                 ")");
    }
    if (t.begin > cursor) {
      throw fail("bytes [" + std::to_string(cursor) + ", " + std::to_string(t.begin) +
                 ") of the data belong to no tensor (before '" + printable(t.name) + "')");
    }
    cursor = t.end;
  }
  if (cursor != h.data_bytes) {
    throw fail("the data section has " + std::to_string(h.data_bytes) + " bytes, the tensors " +
               std::to_string(cursor));
  }
  return h;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  const detail::File file(path);  // regular files only: a FIFO would block or never end
  const std::uint64_t file_size = file.size();
  // The kernel's read-ahead would read the first megabytes of tensors with the header, which
  // under ZeRO are mostly another rank's (ZEROFLAT_READ_AHEAD, common.h).
  if (runtime_env().read_ahead == RuntimeEnv::ReadAhead::kExact) {
    (void)posix_fadvise(file.fd(), 0, 0, POSIX_FADV_RANDOM);
  }
  std::vector<unsigned char> head(std::min<std::uint64_t>(file_size, 8));
  file.read_at(head.data(), head.size(), 0);
  if (head.size() == 8) {
    const std::uint64_t n = header_length(head.data());
    // Read the JSON only when its length is plausible; the parser reports the rest.
    if (n <= kMaxHeaderBytes && n <= file_size - 8) {
      head.resize(8 + n);
      file.read_at(head.data() + 8, n, 8);
    }
  }
  SafetensorsHeader out = parse_safetensors_header(head, file_size, path);
  out.stamp = file.stamp();
  return out;
}

bool is_safetensors_file(const std::string& path) noexcept {
  try {
    const detail::File file(path);
    unsigned char head[9] = {};
    if (file.size() < sizeof head) return false;
    file.read_at(head, sizeof head, 0);
    const std::uint64_t n = header_length(head);
    return head[8] == '{' && n >= 2 && n <= kMaxHeaderBytes && n <= file.size() - 8;
  } catch (...) {
    return false;
  }
}

}  // namespace zeroflat
