// What the training commands (`nibble pretrain`, `nibble sft`) share on the command line: the
// run options (--config, --set, --out, --resume, --stop-after, --no-progress, --device), the
// resume hint an interrupted run's error line ends with, and the line for a finished run resumed
// again.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace nibble::tools {

struct RunArgs {
  std::string config, out, device;
  std::vector<std::string> sets;
  bool resume = false, no_progress = false;
  int64_t stop_after = -1;
};

// Adds the run options to `app`, stored in *a; config_help and set_example describe --config
// and an example override for this command.
void add_run_options(CLI::App& app, RunArgs* a, const std::string& config_help, const std::string& set_example);

// `status` of a run stopped by SIGINT/SIGTERM with a checkpoint in `out`, ending in
// "; resume with: nibble <command> --out '<out>' --resume"; any other status unchanged.
Status with_resume_hint(const Status& status, const std::string& command, const std::string& out);

// Prints "<command>: '<out>' is already finished at step N/N; checkpoint ... (to train further:
// --resume --set steps=M with M > N)".
void print_already_finished(const std::string& command, const std::string& out, int64_t step, int64_t steps,
                            const std::string& checkpoint);

}  // namespace nibble::tools
