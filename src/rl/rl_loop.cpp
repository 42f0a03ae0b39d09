// The RL loop (see rl_loop.h): rollout with recorders, rewards, π_old / π_ref recompute, GRPO
// updates, weight sync, metrics, plots and checkpoints.
#include "rl/rl_loop.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>

#include "core/check.h"
#include "core/log.h"
#include "core/parallel.h"
#include "io/safetensors.h"
#include "rl/fake_quant.h"
#include "rl/mpi_rollout.h"
#include "rl/rollout_worker.h"
#include "rl/sft.h"
#include "rollout/engine.h"
#include "rollout/routing_record.h"
#include "train/atomic_dir.h"
#include "train/checkpoint.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/plot.h"
#include "train/run_lock.h"
#include "train/tokenizer.h"

namespace nibble::rl {

namespace fs = std::filesystem;
using nlohmann::json;

json RlStepMetrics::to_json() const {
  return json{{"step", step},
              {"reward_mean", reward_mean},
              {"reward_std", reward_std},
              {"response_len", response_len},
              {"entropy", entropy},
              {"logp_diff_mean", logp_diff_mean},
              {"logp_diff_max", logp_diff_max},
              {"kl_rollout_train", kl_rollout_train},
              {"guided_mismatch", guided_mismatch},
              {"guided_one_step", guided_one_step},
              {"guided_reproduced", guided_reproduced},
              {"guided_expert_fallback", guided_expert_fallback},
              {"moe_set_mismatch", moe_set_mismatch},
              {"guidance_bytes_per_token", guidance_bytes_per_token},
              {"rollout_tokens_per_s", rollout_tokens_per_s},
              {"train_tokens_per_s", train_tokens_per_s},
              {"sync_seconds", sync_seconds},
              {"sync_bytes", sync_bytes},
              {"sync_linear_bytes", sync_linear_bytes},
              {"step_seconds", step_seconds},
              {"rollout_seconds", rollout_seconds},
              {"logprob_seconds", logprob_seconds},
              {"moe_check_seconds", moe_check_seconds},
              {"train_seconds", train_seconds},
              {"other_seconds", other_seconds},
              {"loss", loss},
              {"clip_fraction", clip_fraction},
              {"tis_fraction", tis_fraction},
              {"kl_ref", kl_ref},
              {"grad_norm", grad_norm},
              {"policy_version", policy_version},
              {"staleness", staleness},
              {"overlap_seconds", overlap_seconds}};
}

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr const char* kPolicyFile = "rollout_policies.safetensors";  // pending versions (max_staleness > 0)
constexpr const char* kRolloutRecipe = "tetrajet-v2";  // two-level NVFP4, the trainer's rl-fake-quant format

rollout::PrecisionMode rollout_mode(Arm a);
rollout::EngineOptions rollout_engine_options(const RlConfig& c) {
  rollout::EngineOptions eo;
  eo.mode = rollout_mode(c.arm);
  eo.recipe_name = kRolloutRecipe;
  eo.max_batch = c.prompts_per_step * c.group_size;
  eo.kv_format = c.rollout_kv;
  return eo;
}

double overlap(std::chrono::steady_clock::time_point a0, std::chrono::steady_clock::time_point a1,
               std::chrono::steady_clock::time_point b0, std::chrono::steady_clock::time_point b1) {
  return std::max(0.0, std::chrono::duration<double>(std::min(a1, b1) - std::max(a0, b0)).count());
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

rollout::PrecisionMode rollout_mode(Arm a) {
  return a == Arm::kBf16Rollout ? rollout::PrecisionMode::kBf16 : rollout::PrecisionMode::kW4A4;
}
bool guided_arm(Arm a) { return a == Arm::kTraceFull || a == Arm::kTrace; }
// The arms whose trainer quantizes activations: with an NVFP4 rollout cache they round K and V too.
bool quantized_kv_arm(Arm a) { return a == Arm::kQat || guided_arm(a); }

model::RecipeConfig trainer_recipe(Arm a) {
  switch (a) {
    case Arm::kBf16Rollout:
    case Arm::kFp4Naive: {
      model::RecipeConfig rc;
      rc.name = "bf16";
      return rc;
    }
    case Arm::kQuads: return fake_quant_recipe_config(true, false);
    default: return fake_quant_recipe_config(true, true);
  }
}

// Every tensor of a checkpoint's safetensors file; errors are data loss naming the file.
Result<std::vector<io::NamedTensor>> read_checkpoint_file(const std::string& path) {
  auto f = io::SafetensorsFile::open(path);
  if (!f) return data_loss("checkpoint '{}': {}", path, f.status().message());
  std::vector<io::NamedTensor> out;
  for (auto& n : f->names()) {
    NIB_ASSIGN_OR_RETURN(Tensor t, f->get(n));
    out.push_back({n, t});
  }
  return out;
}

// A fresh run folder must not hold a run; a resumed one must.
Status check_run_folder(const fs::path& run, bool resume) {
  std::error_code ec;
  const bool has_ckpt = fs::exists(run / "checkpoints" / "latest", ec);
  if (resume && !has_ckpt)
    return not_found("--resume: '{}' holds no checkpoint (checkpoints/latest is missing)", run.string());
  if (!resume && (has_ckpt || fs::exists(run / "metrics.jsonl", ec)))
    return invalid_argument("'{}' already holds a run: pass --resume to continue it, or choose another --out",
                            run.string());
  return Status::ok();
}

struct Sequence {
  int64_t request = 0, sample = 0;
  std::vector<int32_t> tokens;  // prompt + completion
  int64_t prompt_len = 0;
  const rollout::Completion* completion = nullptr;
};

// The (B, T) batch of sequences [b0, b1): inputs = tokens[:-1].
struct TokenBatch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> inputs;    // (B*T)
  std::vector<int64_t> lengths;   // (B) input rows fed (tokens - 1)
  std::vector<uint64_t> record_seq;
};

TokenBatch make_batch(const std::vector<Sequence>& seqs, int64_t b0, int64_t b1, int64_t T) {
  TokenBatch tb;
  tb.B = b1 - b0, tb.T = T;
  tb.inputs.assign(static_cast<size_t>(tb.B * T), 0);
  for (int64_t b = b0; b < b1; ++b) {
    const Sequence& s = seqs[static_cast<size_t>(b)];
    const int64_t L = static_cast<int64_t>(s.tokens.size()) - 1;
    std::copy(s.tokens.begin(), s.tokens.begin() + L, tb.inputs.begin() + (b - b0) * T);
    tb.lengths.push_back(L);
    tb.record_seq.push_back(rollout::recorded_sequence(static_cast<uint64_t>(s.request), s.sample));
  }
  return tb;
}

void set_guidance_rows(TraceGuidance& g, const TokenBatch& tb) {
  const size_t n = static_cast<size_t>(tb.B * tb.T);
  g.row_sequence.assign(n, 0), g.row_position.assign(n, 0), g.row_recorded.assign(n, 0);
  for (int64_t b = 0; b < tb.B; ++b)
    for (int64_t t = 0; t < tb.T; ++t) {
      const size_t r = static_cast<size_t>(b * tb.T + t);
      g.row_sequence[r] = tb.record_seq[static_cast<size_t>(b)];
      g.row_position[r] = static_cast<uint32_t>(t);
      g.row_recorded[r] = t < tb.lengths[static_cast<size_t>(b)];
    }
}

std::vector<train::ParamView> param_views(model::Model& m) {
  std::vector<train::ParamView> views;
  for (auto& p : m.param_refs()) views.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  return views;
}

class RlRun {
 public:
  RlRun(const RlConfig& c, const Task& task, const RlOptions& o)
      : cfg_(c), task_(task), opt_(o), be_(o.backend ? *o.backend : backend::cpu_backend()), run_(o.run_dir) {}
  Result<RlResult> run();

 private:
  Status build_models();
  Status resume_state();
  Status start_worker();
  // The policy version step s's rollouts come from: max(0, s - max_staleness), a function of
  // (s, N) alone, so runs and resumes are reproducible whatever the threads' timing.
  int64_t version_for(int64_t s) const { return std::max<int64_t>(0, s - cfg_.max_staleness); }
  std::vector<TaskInstance> instances(int64_t s) const;
  Result<RolloutJob> rollout_job(int64_t s);
  Status start_rollout(int64_t s);
  // The weight sync: the trainer's current weights as policy version `version` to the worker.
  Status sync(int64_t version, RlStepMetrics* m);
  // t_began: when the step began (the end of the previous step's sync, or the loop's start).
  Result<RlStepMetrics> step(int64_t s, RolloutBatch batch, std::chrono::steady_clock::time_point t_began);
  Status write_checkpoint(int64_t step);
  Status write_plots();

  const RlConfig& cfg_;
  const Task& task_;
  const RlOptions& opt_;
  backend::Backend& be_;
  fs::path run_;
  std::unique_ptr<model::Model> model_, ref_;
  std::unique_ptr<train::Tokenizer> tok_;
  std::unique_ptr<train::AdamW> adamw_;
  std::unique_ptr<backend::Backend> own_rollout_be_;  // when RlOptions::rollout_backend is null
  std::unique_ptr<ThreadRolloutWorker> thread_worker_;  // in-process
  std::unique_ptr<MpiRolloutClient> mpi_worker_;       // disaggregated: ranks 1..N-1 roll out
  WeightSink* sink_ = nullptr;
  RolloutSource* source_ = nullptr;
  // versions sent and still to be used by a later step's rollout (written into checkpoints)
  std::map<int64_t, std::shared_ptr<const PolicyWeights>> pending_;
  std::vector<PolicyWeights> resumed_versions_;  // read by resume_state, sent by start_worker
  std::chrono::steady_clock::time_point prev_train_began_, prev_train_ended_;
  std::vector<int64_t> guided_layers_;
  TraceGuidance guidance_;
  TraceKvQuantizer kv_quantizer_;  // rollout_kv nvfp4: the trainer's K/V step (RTN, guided in the trace arms)
  int64_t start_ = 0;
  std::vector<train::PlotPoint> reward_pts_, gap_mean_pts_, gap_max_pts_;
};

Status RlRun::build_models() {
  register_fake_quant_recipe();
  const model::RecipeConfig recipe = trainer_recipe(cfg_.arm);
  model::RecipeConfig bf16;
  bf16.name = "bf16";
  if (!cfg_.init.empty()) {
    NIB_ASSIGN_OR_RETURN(train::Checkpoint ck, train::open_checkpoint(cfg_.init));
    NIB_ASSIGN_OR_RETURN(model_, train::load_checkpoint_model(ck, &recipe, be_));
    if (cfg_.grpo.kl_coef > 0) {
      NIB_ASSIGN_OR_RETURN(ref_, train::load_checkpoint_model(ck, &bf16, be_));
    }
    NIB_ASSIGN_OR_RETURN(train::Tokenizer t, train::Tokenizer::load(ck.tokenizer_path));
    tok_ = std::make_unique<train::Tokenizer>(std::move(t));
  } else {
    NIB_ASSIGN_OR_RETURN(model::ModelConfig mc, model::parse_model_config(cfg_.model));
    NIB_ASSIGN_OR_RETURN(model_, model::Model::create(mc, recipe, &be_));
    model_->init_weights(cfg_.model_seed);
    if (cfg_.grpo.kl_coef > 0) {
      NIB_ASSIGN_OR_RETURN(ref_, model::Model::create(mc, bf16, &be_));
      ref_->init_weights(cfg_.model_seed);
    }
    if (opt_.resume) {
      NIB_ASSIGN_OR_RETURN(train::Tokenizer t, train::Tokenizer::load((run_ / "tokenizer.model").string()));
      tok_ = std::make_unique<train::Tokenizer>(std::move(t));
    } else {
      train::TokenizerTrainOptions to;
      to.vocab_size = static_cast<int>(cfg_.tokenizer_vocab_size);
      to.hard_vocab_limit = false;
      to.vocab_size_name = "tokenizer_vocab_size";
      NIB_ASSIGN_OR_RETURN(train::Tokenizer t, train::Tokenizer::train(task_tokenizer_texts(task_, cfg_.task_seed), to));
      NIB_RETURN_IF_ERROR(t.save((run_ / "tokenizer.model").string()));
      tok_ = std::make_unique<train::Tokenizer>(std::move(t));
    }
  }
  const model::ModelConfig& mc = model_->config();
  if (tok_->vocab_size() > mc.vocab_size)
    return invalid_argument("the tokenizer has {} pieces, more than the model's vocab_size {}", tok_->vocab_size(),
                            mc.vocab_size);
  if (cfg_.level >= task_.num_levels())
    return invalid_argument("level {} is outside the task's levels 0..{}", cfg_.level, task_.num_levels() - 1);
  // guided layers: trace defaults to the later half, trace-full to all
  const int64_t L = mc.num_hidden_layers;
  guided_layers_ = cfg_.guidance_layers;
  if (guided_layers_.empty()) {
    if (cfg_.arm == Arm::kTrace) guided_layers_ = rollout::later_half_layers(L);
    if (cfg_.arm == Arm::kTraceFull)
      for (int64_t l = 0; l < L; ++l) guided_layers_.push_back(l);
  }
  for (int64_t l : guided_layers_)
    if (l >= L) return invalid_argument("guidance layer {} is outside the model's {} layers", l, L);
  guidance_.layers.assign(static_cast<size_t>(L), false);
  for (int64_t l : guided_layers_) guidance_.layers[static_cast<size_t>(l)] = true;
  attach_guidance(*model_, &guidance_);
  if (cfg_.rollout_kv == backend::KvPageFormat::kNvfp4 && quantized_kv_arm(cfg_.arm)) {
    if (mc.head_dim % 16 != 0)
      return invalid_argument("rollout_kv nvfp4 needs a head dim that is a multiple of 16 (the model's is {})",
                              mc.head_dim);
    kv_quantizer_.set_guidance(&guidance_);
    model_->set_kv_quantizer(&kv_quantizer_);
  }
  train::AdamWConfig ac;
  ac.weight_decay = cfg_.weight_decay;
  adamw_ = std::make_unique<train::AdamW>(ac, &be_);
  return Status::ok();
}

Status RlRun::resume_state() {
  NIB_ASSIGN_OR_RETURN(std::string dir, train::latest_checkpoint_dir(run_.string()));
  NIB_ASSIGN_OR_RETURN(train::Checkpoint ck, train::open_checkpoint(dir));
  if (ck.step > cfg_.steps)
    return invalid_argument("steps={} is below the step the run is at ({}, checkpoint '{}')", cfg_.steps, ck.step,
                            ck.dir);
  NIB_RETURN_IF_ERROR(train::load_model_state(model_.get(), ck.dir));
  const std::string opath = (fs::path(ck.dir) / "optimizer.safetensors").string();
  NIB_ASSIGN_OR_RETURN(std::vector<io::NamedTensor> ostate, read_checkpoint_file(opath));
  Status s = adamw_->import_state(ostate, param_views(*model_));
  if (!s) return data_loss("checkpoint '{}': optimizer state: {}", opath, s.message());
  start_ = ck.step;
  if (cfg_.max_staleness > 0 && start_ > 0) {
    // the policy versions the next steps' rollouts still need (rollout_worker.h)
    NIB_ASSIGN_OR_RETURN(std::vector<io::NamedTensor> pt,
                         read_checkpoint_file((fs::path(ck.dir) / kPolicyFile).string()));
    NIB_ASSIGN_OR_RETURN(resumed_versions_,
                         policies_from_named(pt, *model_, rollout_mode(cfg_.arm), kRolloutRecipe));
    for (int64_t v = version_for(start_); v < start_; ++v)
      if (std::none_of(resumed_versions_.begin(), resumed_versions_.end(),
                       [v](const PolicyWeights& w) { return w.version == v; }))
        return data_loss("checkpoint '{}' lacks policy version {}, which step {}'s rollouts need with max_staleness {}",
                         ck.dir, v, start_ + 1 + (v - version_for(start_)), cfg_.max_staleness);
  }
  const json& pts = ck.trainer;
  for (const json& p : pts.value("reward", json::array())) reward_pts_.push_back({p[0].get<double>(), p[1].get<double>()});
  for (const json& p : pts.value("gap_mean", json::array())) gap_mean_pts_.push_back({p[0].get<double>(), p[1].get<double>()});
  for (const json& p : pts.value("gap_max", json::array())) gap_max_pts_.push_back({p[0].get<double>(), p[1].get<double>()});
  NIB_LOG_INFO("rl: resumed from {} (step {})", ck.dir, start_);
  return Status::ok();
}

Status RlRun::write_checkpoint(int64_t step) {
  auto pts = [](const std::vector<train::PlotPoint>& v) {
    json a = json::array();
    for (const auto& p : v) a.push_back({p.step, p.value});
    return a;
  };
  train::CheckpointWrite w;
  w.model = model_.get();
  w.optimizer = adamw_.get();
  w.trainer = json{{"step", step}, {"reward", pts(reward_pts_)}, {"gap_mean", pts(gap_mean_pts_)},
                   {"gap_max", pts(gap_max_pts_)}};
  // "recipe": bf16 lets eval / generate / a later rl read the checkpoint with a built-in recipe
  w.run_config = json{{"rl", cfg_.to_json()}, {"recipe", "bf16"}};
  const fs::path tokp = cfg_.init.empty() ? run_ / "tokenizer.model" : fs::path();
  if (cfg_.init.empty()) {
    w.tokenizer_path = tokp.string();
  } else {
    NIB_ASSIGN_OR_RETURN(train::Checkpoint ck, train::open_checkpoint(cfg_.init));
    w.tokenizer_path = ck.tokenizer_path;
  }
  w.keep_last = cfg_.keep_checkpoints;
  if (cfg_.max_staleness > 0) {
    // the versions the rollouts of steps step+1.. still need (the trainer's own is version `step`);
    // a resume regenerates a rollout in flight now from them, bit for bit
    std::vector<io::NamedTensor> pt;
    for (const auto& [v, pw] : pending_)
      if (v >= version_for(step) && v < step) pw->append_named(pt);
    w.extra_safetensors.push_back({kPolicyFile, std::move(pt)});
  }
  NIB_ASSIGN_OR_RETURN(std::string dir, train::write_checkpoint(run_.string(), step, w));
  (void)dir;
  return Status::ok();
}

Status RlRun::write_plots() {
  NIB_RETURN_IF_ERROR(train::write_loss_plot((run_ / "reward.png").string(), reward_pts_, {}));
  return train::write_loss_plot((run_ / "logp_gap.png").string(), gap_mean_pts_, gap_max_pts_);
}

std::vector<TaskInstance> RlRun::instances(int64_t s) const {
  std::vector<TaskInstance> inst;
  for (int64_t i = 0; i < cfg_.prompts_per_step; ++i)
    inst.push_back(task_.make(static_cast<int>(cfg_.level), cfg_.task_seed, prompt_instance_index(cfg_, s, i)));
  return inst;
}

Result<RolloutJob> RlRun::rollout_job(int64_t s) {
  RolloutJob job;
  job.step = s, job.version = version_for(s);
  for (const TaskInstance& t : instances(s)) {
    NIB_ASSIGN_OR_RETURN(std::vector<int32_t> prompt, tok_->encode(t.prompt));
    if (prompt.empty()) return invalid_argument("task '{}' made an empty prompt", task_.name());
    rollout::Request r;
    r.prompt = std::move(prompt);
    r.id = static_cast<uint64_t>(job.requests.size());
    r.params.sampling.temperature = cfg_.grpo.temperature;
    r.params.max_new_tokens = cfg_.max_new_tokens;
    r.params.stop_ids = {tok_->eos_id()};
    r.params.num_samples = cfg_.group_size;
    r.params.seed = cfg_.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(s);
    job.requests.push_back(std::move(r));
  }
  job.record_routing = model_->num_moe_layers() > 0;
  if (guided_arm(cfg_.arm)) {
    job.record_guidance = true;
    job.guidance_mode = cfg_.arm == Arm::kTraceFull ? rollout::GuidanceMode::kTraceFull : rollout::GuidanceMode::kTrace;
    job.guidance_layers = guided_layers_;
  }
  // two steps' stores live at once with max_staleness > 0: one spill folder each
  job.guidance_spill_dir = (run_ / fmt::format("guidance_spill_{}", s % 2)).string();
  return job;
}

Status RlRun::start_rollout(int64_t s) {
  NIB_ASSIGN_OR_RETURN(RolloutJob job, rollout_job(s));
  pending_.erase(pending_.begin(), pending_.lower_bound(job.version));
  return source_->start(std::move(job));
}

Status RlRun::sync(int64_t version, RlStepMetrics* m) {
  const auto t_sync = std::chrono::steady_clock::now();
  PolicyWeights w;
  if (sink_->wants_packed()) {  // the device transport: packed in the trainer's memory, no host copy
    w.version = version, w.mode = rollout_mode(cfg_.arm);
    NIB_ASSIGN_OR_RETURN(std::shared_ptr<PackedPolicy> p, pack_policy(*model_, w.mode, kRolloutRecipe));
    w.format = p->layout.format;
    w.packed = std::move(p);
  } else {
    NIB_ASSIGN_OR_RETURN(w, snapshot_policy(*model_, rollout_mode(cfg_.arm), kRolloutRecipe, version));
  }
  auto shared = std::make_shared<const PolicyWeights>(std::move(w));
  NIB_RETURN_IF_ERROR(sink_->send(shared));
  if (m != nullptr) {
    m->sync_seconds = seconds_since(t_sync);
    m->sync_bytes = static_cast<double>(shared->bytes());
    const int64_t rest_bytes = shared->packed ? shared->packed->layout.rest.bytes : static_cast<int64_t>(shared->rest.nbytes());
    m->sync_linear_bytes = static_cast<double>(shared->bytes() - rest_bytes);
  }
  pending_[version] = std::move(shared);
  return Status::ok();
}

Result<RlStepMetrics> RlRun::step(int64_t s, RolloutBatch batch, std::chrono::steady_clock::time_point t_began) {
  const auto t_ready = std::chrono::steady_clock::now();  // the rollout batch is here
  const model::ModelConfig& mc = model_->config();
  const int64_t P = cfg_.prompts_per_step, G = cfg_.group_size, V = mc.vocab_size;
  const int64_t Lm = model_->num_moe_layers(), topk = mc.num_experts_per_tok, E = mc.num_experts;
  RlStepMetrics m;
  m.step = s + 1;
  NIB_CHECK(batch.step == s);
  m.policy_version = batch.version;
  m.staleness = s - batch.version;
  m.overlap_seconds = overlap(batch.began, batch.ended, prev_train_began_, prev_train_ended_);

  // ---- the rollout (generated by the worker from policy version batch.version) ----
  const std::vector<TaskInstance> inst = instances(s);
  const std::vector<rollout::Request>& reqs = batch.requests;
  std::unique_ptr<rollout::RecordStore> routing_store = std::move(batch.routing);
  std::unique_ptr<rollout::RecordStore> guidance_store = std::move(batch.guidance);
  const std::vector<rollout::Completion>& comps = batch.completions;
  const double roll_s = std::chrono::duration<double>(batch.ended - batch.began).count();
  m.rollout_tokens_per_s = static_cast<double>(batch.generated_tokens) / std::max(roll_s, 1e-9);
  m.rollout_seconds = roll_s;
  // the part of the generation inside this step (all of it on-policy; asynchronous, what the
  // previous step's training did not hide)
  const double roll_in_step = overlap(batch.began, batch.ended, t_began, t_ready);
  // asynchronous: the next step's rollout (from version max(0, s + 1 - N) <= s, already sent)
  // runs on the worker while this step trains
  if (cfg_.max_staleness > 0 && s + 1 < cfg_.steps) NIB_RETURN_IF_ERROR(start_rollout(s + 1));

  // ---- rewards and advantages ----
  const int64_t B = P * G;
  std::vector<double> rewards;
  std::vector<Sequence> seqs;
  int64_t T = 0, resp_tokens = 0, all_rows = 0;
  for (const rollout::Completion& c : comps) {
    std::vector<int32_t> answer = c.tokens;
    if (c.finish == rollout::FinishReason::kStopId && !answer.empty()) answer.pop_back();
    // a model vocabulary larger than the tokenizer's can sample ids with no text: malformed, 0
    const bool has_text = std::all_of(answer.begin(), answer.end(), [&](int32_t t) { return t < tok_->vocab_size(); });
    std::string text;
    if (has_text) {
      NIB_ASSIGN_OR_RETURN(text, tok_->decode(answer));
    }
    rewards.push_back(has_text ? task_.reward(inst[static_cast<size_t>(c.request)], text) : 0.0);
    Sequence q;
    q.request = c.request, q.sample = c.sample, q.completion = &c;
    q.tokens = reqs[static_cast<size_t>(c.request)].prompt;
    q.prompt_len = static_cast<int64_t>(q.tokens.size());
    q.tokens.insert(q.tokens.end(), c.tokens.begin(), c.tokens.end());
    T = std::max<int64_t>(T, static_cast<int64_t>(q.tokens.size()) - 1);
    resp_tokens += static_cast<int64_t>(c.tokens.size());
    all_rows += static_cast<int64_t>(q.tokens.size()) - 1;
    seqs.push_back(std::move(q));
  }
  NIB_CHECK(static_cast<int64_t>(seqs.size()) == B);
  double rsum = 0, rsq = 0;
  for (double r : rewards) rsum += r;
  m.reward_mean = rsum / static_cast<double>(B);
  for (double r : rewards) rsq += (r - m.reward_mean) * (r - m.reward_mean);
  m.reward_std = std::sqrt(rsq / static_cast<double>(B));
  m.response_len = static_cast<double>(resp_tokens) / static_cast<double>(B);
  const std::vector<double> adv = group_advantages(rewards, G, cfg_.grpo.adv_eps);
  m.guidance_bytes_per_token =
      all_rows > 0 ? static_cast<double>(guidance_store->stats().payload_bytes) / static_cast<double>(all_rows) : 0.0;

  // ---- the full batch: targets, rollout log-probs, R3 sets ----
  const TokenBatch full = make_batch(seqs, 0, B, T);
  PolicyBatch pb;
  pb.B = B, pb.T = T;
  pb.targets.assign(static_cast<size_t>(B * T), -1);
  pb.logp_rollout.assign(static_cast<size_t>(B * T), 0.0);
  pb.advantage = adv;
  for (int64_t b = 0; b < B; ++b) {
    const Sequence& q = seqs[static_cast<size_t>(b)];
    pb.response_len.push_back(static_cast<int64_t>(q.completion->tokens.size()));
    for (size_t j = 0; j < q.completion->tokens.size(); ++j) {
      const int64_t t = q.prompt_len - 1 + static_cast<int64_t>(j);
      pb.targets[static_cast<size_t>(b * T + t)] = q.completion->tokens[j];
      pb.logp_rollout[static_cast<size_t>(b * T + t)] = q.completion->logprobs[j];
    }
  }
  std::vector<int32_t> forced;
  model::RoutingIO routing;
  m.moe_set_mismatch = kNaN;
  std::vector<float> logits(static_cast<size_t>(B * T * V));
  if (Lm > 0) {
    forced.resize(static_cast<size_t>(Lm * B * T * topk));
    NIB_RETURN_IF_ERROR(rollout::gather_routing(forced.data(), *routing_store, full.record_seq.data(),
                                                full.lengths.data(), B, T, Lm, topk, E));
    const auto t_check = std::chrono::steady_clock::now();
    // expert sets the trainer picks by itself, before R3
    std::vector<int32_t> own(forced.size());
    model::RoutingIO rec_only;
    rec_only.record = own.data();
    set_guidance_rows(guidance_, full);
    model_->forward_logits(logits.data(), full.inputs.data(), B, T, rec_only);
    int64_t differ = 0, count = 0;
    for (int64_t l = 0; l < Lm; ++l)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < full.lengths[static_cast<size_t>(b)]; ++t) {
          const size_t o = static_cast<size_t>(((l * B + b) * T + t) * topk);
          std::vector<int32_t> a(own.begin() + o, own.begin() + o + topk), c(forced.begin() + o, forced.begin() + o + topk);
          std::sort(a.begin(), a.end()), std::sort(c.begin(), c.end());
          differ += a != c, ++count;
        }
    m.moe_set_mismatch = count > 0 ? static_cast<double>(differ) / static_cast<double>(count) : 0.0;
    if (cfg_.r3) routing.forced = forced.data();
    m.moe_check_seconds = seconds_since(t_check);
  }

  // ---- π_old (the trainer's log-probs before the update; guided sites measured here) ----
  const auto t_train = std::chrono::steady_clock::now();
  prev_train_began_ = t_train;
  set_guidance_store(guidance_, guided_arm(cfg_.arm) ? guidance_store.get() : nullptr);
  reset_guided_counts(be_, guidance_);  // the π_old forward's counts are the step's metrics
  guidance_.status = Status::ok();
  set_guidance_rows(guidance_, full);
  model_->forward_logits(logits.data(), full.inputs.data(), B, T, routing);
  NIB_RETURN_IF_ERROR(guidance_.status);
  pb.logp_old.assign(static_cast<size_t>(B * T), 0.0);
  // each row's log-prob and entropy over the threads (rows are independent), then the sums in
  // token order
  std::vector<TokenLogprob> row_lp(pb.targets.size());
  parallel_for(static_cast<int64_t>(pb.targets.size()), 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      if (pb.targets[static_cast<size_t>(n)] >= 0)
        row_lp[static_cast<size_t>(n)] = token_logprob_entropy(logits.data() + n * V, V, pb.targets[static_cast<size_t>(n)],
                                                               cfg_.grpo.temperature);
  });
  double ent = 0, dsum = 0, dmax = 0, k3 = 0;
  for (size_t n = 0; n < pb.targets.size(); ++n) {
    if (pb.targets[n] < 0) continue;
    const TokenLogprob& tl = row_lp[n];
    pb.logp_old[n] = tl.logp;
    ent += tl.entropy;
    const double d = tl.logp - pb.logp_rollout[n];
    dsum += std::abs(d), dmax = std::max(dmax, std::abs(d));
    const double r = std::exp(d);  // π_train / π_rollout on a rollout sample
    k3 += r - 1.0 - d;
  }
  const double nt = std::max<double>(1.0, static_cast<double>(resp_tokens));
  m.entropy = ent / nt, m.logp_diff_mean = dsum / nt, m.logp_diff_max = dmax, m.kl_rollout_train = k3 / nt;
  collect_guided_counts(be_, guidance_);
  const GuidedSiteStats gs = guidance_.stats;
  if (guided_arm(cfg_.arm) && gs.elements > 0) {
    m.guided_mismatch = static_cast<double>(gs.rtn_mismatch) / static_cast<double>(gs.elements);
    m.guided_one_step = gs.rtn_mismatch > 0 ? static_cast<double>(gs.one_step) / static_cast<double>(gs.rtn_mismatch) : 1.0;
    m.guided_reproduced = static_cast<double>(gs.reproduced) / static_cast<double>(gs.elements);
  } else {
    m.guided_mismatch = m.guided_one_step = m.guided_reproduced = kNaN;
  }
  m.guided_expert_fallback = guided_arm(cfg_.arm) && gs.routed_rows > 0
                                 ? static_cast<double>(gs.routed_fallback_rows) / static_cast<double>(gs.routed_rows)
                                 : kNaN;
  if (ref_) {
    ref_->forward_logits(logits.data(), full.inputs.data(), B, T, routing);
    pb.logp_ref.assign(static_cast<size_t>(B * T), 0.0);
    parallel_for(static_cast<int64_t>(pb.targets.size()), 1, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        if (pb.targets[static_cast<size_t>(n)] >= 0)
          pb.logp_ref[static_cast<size_t>(n)] = token_logprob_entropy(logits.data() + n * V, V,
                                                                      pb.targets[static_cast<size_t>(n)],
                                                                      cfg_.grpo.temperature).logp;
    });
  }

  m.logprob_seconds = seconds_since(t_train);

  // ---- GRPO updates over minibatches ----
  const auto t_update = std::chrono::steady_clock::now();
  const int64_t mb = B / cfg_.minibatches;
  const std::vector<train::ParamView> views = param_views(*model_);
  double loss = 0, clipf = 0, tisf = 0, klr = 0, gnorm = 0;
  for (int64_t k = 0; k < cfg_.minibatches; ++k) {
    const int64_t b0 = k * mb, b1 = b0 + mb;
    const TokenBatch tb = make_batch(seqs, b0, b1, T);
    PolicyBatch sub;
    sub.B = mb, sub.T = T;
    auto slice = [&](const auto& v) {
      using V2 = std::decay_t<decltype(v)>;
      return v.empty() ? V2{} : V2(v.begin() + b0 * T, v.begin() + b1 * T);
    };
    sub.targets = slice(pb.targets), sub.logp_rollout = slice(pb.logp_rollout), sub.logp_old = slice(pb.logp_old);
    sub.logp_ref = slice(pb.logp_ref);
    sub.advantage.assign(adv.begin() + b0, adv.begin() + b1);
    sub.response_len.assign(pb.response_len.begin() + b0, pb.response_len.begin() + b1);
    std::vector<int32_t> sub_forced;
    model::RoutingIO sub_routing;
    if (routing.forced != nullptr) {
      for (int64_t l = 0; l < Lm; ++l)
        sub_forced.insert(sub_forced.end(), forced.begin() + ((l * B + b0) * T) * topk,
                          forced.begin() + ((l * B + b1) * T) * topk);
      sub_routing.forced = sub_forced.data();
    }
    set_guidance_rows(guidance_, tb);
    model_->zero_grad();
    model_->set_step(s, cfg_.seed);
    // RL optimises the policy alone: the MoE load-balancing and router z-losses of pretraining
    // are off (their gradients would swamp a policy loss of order 1e-2)
    model::LossOptions no_router_losses;
    no_router_losses.router_aux_loss_coef = 0.0;
    no_router_losses.router_z_loss_coef = 0.0;
    PolicyLossStats ls;
    model_->forward_backward_custom(
        tb.inputs.data(), mb, T,
        [&](float* lg, int64_t N, int64_t Vv) {
          NIB_CHECK(N == mb * T && Vv == V);
          ls = policy_loss_and_grad(lg, sub, V, cfg_.grpo);
          return ls.loss;
        },
        no_router_losses, sub_routing);
    NIB_RETURN_IF_ERROR(guidance_.status);
    const train::GradNorm gn = train::global_grad_norm(views, cfg_.grad_clip, 1.0f, be_);
    if (!gn.finite) return data_loss("step {}: non-finite gradient norm", s + 1);
    NIB_RETURN_IF_ERROR(adamw_->step(views, cfg_.lr, gn.clip_scale));
    loss += ls.loss, clipf += ls.clip_fraction, tisf += ls.tis_fraction, klr += ls.kl, gnorm += gn.norm;
  }
  const double nm = static_cast<double>(cfg_.minibatches);
  m.loss = loss / nm, m.clip_fraction = clipf / nm, m.tis_fraction = tisf / nm, m.kl_ref = klr / nm,
  m.grad_norm = gnorm / nm;
  be_.synchronize();  // the last update's queued work belongs to train_seconds, not to the sync
  prev_train_ended_ = std::chrono::steady_clock::now();
  m.train_seconds = std::chrono::duration<double>(prev_train_ended_ - t_update).count();
  m.train_tokens_per_s = static_cast<double>(all_rows) / std::max(seconds_since(t_train), 1e-9);
  set_guidance_store(guidance_, nullptr);
  NIB_RETURN_IF_ERROR(guidance_store->close());
  NIB_RETURN_IF_ERROR(routing_store->close());

  // ---- weight sync: the trainer's block linears quantized, and the rest, as version s + 1 ----
  NIB_RETURN_IF_ERROR(sync(s + 1, &m));
  m.step_seconds = seconds_since(t_began);
  // disjoint intervals of one steady clock: the rest is >= 0 up to rounding
  m.other_seconds = std::max(0.0, m.step_seconds - roll_in_step - m.moe_check_seconds - m.logprob_seconds -
                                      m.train_seconds - m.sync_seconds);
  return m;
}

Status RlRun::start_worker() {
  if (opt_.group != nullptr && opt_.group->world_size() > 1) {
    NIB_RETURN_IF_ERROR(check_rollout_world(opt_.group->world_size(), cfg_.prompts_per_step));
    NIB_ASSIGN_OR_RETURN(mpi_worker_,
                         MpiRolloutClient::create(*opt_.group, *model_, rollout_mode(cfg_.arm), kRolloutRecipe,
                                                  opt_.weight_transport));
    if (opt_.progress)
      NIB_LOG_INFO("rl: weights go to {} rollout ranks over the {} transport ({} group)", opt_.group->world_size() - 1,
                   mpi_worker_->transport_name(), opt_.group->kind());
    sink_ = mpi_worker_.get(), source_ = mpi_worker_.get();
  } else {
    backend::Backend* rbe = opt_.rollout_backend;
    if (rbe == nullptr) {
      const std::string name = be_.name();  // "cpu", "cuda:0 (NVIDIA H200)"
      NIB_ASSIGN_OR_RETURN(own_rollout_be_, backend::make_backend(name.substr(0, name.find(' '))));
      rbe = own_rollout_be_.get();
    }
    NIB_CHECK_MSG(rbe != &be_, "rl: the rollout worker needs its own backend object (it runs beside the trainer)");
    NIB_ASSIGN_OR_RETURN(thread_worker_, ThreadRolloutWorker::create(model_->config(), trainer_recipe(cfg_.arm), rbe,
                                                                     rollout_engine_options(cfg_)));
    sink_ = thread_worker_.get(), source_ = thread_worker_.get();
  }
  for (PolicyWeights& w : resumed_versions_) {
    auto shared = std::make_shared<const PolicyWeights>(std::move(w));
    NIB_RETURN_IF_ERROR(sink_->send(shared));
    pending_[shared->version] = std::move(shared);
  }
  resumed_versions_.clear();
  return sync(start_, nullptr);  // the trainer's weights now: version start_
}

Result<RlResult> RlRun::run() {
  NIB_RETURN_IF_ERROR(build_models());
  if (opt_.resume) NIB_RETURN_IF_ERROR(resume_state());
  if (opt_.progress)
    NIB_LOG_INFO("rl: {} on {}, task {} level {}, steps {}..{} of {}x{} samples, out {}", arm_name(cfg_.arm), be_.name(),
                 task_.name(), cfg_.level, start_ + 1, cfg_.steps, cfg_.prompts_per_step, cfg_.group_size,
                 run_.string());
  NIB_RETURN_IF_ERROR(start_worker());
  const std::string metrics_path = (run_ / "metrics.jsonl").string();
  if (opt_.resume) NIB_RETURN_IF_ERROR(train::drop_metrics_after_step(metrics_path, start_));
  NIB_ASSIGN_OR_RETURN(train::MetricsWriter mw, train::MetricsWriter::open(metrics_path, /*truncate=*/!opt_.resume));
  NIB_RETURN_IF_ERROR(mw.write(json{{"event", opt_.resume ? "resume" : "start"}, {"step", start_},
                                    {"arm", arm_name(cfg_.arm)}, {"device", be_.name()}}));
  RlResult res;
  res.start_step = start_;
  int64_t s = start_;
  auto t_began = std::chrono::steady_clock::now();  // a step runs from the previous step's sync to its own
  NIB_RETURN_IF_ERROR(start_rollout(s));
  for (; s < cfg_.steps; ++s) {
    NIB_ASSIGN_OR_RETURN(RolloutBatch batch, source_->finish());
    NIB_ASSIGN_OR_RETURN(RlStepMetrics m, step(s, std::move(batch), t_began));
    t_began = std::chrono::steady_clock::now();
    // on-policy: the next rollout waits for this step's weights (version s + 1)
    if (cfg_.max_staleness == 0 && s + 1 < cfg_.steps) NIB_RETURN_IF_ERROR(start_rollout(s + 1));
    NIB_RETURN_IF_ERROR(mw.write(m.to_json()));
    reward_pts_.push_back({static_cast<double>(m.step), m.reward_mean});
    gap_mean_pts_.push_back({static_cast<double>(m.step), m.logp_diff_mean});
    gap_max_pts_.push_back({static_cast<double>(m.step), m.logp_diff_max});
    res.steps.push_back(m);
    if (opt_.progress)
      NIB_LOG_INFO("rl step {}/{}: reward {:.3f} |dlogp| {:.4f} {:.1f}s", m.step, cfg_.steps, m.reward_mean,
                   m.logp_diff_mean, m.step_seconds);
    const bool last = s + 1 == cfg_.steps, stop = opt_.stop_after_step > 0 && s + 1 >= opt_.stop_after_step;
    if (opt_.checkpoints && (last || stop || (cfg_.checkpoint_every > 0 && (s + 1) % cfg_.checkpoint_every == 0))) {
      NIB_RETURN_IF_ERROR(write_checkpoint(s + 1));
      NIB_RETURN_IF_ERROR(write_plots());
    }
    if (stop) {
      // a rollout started for the next step is dropped: a resume regenerates it bit for bit
      if (cfg_.max_staleness > 0 && s + 1 < cfg_.steps) (void)source_->finish();
      ++s;
      break;
    }
  }
  res.end_step = s;
  if (opt_.checkpoints) {
    NIB_ASSIGN_OR_RETURN(res.checkpoint_dir, train::latest_checkpoint_dir(run_.string()));
  }
  return res;
}

}  // namespace

Status serve_rl_rollouts(const RlConfig& config, dist::ProcessGroup& group, backend::Backend* backend,
                         WeightTransportKind weight_transport) {
  register_fake_quant_recipe();
  model::ModelConfig mc;
  if (!config.init.empty()) {
    NIB_ASSIGN_OR_RETURN(train::Checkpoint ck, train::open_checkpoint(config.init));
    mc = ck.model_config;
  } else {
    NIB_ASSIGN_OR_RETURN(mc, model::parse_model_config(config.model));
  }
  return serve_rollouts(group, mc, trainer_recipe(config.arm), backend, rollout_engine_options(config),
                        config.max_staleness, weight_transport);
}

Result<RlResult> run_rl(const RlConfig& config, const Task& task, const RlOptions& options) {
  if (options.run_dir.empty()) return invalid_argument("rl: no output folder given (--out)");
  const fs::path run(options.run_dir);
  std::error_code ec;
  if (fs::exists(run, ec) && !fs::is_directory(run, ec))
    return invalid_argument("--out '{}' is not a folder", run.string());
  NIB_RETURN_IF_ERROR(check_run_folder(run, options.resume));
  NIB_RETURN_IF_ERROR(train::make_dirs(run.string()));
  NIB_ASSIGN_OR_RETURN(train::RunLock lock, train::RunLock::acquire(run.string()));
  RlRun r(config, task, options);
  return r.run();
}

}  // namespace nibble::rl
