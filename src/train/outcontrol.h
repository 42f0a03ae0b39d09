// Checkpoint and inspection glue for OutControl (02-pretraining-recipes.md §4.2) and the rest of
// the linear recipes' state: the static outlier selection is made inside the tetrajet-v2 recipe
// (model/recipe_tetrajet_v2.h) from the calibration window on LinearCall::step; here it travels to
// and from checkpoints as named tensors "recipe.<linear name>.<key>" (keys of
// LinearRecipe::state(), e.g. "recipe.model.layers.0.mlp.down_proj.outliers.channels").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/safetensors.h"
#include "model/transformer.h"

namespace nibble::train {

inline constexpr const char* kRecipeStatePrefix = "recipe.";

// Every linear's LinearRecipe::state() as named tensors (empty for stateless recipes).
std::vector<io::NamedTensor> export_recipe_state(model::Model& m);

// Gives each linear the tensors named "recipe.<its name>.<key>" (LinearRecipe::load_state).
// Tensors without the prefix are ignored (the caller may pass a whole checkpoint); a "recipe."
// tensor that matches no linear is an error.
Status import_recipe_state(model::Model& m, const std::vector<io::NamedTensor>& tensors);

// Outlier input channels per linear name, for the linears that have made a selection.
std::map<std::string, std::vector<int64_t>> outlier_selections(model::Model& m);

}  // namespace nibble::train
