// The model and engine `nibble generate` and `nibble serve` run from a checkpoint (issue #15 item
// 5): in the bf16, w4a16 and w4a4 modes a model of inference storage whose weights are read one
// tensor at a time into the engine's storage (rollout/checkpoint_weights.h: no gradients, no FP32
// block linears or lm_head; the same bits and tokens as loading the training model); in the
// recipe mode, or where the training forward itself is needed (generate --dump-logits), the
// checkpoint's training model (train::load_checkpoint_model) as before.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "core/status.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "train/checkpoint.h"

namespace nibble::tools {

// The engine refers to the model: it is destroyed first (member order).
struct GenerationModel {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<rollout::Engine> engine;  // null where the backend has no paged KV-cache ops
  bool inference_storage() const { return model->storage() == model::ParameterStorage::kInference; }
};

// Loads `ck` on `be` for generation with engine options `eo` (eo.recipe_name is set from the
// model's recipes, precision.h); recipe: the --recipe override or null. training_forward: load
// the training model whatever the mode. Errors: a backend without the engine's ops in a mode
// other than recipe, the checkpoint loaders' errors (one line naming the file and tensor).
Result<GenerationModel> load_generation_model(const train::Checkpoint& ck, const model::RecipeConfig* recipe,
                                              rollout::EngineOptions eo, backend::Backend& be, bool training_forward);

}  // namespace nibble::tools
