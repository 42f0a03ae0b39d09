// Loading a checkpoint for generate / serve: inference storage unless the recipe mode or the
// training forward needs the training model (see generation_model.h).
#include "tools/generation_model.h"

#include <filesystem>

#include "rollout/checkpoint_weights.h"

namespace nibble::tools {

Result<GenerationModel> load_generation_model(const train::Checkpoint& ck, const model::RecipeConfig* recipe,
                                              rollout::EngineOptions eo, backend::Backend& be, bool training_forward) {
  const bool engine_ops = be.supports(backend::Op::kPagedKvCache);
  GenerationModel out;
  if (eo.mode == rollout::PrecisionMode::kRecipe || training_forward) {
    NIB_ASSIGN_OR_RETURN(out.model, train::load_checkpoint_model(ck, recipe, be));
    eo.recipe_name = rollout::weight_layout_recipe(*out.model);
    if (engine_ops) {
      NIB_ASSIGN_OR_RETURN(out.engine, rollout::Engine::create(*out.model, eo));
    }
    return out;
  }
  if (!engine_ops)
    return unimplemented("backend '{}' has no paged KV-cache ops yet (issue #15): the {} mode needs --device cpu",
                         be.name(), rollout::precision_mode_name(eo.mode));
  NIB_ASSIGN_OR_RETURN(model::RecipeConfig rc, train::checkpoint_recipe(ck, recipe));
  const std::string file = (std::filesystem::path(ck.dir) / "model.safetensors").string();
  NIB_ASSIGN_OR_RETURN(rollout::InferenceEngine ie, rollout::load_inference_engine(ck.model_config, rc, file, eo, be));
  out.model = std::move(ie.model);
  out.engine = std::move(ie.engine);
  return out;
}

}  // namespace nibble::tools
