// Checkpoint and inspection glue for the recipes' state (see outcontrol.h).
#include "train/outcontrol.h"

namespace nibble::train {

std::vector<io::NamedTensor> export_recipe_state(model::Model& m) {
  std::vector<io::NamedTensor> out;
  for (const auto& info : m.linear_infos())
    for (auto& [k, t] : m.linear_recipe(info.id)->state())
      out.push_back(io::NamedTensor{std::string(kRecipeStatePrefix) + info.name + "." + k, t});
  return out;
}

Status import_recipe_state(model::Model& m, const std::vector<io::NamedTensor>& tensors) {
  const std::string prefix = kRecipeStatePrefix;
  std::vector<bool> used(tensors.size(), false);
  for (const auto& info : m.linear_infos()) {
    const std::string p = prefix + info.name + ".";
    std::map<std::string, Tensor> mine;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const std::string& n = tensors[i].name;
      if (n.size() > p.size() && n.compare(0, p.size(), p) == 0) {
        if (used[i]) return invalid_argument("recipe state: tensor '{}' matches two linear layers", n);
        mine[n.substr(p.size())] = tensors[i].tensor;
        used[i] = true;
      }
    }
    if (!mine.empty()) NIB_RETURN_IF_ERROR(m.linear_recipe(info.id)->load_state(mine));
  }
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!used[i] && tensors[i].name.compare(0, prefix.size(), prefix) == 0)
      return invalid_argument("recipe state: tensor '{}' matches no linear layer of the model", tensors[i].name);
  return Status::ok();
}

std::map<std::string, std::vector<int64_t>> outlier_selections(model::Model& m) {
  std::map<std::string, std::vector<int64_t>> out;
  for (const auto& info : m.linear_infos()) {
    auto st = m.linear_recipe(info.id)->state();
    auto it = st.find("outliers.channels");
    if (it == st.end()) continue;
    const int64_t* p = it->second.data<int64_t>();
    out[info.name].assign(p, p + it->second.numel());
  }
  return out;
}

}  // namespace nibble::train
