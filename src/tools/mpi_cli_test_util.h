// Helpers of the CLI tests that run nibble under `mpirun` (dp_cli_test.cpp, rl_cli_test.cpp):
// whether it can run here, the mpirun prefix CI needs, and a shell line run with its output kept.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "tools/cli_test_util.h"

namespace nibble::tools::test {

// "" when runs under mpirun can be tested here, else why not (the skip message).
inline std::string why_no_mpirun() {
#ifndef NIBBLE_HAVE_MPI
  return "nibble was built without MPI (install libopenmpi-dev openmpi-bin: scripts/setup.sh, then re-run cmake)";
#else
  if (std::system("command -v mpirun > /dev/null 2>&1") != 0)
    return "mpirun not found (install openmpi-bin: scripts/setup.sh)";
  return "";
#endif
}

// `mpirun -np N` with the options CI needs: more ranks than cores, and root only where we are root.
// LeakSanitizer off for the ranks (sanitizer CI): OpenMPI keeps allocations past MPI_Finalize.
inline std::string mpirun(int np) {
  return "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0 mpirun --oversubscribe" + std::string(::geteuid() == 0 ? " --allow-run-as-root" : "") + " -np " +
         std::to_string(np) + " ";
}

// Runs a shell command line in `dir`, capturing stdout/stderr.
inline RunResult run_shell(const fs::path& dir, const std::string& cmd) {
  RunResult r;
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const int status = std::system((cmd + " > '" + out.string() + "' 2> '" + err.string() + "'").c_str());
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace nibble::tools::test
