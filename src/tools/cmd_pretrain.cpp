// `nibble pretrain`: trains a model from a run config (train/run_config.h) with `--set`
// overrides, writing metrics.jsonl, loss.png and checkpoints into --out; `--resume` continues
// the run from its latest checkpoint bit-identically. The loop itself is train/trainer.h. The run
// folder is locked while it works (train/run_lock.h); SIGINT/SIGTERM stop it after the current
// step with a checkpoint, and the one error line says how to resume (exit 130/143). `--device`
// picks the backend (tools/device_option.h); the run folder is the same on every device, so a
// run resumes on another one. Under `mpirun -np N` (or RANK/WORLD_SIZE/MASTER_* with NCCL) it
// trains data-parallel (tools/process_group_setup.h, train/data_parallel.h); rank 0 prints and
// writes, and an error only one rank saw ends the whole world (abort_world) instead of a hang.
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/interrupt.h"
#include "core/log.h"
#include "tools/command.h"
#include "tools/device_option.h"
#include "tools/process_group_setup.h"
#include "tools/run_command.h"
#include "train/progress.h"
#include "train/trainer.h"

namespace nibble::tools {
namespace {

struct PretrainArgs : RunArgs {
  std::vector<std::string> data;
};

int run_pretrain_in(const PretrainArgs& a, const dist::LaunchEnv& launch);

int run_pretrain(const PretrainArgs& a) {
  auto launch = read_launch();
  if (!launch) return report_error("pretrain", launch.status());
  return run_pretrain_in(a, *launch);
}

int run_pretrain_in(const PretrainArgs& a, const dist::LaunchEnv& launch) {
  // An error before the group exists: this rank alone knows; under mpirun the launcher ends the
  // job when a rank exits non-zero before MPI_Init.
  auto be = open_device(device_for_launch(a.device, launch));
  if (!be) return report_error("pretrain", be.status());
  auto pg = open_process_group(launch, **be);
  if (!pg) return report_error("pretrain", pg.status());
  dist::ProcessGroup& group = *(*pg)->group;
  const bool rank0 = group.rank() == 0, multi = group.world_size() > 1;
  if (!rank0) spdlog::set_level(spdlog::level::warn);  // one run log: rank 0's (warnings from all)
  // After the group exists: an error every rank returned together (agreed) is printed by rank 0
  // and the processes end normally; one seen by this rank alone is printed here and ends the world.
  auto fail = [&](const Status& st) {
    const bool together = group.failed_together();
    int rc = 0;
    if (rank0 || !together) rc = report_error("pretrain", multi ? Status(st.code(), st.message() + (rank0 ? "" : fmt::format(" (rank {})", group.rank()))) : st);
    else rc = st.code() == StatusCode::kInvalidArgument ? 2 : 1;
    if (multi && !together) group.abort_world(rc);
    return rc;
  };
  std::vector<std::string> overrides = a.sets;
  if (!a.data.empty()) overrides.push_back("data.files=" + nlohmann::json(a.data).dump());
  Result<train::RunConfig> cfg = Status::ok();
  if (a.resume) {
    if (!a.config.empty()) NIB_LOG_INFO("--resume: using the run config saved in the checkpoint (--config ignored)");
    cfg = train::resume_run_config(a.out, overrides);
  } else if (!a.config.empty()) {
    cfg = train::load_run_config(a.config, overrides);
  } else {
    cfg = train::resolve_run_config(nlohmann::json::object(), overrides);
  }
  Status cfg_status = cfg ? Status::ok() : cfg.status();
  if (multi) cfg_status = dist::agree(group, cfg_status);  // a bad --set: one line from rank 0, no abort
  if (!cfg_status) return fail(cfg_status);
  train::TrainOptions opt;
  opt.run_dir = a.out;
  opt.resume = a.resume;
  opt.stop_after_step = a.stop_after;
  opt.progress = !a.no_progress;
  opt.backend = be->get();
  opt.group = &group;
  NIB_LOG_INFO("pretrain: on {}, {} recipe, {} steps of {}x{}x{} tokens, out {}; world: {} ({})", (*be)->name(),
               cfg->recipe.name, cfg->steps, cfg->batch_size, cfg->grad_accum, cfg->seq_len, a.out,
               launch.describe(), group.kind());
  install_interrupt_handlers();
  auto r = train::run_pretraining(*cfg, opt);
  if (!r && !rank0 && group.failed_together()) return fail(r.status());
  if (!r) return fail(with_resume_hint(r.status(), "pretrain", a.out));
  if (!rank0) return 0;  // rank 0 prints the result
  if (r->already_finished) {  // a plain --resume of a finished run: nothing done, exit 0
    print_already_finished("pretrain", a.out, r->end_step, cfg->steps, r->checkpoint_dir);
    return 0;
  }
  // --stop-after before the first validation: say so rather than print a loss of 0.
  const std::string val = r->validated ? fmt::format("val loss {:.4f}  val ppl {}", r->val_loss,
                                                     train::ProgressBar::format_perplexity(r->val_ppl))
                                       : std::string("no validation ran");
  std::printf("pretrain: %s step %lld/%lld  %s  skipped %lld  %.1f s (%.0f tok/s)  checkpoint %s\n",
              cfg->recipe.name.c_str(), static_cast<long long>(r->end_step), static_cast<long long>(cfg->steps),
              val.c_str(), static_cast<long long>(r->skipped_steps), r->seconds, r->tokens_per_second,
              r->checkpoint_dir.empty() ? "none (no step was trained)" : r->checkpoint_dir.c_str());
  return 0;
}

}  // namespace

NIBBLE_REGISTER_COMMAND(kPretrainCommand, "pretrain",
                        "Pretrain a model: run config + --set overrides; checkpoints, metrics.jsonl, loss.png",
                        [](CLI::App& app) -> CommandRun {
                          auto a = std::make_shared<PretrainArgs>();
                          add_run_options(app, a.get(), "Run config JSON (see docs/training.md); defaults if omitted",
                                          "optimizer.lr=1e-3");
                          app.add_option("--data", a->data, "Training text files, or NIBTOK token shards with data.tokenizer set (default: the KJV corpus)");
                          return [a] { return run_pretrain(*a); };
                        });

}  // namespace nibble::tools
