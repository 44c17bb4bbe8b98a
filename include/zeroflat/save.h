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
//      with it in one atomic rename (renameat2 RENAME_EXCHANGE), then the old one removed;
//      then the folder `dir` itself is fsync'd;
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
// publish.exchange: as on a file system without RENAME_EXCHANGE). The steps:
// sync_files.<k> (k from 1, each file), sync_tree, publish.aside, publish.rename,
// publish.exchange, publish.remove, publish.fsync, latest.write, latest.fsync, latest.rename,
// latest.fsync_dir, and the caller's own (save_step). Read once per process (runtime_env);
// nothing but these steps acts on it.
#pragma once

#include <optional>
#include <string>
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

// fsync of each file's data. Throws IoError naming the file.
void sync_files(const std::vector<std::string>& paths);

// fsync of every regular file and folder under `dir`, and of `dir`. Throws IoError naming the
// file.
void sync_tree(const std::string& dir);

// How publish_tag made the tag visible.
struct Published {
  bool replaced = false;   // a tag of that name was there before (and is removed)
  bool exchanged = false;  // ... swapped in one atomic rename (else renamed aside, then in)
};

// Makes `dir/partial` visible as `dir/tag`, as above; `dir` fsync'd. Throws IoError naming the
// step and the paths; on a failure before the new tag is in place, the old one is still there.
Published publish_tag(const std::string& dir, const std::string& partial, const std::string& tag);

// Replaces `dir/latest` with `tag` (its bytes alone, as DeepSpeed writes it) by write, fsync,
// rename and fsync of `dir`. Throws IoError naming the step.
void write_latest(const std::string& dir, const std::string& tag);

// A step of a save that the caller performs itself (the Python drop-in's writes of DeepSpeed's
// files, "write.<k>"): nothing, unless the test fault hook names it (above).
void save_step(const std::string& step, const std::string& path);

// For tests: the fault the steps of this process act on from now, in place of
// ZEROFLAT_TEST_SAVE_FAULT's; none puts the variable's back.
void set_save_fault_for_testing(std::optional<std::string> spec);

}  // namespace zeroflat
