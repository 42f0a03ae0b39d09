// Run config parsing: defaults, merge with unknown-key detection, dotted overrides, validation.
// See run_config.h and docs/training.md (the reference table of every key).
#include "train/run_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "io/regular_file.h"
#include "train/corpus.h"

namespace nibble::train {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Subtrees whose keys are checked by their own parsers (model config, recipe, schedule).
bool is_free_subtree(const std::string& top) { return top == "model" || top == "recipe" || top == "schedule"; }

std::string kind_name(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

bool same_kind(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) return true;
  return a.type() == b.type();
}

Status merge_into(json* dst, const json& src, const std::string& prefix) {
  if (!src.is_object()) return invalid_argument("run config: '{}' must be an object", prefix.empty() ? "<top>" : prefix);
  for (auto it = src.begin(); it != src.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (!dst->contains(it.key())) return invalid_argument("run config: unknown key '{}'", key);
    json& d = (*dst)[it.key()];
    if (prefix.empty() && is_free_subtree(it.key())) {
      if (it.key() == "recipe" && it->is_string()) {
        d = json{{"name", *it}};
      } else if (it.key() == "model" ? !(it->is_string() || it->is_object()) : !it->is_object()) {
        return invalid_argument("run config: bad value for '{}': expected {}, got {}", key,
                                it.key() == "model" ? "a path or an object" : "an object", kind_name(*it));
      } else {
        d = *it;
      }
      continue;
    }
    if (d.is_object()) {
      NIB_RETURN_IF_ERROR(merge_into(&d, *it, key));
      continue;
    }
    if (!same_kind(d, *it))
      return invalid_argument("run config: bad value for '{}': expected {}, got {}", key, kind_name(d), kind_name(*it));
    d = *it;
  }
  return Status::ok();
}

Result<json> read_json_file(const std::string& path, const std::string& what) {
  auto text = io::read_regular_file(path, what);
  if (!text && text.status().code() == StatusCode::kNotFound) return not_found("{}: cannot open '{}'", what, path);
  if (!text) return text.status();
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  // A malformed file is bad input (exit 1); bad values in a well-formed one are bad arguments.
  if (j.is_discarded()) return data_loss("{}: '{}' is not valid JSON", what, path);
  return j;
}

// A relative path as given, else relative to base_dir, else to the source tree.
std::string find_file(const std::string& path, const std::string& base_dir) {
  if (fs::path(path).is_absolute() || fs::exists(path)) return path;
  if (!base_dir.empty() && fs::exists(fs::path(base_dir) / path)) return (fs::path(base_dir) / path).string();
#ifdef NIBBLE_SOURCE_DIR
  if (fs::exists(fs::path(NIBBLE_SOURCE_DIR) / path)) return (fs::path(NIBBLE_SOURCE_DIR) / path).string();
#endif
  return path;
}

Result<int64_t> get_int(const json& j, const std::string& dotted, int64_t min_value) {
  const json* v = &j;
  std::string rest = dotted;
  while (true) {
    auto dot = rest.find('.');
    v = &(*v)[rest.substr(0, dot)];
    if (dot == std::string::npos) break;
    rest = rest.substr(dot + 1);
  }
  double d = v->is_number() ? v->get<double>() : NAN;
  if (!v->is_number() || d != std::floor(d) || d < static_cast<double>(min_value) || d > 9.0e15)
    return invalid_argument("run config: bad value for '{}': must be an integer >= {}", dotted, min_value);
  return static_cast<int64_t>(d);
}

Result<double> get_num(const json& v, const std::string& dotted, double lo, double hi, bool lo_open = false) {
  if (!v.is_number()) return invalid_argument("run config: bad value for '{}': must be a number", dotted);
  double d = v.get<double>();
  if (!(std::isfinite(d) && (lo_open ? d > lo : d >= lo) && d <= hi))
    return invalid_argument("run config: bad value for '{}': must be in {}{}, {}]", dotted, lo_open ? "(" : "[", lo, hi);
  return d;
}

// A config file's relative data paths name files next to it (docs/training.md "Paths"): they
// become config_dir/path here, before the command line's overrides (relative to the current
// folder) are applied.
void resolve_config_file_paths(json* user, const std::string& config_dir) {
  if (!user->contains("data") || !(*user)["data"].is_object()) return;
  json& data = (*user)["data"];
  auto resolve = [&](json& v) {
    if (!v.is_string()) return;  // wrong kinds are reported by resolve_run_config
    const std::string p = v.get<std::string>();
    if (!p.empty() && fs::path(p).is_relative()) v = (fs::path(config_dir) / p).lexically_normal().string();
  };
  for (const char* key : {"tokenizer", "dir"})
    if (data.contains(key)) resolve(data[key]);
  for (const char* key : {"files", "val_files"})
    if (data.contains(key) && data[key].is_array())
      for (json& f : data[key]) resolve(f);
}

}  // namespace

json default_run_config_json() {
  return json{
      {"model", "configs/tiny-dense.json"},
      {"recipe", {{"name", "bf16"}}},
      {"seed", 1234},
      {"batch_size", 8},
      {"seq_len", 128},
      {"grad_accum", 1},
      {"steps", 200},
      {"optimizer", {{"lr", 1e-3}, {"betas", {0.9, 0.95}}, {"eps", 1e-8}, {"weight_decay", 0.1}, {"grad_clip", 1.0}}},
      {"schedule", {{"type", "cosine"}, {"warmup_steps", 20}, {"final_lr_fraction", 0.1}}},
      {"z_loss", 1e-5},
      {"eval", {{"interval", 50}, {"batches", 8}}},
      {"checkpoint", {{"interval", 100}, {"keep_last", 2}}},
      {"data", {{"files", json::array()}, {"dir", ""}, {"vocab_size", 0}, {"val_fraction", 0.05}, {"tokenizer", ""},
                {"val_files", json::array()}}},
      {"max_bad_steps", 5},
      {"threads", 0},
      {"log_interval", 10},
      {"dist", {{"zero", 1}, {"bucket_elems", 4194304}, {"overlap", 1}}},
      {"task", {{"name", ""}, {"levels", {0}}, {"seed", 1}, {"train_examples", 2048}, {"val_examples", 128},
                {"accuracy_examples", 64}, {"max_new_tokens", 32}}},
  };
}

Status apply_override(json* j, const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    return invalid_argument("--set '{}': expected key=value (e.g. optimizer.lr=1e-3)", assignment);
  const std::string key = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = text;
  std::vector<std::string> parts;
  for (size_t b = 0;;) {
    auto dot = key.find('.', b);
    parts.push_back(key.substr(b, dot == std::string::npos ? std::string::npos : dot - b));
    if (dot == std::string::npos) break;
    b = dot + 1;
  }
  for (auto& p : parts)
    if (p.empty()) return invalid_argument("--set '{}': empty key segment", assignment);
  const bool free = is_free_subtree(parts[0]);
  json* node = j;
  std::string at;
  for (size_t i = 0; i < parts.size(); ++i) {
    at += (i ? "." : "") + parts[i];
    const bool last = i + 1 == parts.size();
    if (!node->is_object()) return invalid_argument("--set {}: '{}' is not an object", key, at.substr(0, at.rfind('.')));
    if (i == 0 && parts[0] == "recipe" && !last && (*node)["recipe"].is_string())
      (*node)["recipe"] = json{{"name", (*node)["recipe"]}};
    if (!node->contains(parts[i])) {
      if (!(free && i > 0)) return invalid_argument("--set: unknown key '{}'", at);
      if (!last) (*node)[parts[i]] = json::object();
    }
    if (last) {
      json& d = (*node)[parts[i]];
      if (i == 0 && parts[0] == "recipe" && value.is_string()) {
        d = json{{"name", value}};
      } else if (!free && d.is_object()) {
        return invalid_argument("--set {}: '{}' is a section; set one of its keys", key, at);
      } else if (!free && !same_kind(d, value)) {
        return invalid_argument("--set {}: bad value '{}': expected {}, got {}", key, text, kind_name(d), kind_name(value));
      } else {
        d = value;
      }
      return Status::ok();
    }
    node = &(*node)[parts[i]];
  }
  return Status::ok();
}

Result<RunConfig> resolve_run_config(const json& user, const std::vector<std::string>& overrides,
                                     const std::string& base_dir) {
  json j = default_run_config_json();
  NIB_RETURN_IF_ERROR(merge_into(&j, user, ""));
  // Inline the model config so overrides like model.hidden_size work and checkpoints are self-contained.
  if (j["model"].is_string()) {
    std::string path = find_file(j["model"].get<std::string>(), base_dir);
    NIB_ASSIGN_OR_RETURN(json m, read_json_file(path, "run config: model"));
    j["model"] = m;
  }
  for (const auto& o : overrides) NIB_RETURN_IF_ERROR(apply_override(&j, o));
  if (j["model"].is_string()) {  // an override may have set a new path
    std::string path = find_file(j["model"].get<std::string>(), base_dir);
    NIB_ASSIGN_OR_RETURN(json m, read_json_file(path, "run config: model"));
    j["model"] = m;
  }

  RunConfig c;
  c.json = j;
  c.model_json = j["model"];
  {
    auto m = model::parse_model_config(c.model_json);
    if (!m) return invalid_argument("run config: model: {}", m.status().message());
    c.model = *m;
  }
  {
    auto r = model::parse_recipe_config(j["recipe"]);
    if (!r) return invalid_argument("run config: {}", r.status().message());
    c.recipe = *r;
    if (!model::has_linear_recipe(c.recipe.name)) {
      std::string names;
      for (auto& n : model::linear_recipe_names()) names += (names.empty() ? "" : ", ") + n;
      return invalid_argument("run config: bad value for 'recipe.name': unknown recipe '{}' (registered: {})",
                              c.recipe.name, names);
    }
  }
  NIB_ASSIGN_OR_RETURN(int64_t seed, get_int(j, "seed", 0));
  c.seed = static_cast<uint64_t>(seed);
  NIB_ASSIGN_OR_RETURN(c.batch_size, get_int(j, "batch_size", 1));
  NIB_ASSIGN_OR_RETURN(c.seq_len, get_int(j, "seq_len", 1));
  NIB_ASSIGN_OR_RETURN(c.grad_accum, get_int(j, "grad_accum", 1));
  NIB_ASSIGN_OR_RETURN(c.steps, get_int(j, "steps", 1));
  // OsciReset's start as a fraction of training is resolved here, so the recipe sees an absolute step.
  if (c.recipe.oscireset.start_step < 0)
    c.recipe.oscireset.start_step = std::llround(c.recipe.oscireset.start_fraction * static_cast<double>(c.steps));
  if (c.seq_len > c.model.max_position_embeddings)
    return invalid_argument("run config: bad value for 'seq_len': {} exceeds the model's max_position_embeddings {}",
                            c.seq_len, c.model.max_position_embeddings);
  const json& opt = j["optimizer"];
  NIB_ASSIGN_OR_RETURN(c.lr, get_num(opt["lr"], "optimizer.lr", 0, 10, /*lo_open=*/true));
  if (opt["betas"].size() != 2) return invalid_argument("run config: bad value for 'optimizer.betas': must be [beta1, beta2]");
  NIB_ASSIGN_OR_RETURN(c.adamw.beta1, get_num(opt["betas"][0], "optimizer.betas[0]", 0, 1));
  NIB_ASSIGN_OR_RETURN(c.adamw.beta2, get_num(opt["betas"][1], "optimizer.betas[1]", 0, 1));
  if (c.adamw.beta1 >= 1 || c.adamw.beta2 >= 1)
    return invalid_argument("run config: bad value for 'optimizer.betas': each must be < 1");
  NIB_ASSIGN_OR_RETURN(c.adamw.eps, get_num(opt["eps"], "optimizer.eps", 0, 1, /*lo_open=*/true));
  NIB_ASSIGN_OR_RETURN(c.adamw.weight_decay, get_num(opt["weight_decay"], "optimizer.weight_decay", 0, 10));
  NIB_ASSIGN_OR_RETURN(c.grad_clip, get_num(opt["grad_clip"], "optimizer.grad_clip", 0, 1e30));
  NIB_RETURN_IF_ERROR(validate(c.adamw));
  {
    auto s = schedule_from_json(j["schedule"]);
    if (!s) return invalid_argument("run config: {}", s.status().message());
    c.schedule = *s;
    auto bound = LrSchedule::create(c.schedule, c.lr, c.steps);
    if (!bound) return invalid_argument("run config: {}", bound.status().message());
  }
  NIB_ASSIGN_OR_RETURN(c.z_loss, get_num(j["z_loss"], "z_loss", 0, 1));
  NIB_ASSIGN_OR_RETURN(c.eval_interval, get_int(j, "eval.interval", 0));
  NIB_ASSIGN_OR_RETURN(c.eval_batches, get_int(j, "eval.batches", 0));
  NIB_ASSIGN_OR_RETURN(c.checkpoint_interval, get_int(j, "checkpoint.interval", 0));
  NIB_ASSIGN_OR_RETURN(c.keep_last, get_int(j, "checkpoint.keep_last", 1));
  for (const auto& f : j["data"]["files"]) {
    if (!f.is_string() || f.get<std::string>().empty())
      return invalid_argument("run config: bad value for 'data.files': must be a list of file paths");
    c.data_files.push_back(f.get<std::string>());
  }
  for (const auto& f : j["data"]["val_files"]) {
    if (!f.is_string() || f.get<std::string>().empty())
      return invalid_argument("run config: bad value for 'data.val_files': must be a list of token shard paths");
    c.val_files.push_back(f.get<std::string>());
  }
  c.tokenizer_file = j["data"]["tokenizer"].get<std::string>();
  c.data_dir = j["data"]["dir"].get<std::string>();
  NIB_ASSIGN_OR_RETURN(c.vocab_size, get_int(j, "data.vocab_size", 0));
  // data.vocab_size 0 takes the model's: a too-small value is then the model's key.
  const char* vocab_key = c.vocab_size == 0 ? "model.vocab_size" : "data.vocab_size";
  if (c.vocab_size == 0) c.vocab_size = c.model.vocab_size;
  if (c.vocab_size < 261)
    return invalid_argument("run config: bad value for '{}': {} < 261 (the trained tokenizer needs 4 specials + 256 "
                            "byte pieces + 1)",
                            vocab_key, c.vocab_size);
  if (c.vocab_size > c.model.vocab_size)
    return invalid_argument("run config: bad value for 'data.vocab_size': {} exceeds the model's vocab_size {}",
                            c.vocab_size, c.model.vocab_size);
  NIB_ASSIGN_OR_RETURN(c.val_fraction, get_num(j["data"]["val_fraction"], "data.val_fraction", 0, 0.5, true));
  NIB_ASSIGN_OR_RETURN(c.max_bad_steps, get_int(j, "max_bad_steps", 1));
  NIB_ASSIGN_OR_RETURN(int64_t threads, get_int(j, "threads", 0));
  c.threads = static_cast<int>(threads);
  NIB_ASSIGN_OR_RETURN(c.log_interval, get_int(j, "log_interval", 1));
  NIB_ASSIGN_OR_RETURN(c.zero, get_int(j, "dist.zero", 0));
  if (c.zero > 1) return invalid_argument("run config: bad value for 'dist.zero': must be 0 (off) or 1 (ZeRO-1)");
  NIB_ASSIGN_OR_RETURN(c.bucket_elems, get_int(j, "dist.bucket_elems", 1));
  NIB_ASSIGN_OR_RETURN(c.overlap, get_int(j, "dist.overlap", 0));
  if (c.overlap > 1)
    return invalid_argument("run config: bad value for 'dist.overlap': must be 0 (reduce after backward) or 1 (overlapped)");
  const json& task = j["task"];
  c.task.name = task["name"].get<std::string>();
  c.task.levels.clear();
  for (const auto& l : task["levels"]) {
    if (!l.is_number_integer() || l.get<int64_t>() < 0 || l.get<int64_t>() > 255)
      return invalid_argument("run config: bad value for 'task.levels': must be a list of levels (integers 0..255)");
    c.task.levels.push_back(l.get<int64_t>());
  }
  if (c.task.levels.empty()) return invalid_argument("run config: bad value for 'task.levels': must name a level");
  NIB_ASSIGN_OR_RETURN(int64_t task_seed, get_int(j, "task.seed", 0));
  c.task.seed = static_cast<uint64_t>(task_seed);
  NIB_ASSIGN_OR_RETURN(c.task.train_examples, get_int(j, "task.train_examples", 1));
  NIB_ASSIGN_OR_RETURN(c.task.val_examples, get_int(j, "task.val_examples", 1));
  NIB_ASSIGN_OR_RETURN(c.task.accuracy_examples, get_int(j, "task.accuracy_examples", 0));
  NIB_ASSIGN_OR_RETURN(c.task.max_new_tokens, get_int(j, "task.max_new_tokens", 1));
  return c;
}

Result<RunConfig> load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  NIB_ASSIGN_OR_RETURN(json j, read_json_file(path, "run config"));
  if (!j.is_object()) return data_loss("run config: '{}' must hold a JSON object", path);
  const std::string config_dir = fs::path(path).parent_path().string();
  resolve_config_file_paths(&j, config_dir.empty() ? "." : config_dir);
  return resolve_run_config(j, overrides, config_dir);
}

}  // namespace nibble::train
