// Training-loop glue for the linear recipes' optimizer-step hook (OsciReset, 02-pretraining-
// recipes.md §3). The per-element OsciReset logic lives in the tetrajet-v2 recipe
// (model/recipe_tetrajet_v2.h: model/ cannot depend on train/); these functions are what the
// pretraining loop calls: once before training (total steps, for start_fraction), after every
// optimizer update (the hook on every linear with its (N,K) weight view), and for metrics.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "model/transformer.h"

namespace nibble::train {

// LinearRecipe::set_total_steps(total_steps) on every linear of the model.
void set_recipe_total_steps(model::Model& m, int64_t total_steps);

// After the optimizer update of step `step` (the step number the update completed, the same
// number Model::set_step gave its forward): LinearRecipe::after_optimizer_step on every linear
// with its master weight view (N,K), which OsciReset may modify. Returns the number of weight
// elements reset at this step, summed over linears.
int64_t recipe_after_optimizer_step(model::Model& m, int64_t step);

// LinearRecipe::stats() summed over linears (e.g. "oscireset.resets_total", "outliers.channels",
// "outliers.selected" = number of layers with a selection); "*.start_step" keys take the max.
std::map<std::string, double> recipe_stats(model::Model& m);

}  // namespace nibble::train
