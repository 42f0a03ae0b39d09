// The built-in LinearRecipe registrations. A new recipe adds one `add(...)` line here
// (registration from a static initialiser in another file of a static library would be dropped
// by the linker). A plain name -> factory table, as in ggml's backend registry.
#include <functional>

#include "model/linear.h"
#include "model/recipe_nvfp4_nvidia.h"
#include "model/recipe_tetrajet_v2.h"

namespace nibble::model {

void register_builtin_linear_recipes(const std::function<void(const std::string&, LinearRecipeFactory)>& add) {
  add("fp32", [](const RecipeConfig&, const LinearInfo&) -> Result<std::unique_ptr<LinearRecipe>> {
    return std::unique_ptr<LinearRecipe>(new Fp32LinearRecipe());
  });
  add("bf16", [](const RecipeConfig&, const LinearInfo&) -> Result<std::unique_ptr<LinearRecipe>> {
    return std::unique_ptr<LinearRecipe>(new Bf16LinearRecipe());
  });
  add("nvfp4-nvidia", make_nvfp4_nvidia_recipe);
  add("tetrajet-v2", make_tetrajet_v2_recipe);
}

}  // namespace nibble::model
