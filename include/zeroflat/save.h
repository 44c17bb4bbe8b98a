// Publishing a checkpoint so that a crash never costs a complete one.
//
// DeepSpeed writes each file of a tag in place and `latest` with a plain write, no fsync: a crash
// mid-save can leave `latest` naming a tag whose files are half written, and a save over an
// existing tag destroys it file by file before the new one is whole. Here a tag is written
// under a temporary name beside where it goes, made durable, and made visible by one rename;
// `latest` is replaced last, by write-to-temporary and rename. Each step is durable before the
// next:
//
//   1. every rank writes its files under `<dir>/<partial_tag_name(tag)>`, then sync_files()
//      the files it wrote (their data on storage), then all ranks meet;
//   2. one rank publishes: sync_tree(partial) (every file and folder under it), then
//      publish_tag(): a new tag is the partial folder renamed; an existing tag is exchanged
//      with it in one atomic rename (renameat2 RENAME_EXCHANGE); then the folder `dir` itself
//      is fsync'd, and the old one, out of sight under the partial name, is removed by the
//      library's thread after publish_tag has returned (finish_removals);
//   3. write_latest(): `latest.tmp` written and fsync'd, renamed over `latest`, `dir` fsync'd.
//
// After a crash at any point, `latest` names a complete tag: the one before, or the new one
// (a leftover partial folder is removed by the next save: remove_partial). On a file system
// without RENAME_EXCHANGE, an existing tag is renamed aside and the new one renamed in, and a
// crash between the two leaves the tag's name missing for its `latest` (said in the returned
// Published).
//
// Faults for tests: with ZEROFLAT_TEST_SAVE_FAULT="<step>:<kind>" in the environment, the
// library acts at that step as if the system had failed: kind "kill" (the process SIGKILLs
// itself), "eio" or "enospc" (the step throws IoError with that error), "unsupported" (at
// publish.exchange: as on a file system without RENAME_EXCHANGE), "delay" (the step takes half a
// second more). The steps: write.<k>, write.part.<k> and sync_files.<k> (k from 1: each file,
// each shared part of this rank), marker, sync_tree, publish.aside, publish.rename,
// publish.exchange, publish.remove, publish.fsync, latest.write, latest.fsync, latest.rename,
// latest.fsync_dir, and the caller's own (save_step); publish.remove acts in the thread that
// removes a replaced folder (a failure there leaves the folder to finish_removals, a kill comes
// after the publication). Read once per process (runtime_env);
// nothing but these steps acts on it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "zeroflat/common.h"

namespace zeroflat {

// The temporary folder a tag is written in, beside it: ".zeroflat-partial-<tag>". Throws
// InvalidArgument for a tag that is not a plain folder name (empty, ".", "..", holding '/', a
// NUL, or starting with ".zeroflat-").
std::string partial_tag_name(const std::string& tag);

// Removes `dir/partial` and everything under it, if there (a crashed save's leftovers); never
// follows a link out of it.
void remove_partial(const std::string& dir, const std::string& partial);

// Removes every partial tag folder under `dir` (the leftovers of saves that failed or crashed,
// whatever their tags). Returns how many. A folder aside (".zeroflat-old-<tag>", which may be
// the only copy of a tag after a crash mid-replace) is kept.
int remove_partials(const std::string& dir);

// fsync of each file's data. Throws IoError naming the file.
void sync_files(const std::vector<std::string>& paths);

// fsync of every regular file and folder under `dir`, and of `dir`. Throws IoError naming the
// file.
void sync_tree(const std::string& dir);

// How publish_tag made the tag visible.
struct Published {
  bool replaced = false;   // a tag of that name was there before (removed after the return)
  bool exchanged = false;  // ... swapped in one atomic rename (else renamed aside, then in)
};

// Makes `dir/partial` visible as `dir/tag`, as above; `dir` fsync'd. Throws IoError naming the
// step and the paths; on a failure before the new tag is in place, the old one is still there.
Published publish_tag(const std::string& dir, const std::string& partial, const std::string& tag);

// Waits until the folders that publications replaced are removed (the library removes them in a
// thread after publish_tag returns, so that a save's time does not include them; the process's
// exit, remove_partial, remove_partials and publish_tag wait for it too). A folder that thread
// could not remove is tried again here: IoError, naming it, if it still cannot be.
void finish_removals();

// Replaces `dir/latest` with `tag` (its bytes alone, as DeepSpeed writes it) by write, fsync,
// rename and fsync of `dir`. Throws IoError naming the step.
void write_latest(const std::string& dir, const std::string& tag);

// A step of a save that the caller performs itself (the Python drop-in's writes of DeepSpeed's
// files, "write.<k>"): nothing, unless the test fault hook names it (above).
void save_step(const std::string& step, const std::string& path);

// --- torch.save's file format, from staged bytes ---------------------------------------------

// CRC-32 of the zip format (polynomial 0xEDB88320), continued from `crc` (0 to start).
std::uint32_t crc32(std::uint32_t crc, const void* data, std::uint64_t num_bytes) noexcept;
// The CRC-32 of A followed by B from crc(A), crc(B) and B's length.
std::uint32_t crc32_combine(std::uint32_t first, std::uint32_t second,
                            std::uint64_t second_bytes) noexcept;

// One storage of a torch.save file: its bytes, by the key its pickle names ("data/<key>").
struct StagedStorage {
  std::string key;
  const std::byte* data = nullptr;  // the caller's, unchanged until the write returns
  std::uint64_t size = 0;           // the record's size
  // A record that `parts` ranks write together (a rank-shared file): `data` is then only this
  // rank's part 0 (share_range), and each rank k in [1, parts) writes part k at its offset in
  // the file (SharedPart) and reports its CRC-32.
  unsigned parts = 1;
};

// A file as torch.save writes it: the pickle of the object (its storages referred to by key,
// as torch's persistent ids do) and the storages' bytes.
struct StagedFile {
  std::string path;
  std::string pickle;
  std::vector<StagedStorage> storages;
};

// Part k of a record of `size` bytes that `parts` ranks write: [begin, end), 4 KiB-aligned cuts.
struct ShareRange {
  std::uint64_t begin;
  std::uint64_t end;
};
ShareRange share_range(std::uint64_t size, unsigned parts, unsigned k);

// Another rank's part of a shared record: `size` bytes at `offset` of the file at `path`.
struct SharedPart {
  std::string path;
  std::uint64_t offset = 0;
  const std::byte* data = nullptr;
  std::uint64_t size = 0;
};

// Writes `part` (the file is created if no rank has yet; never truncated) and fsyncs it.
// Returns the part's CRC-32. Throws IoError naming the file.
std::uint32_t write_shared_part(const SharedPart& part, std::atomic<std::uint64_t>* written = nullptr);

// Direct writes (RuntimeEnv::save_io): a record of at least kDirectMinBytes whose staged bytes
// lie at the same place within a kDirectAlign-byte page as its data in the file has its whole
// pages written with O_DIRECT, the disk reading them from the staging (a save's staging places
// each large record so: torch_file_data_offsets); the partial pages at its ends, the small
// records and the headers go through the page cache. A file system that refuses O_DIRECT gets
// every byte through the page cache. The fsync after covers both.
inline constexpr std::uint64_t kDirectAlign = 4096;
inline constexpr std::uint64_t kDirectMinBytes = std::uint64_t{1} << 20;

// Where each storage's data will begin in `file`'s archive, in `file.storages`' order: the
// layout only (keys and sizes; the storages' bytes are not read and need not be staged yet).
std::vector<std::uint64_t> torch_file_data_offsets(const StagedFile& file);

// A torch.save file written in two steps, so that other ranks may write parts of its shared
// records between them: write_data() writes every byte this rank has (CRCs beside the writes);
// finish() combines the other ranks' parts' CRCs into each shared record's, then writes the
// headers and the central directory. Not fsync'd.
class TorchFileWriter {
 public:
  explicit TorchFileWriter(const StagedFile& file);  // the file is the caller's until finish()
  ~TorchFileWriter();
  TorchFileWriter(const TorchFileWriter&) = delete;
  TorchFileWriter& operator=(const TorchFileWriter&) = delete;

  // Where each storage's data begins in the file, in `file.storages`' order.
  std::vector<std::uint64_t> data_offsets() const;
  // How many storages are shared (parts > 1).
  std::size_t shared_records() const;
  // direct: whether large records may be written with O_DIRECT (none: RuntimeEnv::save_io).
  void write_data(std::atomic<std::uint64_t>* written = nullptr, std::optional<bool> direct = std::nullopt);
  // other_parts[k - 1][j]: the CRC-32 of rank k's part of the j-th shared record. Returns the
  // file's size.
  std::uint64_t finish(const std::vector<std::vector<std::uint32_t>>& other_parts);
  // The file's bytes this rank wrote (all of them but the other ranks' parts), once finished.
  std::uint64_t bytes_written() const;
  // Of those, the bytes written with O_DIRECT.
  std::uint64_t direct_bytes() const;

 private:
  struct State;
  const StagedFile& file_;
  std::unique_ptr<State> state_;
};

// Writes `file` as one zip archive that torch.load reads: the records torch writes
// ("<stem>/data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/<key>" for
// each storage, "version", ".data/serialization_id"), stored, each one's data at a 64-byte
// boundary, with their CRC-32s and zip64 end records. The data is written first (the whole
// pages of large records with O_DIRECT where they qualify, kDirectAlign; the rest with
// write-back started behind it) while another thread computes the CRCs; then the headers.
// Not fsync'd.
// Adds the bytes of data written to `written` as it goes. Returns the file's size. Throws
// IoError naming the file.
std::uint64_t write_torch_file(const StagedFile& file, std::atomic<std::uint64_t>* written = nullptr);

// How a background writer's thread competes with the training's threads for the cores.
//   kIdle    SCHED_IDLE: it runs when a core would otherwise idle (the steps barely notice it;
//            a write beside steps that keep every core busy takes longer)
//   kLow     10 nicer than the caller (about a tenth of a core's time when it competes)
//   kNormal  as the caller's threads (the shortest write, the most felt by the steps)
enum class WritePriority { kIdle, kLow, kNormal };
// Parses "idle", "low" or "normal"; InvalidArgument naming the choices otherwise.
WritePriority parse_write_priority(const std::string& name);
// Puts the calling thread at `p` (best effort: a system that refuses keeps it as it is).
void set_thread_write_priority(WritePriority p) noexcept;

// --- Items appended to one file, as DCP's FileSystemWriter writes a rank's file -------------

// One item: a torch.save archive (`archive`; its `path` names the archive's record prefix, as
// torch.save's "archive" when it writes into a stream) or, without one, `size` bytes at `data`.
struct AppendedItem {
  const StagedFile* archive = nullptr;  // the caller's, unchanged until the write returns
  const std::byte* data = nullptr;
  std::uint64_t size = 0;
};

// Where an item went in the file.
struct ItemSpan {
  std::uint64_t offset = 0;
  std::uint64_t length = 0;
};

// Writes `items` one after the other into a new file at `path` (truncated), each archive's
// offsets counted from its own start, as torch.save writes into a stream at any position: the
// slice [offset, offset + length) is an archive that torch.load reads. Small records travel
// with the headers around them, large ones are written from where they are, write-back started
// behind. An archive with a record of kDirectMinBytes and more starts at a page (zeros before
// it, outside every span) and that record's data at its bytes' offset within a page in memory
// (still 64-byte aligned in the archive where the memory is), so that its whole pages go with
// O_DIRECT (ZEROFLAT_SAVE_IO, where the file system takes it); the records' CRC-32s are
// computed by a second thread ahead of the writes. `sync`: fsync'd before it returns. A
// `priority` other than kNormal: written by a thread of its own at that priority (the caller
// waits), so that the training's threads come first. Returns each item's span; throws IoError
// naming the file.
std::vector<ItemSpan> write_appended(const std::string& path, const std::vector<AppendedItem>& items, bool sync,
                                     WritePriority priority = WritePriority::kNormal,
                                     std::atomic<std::uint64_t>* written = nullptr);

// --- A save written in the background ---------------------------------------------------------

// One range of a snapshot: `size` bytes from `from` to `to`.
struct StageCopy {
  std::byte* to = nullptr;
  const std::byte* from = nullptr;
  std::uint64_t size = 0;
};

// How stage_copies writes the staging. Automatic: streaming (non-temporal) stores when the bytes
// are past the last-level cache and the staging has been written before (a save's reused
// staging: no read of each destination line before its write, no eviction of the training's
// working set); ordinary stores otherwise (fresh pages, small saves).
enum class StageStores { Automatic, Ordinary, Streaming };

// Copies every range, the bytes split evenly over `threads` threads (1: the caller's alone): the
// snapshot a save takes of a rank's state before it returns. Every store is visible to other
// threads when it returns.
void stage_copies(const std::vector<StageCopy>& copies, unsigned threads,
                  StageStores stores = StageStores::Automatic);

// What one rank writes of a checkpoint, and (`dir` not empty) how it is published.
struct SaveJob {
  std::string dir;      // the checkpoint folder; empty: only the files, nothing published
  std::string partial;  // partial_tag_name(tag), under dir, where the files are
  std::string tag;
  int rank = 0;         // the first rank publishes, once every rank's files are durable
  int world = 1;
  bool save_latest = true;
  WritePriority priority = WritePriority::kIdle;  // the writing thread's, behind the training
  double timeout_seconds = 1800;   // the first rank's wait for the others' files
  std::vector<StagedFile> files;    // written in order
  // More files come after start() (BackgroundSave::add_file), the last with seal(): the writer
  // starts on each one as it comes, while the caller is still snapshotting the next.
  bool streamed = false;
  // Parts of the first rank's shared records that this rank writes (another rank than the
  // first): one per shared record, in the order of the first rank's files and their records.
  std::vector<SharedPart> shared_parts;
};

// How a background save ended.
struct SaveOutcome {
  std::string error;      // empty: it succeeded
  int error_code = 0;     // the errno of an IoError on this rank, else 0
  int failed_rank = -1;   // on the first rank: another rank whose failure stopped it
  bool published = false;
  bool replaced = false;
  bool exchanged = false;
  std::uint64_t bytes = 0;  // file bytes this rank wrote (its parts of shared records too)
  std::uint64_t direct_bytes = 0;  // of those, written with O_DIRECT (kDirectAlign)
  double seconds = 0;       // from start to the end of this rank's part
  // Where those seconds went: writing the files' data and this rank's parts; fsyncing its
  // files; on the first rank, waiting for the others' markers (on the others, writing theirs);
  // on the first rank, finishing the shared files, the folder's fsync, its rename and `latest`.
  double write_seconds = 0;
  double sync_seconds = 0;
  double wait_seconds = 0;
  double publish_seconds = 0;
};

// A rank's save, written by a thread of its own: this rank's files (write.<k>), its parts of
// the first rank's shared records (write.part.<k>, each fsync'd), the files' fsync
// (sync_files.<k>), then on any rank but the first a marker `.zeroflat-done-<rank>` in the
// partial folder (one line "crc <8 hex digits>" per shared part; written whole under a
// temporary name, fsync'd and renamed in, so that the first rank never reads half of one), or on
// a failure `.zeroflat-failed-<rank>` holding its words. The first rank waits for every other rank's
// marker (a failed one, or none within the timeout, stops it: nothing published), finishes its
// files with shared records from the parts' CRCs and fsyncs them, removes the markers, then
// sync_tree, publish_tag and write_latest as above. The ranks share only the file system: no
// collective runs in the background.
namespace detail {
struct SaveQueue;
}  // namespace detail

class BackgroundSave {
 public:
  BackgroundSave() = default;
  ~BackgroundSave();  // waits for a save still being written
  BackgroundSave(const BackgroundSave&) = delete;
  BackgroundSave& operator=(const BackgroundSave&) = delete;

  // Starts writing `job`. Throws Error while a save started before has not been waited for.
  void start(SaveJob job);
  // A streamed job's next file (its staged bytes the writer's until files_written() passes it),
  // written after those before it. `first`: one the caller waits for (written from its tensors
  // themselves: pending_first()); it adds those before the others. Ignored once the save has
  // ended (its failure is in the outcome).
  void add_file(StagedFile file, bool first = false);
  // A streamed job's last call: no more files; this rank's parts of the first rank's shared
  // records. Until it comes the writer waits (cancel() gives the save up).
  void seal(std::vector<SharedPart> shared_parts = {});
  // Files added as `first` not yet written.
  std::size_t pending_first() const;
  // Waits for the save started last and returns how it ended (a default outcome when none was
  // started since the last wait). Its staged bytes are the caller's again.
  SaveOutcome wait();
  // Gives the save up before it is published (another rank could not start its share): the
  // first rank stops waiting for the others' markers. Its files stay in the partial folder.
  void cancel() noexcept;
  // Whether a started save has ended (wait() then returns at once).
  bool finished() const noexcept { return finished_.load(std::memory_order_acquire); }
  // Data bytes written so far, of `bytes_total()`, for progress.
  std::uint64_t bytes_written() const noexcept { return written_.load(std::memory_order_relaxed); }
  std::uint64_t bytes_total() const noexcept { return total_.load(std::memory_order_relaxed); }
  // How many of the job's files have all their data written, in the order they are written
  // (a job's files in order; a streamed job's as add_file says): the memory they were staged in,
  // or the tensors they were written from, is the caller's again (their headers may come later,
  // from what the writer keeps).
  std::size_t files_written() const noexcept { return files_written_.load(std::memory_order_acquire); }

 private:
  std::shared_ptr<detail::SaveQueue> queue_;  // a streamed job's files yet to come
  SaveJob job_;
  SaveOutcome outcome_;
  std::atomic<std::uint64_t> written_{0};
  std::atomic<std::uint64_t> total_{0};
  std::atomic<std::size_t> files_written_{0};
  std::atomic<bool> finished_{true};
  std::atomic<bool> cancelled_{false};
  std::thread thread_;
};

// For tests: the fault the steps of this process act on from now, in place of
// ZEROFLAT_TEST_SAVE_FAULT's; none puts the variable's back.
void set_save_fault_for_testing(std::optional<std::string> spec);

}  // namespace zeroflat
