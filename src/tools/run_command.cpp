// The training commands' shared command-line pieces (run_command.h): the run options, the
// resume hint of an interrupted run (the run folder shell-quoted so the line can be pasted), and
// the finished-run line.
#include "tools/run_command.h"

#include <cstdio>
#include <limits>

#include "core/interrupt.h"
#include "tools/device_option.h"
#include "tools/option_check.h"
#include "train/checkpoint.h"

namespace nibble::tools {

void add_run_options(CLI::App& app, RunArgs* a, const std::string& config_help, const std::string& set_example) {
  // A missing file is reported by load_run_config (bad input: exit 1), not by CLI11 (exit 2).
  app.add_option("--config", a->config, config_help);
  app.add_option("--set", a->sets, "Override a config key, e.g. --set " + set_example + " (repeatable)")
      ->allow_extra_args(false);
  app.add_option("--out", a->out, "Run folder (checkpoints/, metrics.jsonl, loss.png)")->required();
  app.add_flag("--resume", a->resume, "Continue from the run folder's latest checkpoint");
  app.add_option("--stop-after", a->stop_after,
                 "Stop after this step with a checkpoint, as if interrupted (for testing --resume)")
      ->check(IntegerIn(1, std::numeric_limits<int64_t>::max()));
  app.add_flag("--no-progress", a->no_progress, "No progress bar");
  add_device_option(app, &a->device);
}

Status with_resume_hint(const Status& status, const std::string& command, const std::string& out) {
  if (status.is_ok() || interrupt_signal() == 0 || !train::latest_checkpoint_dir(out).is_ok()) return status;
  std::string quoted = "'";
  for (char c : out) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  return Status(status.code(), status.message() + "; resume with: nibble " + command + " --out " + quoted + " --resume");
}

void print_already_finished(const std::string& command, const std::string& out, int64_t step, int64_t steps,
                            const std::string& checkpoint) {
  std::printf("%s: '%s' is already finished at step %lld/%lld; checkpoint %s (to train further: --resume --set "
              "steps=N with N > %lld)\n", command.c_str(), out.c_str(), static_cast<long long>(step),
              static_cast<long long>(steps), checkpoint.c_str(), static_cast<long long>(step));
}

}  // namespace nibble::tools
