// Training-loop glue for the recipes' optimizer-step hook (see oscireset.h).
#include "train/oscireset.h"

#include <algorithm>

namespace nibble::train {

void set_recipe_total_steps(model::Model& m, int64_t total_steps) {
  for (const auto& info : m.linear_infos()) m.linear_recipe(info.id)->set_total_steps(total_steps);
}

int64_t recipe_after_optimizer_step(model::Model& m, int64_t step) {
  int64_t resets = 0;
  for (const auto& info : m.linear_infos()) {
    model::LinearRecipe* r = m.linear_recipe(info.id);
    auto before = r->stats();
    r->after_optimizer_step(m.backend(), m.linear_weight(info.id), info.N, info.K, step);
    auto after = r->stats();
    auto a = after.find("oscireset.resets_total");
    if (a != after.end()) resets += static_cast<int64_t>(a->second - before["oscireset.resets_total"]);
  }
  return resets;
}

std::map<std::string, double> recipe_stats(model::Model& m) {
  std::map<std::string, double> out;
  for (const auto& info : m.linear_infos()) {
    for (const auto& [k, v] : m.linear_recipe(info.id)->stats()) {
      const bool is_max = k.size() >= 11 && k.compare(k.size() - 11, 11, ".start_step") == 0;
      auto it = out.find(k);
      if (it == out.end()) out[k] = v;
      else it->second = is_max ? std::max(it->second, v) : it->second + v;
    }
  }
  return out;
}

}  // namespace nibble::train
