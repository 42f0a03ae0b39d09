// Tests of the output-path guards (io/output_guard.h) and of what they give the atomic writer:
// same_file through hard links and symlinks, path_within on real paths, stale temporaries of
// killed writers removed by the next AtomicFileWriter of the same name (only when their process
// is gone), and a writer asked to stop on SIGINT that abandons its file with no temporary left.
#include "io/output_guard.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "core/interrupt.h"
#include "io/atomic_file.h"

namespace nibble::io {
namespace {

namespace fs = std::filesystem;

// The pid of a process that has exited (and was reaped): what a killed writer leaves in names.
long dead_pid() {
  pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return static_cast<long>(pid);
}

class OutputGuardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nibble_output_guard_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    clear_interrupt();
  }
  void TearDown() override {
    clear_interrupt();
    fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(OutputGuardTest, SameFileSeesLinksAndPathWithinSeesRealPaths) {
  std::ofstream(path("a")) << "x";
  ASSERT_EQ(::link(path("a").c_str(), path("hard").c_str()), 0);
  fs::create_symlink(path("a"), path("soft"));
  EXPECT_TRUE(same_file(path("a"), path("hard")));
  EXPECT_TRUE(same_file(path("a"), path("soft")));
  std::ofstream(path("b")) << "x";
  EXPECT_FALSE(same_file(path("a"), path("b")));
  EXPECT_FALSE(same_file(path("a"), path("missing")));

  fs::create_directories(path("run/checkpoints"));
  fs::create_directory_symlink(path("run"), path("alias"));
  EXPECT_TRUE(path_within(path("run/checkpoints/x"), path("run")));
  EXPECT_TRUE(path_within(path("alias/new/deeper"), path("run")));  // through the symlink, not yet existing
  EXPECT_TRUE(path_within(path("run/"), path("run")));
  EXPECT_TRUE(path_within(path("run/checkpoints/.."), path("run")));
  EXPECT_TRUE(path_within(path("run"), dir_.string()));
  EXPECT_FALSE(path_within(path("runner"), path("run")));  // a prefix of the name is not a parent
  EXPECT_FALSE(path_within(dir_.string(), path("run")));
}

TEST_F(OutputGuardTest, TheNextWriteRemovesTemporariesOfKilledWriters) {
  const std::string out = path("out.safetensors");
  const std::string dead = std::to_string(dead_pid()), live = std::to_string(::getppid());
  const std::vector<std::string> stale = {out + ".tmp." + dead + ".0", out + ".tmp." + dead, out + ".old." + dead};
  const std::vector<std::string> kept = {out + ".tmp." + live + ".0",   // its writer still runs
                                         path("other.safetensors.tmp." + dead + ".0"),  // another name
                                         out + ".tmp.x" + dead, out + ".backup"};
  for (const auto& p : stale) std::ofstream(p) << "partial";
  fs::create_directories(out + ".old." + dead + "x");  // not a pid: kept
  for (const auto& p : kept) std::ofstream(p) << "keep";
  ASSERT_TRUE(write_file_atomic(out, "new", 3));
  for (const auto& p : stale) EXPECT_FALSE(fs::exists(p)) << p;
  for (const auto& p : kept) EXPECT_TRUE(fs::exists(p)) << p;
  EXPECT_TRUE(fs::exists(out + ".old." + dead + "x"));
  // Under a lock (any_pid), a live pid's temporary goes too; this process's own never does.
  const std::string mine = out + ".tmp." + std::to_string(::getpid()) + ".7";
  std::ofstream(mine) << "mine";
  EXPECT_EQ(remove_stale_temporaries(out, /*any_pid=*/true), 1);
  EXPECT_FALSE(fs::exists(out + ".tmp." + live + ".0"));
  EXPECT_TRUE(fs::exists(mine));
}

TEST_F(OutputGuardTest, AWriterStoppedBySigintLeavesNoTemporary) {
  const std::string out = path("out.bin");
  auto w = AtomicFileWriter::create(out);
  ASSERT_TRUE(w);
  w->stop_on_interrupt();
  ASSERT_TRUE(w->append("abc", 3));
  const std::string temp = w->temp_path();
  EXPECT_TRUE(fs::exists(temp));
  install_interrupt_handlers();
  ::raise(SIGINT);
  Status s = w->append("def", 3);
  clear_interrupt();
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("interrupted by SIGINT"), std::string::npos) << s.message();
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace nibble::io
