// Publishing a checkpoint (save.h): a fault at every step, of every kind, leaves `latest` naming
// a complete checkpoint (the one before, or the new one), and the next save succeeds.
#include "zeroflat/save.h"

#include "common/thread_pool.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace zeroflat {
namespace {

namespace fs = std::filesystem;

constexpr int kFiles = 3;

std::string file_text(int version, int i) {
  std::string out = "version " + std::to_string(version) + " file " + std::to_string(i) + "\n";
  while (out.size() < 5000) out += out;
  return out;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// One save as a caller makes it: leftovers removed, the files written under the partial name
// and synced, then published; `latest` last.
void save(const std::string& dir, const std::string& tag, int version) {
  const std::string partial = partial_tag_name(tag);
  remove_partial(dir, partial);
  fs::create_directories(dir + "/" + partial + "/sub");
  std::vector<std::string> written;
  for (int i = 0; i < kFiles; ++i) {
    const std::string path =
        dir + "/" + partial + (i == kFiles - 1 ? "/sub/" : "/") + "f" + std::to_string(i);
    std::ofstream(path, std::ios::binary) << file_text(version, i);
    written.push_back(path);
  }
  sync_files(written);
  sync_tree(dir + "/" + partial);
  (void)publish_tag(dir, partial, tag);
  write_latest(dir, tag);
}

// The version `dir/latest` names, whole (every file of one version), or a failure saying what
// is wrong; nullopt when there is no `latest` at all.
std::optional<int> complete(const std::string& dir, std::string* why) {
  if (!fs::exists(dir + "/latest")) return std::nullopt;
  const std::string tag = slurp(dir + "/latest");
  const fs::path t = fs::path(dir) / tag;
  if (!fs::is_directory(t)) {
    *why = "latest names '" + tag + "', which is not there";
    return -1;
  }
  int version = -1;
  for (int i = 0; i < kFiles; ++i) {
    const fs::path f = t / (i == kFiles - 1 ? "sub" : "") / ("f" + std::to_string(i));
    const std::string text = slurp(f);
    int v = -1;
    for (int candidate = 1; candidate <= 9; ++candidate) {
      if (text == file_text(candidate, i)) v = candidate;
    }
    if (v < 0 || (version >= 0 && v != version)) {
      *why = "file " + f.string() + " is not whole, or of another version than the others";
      return -1;
    }
    version = v;
  }
  return version;
}

struct Scenario {
  const char* name;
  std::function<void(const std::string&)> before;  // the checkpoints there before
  const char* tag;                                 // the save the fault hits
  std::vector<std::optional<int>> allowed;         // what `latest` may give after the fault
};

std::vector<std::string> steps_of(bool replaces) {
  std::vector<std::string> out;
  for (int i = 1; i <= kFiles; ++i) out.push_back("sync_files." + std::to_string(i));
  out.push_back("sync_tree");
  if (replaces) {
    out.insert(out.end(), {"publish.exchange", "publish.fsync", "publish.remove"});
  } else {
    out.insert(out.end(), {"publish.rename", "publish.fsync"});
  }
  out.insert(out.end(), {"latest.write", "latest.fsync", "latest.rename", "latest.fsync_dir"});
  return out;
}

TEST(Save, AFaultAtEveryStepNeverCostsACompleteCheckpoint) {
  const std::vector<Scenario> scenarios = {
      {"first save", [](const std::string&) {}, "a", {std::nullopt, 2}},
      {"a new tag beside one", [](const std::string& d) { save(d, "a", 1); }, "b", {1, 2}},
      {"the same tag again", [](const std::string& d) { save(d, "a", 1); }, "a", {1, 2}},
      {"a tag that latest does not name",
       [](const std::string& d) {
         save(d, "a", 1);
         save(d, "b", 3);
       },
       "a",
       {3, 2}},
  };
  int faults = 0;
  for (const Scenario& s : scenarios) {
    const bool replaces = std::string(s.name) != "first save" &&
                          std::string(s.name) != "a new tag beside one";
    for (const std::string& step : steps_of(replaces)) {
      for (const char* kind : {"kill", "eio", "enospc"}) {
        const std::string dir = ::testing::TempDir() + "save_test_" + std::to_string(getpid()) +
                                "_" + std::to_string(faults);
        fs::remove_all(dir);
        fs::create_directories(dir);
        s.before(dir);
        const std::string spec = step + ":" + kind;
        bool failed = false;
        if (std::string(kind) == "kill") {
          const pid_t child = fork();
          ASSERT_GE(child, 0);
          if (child == 0) {
            set_save_fault_for_testing(spec);
            try {
              save(dir, s.tag, 2);
              finish_removals();  // publish.remove acts in the thread, after the save returned
            } catch (...) {
              _exit(3);
            }
            _exit(0);
          }
          int status = 0;
          ASSERT_EQ(waitpid(child, &status, 0), child);
          failed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
        } else {
          set_save_fault_for_testing(spec);
          try {
            save(dir, s.tag, 2);
            // The removal of the replaced tag fails in the library's thread, after the save has
            // returned: tried again here, it fails again while the fault holds.
            if (step == "publish.remove") finish_removals();
          } catch (const IoError& e) {
            failed = true;
            EXPECT_NE(std::string(e.what()).find(step), std::string::npos) << e.what();
            EXPECT_EQ(e.code(), std::string(kind) == "eio" ? EIO : ENOSPC);
          }
          set_save_fault_for_testing(std::nullopt);
        }
        EXPECT_TRUE(failed) << s.name << ", " << spec << ": the fault did not act";
        std::string why;
        const std::optional<int> seen = complete(dir, &why);
        EXPECT_NE(seen, std::optional<int>(-1)) << s.name << ", " << spec << ": " << why;
        EXPECT_NE(std::find(s.allowed.begin(), s.allowed.end(), seen), s.allowed.end())
            << s.name << ", " << spec << ": latest gives version " << (seen ? *seen : 0);
        // The next save succeeds, leftovers and all, and is whole.
        save(dir, s.tag, 4);
        EXPECT_EQ(complete(dir, &why), std::optional<int>(4)) << s.name << ", " << spec << ": " << why;
        finish_removals();
        for (const auto& e : fs::directory_iterator(dir)) {
          const std::string n = e.path().filename().string();
          EXPECT_FALSE(n.starts_with(".zeroflat-")) << s.name << ", " << spec << ": " << n << " left";
        }
        fs::remove_all(dir);
        ++faults;
      }
    }
  }
  EXPECT_GE(faults, 120);
  RecordProperty("faults", faults);
}

TEST(Save, ATagThatIsNotAPlainNameIsRefusedBeforeAnythingIsWritten) {
  for (const std::string& bad : std::vector<std::string>{"", ".", "..", "a/b", "/abs", std::string("a\0b", 3),
                                ".zeroflat-partial-x"}) {
    EXPECT_THROW((void)partial_tag_name(bad), InvalidArgument) << bad;
  }
  EXPECT_EQ(partial_tag_name("global_step10"), ".zeroflat-partial-global_step10");
  const std::string dir = ::testing::TempDir() + "save_test_names_" + std::to_string(getpid());
  fs::create_directories(dir);
  EXPECT_THROW(remove_partial(dir, "global_step10"), InvalidArgument);
  EXPECT_THROW(write_latest(dir, "../elsewhere"), InvalidArgument);
  EXPECT_FALSE(fs::exists(dir + "/latest"));
  fs::remove_all(dir);
}

TEST(Save, WithoutAnAtomicExchangeAnExistingTagIsRenamedAsideThenReplaced) {
  const std::string dir = ::testing::TempDir() + "save_test_aside_" + std::to_string(getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  save(dir, "a", 1);
  set_save_fault_for_testing("publish.exchange:unsupported");
  save(dir, "a", 2);
  set_save_fault_for_testing(std::nullopt);
  std::string why;
  EXPECT_EQ(complete(dir, &why), std::optional<int>(2)) << why;
  finish_removals();
  for (const auto& e : fs::directory_iterator(dir)) {
    EXPECT_FALSE(e.path().filename().string().starts_with(".zeroflat-")) << e.path();
  }
  // A fault in the fallback after the old tag went aside, before the new one is in: the old
  // one is put back.
  set_save_fault_for_testing("publish.exchange:unsupported");
  const std::string partial = partial_tag_name("a");
  fs::create_directories(dir + "/" + partial);
  EXPECT_THROW((void)publish_tag(dir, partial + "-missing", "a"), IoError);
  set_save_fault_for_testing(std::nullopt);
  EXPECT_EQ(complete(dir, &why), std::optional<int>(2)) << why;
  fs::remove_all(dir);
}

TEST(Save, LatestHoldsTheTagAloneAsDeepSpeedWritesIt) {
  const std::string dir = ::testing::TempDir() + "save_test_latest_" + std::to_string(getpid());
  fs::create_directories(dir);
  save(dir, "global_step7", 1);
  EXPECT_EQ(slurp(dir + "/latest"), "global_step7");
  EXPECT_FALSE(fs::exists(dir + "/latest.tmp"));
  const Published again = [&] {
    const std::string partial = partial_tag_name("global_step7");
    fs::create_directories(dir + "/" + partial);
    std::ofstream(dir + "/" + partial + "/x") << "new";
    return publish_tag(dir, partial, "global_step7");
  }();
  EXPECT_TRUE(again.replaced);
  EXPECT_TRUE(again.exchanged);  // this machine's file system swaps in one rename
  EXPECT_TRUE(fs::exists(dir + "/global_step7/x"));
  EXPECT_FALSE(fs::exists(dir + "/global_step7/f0"));
  finish_removals();
  EXPECT_FALSE(fs::exists(dir + "/" + partial_tag_name("global_step7")));
  fs::remove_all(dir);
}

TEST(Save, TheReplacedTagIsRemovedAfterThePublicationAndAFailedRemovalIsTriedAgain) {
  const std::string dir = ::testing::TempDir() + "save_test_retired_" + std::to_string(getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  save(dir, "a", 1);
  // The removal fails in the library's thread: the save has returned, whole; the old tag waits
  // out of sight under the partial name, and each later try fails while the fault holds.
  set_save_fault_for_testing("publish.remove:eio");
  save(dir, "a", 2);
  EXPECT_THROW(finish_removals(), IoError);
  EXPECT_TRUE(fs::exists(dir + "/" + partial_tag_name("a") + "/f0"));
  try {
    finish_removals();
    ADD_FAILURE() << "a folder that could not be removed was forgotten";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(partial_tag_name("a")), std::string::npos) << e.what();
    EXPECT_EQ(e.code(), EIO);
  }
  set_save_fault_for_testing(std::nullopt);
  std::string why;
  EXPECT_EQ(complete(dir, &why), std::optional<int>(2)) << why;
  finish_removals();
  EXPECT_FALSE(fs::exists(dir + "/" + partial_tag_name("a")));
  // Another tag's save settles a pending removal before it cleans its own folder.
  set_save_fault_for_testing("publish.remove:delay");
  save(dir, "a", 3);
  set_save_fault_for_testing(std::nullopt);
  save(dir, "b", 4);
  EXPECT_FALSE(fs::exists(dir + "/" + partial_tag_name("a")));
  EXPECT_EQ(complete(dir, &why), std::optional<int>(4)) << why;
  EXPECT_EQ(slurp(dir + "/a/f0"), file_text(3, 0));
  // Where the system refuses the thread, the publication removes the old tag itself.
  detail::set_thread_start_hook([](unsigned) { throw std::system_error(EAGAIN, std::generic_category()); });
  save(dir, "a", 5);
  detail::set_thread_start_hook({});
  EXPECT_FALSE(fs::exists(dir + "/" + partial_tag_name("a")));
  EXPECT_EQ(slurp(dir + "/a/f0"), file_text(5, 0));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace zeroflat
