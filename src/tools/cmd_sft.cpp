// `nibble sft`: the supervised warm start on generated task solutions (rl/sft.h) before `nibble
// rl`: a run config whose "task" section names the task, with `--set` overrides; the same run
// folder, checkpoints, metrics.jsonl, resume and misuse protection as `nibble pretrain` (it runs
// the pretraining trainer), plus greedy held-out accuracy at each validation. One process (no
// data parallelism); `--device` picks the backend.
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/interrupt.h"
#include "core/log.h"
#include "rl/sft.h"
#include "tools/command.h"
#include "tools/device_option.h"
#include "tools/run_command.h"

namespace nibble::tools {
namespace {

int run_sft(const RunArgs& a) {
  if (a.config.empty() && !a.resume)
    return report_error("sft", invalid_argument("--config is required (a run config with a \"task\" section; "
                                                "see docs/rl.md), except with --resume"));
  auto be = open_device(a.device);
  if (!be) return report_error("sft", be.status());
  Result<train::RunConfig> cfg = Status::ok();
  if (a.resume) {
    if (!a.config.empty()) NIB_LOG_INFO("--resume: using the run config saved in the checkpoint (--config ignored)");
    cfg = train::resume_run_config(a.out, a.sets);
  } else {
    cfg = train::load_run_config(a.config, a.sets);
  }
  if (!cfg) return report_error("sft", cfg.status());
  train::TrainOptions opt;
  opt.run_dir = a.out;
  opt.resume = a.resume;
  opt.stop_after_step = a.stop_after;
  opt.progress = !a.no_progress;
  opt.backend = be->get();
  NIB_LOG_INFO("sft: on {}, task {} levels [{}], {} recipe, {} steps of {}x{}x{} tokens, out {}", (*be)->name(),
               cfg->task.name, fmt::format("{}", fmt::join(cfg->task.levels, ",")), cfg->recipe.name, cfg->steps,
               cfg->batch_size, cfg->grad_accum, cfg->seq_len, a.out);
  install_interrupt_handlers();
  auto r = rl::run_sft(*cfg, opt);
  if (!r) return report_error("sft", with_resume_hint(r.status(), "sft", a.out));
  if (r->already_finished) {
    print_already_finished("sft", a.out, r->end_step, cfg->steps, r->checkpoint_dir);
    return 0;
  }
  std::string val = r->validated ? fmt::format("val loss {:.4f}", r->val_loss) : std::string("no validation ran");
  if (r->validation_extra.is_object() && r->validation_extra.contains("accuracy"))
    val += fmt::format("  accuracy {:.3f} ({}/{})", r->validation_extra["accuracy"].get<double>(),
                       r->validation_extra["accuracy_correct"].get<int64_t>(),
                       r->validation_extra["accuracy_total"].get<int64_t>());
  std::printf("sft: %s step %lld/%lld  %s  skipped %lld  %.1f s  checkpoint %s\n", cfg->task.name.c_str(),
              static_cast<long long>(r->end_step), static_cast<long long>(cfg->steps), val.c_str(),
              static_cast<long long>(r->skipped_steps), r->seconds,
              r->checkpoint_dir.empty() ? "none (no step was trained)" : r->checkpoint_dir.c_str());
  return 0;
}

}  // namespace

NIBBLE_REGISTER_COMMAND(kSftCommand, "sft",
                        "Supervised warm start on generated task solutions (loss on answer tokens) before nibble rl",
                        [](CLI::App& app) -> CommandRun {
                          auto a = std::make_shared<RunArgs>();
                          add_run_options(app, a.get(),
                                          "Run config JSON with a \"task\" section (docs/rl.md), e.g. configs/sft-tiny-moe.json",
                                          "task.levels=[0,1]");
                          return [a] { return run_sft(*a); };
                        });

}  // namespace nibble::tools
