// Checkpoint writing (atomic folder + latest pointer + pruning) and reading. See checkpoint.h.
#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "core/bits.h"
#include "io/regular_file.h"
#include "train/atomic_dir.h"

namespace nibble::train {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

Status run_hook(const CheckpointHook& hook, const std::string& stage) {
  if (!hook) return Status::ok();
  return hook(stage);
}

Result<std::string> read_small_file(const std::string& path) {
  auto text = io::read_regular_file(path, "checkpoint file");
  if (!text && text.status().code() == StatusCode::kNotFound) return not_found("cannot open '{}'", path);
  return text;
}

Result<json> read_json(const std::string& path) {
  NIB_ASSIGN_OR_RETURN(std::string text, read_small_file(path));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return data_loss("corrupt checkpoint file '{}': not a JSON object", path);
  return j;
}

// Step folders under `ckpt_root`, sorted by step.
std::vector<std::pair<int64_t, std::string>> list_step_dirs(const std::string& ckpt_root) {
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  static const std::regex re("step_([0-9]+)");
  for (auto& e : fs::directory_iterator(ckpt_root, ec)) {
    std::smatch m;
    std::string name = e.path().filename().string();
    if (e.is_directory() && std::regex_match(name, m, re)) out.emplace_back(std::stoll(m[1].str()), name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Removes leftovers of crashed writes of other processes (step_N.tmp.<pid>, step_N.old.<pid>,
// latest.tmp.<pid>): the writer holds the run lock (run_lock.h), so no other process is writing.
void remove_stale_temporaries(const std::string& ckpt_root) {
  std::error_code ec;
  static const std::regex re("(step_[0-9]+\\.(tmp|old)|latest\\.tmp)\\.([0-9]+)");
  const std::string mine = std::to_string(::getpid());
  std::vector<fs::path> stale;
  for (auto& e : fs::directory_iterator(ckpt_root, ec)) {
    std::smatch m;
    std::string name = e.path().filename().string();
    if (std::regex_match(name, m, re) && m[3].str() != mine) stale.push_back(e.path());
  }
  for (auto& p : stale) fs::remove_all(p, ec);
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%06lld", static_cast<long long>(step));
  return buf;
}

std::vector<io::NamedTensor> model_named_tensors(const model::Model& model) {
  // Host tensors viewing one host copy of the parameters (the model's memory may be a GPU's).
  const size_t bytes = static_cast<size_t>(model.num_params()) * sizeof(float);
  auto host = std::make_shared<Storage>(bytes, Device::kCPU);
  model.download_parameters(static_cast<float*>(host->data()));
  auto& m = const_cast<model::Model&>(model);
  std::vector<io::NamedTensor> out;
  for (const auto& p : model.param_refs()) {
    const size_t off = static_cast<size_t>(p.value - m.flat_values()) * sizeof(float);
    out.push_back({p.name, Tensor(host, off, DType::kF32, p.shape)});
  }
  return out;
}

std::vector<io::NamedTensor> recipe_state_tensors(const model::Model& model) {
  std::vector<io::NamedTensor> out;
  auto& m = const_cast<model::Model&>(model);
  for (const auto& info : m.linear_infos()) {
    const model::LinearRecipe* r = m.linear_recipe(info.id);
    if (!r) continue;
    for (auto& [key, t] : r->state()) out.push_back({info.name + "/" + key, t});
  }
  return out;
}

Result<std::string> write_checkpoint(const std::string& run_dir, int64_t step, const CheckpointWrite& w) {
  NIB_CHECK(w.model != nullptr && w.optimizer != nullptr);
  const std::string root = (fs::path(run_dir) / "checkpoints").string();
  NIB_RETURN_IF_ERROR(make_dirs(root));
  remove_stale_temporaries(root);
  const std::string name = checkpoint_dir_name(step);
  const std::string final_dir = (fs::path(root) / name).string();
  NIB_ASSIGN_OR_RETURN(AtomicDir dir, AtomicDir::create(final_dir));
  const fs::path tmp(dir.temp_path());
  const std::map<std::string, std::string> meta{{"format", "pt"}, {"producer", "nibble"}};

  NIB_RETURN_IF_ERROR(run_hook(w.hook, "model.safetensors"));
  NIB_RETURN_IF_ERROR(io::write_safetensors((tmp / "model.safetensors").string(), model_named_tensors(*w.model), meta));
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "optimizer.safetensors"));
  NIB_RETURN_IF_ERROR(io::write_safetensors((tmp / "optimizer.safetensors").string(),
                                            w.optimizer_state != nullptr ? *w.optimizer_state : w.optimizer->export_state()));
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "recipe_state.safetensors"));
  NIB_RETURN_IF_ERROR(io::write_safetensors((tmp / "recipe_state.safetensors").string(), recipe_state_tensors(*w.model)));
  for (const auto& [file, tensors] : w.extra_safetensors) {
    NIB_RETURN_IF_ERROR(run_hook(w.hook, file));
    NIB_RETURN_IF_ERROR(io::write_safetensors((tmp / file).string(), tensors, meta));
  }
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "config.json"));
  NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "config.json").string(), w.model->config().to_json().dump(2) + "\n"));
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "run_config.json"));
  NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "run_config.json").string(), w.run_config.dump(2) + "\n"));
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "tokenizer.model"));
  if (!w.tokenizer_path.empty()) {
    NIB_ASSIGN_OR_RETURN(std::string tok, read_small_file(w.tokenizer_path));
    NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "tokenizer.model").string(), tok));
  }
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "trainer.json"));
  json trainer = w.trainer;
  trainer["step"] = step;
  NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "trainer.json").string(), trainer.dump(2) + "\n"));
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "commit"));
  NIB_RETURN_IF_ERROR(dir.commit());
  NIB_RETURN_IF_ERROR(run_hook(w.hook, "latest"));
  NIB_RETURN_IF_ERROR(write_file_atomic((fs::path(root) / "latest").string(), name + "\n"));

  auto dirs = list_step_dirs(root);
  const int64_t keep = std::max<int64_t>(1, w.keep_last);
  std::error_code ec;
  for (int64_t i = 0; i + keep < static_cast<int64_t>(dirs.size()); ++i)
    if (dirs[i].second != name) fs::remove_all(fs::path(root) / dirs[i].second, ec);
  return final_dir;
}

Result<std::string> latest_checkpoint_dir(const std::string& run_dir) {
  const fs::path root = fs::path(run_dir) / "checkpoints";
  const fs::path latest = root / "latest";
  if (!fs::exists(latest)) return not_found("no checkpoint in '{}' (missing {})", run_dir, latest.string());
  NIB_ASSIGN_OR_RETURN(std::string name, read_small_file(latest.string()));
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  static const std::regex re("step_[0-9]+");
  if (!std::regex_match(name, re)) return data_loss("corrupt checkpoint pointer '{}'", latest.string());
  const fs::path dir = root / name;
  if (!fs::is_directory(dir))
    return not_found("checkpoint pointer '{}' names a missing folder '{}'", latest.string(), dir.string());
  return dir.string();
}

Result<Checkpoint> open_checkpoint(const std::string& path) {
  if (!fs::exists(path)) return not_found("checkpoint '{}' does not exist", path);
  std::string dir;
  if (fs::exists(fs::path(path) / "trainer.json")) {
    dir = path;
  } else if (fs::exists(fs::path(path) / "checkpoints" / "latest")) {
    NIB_ASSIGN_OR_RETURN(dir, latest_checkpoint_dir(path));
  } else if (fs::exists(fs::path(path) / "latest")) {
    NIB_ASSIGN_OR_RETURN(dir, latest_checkpoint_dir(fs::path(path).parent_path().string()));
  } else {
    return not_found("'{}' is not a checkpoint (no trainer.json) nor a run folder (no checkpoints/latest)", path);
  }
  Checkpoint c;
  c.dir = dir;
  const fs::path d(dir);
  NIB_ASSIGN_OR_RETURN(c.trainer, read_json((d / "trainer.json").string()));
  if (!c.trainer.contains("step") || !c.trainer["step"].is_number_integer())
    return data_loss("corrupt checkpoint file '{}': no integer 'step'", (d / "trainer.json").string());
  c.step = c.trainer["step"].get<int64_t>();
  NIB_ASSIGN_OR_RETURN(c.run_config, read_json((d / "run_config.json").string()));
  NIB_ASSIGN_OR_RETURN(c.model_config_json, read_json((d / "config.json").string()));
  auto mc = model::parse_model_config(c.model_config_json);
  if (!mc) return data_loss("corrupt checkpoint file '{}': {}", (d / "config.json").string(), mc.status().message());
  c.model_config = *mc;
  for (const char* f : {"model.safetensors", "tokenizer.model"})
    if (!fs::exists(d / f)) return not_found("incomplete checkpoint '{}': missing {}", dir, f);
  c.tokenizer_path = (d / "tokenizer.model").string();
  return c;
}

Status load_model_state(model::Model* model, const std::string& dir) {
  const std::string path = (fs::path(dir) / "model.safetensors").string();
  auto file = io::SafetensorsFile::open(path);
  if (!file) return data_loss("corrupt checkpoint file '{}': {}", path, file.status().message());
  size_t used = 0;
  // Read into one host copy of the parameters, then upload (the model's memory may be a GPU's).
  std::vector<float> host(static_cast<size_t>(model->num_params()));
  for (const auto& p : model->param_refs()) {
    if (!file->contains(p.name)) return data_loss("checkpoint '{}' lacks tensor '{}'", path, p.name);
    NIB_ASSIGN_OR_RETURN(Tensor t, file->get(p.name));
    if (t.shape() != p.shape)
      return data_loss("checkpoint '{}': tensor '{}' has the wrong shape for this model config", path, p.name);
    float* dst = host.data() + (p.value - model->flat_values());
    if (t.dtype() == DType::kF32) {
      std::memcpy(dst, t.raw(), sizeof(float) * p.numel);
    } else if (t.dtype() == DType::kBF16) {
      const uint16_t* b = t.data<uint16_t>();
      for (int64_t i = 0; i < p.numel; ++i) dst[i] = bf16_bits_to_f32(b[i]);
    } else {
      return data_loss("checkpoint '{}': tensor '{}' must be F32 or BF16", path, p.name);
    }
    ++used;
  }
  if (used != file->names().size())
    return data_loss("checkpoint '{}' holds {} tensors, the model has {}", path, file->names().size(), used);
  model->upload_parameters(host.data());

  const std::string rpath = (fs::path(dir) / "recipe_state.safetensors").string();
  if (!fs::exists(rpath)) return Status::ok();
  auto rfile = io::SafetensorsFile::open(rpath);
  if (!rfile) return data_loss("corrupt checkpoint file '{}': {}", rpath, rfile.status().message());
  std::map<std::string, std::map<std::string, Tensor>> by_linear;
  for (const auto& n : rfile->names()) {
    auto slash = n.rfind('/');
    if (slash == std::string::npos) return data_loss("checkpoint '{}': bad recipe state name '{}'", rpath, n);
    NIB_ASSIGN_OR_RETURN(Tensor t, rfile->get(n));
    by_linear[n.substr(0, slash)][n.substr(slash + 1)] = t;
  }
  for (const auto& info : model->linear_infos()) {
    auto it = by_linear.find(info.name);
    model::LinearRecipe* r = model->linear_recipe(info.id);
    if (it == by_linear.end() || r == nullptr) continue;
    Status s = r->load_state(it->second);
    if (!s) return data_loss("checkpoint '{}': recipe state of '{}': {}", rpath, info.name, s.message());
  }
  return Status::ok();
}

Result<model::RecipeConfig> checkpoint_recipe(const Checkpoint& ckpt, const model::RecipeConfig* recipe) {
  if (recipe) return *recipe;
  model::RecipeConfig rc;
  auto it = ckpt.run_config.find("recipe");
  if (it != ckpt.run_config.end()) {
    auto r = model::parse_recipe_config(*it);
    if (!r) return data_loss("checkpoint '{}': run_config.json: {}", ckpt.dir, r.status().message());
    rc = *r;
  }
  return rc;
}

Result<std::unique_ptr<model::Model>> load_checkpoint_model(const Checkpoint& ckpt, const model::RecipeConfig* recipe,
                                                            backend::Backend& be) {
  NIB_ASSIGN_OR_RETURN(model::RecipeConfig rc, checkpoint_recipe(ckpt, recipe));
  NIB_ASSIGN_OR_RETURN(auto m, model::Model::create(ckpt.model_config, rc, &be));
  NIB_RETURN_IF_ERROR(load_model_state(m.get(), ckpt.dir));
  return m;
}

Result<std::vector<io::NamedTensor>> load_checkpoint_tensors(const Checkpoint& ckpt) {
  const model::RecipeConfig plain;  // the weights do not depend on the recipe
  NIB_ASSIGN_OR_RETURN(auto m, load_checkpoint_model(ckpt, &plain));
  std::vector<io::NamedTensor> out;
  for (const auto& nt : model_named_tensors(*m)) out.push_back({nt.name, nt.tensor.clone()});
  return out;
}

}  // namespace nibble::train
