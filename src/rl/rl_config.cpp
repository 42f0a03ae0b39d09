// The RL run config (rl_loop.h): JSON parsing with one-line errors, and its JSON form.
#include <fstream>
#include <sstream>

#include "rl/rl_loop.h"

namespace nibble::rl {

using nlohmann::json;

Result<Arm> parse_arm(const std::string& s) {
  for (Arm a : {Arm::kBf16Rollout, Arm::kFp4Naive, Arm::kQat, Arm::kQuads, Arm::kTraceFull, Arm::kTrace})
    if (s == arm_name(a)) return a;
  return invalid_argument("unknown arm '{}' (bf16-rollout, fp4-naive, qat, quads, trace-full, trace)", s);
}

const char* arm_name(Arm a) {
  switch (a) {
    case Arm::kBf16Rollout: return "bf16-rollout";
    case Arm::kFp4Naive: return "fp4-naive";
    case Arm::kQat: return "qat";
    case Arm::kQuads: return "quads";
    case Arm::kTraceFull: return "trace-full";
    case Arm::kTrace: return "trace";
  }
  return "?";
}

json RlConfig::to_json() const {
  return json{{"init", init},
              {"model", model},
              {"model_seed", model_seed},
              {"tokenizer_vocab_size", tokenizer_vocab_size},
              {"task", task},
              {"level", level},
              {"task_seed", task_seed},
              {"arm", arm_name(arm)},
              {"guidance_layers", guidance_layers},
              {"r3", r3},
              {"rollout_kv", backend::kv_page_format_name(rollout_kv)},
              {"steps", steps},
              {"prompts_per_step", prompts_per_step},
              {"train_instances", train_instances},
              {"group_size", group_size},
              {"max_new_tokens", max_new_tokens},
              {"minibatches", minibatches},
              {"clip_eps", grpo.clip_eps},
              {"aggregation", aggregation_name(grpo.aggregation)},
              {"kl_coef", grpo.kl_coef},
              {"tis", tis_mode_name(grpo.tis)},
              {"tis_cap", grpo.tis_cap},
              {"temperature", grpo.temperature},
              {"lr", lr},
              {"weight_decay", weight_decay},
              {"grad_clip", grad_clip},
              {"seed", seed},
              {"max_staleness", max_staleness},
              {"checkpoint_every", checkpoint_every},
              {"keep_checkpoints", keep_checkpoints}};
}

namespace {
template <typename T>
Status get(const json& j, const char* key, T& out) {
  auto it = j.find(key);
  if (it == j.end()) return Status::ok();
  try {
    out = it->get<T>();
  } catch (const json::exception&) {
    return invalid_argument("rl config: '{}' has the wrong type ({})", key, it->dump());
  }
  return Status::ok();
}
}  // namespace

Result<RlConfig> parse_rl_config(const json& j) {
  if (!j.is_object()) return invalid_argument("rl config: expected a JSON object");
  const json known = RlConfig{}.to_json();
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!known.contains(it.key())) return invalid_argument("rl config: unknown key '{}'", it.key());
  RlConfig c;
  std::string rollout_kv = backend::kv_page_format_name(c.rollout_kv);
  std::string arm = arm_name(c.arm), agg = aggregation_name(c.grpo.aggregation), tis = tis_mode_name(c.grpo.tis);
  NIB_RETURN_IF_ERROR(get(j, "init", c.init));
  NIB_RETURN_IF_ERROR(get(j, "model", c.model));
  NIB_RETURN_IF_ERROR(get(j, "model_seed", c.model_seed));
  NIB_RETURN_IF_ERROR(get(j, "tokenizer_vocab_size", c.tokenizer_vocab_size));
  NIB_RETURN_IF_ERROR(get(j, "task", c.task));
  NIB_RETURN_IF_ERROR(get(j, "level", c.level));
  NIB_RETURN_IF_ERROR(get(j, "task_seed", c.task_seed));
  NIB_RETURN_IF_ERROR(get(j, "arm", arm));
  NIB_RETURN_IF_ERROR(get(j, "guidance_layers", c.guidance_layers));
  NIB_RETURN_IF_ERROR(get(j, "r3", c.r3));
  NIB_RETURN_IF_ERROR(get(j, "rollout_kv", rollout_kv));
  NIB_RETURN_IF_ERROR(get(j, "steps", c.steps));
  NIB_RETURN_IF_ERROR(get(j, "prompts_per_step", c.prompts_per_step));
  NIB_RETURN_IF_ERROR(get(j, "train_instances", c.train_instances));
  NIB_RETURN_IF_ERROR(get(j, "group_size", c.group_size));
  NIB_RETURN_IF_ERROR(get(j, "max_new_tokens", c.max_new_tokens));
  NIB_RETURN_IF_ERROR(get(j, "minibatches", c.minibatches));
  NIB_RETURN_IF_ERROR(get(j, "clip_eps", c.grpo.clip_eps));
  NIB_RETURN_IF_ERROR(get(j, "aggregation", agg));
  NIB_RETURN_IF_ERROR(get(j, "kl_coef", c.grpo.kl_coef));
  NIB_RETURN_IF_ERROR(get(j, "tis", tis));
  NIB_RETURN_IF_ERROR(get(j, "tis_cap", c.grpo.tis_cap));
  NIB_RETURN_IF_ERROR(get(j, "temperature", c.grpo.temperature));
  NIB_RETURN_IF_ERROR(get(j, "lr", c.lr));
  NIB_RETURN_IF_ERROR(get(j, "weight_decay", c.weight_decay));
  NIB_RETURN_IF_ERROR(get(j, "grad_clip", c.grad_clip));
  NIB_RETURN_IF_ERROR(get(j, "seed", c.seed));
  NIB_RETURN_IF_ERROR(get(j, "max_staleness", c.max_staleness));
  NIB_RETURN_IF_ERROR(get(j, "checkpoint_every", c.checkpoint_every));
  NIB_RETURN_IF_ERROR(get(j, "keep_checkpoints", c.keep_checkpoints));
  NIB_ASSIGN_OR_RETURN(c.arm, parse_arm(arm));
  if (rollout_kv == "bf16")
    c.rollout_kv = backend::KvPageFormat::kBf16;
  else if (rollout_kv == "nvfp4")
    c.rollout_kv = backend::KvPageFormat::kNvfp4;
  else
    return invalid_argument("rl config: rollout_kv '{}': expected bf16 or nvfp4", rollout_kv);
  NIB_ASSIGN_OR_RETURN(c.grpo.aggregation, parse_aggregation(agg));
  NIB_ASSIGN_OR_RETURN(c.grpo.tis, parse_tis_mode(tis));
  if (c.init.empty() && !c.model.is_object())
    return invalid_argument("rl config: give 'init' (a checkpoint) or 'model' (a model config object)");
  if (c.steps < 1) return invalid_argument("rl config: steps must be >= 1 (got {})", c.steps);
  if (c.prompts_per_step < 1 || c.group_size < 2)
    return invalid_argument("rl config: prompts_per_step must be >= 1 and group_size >= 2 (got {}, {})",
                            c.prompts_per_step, c.group_size);
  if (c.prompts_per_step >= (1 << 16)) return invalid_argument("rl config: prompts_per_step must be below 65536");
  if (c.train_instances < 0)
    return invalid_argument("rl config: train_instances must be >= 0 (0: fresh instances every step; got {})",
                            c.train_instances);
  if (c.max_new_tokens < 1) return invalid_argument("rl config: max_new_tokens must be >= 1");
  const int64_t B = c.prompts_per_step * c.group_size;
  if (c.minibatches < 1 || B % c.minibatches != 0)
    return invalid_argument("rl config: minibatches ({}) must divide prompts_per_step x group_size ({})", c.minibatches, B);
  if (!(c.grpo.clip_eps > 0 && c.grpo.clip_eps < 1)) return invalid_argument("rl config: clip_eps must be in (0, 1)");
  if (!(c.grpo.tis_cap >= 1)) return invalid_argument("rl config: tis_cap must be >= 1");
  if (!(c.grpo.kl_coef >= 0)) return invalid_argument("rl config: kl_coef must be >= 0");
  if (!(c.grpo.temperature > 0)) return invalid_argument("rl config: temperature must be > 0 (the loss needs log-probs)");
  if (!(c.lr > 0) || !(c.weight_decay >= 0) || !(c.grad_clip >= 0))
    return invalid_argument("rl config: lr must be > 0, weight_decay and grad_clip >= 0");
  if (c.level < 0) return invalid_argument("rl config: level must be >= 0");
  if (c.max_staleness < 0) return invalid_argument("rl config: max_staleness must be >= 0 (got {})", c.max_staleness);
  if (c.checkpoint_every < 0 || c.keep_checkpoints < 1)
    return invalid_argument("rl config: checkpoint_every must be >= 0 and keep_checkpoints >= 1");
  for (int64_t l : c.guidance_layers)
    if (l < 0) return invalid_argument("rl config: guidance layer {} is negative", l);
  return c;
}

Result<RlConfig> load_rl_config(const std::string& path) {
  std::ifstream f(path);
  if (!f) return not_found("rl config '{}' cannot be read", path);
  std::stringstream ss;
  ss << f.rdbuf();
  json j = json::parse(ss.str(), nullptr, false);
  if (j.is_discarded()) return invalid_argument("rl config '{}' is not valid JSON", path);
  auto c = parse_rl_config(j);
  if (!c) return Status(c.status().code(), fmt::format("{}: {}", path, c.status().message()));
  return c;
}

int64_t prompt_instance_index(const RlConfig& c, int64_t step, int64_t i) {
  const int64_t k = step * c.prompts_per_step + i;
  return c.train_instances > 0 ? k % c.train_instances : k;
}

}  // namespace nibble::rl
