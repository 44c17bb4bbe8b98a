// The background save (save.h): CRC-32, torch.save's zip archive written from staged bytes, and
// the two-rank write-then-publish through the file system, faults included.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "model/zip.h"
#include "zeroflat/save.h"

namespace zeroflat {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string temp_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "save_writer_" + std::to_string(getpid()) + "_" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// CRC-32 bit by bit, the definition the table method must equal.
std::uint32_t crc_by_bits(const std::string& s) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
  }
  return ~c;
}

TEST(Crc32, EqualsTheBitwiseDefinitionAndCombinesAtAnySplit) {
  EXPECT_EQ(crc32(0, "123456789", 9), 0xCBF43926u);  // the check value of CRC-32/ISO-HDLC
  EXPECT_EQ(crc32(0, "", 0), 0u);
  std::mt19937 gen(7);
  for (int round = 0; round < 50; ++round) {
    std::string s(gen() % 3000, '\0');
    for (char& c : s) c = static_cast<char>(gen());
    const std::size_t offset = gen() % 8;  // unaligned starts
    const std::string t = s.substr(std::min(offset, s.size()));
    const std::uint32_t whole = crc32(0, t.data(), t.size());
    ASSERT_EQ(whole, crc_by_bits(t));
    const std::size_t cut = t.empty() ? 0 : gen() % (t.size() + 1);
    const std::uint32_t a = crc32(0, t.data(), cut), b = crc32(0, t.data() + cut, t.size() - cut);
    EXPECT_EQ(crc32_combine(a, b, t.size() - cut), whole) << t.size() << " cut at " << cut;
    EXPECT_EQ(crc32(a, t.data() + cut, t.size() - cut), whole);
  }
}

StagedFile sample_file(const std::string& path, const std::vector<std::string>& storages) {
  StagedFile f;
  f.path = path;
  f.pickle = "not parsed by the writer";
  for (std::size_t i = 0; i < storages.size(); ++i) {
    f.storages.push_back({std::to_string(i), reinterpret_cast<const std::byte*>(storages[i].data()),
                          storages[i].size()});
  }
  return f;
}

TEST(TorchWriter, TheArchiveHoldsTorchsRecordsAlignedWithTheirCrcs) {
  const std::string dir = temp_dir("archive");
  std::vector<std::string> storages = {std::string(100000, 'a'), "", "xyz", std::string(70, 'q')};
  std::mt19937 gen(3);
  for (char& c : storages[0]) c = static_cast<char>(gen());
  const StagedFile f = sample_file(dir + "/model_states.pt", storages);
  std::atomic<std::uint64_t> written{0};
  const std::uint64_t size = write_torch_file(f, &written);
  EXPECT_EQ(size, fs::file_size(f.path));
  EXPECT_EQ(written.load(), f.pickle.size() + 100000 + 3 + 70 + 1 + 2 + 6 + 2);
  const std::string bytes = slurp(f.path);
  const detail::FileSource source(f.path);
  const detail::ZipArchive zip = detail::read_zip(source);
  std::vector<std::string> names;
  for (const detail::ZipEntry& e : zip.entries) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{
                       "model_states/data.pkl", "model_states/.format_version",
                       "model_states/.storage_alignment", "model_states/byteorder",
                       "model_states/data/0", "model_states/data/1", "model_states/data/2",
                       "model_states/data/3", "model_states/version",
                       "model_states/.data/serialization_id"}));
  // The central directory's CRC of each entry, by name.
  auto u16 = [&](std::size_t at) {
    return static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at])) |
           (static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[at + 1])) << 8);
  };
  std::map<std::string, std::uint32_t> crcs;
  const detail::ZipEntry& last = zip.entries.back();
  for (std::size_t at = last.offset + last.bytes; bytes.compare(at, 4, "PK\x01\x02") == 0;) {
    const std::size_t name_len = u16(at + 28), extra = u16(at + 30), comment = u16(at + 32);
    crcs[bytes.substr(at + 46, name_len)] = u16(at + 16) | (u16(at + 18) << 16);
    at += 46 + name_len + extra + comment;
  }
  ASSERT_EQ(crcs.size(), zip.entries.size());
  for (const detail::ZipEntry& e : zip.entries) {
    EXPECT_EQ(e.offset % 64, 0u) << e.name;
    const std::string data = bytes.substr(e.offset, e.bytes);
    EXPECT_EQ(crcs[e.name], crc_by_bits(data)) << e.name;
    if (e.name.starts_with("model_states/data/")) {
      EXPECT_EQ(data, storages[std::stoul(e.name.substr(18))]) << e.name;
    }
  }
  EXPECT_EQ(bytes.substr(zip.find("model_states/byteorder")->offset, 6), "little");
  // The same object saved twice: the same bytes (the serialization id follows the contents).
  const std::string again = dir + "/again/model_states.pt";
  fs::create_directories(dir + "/again");
  StagedFile g = f;
  g.path = again;
  write_torch_file(g);
  EXPECT_EQ(slurp(again), bytes);
  storages[2] = "xyw";
  write_torch_file(sample_file(again, storages));
  EXPECT_NE(slurp(again), bytes);
  fs::remove_all(dir);
}

// Whether the file system under `dir` takes O_DIRECT writes of whole aligned pages.
bool takes_direct_writes(const std::string& dir) {
  const std::string path = dir + "/probe";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) return false;
  void* page = std::aligned_alloc(kDirectAlign, kDirectAlign);
  std::memset(page, 0, kDirectAlign);
  const bool ok = ::pwrite(fd, page, kDirectAlign, 0) == static_cast<ssize_t>(kDirectAlign);
  std::free(page);
  ::close(fd);
  fs::remove(path);
  return ok;
}

TEST(TorchWriter, LargeRecordsStagedAtTheirPlaceInAPageAreWrittenDirectAndTheBytesAreTheSame) {
  const std::string dir = temp_dir("direct");
  // Two large records staged at their data's place within a page of the file, one staged a
  // byte off it (written through the page cache), and small ones around them.
  const std::vector<std::uint64_t> sizes = {100, (5u << 20) + 123, 7, (3u << 20) + 4096 * 3, (2u << 20) + 1};
  const std::vector<bool> at_phase = {false, true, false, true, false};
  StagedFile f;
  f.path = dir + "/optim_states.pt";
  f.pickle = std::string(333, 'p');
  for (std::size_t i = 0; i < sizes.size(); ++i) f.storages.push_back({std::to_string(i), nullptr, sizes[i]});
  const std::vector<std::uint64_t> offsets = torch_file_data_offsets(f);
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> buffers;
  std::mt19937 gen(11);
  std::uint64_t expect_direct = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::uint64_t phase = (offsets[i] % kDirectAlign + (at_phase[i] ? 0 : 64)) % kDirectAlign;
    // aligned_alloc's size: a whole number of its alignment.
    const std::uint64_t room = (sizes[i] + 2 * kDirectAlign) / kDirectAlign * kDirectAlign;
    buffers.emplace_back(static_cast<std::byte*>(std::aligned_alloc(kDirectAlign, room)), &std::free);
    std::byte* p = buffers.back().get() + phase;
    for (std::uint64_t k = 0; k < sizes[i]; ++k) p[k] = static_cast<std::byte>(gen());
    f.storages[i].data = p;
    const std::uint64_t a = (offsets[i] + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    const std::uint64_t b = (offsets[i] + sizes[i]) / kDirectAlign * kDirectAlign;
    if (at_phase[i] && b - a >= kDirectMinBytes) expect_direct += b - a;
  }
  ASSERT_GT(expect_direct, 4u << 20);
  const bool direct_here = takes_direct_writes(dir);
  TorchFileWriter direct(f);
  std::atomic<std::uint64_t> written{0};
  direct.write_data(&written, true);
  direct.finish({});
  EXPECT_EQ(direct.direct_bytes(), direct_here ? expect_direct : 0u) << (direct_here ? "" : "(no O_DIRECT here)");
  const std::uint64_t data = f.pickle.size() + 1 + 2 + 6 + 2;  // the serialization id: in finish()
  EXPECT_EQ(written.load(), data + std::accumulate(sizes.begin(), sizes.end(), std::uint64_t{0}));
  const std::string bytes = slurp(f.path);
  // The same file through the page cache alone: the same bytes.
  StagedFile g = f;
  g.path = dir + "/buffered/optim_states.pt";
  fs::create_directories(dir + "/buffered");
  TorchFileWriter buffered(g);
  buffered.write_data(nullptr, false);
  buffered.finish({});
  EXPECT_EQ(buffered.direct_bytes(), 0u);
  EXPECT_EQ(slurp(g.path), bytes);
  // A file system that refuses O_DIRECT (the fault hook says so): the same bytes again.
  set_save_fault_for_testing("write.direct:unsupported");
  g.path = dir + "/refused/optim_states.pt";
  fs::create_directories(dir + "/refused");
  TorchFileWriter refused(g);
  refused.write_data(nullptr, true);
  refused.finish({});
  set_save_fault_for_testing(std::nullopt);
  EXPECT_EQ(refused.direct_bytes(), 0u);
  EXPECT_EQ(slurp(g.path), bytes);
  // And each record's bytes are the staged ones.
  const detail::FileSource source(f.path);
  const detail::ZipArchive zip = detail::read_zip(source);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const detail::ZipEntry* e = zip.find("optim_states/data/" + std::to_string(i));
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->offset, offsets[i]);
    EXPECT_EQ(bytes.compare(e->offset, sizes[i], reinterpret_cast<const char*>(f.storages[i].data), sizes[i]), 0) << i;
  }
  fs::remove_all(dir);
}

TEST(TorchWriter, AppendedArchivesAreTheArchivesWrittenAloneEachAtItsSpan) {
  // As DCP's writer appends a rank's items to one file: each archive's slice is byte for byte
  // the archive write_torch_file writes alone (its offsets its own), raw items their bytes, the
  // items in a row, whichever of the buffered and the direct paths a record takes.
  const std::string dir = temp_dir("appended");
  std::mt19937 gen(11);
  std::vector<std::string> big(1, std::string(300000, '\0'));  // past the buffered size
  for (char& c : big[0]) c = static_cast<char>(gen());
  const std::vector<std::string> small = {"abc", std::string(5000, 'z')};
  const std::vector<std::string> none = {};
  const StagedFile a = sample_file("archive", small), b = sample_file("archive", big),
                   c = sample_file("archive", none);
  const std::string raw = "raw bytes between archives";
  std::vector<AppendedItem> items(5);
  items[0].archive = &a;
  items[1].data = reinterpret_cast<const std::byte*>(raw.data());
  items[1].size = raw.size();
  items[2].archive = &b;
  items[3].archive = &c;
  items[4].archive = &a;
  for (WritePriority low : {WritePriority::kNormal, WritePriority::kIdle, WritePriority::kLow}) {
    std::atomic<std::uint64_t> written{0};
    const std::string path = dir + "/__0_0.distcp";
    const std::vector<ItemSpan> spans = write_appended(path, items, true, low, &written);
    const std::string bytes = slurp(path);
    ASSERT_EQ(spans.size(), items.size());
    EXPECT_EQ(written.load(), bytes.size());
    EXPECT_EQ(spans.front().offset, 0u);
    EXPECT_EQ(spans.back().offset + spans.back().length, bytes.size());
    for (std::size_t i = 0; i + 1 < spans.size(); ++i) {
      EXPECT_EQ(spans[i].offset + spans[i].length, spans[i + 1].offset);
    }
    EXPECT_EQ(bytes.substr(spans[1].offset, spans[1].length), raw);
    for (std::size_t i : {0, 2, 3, 4}) {
      StagedFile alone = *items[i].archive;
      alone.path = dir + "/archive";
      write_torch_file(alone);
      EXPECT_EQ(bytes.substr(spans[i].offset, spans[i].length), slurp(alone.path)) << "item " << i;
      const std::string piece = bytes.substr(spans[i].offset, spans[i].length);
      const detail::MemorySource source(
          std::span<const unsigned char>(reinterpret_cast<const unsigned char*>(piece.data()), piece.size()), "item");
      const detail::ZipArchive zip = detail::read_zip(source);
      ASSERT_NE(zip.find("archive/data.pkl"), nullptr) << "item " << i;
    }
  }
  EXPECT_THROW(write_appended(dir + "/missing/x.distcp", items, false), IoError);
  EXPECT_THROW(write_appended(dir + "/missing/x.distcp", items, false, WritePriority::kIdle), IoError);
  EXPECT_EQ(parse_write_priority("idle"), WritePriority::kIdle);
  EXPECT_EQ(parse_write_priority("normal"), WritePriority::kNormal);
  EXPECT_THROW(parse_write_priority("high"), InvalidArgument);
  fs::remove_all(dir);
}

TEST(TorchWriter, AppendedLargeRecordsStartAtTheirMemorysPlaceInAPageAndLoadBack) {
  // A record of 1 MiB and more: its archive starts at a page (zeros before it, outside every
  // span) and its data at the same offset within a page as its bytes in memory (64-byte aligned
  // within the archive), so that its whole pages go with O_DIRECT; memory that is not 64-byte
  // aligned keeps torch's layout. Every archive reads back with its records' bytes and CRCs.
  const std::string dir = temp_dir("appended_large");
  const std::size_t n = (3 << 20) + 100;
  const std::size_t region_bytes = (4 * n + 3 * 4096 + 4095) / 4096 * 4096;  // whole pages
  auto* region = static_cast<unsigned char*>(std::aligned_alloc(4096, region_bytes));
  std::mt19937 gen(12);
  for (std::size_t i = 0; i < region_bytes; ++i) region[i] = static_cast<unsigned char>(gen());
  const auto up = [](std::size_t x) { return (x + 4095) / 4096 * 4096; };
  const std::size_t starts[] = {0, up(n) + 640, up(2 * up(n) + 640 + n) + 8};  // page, 64, odd
  std::vector<StagedFile> files(3);
  for (std::size_t k = 0; k < 3; ++k) {
    files[k].path = "archive";
    files[k].pickle = std::string(37 + k * 11, 'p');
    files[k].storages.push_back({"0", reinterpret_cast<const std::byte*>(region + starts[k]), n});
    files[k].storages.push_back({"1", reinterpret_cast<const std::byte*>(region), 5});
  }
  const std::string raw = "an odd number of raw bytes";
  std::vector<AppendedItem> items(4);
  items[0].data = reinterpret_cast<const std::byte*>(raw.data());
  items[0].size = raw.size();
  for (std::size_t k = 0; k < 3; ++k) items[k + 1].archive = &files[k];
  const bool direct = runtime_env().save_io == RuntimeEnv::SaveIo::kDirect;  // the default
  for (WritePriority priority : {WritePriority::kIdle, WritePriority::kNormal}) {
    const std::string io = direct ? "direct" : "buffered";
    const std::string path = dir + "/__0_0.distcp";
    std::atomic<std::uint64_t> written{0};
    const std::vector<ItemSpan> spans = write_appended(path, items, true, priority, &written);
    const std::string bytes = slurp(path);
    EXPECT_EQ(written.load(), bytes.size()) << io;
    EXPECT_EQ(bytes.substr(spans[0].offset, spans[0].length), raw);
    for (std::size_t k = 0; k < 3; ++k) {
      const ItemSpan& span = spans[k + 1];
      const std::uint64_t before = spans[k].offset + spans[k].length;
      ASSERT_LE(before, span.offset);
      EXPECT_EQ(bytes.find_first_not_of('\0', before), before < span.offset ? span.offset : before);
      const std::string piece = bytes.substr(span.offset, span.length);
      const auto* first = reinterpret_cast<const unsigned char*>(piece.data());
      const detail::MemorySource source(std::span<const unsigned char>(first, piece.size()),
                                        "item");
      const detail::ZipArchive zip = detail::read_zip(source);
      const detail::ZipEntry* e = zip.find("archive/data/0");
      ASSERT_NE(e, nullptr) << io << " item " << k;
      EXPECT_EQ(e->offset % 64, 0u);
      const auto* want = reinterpret_cast<const char*>(files[k].storages[0].data);
      EXPECT_EQ(piece.compare(e->offset, n, want, n), 0);
      std::uint32_t crc = 0;  // the local header's
      std::memcpy(&crc, piece.data() + e->header + 14, 4);
      EXPECT_EQ(crc, crc32(0, files[k].storages[0].data, n));
      if (direct && k < 2) {
        EXPECT_EQ(span.offset % 4096, 0u) << "item " << k;
        EXPECT_EQ((span.offset + e->offset) % 4096, starts[k] % 4096) << "item " << k;
      }
    }
  }
  std::free(region);
  fs::remove_all(dir);
}

TEST(WritePriority, EachSettingPutsTheCallingThreadWhereItSays) {
  // Each on a thread of its own (a thread cannot raise its nice again without privileges).
  auto on_thread = [](WritePriority p) {
    int policy = -1, nice = -100;
    std::thread t([&] {
      set_thread_write_priority(p);
      policy = sched_getscheduler(0);
      errno = 0;
      nice = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
    });
    t.join();
    return std::pair<int, int>(policy, nice);
  };
  const int base = getpriority(PRIO_PROCESS, 0);
  EXPECT_EQ(on_thread(WritePriority::kIdle).first, SCHED_IDLE);
  EXPECT_EQ(on_thread(WritePriority::kLow), std::make_pair(SCHED_OTHER, std::min(19, base + 10)));
  EXPECT_EQ(on_thread(WritePriority::kNormal), std::make_pair(SCHED_OTHER, base));
}

TEST(TorchWriter, AStorageKeyThatIsNotAPlainNameIsRefused) {
  const std::string dir = temp_dir("keys");
  StagedFile f = sample_file(dir + "/x.pt", {"ab"});
  f.storages[0].key = "../x";
  EXPECT_THROW(write_torch_file(f), InvalidArgument);
  f.storages[0].key = "";
  EXPECT_THROW(write_torch_file(f), InvalidArgument);
  fs::remove_all(dir);
}

// Two ranks of one checkpoint, each with its own writer, as two processes would run them.
struct TwoRanks {
  std::string dir;
  std::vector<std::string> data0, data1;
  SaveJob job(int rank, const std::string& tag) const {
    SaveJob j;
    j.dir = dir;
    j.tag = tag;
    j.partial = partial_tag_name(tag);
    j.rank = rank;
    j.world = 2;
    j.timeout_seconds = 20;
    const std::string folder = dir + "/" + j.partial + "/";
    if (rank == 0) {
      j.files.push_back(sample_file(folder + "mp_rank_00_model_states.pt", data0));
      j.files.push_back(sample_file(folder + "zero_pp_rank_0_optim_states.pt", data1));
    } else {
      j.files.push_back(sample_file(folder + "zero_pp_rank_1_optim_states.pt", data1));
    }
    return j;
  }
  // One save of both ranks: the outcomes of rank 0 and rank 1.
  std::pair<SaveOutcome, SaveOutcome> save(const std::string& tag) const {
    remove_partial(dir, partial_tag_name(tag));
    fs::create_directories(dir + "/" + partial_tag_name(tag));
    BackgroundSave r0, r1;
    r0.start(job(0, tag));
    r1.start(job(1, tag));
    SaveOutcome o1 = r1.wait();
    SaveOutcome o0 = r0.wait();
    return {o0, o1};
  }
};

TEST(BackgroundSave, TheFirstRankPublishesOnceEveryRanksFilesAreDurable) {
  TwoRanks t{temp_dir("publish"), {"model", std::string(5000, 'm')}, {"optim", std::string(9000, 'o')}};
  auto [o0, o1] = t.save("step1");
  EXPECT_EQ(o0.error, "");
  EXPECT_EQ(o1.error, "");
  EXPECT_TRUE(o0.published);
  EXPECT_FALSE(o1.published);
  EXPECT_EQ(slurp(t.dir + "/latest"), "step1");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(t.dir + "/step1")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"mp_rank_00_model_states.pt",
                                             "zero_pp_rank_0_optim_states.pt",
                                             "zero_pp_rank_1_optim_states.pt"}));  // no marker left
  EXPECT_EQ(o0.bytes, fs::file_size(t.dir + "/step1/mp_rank_00_model_states.pt") +
                          fs::file_size(t.dir + "/step1/zero_pp_rank_0_optim_states.pt"));
  fs::remove_all(t.dir);
}

TEST(BackgroundSave, AStreamedSaveWritesEachFileAsItComesAndPublishesOnlyOnceSealed) {
  TwoRanks t{temp_dir("streamed"), {"model", std::string(5000, 'm')}, {"optim", std::string(9000, 'o')}};
  auto wait_for = [](auto&& ready) {
    for (int i = 0; i < 5000 && !ready(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return ready();
  };
  for (const std::string tag : {"s1", "given-up"}) {
    fs::create_directories(t.dir + "/" + partial_tag_name(tag));
    // Each rank's files come one at a time after start(); the first is written before the
    // second comes, and nothing is published before both ranks have sealed.
    BackgroundSave r[2];
    SaveJob jobs[2] = {t.job(0, tag), t.job(1, tag)};
    for (int k = 0; k < 2; ++k) {
      SaveJob j = jobs[k];
      j.files.clear();
      j.streamed = true;
      r[k].start(j);
      r[k].add_file(jobs[k].files[0]);
    }
    EXPECT_TRUE(wait_for([&] { return r[0].files_written() == 1 && r[1].files_written() == 1; })) << tag;
    EXPECT_FALSE(r[0].finished());
    EXPECT_FALSE(fs::exists(t.dir + "/" + tag));
    r[0].add_file(jobs[0].files[1], true);
    EXPECT_TRUE(wait_for([&] { return r[0].pending_first() == 0; }));
    EXPECT_EQ(r[0].files_written(), 2u);
    if (tag == "s1") {
      r[1].seal();
      r[0].seal();
    } else {  // a rank could not take its snapshot: every rank gives the save up
      r[1].cancel();
      r[0].cancel();
    }
    const SaveOutcome o0 = r[0].wait(), o1 = r[1].wait();
    r[0].add_file(jobs[0].files[0]);  // after the end: dropped
    if (tag == "s1") {
      EXPECT_EQ(o0.error, "");
      EXPECT_EQ(o1.error, "");
      EXPECT_TRUE(o0.published);
      EXPECT_EQ(slurp(t.dir + "/latest"), "s1");
      EXPECT_EQ(o0.bytes, fs::file_size(t.dir + "/s1/mp_rank_00_model_states.pt") +
                              fs::file_size(t.dir + "/s1/zero_pp_rank_0_optim_states.pt"));
      EXPECT_TRUE(fs::exists(t.dir + "/s1/zero_pp_rank_1_optim_states.pt"));
    } else {
      EXPECT_NE(o0.error.find("given up"), std::string::npos) << o0.error;
      EXPECT_NE(o1.error.find("given up"), std::string::npos) << o1.error;
      EXPECT_FALSE(o0.published);
      EXPECT_FALSE(fs::exists(t.dir + "/" + tag));
      EXPECT_EQ(slurp(t.dir + "/latest"), "s1");
    }
  }
  fs::remove_all(t.dir);
}

TEST(BackgroundSave, ARankThatFailsStopsThePublicationAndTheFirstRankNamesIt) {
  TwoRanks t{temp_dir("failed"), {"model"}, {"optim"}};
  ASSERT_EQ(t.save("a").first.error, "");
  // Rank 1 cannot create its file (its folder is missing): a real error, not an injected one.
  remove_partial(t.dir, partial_tag_name("b"));
  fs::create_directories(t.dir + "/" + partial_tag_name("b"));
  SaveJob j1 = t.job(1, "b");
  j1.files[0].path = t.dir + "/" + partial_tag_name("b") + "/missing/x.pt";
  BackgroundSave r0, r1;
  r0.start(t.job(0, "b"));
  r1.start(std::move(j1));
  const SaveOutcome o1 = r1.wait(), o0 = r0.wait();
  EXPECT_EQ(o1.error_code, ENOENT) << o1.error;
  EXPECT_NE(o1.error.find("missing/x.pt"), std::string::npos) << o1.error;
  EXPECT_EQ(o0.failed_rank, 1);
  EXPECT_NE(o0.error.find("rank 1 failed writing its files"), std::string::npos) << o0.error;
  EXPECT_NE(o0.error.find("missing/x.pt"), std::string::npos) << o0.error;
  EXPECT_FALSE(o0.published);
  EXPECT_EQ(slurp(t.dir + "/latest"), "a");
  EXPECT_FALSE(fs::exists(t.dir + "/b"));
  // The failed save's folder is removed by the next save's remove_partials, whatever its tag.
  fs::create_directories(t.dir + "/.zeroflat-old-a");
  EXPECT_EQ(remove_partials(t.dir), 1);
  EXPECT_FALSE(fs::exists(t.dir + "/" + partial_tag_name("b")));
  EXPECT_TRUE(fs::exists(t.dir + "/.zeroflat-old-a"));  // kept: it may be a tag's only copy
  EXPECT_EQ(remove_partials(t.dir + "/none"), 0);
  fs::remove_all(t.dir);
}

TEST(BackgroundSave, TheFirstRankGivesUpOnARankThatNeverFinishes) {
  TwoRanks t{temp_dir("timeout"), {"model"}, {"optim"}};
  fs::create_directories(t.dir + "/" + partial_tag_name("a"));
  SaveJob j0 = t.job(0, "a");
  j0.timeout_seconds = 0.2;
  BackgroundSave r0;
  r0.start(std::move(j0));
  EXPECT_THROW(r0.start(t.job(0, "a")), Error);  // one save at a time
  const SaveOutcome o0 = r0.wait();
  EXPECT_NE(o0.error.find("rank 1 did not finish writing its files within"), std::string::npos) << o0.error;
  EXPECT_FALSE(fs::exists(t.dir + "/latest"));
  EXPECT_TRUE(r0.finished());
  EXPECT_EQ(r0.wait().error, "");  // waited for already: a default outcome
  fs::remove_all(t.dir);
}

TEST(BackgroundSave, AFaultAtAnyStepOfEitherRankLeavesLatestOnTheCheckpointBefore) {
  TwoRanks t{temp_dir("faults"), {"model", std::string(3000, 'm')}, {"optim", "state"}};
  ASSERT_EQ(t.save("t").first.error, "");
  const std::string before = slurp(t.dir + "/t/zero_pp_rank_1_optim_states.pt");
  const std::vector<std::string> steps = {"write.1", "write.2", "sync_files.1", "sync_files.2",
                                          "marker", "sync_tree", "publish.exchange",
                                          "publish.fsync", "latest.write",
                                          "latest.fsync", "latest.rename", "latest.fsync_dir"};
  int faults = 0;
  for (const std::string& step : steps) {
    for (const char* kind : {"eio", "enospc"}) {
      TwoRanks changed = t;
      changed.data1 = {"optim", "state " + step + kind};
      set_save_fault_for_testing(step + ":" + kind);
      auto [o0, o1] = changed.save("t");
      set_save_fault_for_testing(std::nullopt);
      const std::string where = step + ":" + kind;
      EXPECT_TRUE(!o0.error.empty() || !o1.error.empty()) << where << ": the fault did not act";
      EXPECT_EQ(slurp(t.dir + "/latest"), "t") << where;
      const std::string now = slurp(t.dir + "/t/zero_pp_rank_1_optim_states.pt");
      // Whole: the checkpoint before, or (a fault after the exchange) the new one, never a mix.
      const bool old = now == before;
      EXPECT_TRUE(old || step.starts_with("publish.fsync") || step.starts_with("latest"))
          << where << ": the tag changed before it was published";
      EXPECT_EQ(slurp(t.dir + "/t/mp_rank_00_model_states.pt").size(),
                fs::file_size(t.dir + "/t/mp_rank_00_model_states.pt"));
      // The next save succeeds and leaves nothing behind.
      ASSERT_EQ(t.save("t").first.error, "") << where;
      finish_removals();  // the tag that save replaced
      for (const auto& e : fs::directory_iterator(t.dir)) {
        EXPECT_FALSE(e.path().filename().string().starts_with(".zeroflat-")) << where;
      }
      EXPECT_EQ(slurp(t.dir + "/t/zero_pp_rank_1_optim_states.pt"), before) << where;
      ++faults;
    }
  }
  EXPECT_EQ(faults, 24);
  RecordProperty("faults", faults);
  fs::remove_all(t.dir);
}

TEST(StageCopies, EveryRangeIsCopiedWhateverTheSplit) {
  std::vector<std::string> from = {std::string(10 << 20, 'a'), "b", "", std::string(3 << 20, 'c')};
  std::mt19937 gen(5);
  for (std::string& s : from) {
    for (char& c : s) c = static_cast<char>(gen());
  }
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    std::vector<std::string> to;
    for (const std::string& s : from) to.emplace_back(s.size(), '\0');
    std::vector<StageCopy> copies;
    for (std::size_t i = 0; i < from.size(); ++i) {
      copies.push_back({reinterpret_cast<std::byte*>(to[i].data()),
                        reinterpret_cast<const std::byte*>(from[i].data()), from[i].size()});
    }
    stage_copies(copies, threads);
    EXPECT_EQ(to, from) << threads << " threads";
  }
}

TEST(StageCopies, StreamingStoresCopyEveryByteAtAnyAlignment) {
  // Source and destination at every offset within a cache line, so the streaming body starts
  // after an ordinary head and ends before an ordinary tail; the runs cross the threads' cuts.
  std::vector<unsigned char> from((5 << 20) + 64), to(from.size() + 64);
  std::mt19937 gen(7);
  for (unsigned char& c : from) c = static_cast<unsigned char>(gen());
  for (StageStores stores : {StageStores::Streaming, StageStores::Ordinary}) {
    for (unsigned threads : {1u, 2u, 3u}) {
      for (std::size_t skew : {0u, 1u, 17u, 63u}) {
        std::fill(to.begin(), to.end(), 0);
        const std::size_t sizes[] = {(3 << 20) + 5, 300, 255, 1, (2 << 20) - 600};
        std::vector<StageCopy> copies;
        std::size_t at = 0;
        for (std::size_t n : sizes) {
          copies.push_back({reinterpret_cast<std::byte*>(to.data() + skew + at),
                            reinterpret_cast<const std::byte*>(from.data() + at), n});
          at += n;
        }
        stage_copies(copies, threads, stores);
        ASSERT_TRUE(std::equal(from.begin(), from.begin() + at, to.begin() + skew))
            << "threads " << threads << ", skew " << skew;
        const auto zero = [](unsigned char c) { return c == 0; };
        EXPECT_TRUE(std::all_of(to.begin(), to.begin() + skew, zero));
        EXPECT_TRUE(std::all_of(to.begin() + skew + at, to.end(), zero));
      }
    }
  }
}

}  // namespace
}  // namespace zeroflat

namespace zeroflat {
namespace {

TEST(TorchWriter, ARecordSharedByThreeRanksIsOneArchiveWithTheWholeRecordsCrc) {
  const std::string dir = temp_dir("shared");
  std::string big(3 * 4096 * 5 + 123, '\0');  // cut in 4 KiB-aligned parts
  std::mt19937 gen(11);
  for (char& c : big) c = static_cast<char>(gen());
  const std::string small = "buffers";
  StagedFile f;
  f.path = dir + "/mp_rank_00_model_states.pt";
  f.pickle = "pickle";
  const ShareRange p0 = share_range(big.size(), 3, 0);
  f.storages.push_back({"0", reinterpret_cast<const std::byte*>(small.data()), small.size()});
  f.storages.push_back({"1", reinterpret_cast<const std::byte*>(big.data()), big.size(), 3});
  TorchFileWriter w(f);
  ASSERT_EQ(w.shared_records(), 1u);
  const std::uint64_t offset = w.data_offsets()[1];
  std::atomic<std::uint64_t> written{0};
  w.write_data(&written);
  EXPECT_EQ(written.load(), f.pickle.size() + small.size() + p0.end + 1 + 2 + 6 + 2);
  // The other two ranks' parts, as their own processes would write them.
  std::vector<std::vector<std::uint32_t>> crcs;
  for (unsigned k = 1; k < 3; ++k) {
    const ShareRange p = share_range(big.size(), 3, k);
    EXPECT_EQ(p.begin % 4096, 0u);
    crcs.push_back({write_shared_part({f.path, offset + p.begin,
                                       reinterpret_cast<const std::byte*>(big.data()) + p.begin,
                                       p.end - p.begin})});
  }
  EXPECT_EQ(share_range(big.size(), 3, 2).end, big.size());
  EXPECT_THROW(w.finish({crcs[0]}), Error);  // one rank's CRCs missing
  const std::uint64_t size = w.finish(crcs);
  EXPECT_EQ(size, fs::file_size(f.path));
  EXPECT_EQ(w.bytes_written(), size - (big.size() - p0.end));  // all but the others' parts
  const std::string bytes = slurp(f.path);
  const detail::FileSource source(f.path);
  const detail::ZipArchive zip = detail::read_zip(source);
  const detail::ZipEntry* e = zip.find("mp_rank_00_model_states/data/1");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(bytes.substr(e->offset, e->bytes), big);
  // The central directory's CRC of the record is the whole record's.
  const std::size_t name = bytes.rfind("mp_rank_00_model_states/data/1");
  const std::size_t central = name - 46;
  ASSERT_EQ(bytes.compare(central, 4, "PK\x01\x02"), 0);
  std::uint32_t crc = 0;
  for (int i = 3; i >= 0; --i) crc = (crc << 8) | static_cast<unsigned char>(bytes[central + 16 + i]);
  EXPECT_EQ(crc, crc_by_bits(big));
  // A file with shared records is not written whole by write_torch_file.
  EXPECT_THROW(write_torch_file(f), InvalidArgument);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace zeroflat

namespace zeroflat {
namespace {

TEST(BackgroundSave, TwoRanksWriteTheFirstRanksSharedRecordAndItsCrcComesThroughTheMarker) {
  const std::string dir = temp_dir("shared_job");
  std::string flat(2 * 4096 * 3 + 77, '\0');
  std::mt19937 gen(13);
  for (char& c : flat) c = static_cast<char>(gen());
  const std::string partial = partial_tag_name("s");
  fs::create_directories(dir + "/" + partial);
  const std::string path = dir + "/" + partial + "/mp_rank_00_model_states.pt";
  SaveJob j0, j1;
  for (SaveJob* j : {&j0, &j1}) {
    j->dir = dir;
    j->partial = partial;
    j->tag = "s";
    j->world = 2;
    j->timeout_seconds = 20;
  }
  j1.rank = 1;
  StagedFile f;
  f.path = path;
  f.pickle = "p";
  f.storages.push_back({"0", reinterpret_cast<const std::byte*>(flat.data()), flat.size(), 2});
  const std::uint64_t offset = TorchFileWriter(f).data_offsets()[0];
  j0.files.push_back(f);
  const ShareRange p1 = share_range(flat.size(), 2, 1);
  j1.shared_parts.push_back({path, offset + p1.begin,
                             reinterpret_cast<const std::byte*>(flat.data()) + p1.begin, p1.end - p1.begin});
  BackgroundSave r0, r1;
  r0.start(j0);
  r1.start(j1);
  const SaveOutcome o1 = r1.wait(), o0 = r0.wait();
  ASSERT_EQ(o1.error, "");
  ASSERT_EQ(o0.error, "");
  EXPECT_EQ(o1.bytes, p1.end - p1.begin);
  const std::string published = dir + "/s/mp_rank_00_model_states.pt";
  const detail::FileSource source(published);
  const detail::ZipArchive zip = detail::read_zip(source);
  const detail::ZipEntry* e = zip.find("mp_rank_00_model_states/data/0");
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(slurp(published).substr(e->offset, e->bytes), flat);
  fs::remove_all(dir);
}

TEST(BackgroundSave, AMarkerThatIsNotAListOfCrcsStopsThePublication) {
  for (const std::string& text : {std::string("crc 1234567\n"), std::string("crc 123456789\n"),
                                  std::string("crc zzzzzzzz\n"), std::string("hello"),
                                  std::string("crc 00000000\ncrc 00000000\n")}) {
    const std::string dir = temp_dir("bad_marker");
    const std::string partial = partial_tag_name("m");
    fs::create_directories(dir + "/" + partial);
    std::ofstream(dir + "/" + partial + "/.zeroflat-done-1") << text;
    std::string flat(5000, 'f');
    SaveJob j0;
    j0.dir = dir;
    j0.partial = partial;
    j0.tag = "m";
    j0.world = 2;
    j0.timeout_seconds = 5;
    StagedFile f;
    f.path = dir + "/" + partial + "/x.pt";
    f.pickle = "p";
    f.storages.push_back({"0", reinterpret_cast<const std::byte*>(flat.data()), flat.size(), 2});
    j0.files.push_back(f);
    BackgroundSave r0;
    r0.start(j0);
    const SaveOutcome o0 = r0.wait();
    EXPECT_NE(o0.error, "") << text;
    EXPECT_FALSE(o0.published) << text;
    EXPECT_FALSE(fs::exists(dir + "/m")) << text;
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace zeroflat
