// Training checkpoints: RUN_DIR/checkpoints/step_000123/ holding model.safetensors (F32, HF
// tensor names), optimizer.safetensors (AdamW moments + step), recipe_state.safetensors (each
// linear's LinearRecipe::state(), named "<linear name>/<key>"), trainer.json (step, loader
// cursor, counters), config.json (HF model config), run_config.json and tokenizer.model. Each
// checkpoint is built in a temporary folder and renamed into place (AtomicDir), then the
// `checkpoints/latest` pointer file is rewritten atomically, then all but the last N are removed:
// a crash at any point leaves the previous checkpoint complete and `latest` naming a whole one.
// Mirrors the layout of HF Trainer's checkpoint-N folders with safetensors instead of pickles.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/linear.h"
#include "model/transformer.h"
#include "train/optimizer.h"

namespace nibble::train {

// "step_000123" (at least 6 digits).
std::string checkpoint_dir_name(int64_t step);

// Called before each stage of a checkpoint write with the stage name (a file name such as
// "model.safetensors", then "commit" and "latest"); a non-ok Status aborts the write there.
// Tests use it to simulate a crash mid-write.
using CheckpointHook = std::function<Status(const std::string& stage)>;

struct CheckpointWrite {
  const model::Model* model = nullptr;      // parameters and recipe states
  const AdamW* optimizer = nullptr;
  // When set, written as optimizer.safetensors instead of optimizer->export_state(): ZeRO-1's
  // state gathered from every rank (Zero1::gather_state; the same tensors, full moments).
  const std::vector<io::NamedTensor>* optimizer_state = nullptr;
  nlohmann::json trainer;                   // trainer.json (must hold "step")
  nlohmann::json run_config;                // run_config.json
  std::string tokenizer_path;               // copied as tokenizer.model
  // Further safetensors files of the folder, (file name, tensors): e.g. the policy versions an
  // asynchronous RL run's rollout worker still needs (rl/rollout_worker.h).
  std::vector<std::pair<std::string, std::vector<io::NamedTensor>>> extra_safetensors;
  int64_t keep_last = 2;
  CheckpointHook hook;
};

// Writes RUN_DIR/checkpoints/step_<step>/ atomically, updates `latest`, prunes to keep_last.
// Returns the final folder.
Result<std::string> write_checkpoint(const std::string& run_dir, int64_t step, const CheckpointWrite& w);

// A checkpoint folder found and its small files parsed and checked.
struct Checkpoint {
  std::string dir;                  // the step folder
  int64_t step = 0;
  nlohmann::json trainer;
  nlohmann::json run_config;
  model::ModelConfig model_config;
  nlohmann::json model_config_json;
  std::string tokenizer_path;
};

// `path`: a step folder (has trainer.json), a run folder (uses checkpoints/latest) or a
// checkpoints folder (uses latest). Missing or corrupt parts are errors naming the file.
// optimizer.safetensors is not required: only a resume needs it (and checks it itself).
Result<Checkpoint> open_checkpoint(const std::string& path);
// The step folder `latest` names under RUN_DIR/checkpoints, or not_found.
Result<std::string> latest_checkpoint_dir(const std::string& run_dir);

// The model's parameters as F32 tensors with HF names (views; valid while the model lives).
std::vector<io::NamedTensor> model_named_tensors(const model::Model& model);
// Recipe states of all linears as "<linear name>/<key>" tensors.
std::vector<io::NamedTensor> recipe_state_tensors(const model::Model& model);

// Copies model.safetensors of `dir` into `model` (every parameter must be present with its HF
// shape, F32 or BF16; extra tensors are errors) and the recipe states, when present.
Status load_model_state(model::Model* model, const std::string& dir);

// The recipe the checkpoint's model runs: `recipe` when given, else its run_config's (default
// bf16). Error: a run_config recipe that does not parse.
Result<model::RecipeConfig> checkpoint_recipe(const Checkpoint& ckpt, const model::RecipeConfig* recipe = nullptr);

// Builds the checkpoint's model on `be` (recipe from its run_config unless `recipe` is given) and
// loads it; the checkpoint format is the same whichever device wrote or reads it.
// This (through load_model_state) is the one way every command reads a checkpoint's weights, so
// eval, generate, export and resume accept and refuse the same checkpoints.
Result<std::unique_ptr<model::Model>> load_checkpoint_model(const Checkpoint& ckpt,
                                                            const model::RecipeConfig* recipe = nullptr,
                                                            backend::Backend& be = backend::cpu_backend());

// The checkpoint's parameters as owned F32 tensors with HF names, in the model's order, loaded
// and checked by load_checkpoint_model (for exports).
Result<std::vector<io::NamedTensor>> load_checkpoint_tensors(const Checkpoint& ckpt);

}  // namespace nibble::train
