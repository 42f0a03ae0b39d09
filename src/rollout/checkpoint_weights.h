// A checkpoint's weights into the rollout engine without a training model (issue #15 item 5 on
// a real model size): the model is created with inference storage (no gradients, no FP32 block
// linears, no FP32 copy of a BF16 lm_head; model/transformer.h ParameterStorage) and the
// checkpoint's model.safetensors is read one tensor at a time (Engine::load_weights): kept
// parameters are copied to the model, each block linear's HF members are stacked on the host
// (one fused linear at a time) and quantized by the trainer's quantizer, or made BF16 bits, as
// the engine does from a training model's master weights (the same bits), and the lm_head
// becomes the engine's BF16 bits. A `nibble quantize --format nvfp4-2level` output (raw, RTN;
// rollout/quantized_weights.h) is taken as it is: its codes and scales, not re-quantized.
#pragma once

#include <memory>
#include <string>

#include "backend/backend.h"
#include "core/status.h"
#include "model/config.h"
#include "model/linear.h"
#include "model/transformer.h"
#include "rollout/engine.h"

namespace nibble::rollout {

// The recipe whose NVFP4 layout the 4-bit modes use (precision.h): the first linear recipe of
// `model` that is not "bf16" (nvfp4-nvidia's bf16_last_blocks keeps its last blocks in BF16),
// else "bf16".
std::string weight_layout_recipe(model::Model& model);

// A model of inference storage and the engine over it, holding a checkpoint's weights. The
// engine refers to the model: destroy the engine first (member order does).
struct InferenceEngine {
  std::unique_ptr<model::Model> model;
  std::unique_ptr<Engine> engine;
};

// Builds `config`'s model with `recipe` (attention precision, lm_head operands, NVFP4 layout:
// options.recipe_name is overwritten by weight_layout_recipe) in inference storage on `be`, the
// engine with `options` (mode bf16, w4a16 or w4a4), and loads `model_file` (Engine::load_weights).
// Peak host memory: about one tensor (the file is mapped, not read whole). Errors: the recipe
// mode (it runs the training model's recipes), model or engine creation, load_weights' errors.
Result<InferenceEngine> load_inference_engine(const model::ModelConfig& config, const model::RecipeConfig& recipe,
                                              const std::string& model_file, EngineOptions options,
                                              backend::Backend& be);

}  // namespace nibble::rollout
