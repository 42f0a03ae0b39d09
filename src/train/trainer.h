// The pretraining loop of `nibble pretrain` (llm.c's train_gpt2 main loop, nanoGPT's train.py):
// prepare the data folder, build the model with its LinearRecipe, then per optimizer step:
// grad_accum micro-batches of forward+backward (CE + z-loss), global-norm clip, AdamW with the
// LR schedule, the recipes' after_optimizer_step hooks (OsciReset), progress bar, metrics.jsonl,
// periodic validation (loss, perplexity) with loss.png, and atomic checkpoints. Non-finite loss
// or gradients skip the update (logged) and abort after max_bad_steps in a row. A resumed run
// reproduces the uninterrupted run's losses bit for bit (same thread count).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "dist/process_group.h"
#include "model/transformer.h"
#include "train/checkpoint.h"
#include "train/loader.h"
#include "train/run_config.h"

namespace nibble::train {

// Training data the caller makes instead of the data folder (`nibble sft`: tokenized task
// examples, prompt positions without targets): train and validation rows, the tokenizer file
// checkpoints copy, and a line for the log.
struct RowData {
  std::shared_ptr<const Rows> train, val;
  std::string tokenizer_path;
  std::string description;
};

struct TrainOptions {
  std::string run_dir;            // outputs: metrics.jsonl, loss.png, checkpoints/, data/ (default)
  bool resume = false;            // continue from run_dir's latest checkpoint
  int64_t stop_after_step = -1;   // > 0: stop after this step (with a checkpoint), as if interrupted
  bool progress = true;           // progress bar on stderr
  // Where the model, its gradients and the AdamW moments live and every op runs (null: the
  // process CPU backend); it must outlive the call. Deliberately not part of RunConfig: the run
  // config is the run's identity (saved in checkpoints, checked on resume), the device is not, so
  // a run started on a GPU resumes on a CPU and back. Recorded in metrics.jsonl ("device" of the
  // start and resume events).
  backend::Backend* backend = nullptr;
  CheckpointHook checkpoint_hook; // tests: inject failures into checkpoint writes
  // tests: called after each step's backward (and gradient reduce) with (step, grads (n) f32, n)
  // to inject NaNs.
  std::function<void(int64_t step, float* grads, int64_t n)> grad_hook;
  // Data parallelism (train/data_parallel.h): null or the "single" group trains alone as before.
  // Any other group (MPI, NCCL; also a one-rank one, which runs the collectives) splits each
  // micro-batch's rows over its ranks and sums gradients over them; rank 0 alone takes the run
  // lock and writes data/, metrics.jsonl, loss.png and checkpoints (same format: a run resumes
  // in another world size). Every rank must call run_pretraining with the same config and folder.
  dist::ProcessGroup* group = nullptr;
  // Rows instead of the data folder (`nibble sft`; not with data parallelism): called under the
  // run lock after the fresh/resume checks, with the folder of the checkpoint being resumed (""
  // on a fresh run). The loaders shuffle, batch and resume the rows as they do shard windows.
  std::function<Result<RowData>(const RunConfig& config, const std::string& resume_checkpoint)> row_data;
  // Called after each validation with the model and the step; its JSON object is merged into
  // that validation's metrics.jsonl event, and the last one into the end event (`nibble sft`:
  // greedy accuracy on held-out instances).
  std::function<Result<nlohmann::json>(model::Model& model, int64_t step)> after_validation;
};

struct TrainResult {
  int64_t start_step = 0;          // the step this call started from (0, or the resumed one)
  int64_t end_step = 0;            // steps done at return
  std::vector<double> losses;      // training loss (CE + z-loss) of each step of this call; NaN if skipped
  int64_t skipped_steps = 0;
  bool validated = false;            // a validation ran (else val_loss/val_ppl mean nothing)
  double val_loss = 0, val_ppl = 0;  // last validation
  double seconds = 0, tokens_per_second = 0;
  std::string checkpoint_dir;      // the last checkpoint written (on resume: the one resumed from)
  nlohmann::json validation_extra; // the last after_validation result (null if none ran)
  bool already_finished = false;   // resume of a run whose checkpoint is at its last step: nothing done
};

struct EvalResult {
  double loss = 0;      // mean cross-entropy per target token (nats)
  double ppl = 0;       // exp(loss)
  int64_t tokens = 0;
  int64_t batches = 0;
};

// Validation: mean CE over the loader's batches (no z-loss), forward only, on the model's backend.
// stop_on_interrupt: a SIGINT/SIGTERM recorded by core/interrupt.h ends it between batches with
// cancelled_status (`nibble eval`; the trainer's periodic validation finishes and checkpoints).
// group (data parallel): rank r evaluates batches r, r+N, ...; the CE sums are added over ranks.
Result<EvalResult> evaluate(model::Model* model, const ValLoader& val, bool stop_on_interrupt = false,
                            dist::ProcessGroup* group = nullptr);

// The run config saved in run_dir's latest checkpoint, with `overrides` applied (for --resume).
Result<RunConfig> resume_run_config(const std::string& run_dir, const std::vector<std::string>& overrides);

// Trains per `config`; see TrainOptions. Errors: bad data, model/recipe errors, a run_dir that
// already has checkpoints without resume, max_bad_steps consecutive non-finite steps (the message
// names the newest checkpoint holding trained, finite weights, or "none"), a resume whose
// `steps` or `stop_after_step` is below the checkpoint's step. A resume of a run already at
// `steps` returns at once with already_finished set, writing nothing (no metrics event).
// Checkpoints are only written once an optimizer update has been applied: a run whose every
// step so far was skipped has nothing trained to save.
Result<TrainResult> run_pretraining(const RunConfig& config, const TrainOptions& options);

}  // namespace nibble::train
