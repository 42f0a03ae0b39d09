// Test helper for MPI code: re-launches the running GoogleTest program under `mpirun -np N` with
// a test filter, so one TEST both starts the workers (from ctest) and is their body (under
// mpirun: OMPI_COMM_WORLD_SIZE set). Used by the MPI tests of dist/, train/ and rl/.
// LeakSanitizer is off for the workers (sanitizer CI): OpenMPI keeps allocations past MPI_Finalize.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "dist/process_group.h"

namespace nibble::dist::test {

inline bool under_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

// "" when MPI tests can run here, else why not (the GTEST_SKIP message).
inline std::string why_no_mpirun() {
  if (!mpi_available()) return "nibble was built without MPI (install libopenmpi-dev openmpi-bin and re-run cmake)";
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0) return "mpirun not found (install openmpi-bin)";
  return "";
}

// What `mpirun -np np THIS_PROGRAM --gtest_filter=filter` printed (stdout and stderr), its exit
// status in *ok (exited 0), and in *passed how many workers printed "[  PASSED  ] 1 test".
inline std::string run_self_under_mpirun(int np, const std::string& filter, bool* ok, int* passed) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd = "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 mpirun --oversubscribe" +
                          std::string(::geteuid() == 0 ? " --allow-run-as-root" : "") + " -np " + std::to_string(np) +
                          " '" + self + "' --gtest_color=no --gtest_filter=" + filter + " 2>&1";
  std::string out;
  *ok = false;
  *passed = 0;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return "popen failed: " + cmd;
  char buf[4096];
  while (size_t k = std::fread(buf, 1, sizeof buf, p)) out.append(buf, k);
  const int status = ::pclose(p);
  *ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  for (size_t at = out.find("[  PASSED  ] 1 test"); at != std::string::npos; at = out.find("[  PASSED  ] 1 test", at + 1))
    ++*passed;
  return out;
}

// The launching half of such a TEST: `filter` under mpirun -np np must exit 0 with every worker
// passing its one test (the caller skips first when why_no_mpirun() says why it cannot run).
inline void expect_every_rank_passes(int np, const std::string& filter) {
  bool ok = false;
  int passed = 0;
  const std::string out = run_self_under_mpirun(np, filter, &ok, &passed);
  EXPECT_TRUE(ok) << out;
  EXPECT_EQ(passed, np) << out;
}

}  // namespace nibble::dist::test
