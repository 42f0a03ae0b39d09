// The pretraining loop (see trainer.h). Step numbering: step s (0-based) is the s-th optimizer
// update; metrics, checkpoints and `trainer.json` count steps done (s + 1).
#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <regex>

#include "core/interrupt.h"
#include "core/log.h"
#include "core/parallel.h"
#include "io/output_guard.h"
#include "io/regular_file.h"
#include "train/atomic_dir.h"
#include "train/data_parallel.h"
#include "train/dataset.h"
#include "train/grad_overlap.h"
#include "train/metrics.h"
#include "train/oscireset.h"
#include "train/plot.h"
#include "train/progress.h"
#include "train/run_lock.h"
#include "train/schedule.h"
#include "train/zero.h"

namespace nibble::train {

namespace {
namespace fs = std::filesystem;
using nlohmann::json;

// The folders of `path` that do not exist yet (what make_dirs would create), deepest first.
std::vector<fs::path> missing_folders(const fs::path& path) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::path p = fs::absolute(path, ec).lexically_normal(); !p.empty() && !fs::exists(fs::symlink_status(p, ec));
       p = p.parent_path()) {
    if (p.filename().empty()) {  // "a/b/" normalises to "a/b/": its folder is the parent
      if (p == p.parent_path()) break;
      continue;
    }
    out.push_back(p);
    if (p == p.parent_path()) break;
  }
  return out;
}

// A fresh run writes metrics.jsonl, loss.png, checkpoints/ (and data/) into the run folder:
// refuse a folder where those names hold something nibble did not write (it would be replaced).
Status check_fresh_run_folder(const fs::path& run) {
  std::error_code ec;
  bool nibble_metrics = false;
  const fs::path metrics = run / "metrics.jsonl";
  if (fs::exists(fs::symlink_status(metrics, ec))) {
    auto text = io::read_regular_file(metrics.string(), "metrics file");  // a FIFO is refused, never read
    const std::string first = text ? text->substr(0, text->find('\n')) : std::string();
    const json j = json::parse(first, nullptr, false);
    nibble_metrics = text && fs::is_regular_file(fs::symlink_status(metrics, ec)) &&
                     (first.empty() || (j.is_object() && (j.contains("event") || j.contains("step"))));
    if (!nibble_metrics)
      return invalid_argument("--out '{}' holds a metrics.jsonl that nibble did not write: choose another --out",
                              run.string());
  }
  if (fs::exists(fs::symlink_status(run / "loss.png", ec)) && !nibble_metrics)
    return invalid_argument("--out '{}' holds a loss.png but no nibble metrics.jsonl: choose another --out", run.string());
  const fs::path ckpts = run / "checkpoints";
  if (fs::exists(fs::symlink_status(ckpts, ec))) {
    if (!fs::is_directory(fs::symlink_status(ckpts, ec)))
      return invalid_argument("--out '{}': 'checkpoints' is not a folder: choose another --out", run.string());
    static const std::regex ours(R"((step_[0-9]+|latest)(\.(tmp|old)\.[0-9]+)?)");
    for (const auto& e : fs::directory_iterator(ckpts, ec))
      if (!std::regex_match(e.path().filename().string(), ours))
        return invalid_argument("--out '{}': checkpoints/ holds '{}', which nibble did not write: choose another --out",
                                run.string(), e.path().filename().string());
  }
  return Status::ok();
}

Result<TrainResult> run_pretraining_locked(const RunConfig& cfg, const TrainOptions& opt);

// True when `opt` asks for data parallelism (any group but the trivial one).
bool data_parallel(const TrainOptions& opt) { return opt.group != nullptr && opt.group->kind() != "single"; }

}  // namespace

Result<EvalResult> evaluate(model::Model* model, const ValLoader& val, bool stop_on_interrupt,
                            dist::ProcessGroup* group) {
  EvalResult r;
  double ce_sum = 0;
  Batch b;
  const int world = group != nullptr ? group->world_size() : 1, rank = group != nullptr ? group->rank() : 0;
  for (int64_t i = rank; i < val.num_batches(); i += world) {
    if (stop_on_interrupt && interrupt_signal() != 0) return cancelled_status("during evaluation");
    NIB_RETURN_IF_ERROR(val.get(i, &b));
    model::LossParts lp = model->forward_loss(b.tokens.data(), b.targets.data(), b.batch, b.seq_len);
    ce_sum += lp.ce * static_cast<double>(lp.n_tokens);
    r.tokens += lp.n_tokens;
    ++r.batches;
  }
  if (world > 1) {  // sums: (3) f64, exact for the counts (integers below 2^53)
    double sums[3] = {ce_sum, static_cast<double>(r.tokens), static_cast<double>(r.batches)};
    NIB_RETURN_IF_ERROR(group->all_reduce_sum_host(sums, 3));
    ce_sum = sums[0];
    r.tokens = static_cast<int64_t>(sums[1]);
    r.batches = static_cast<int64_t>(sums[2]);
  }
  if (r.tokens == 0) return data_loss("evaluation: no validation tokens");
  r.loss = ce_sum / static_cast<double>(r.tokens);
  r.ppl = std::exp(r.loss);
  return r;
}

Result<RunConfig> resume_run_config(const std::string& run_dir, const std::vector<std::string>& overrides) {
  NIB_ASSIGN_OR_RETURN(std::string dir, latest_checkpoint_dir(run_dir));
  NIB_ASSIGN_OR_RETURN(Checkpoint ck, open_checkpoint(dir));
  return resolve_run_config(ck.run_config, overrides);
}

Result<TrainResult> run_pretraining(const RunConfig& cfg, const TrainOptions& opt) {
  if (opt.run_dir.empty()) return invalid_argument("pretrain: no output folder (--out)");
  const fs::path run(opt.run_dir);
  if (data_parallel(opt)) {
    // Rank 0 alone creates and locks the run folder (one writer per folder); the others learn
    // whether it could, so a refused folder stops every rank with rank 0's message.
    dist::ProcessGroup& g = *opt.group;
    std::vector<fs::path> created;
    std::optional<RunLock> lock;
    Status s = Status::ok();
    if (g.rank() == 0) {
      created = missing_folders(run);
      s = make_dirs(run.string());
      if (s) {
        auto l = RunLock::acquire(run.string());
        if (l) lock.emplace(std::move(l).value());
        else s = l.status();
      }
    }
    s = dist::agree(g, s);
    Result<TrainResult> result = s ? run_pretraining_locked(cfg, opt) : Result<TrainResult>(s);
    lock.reset();
    if (!result && g.rank() == 0) {
      std::error_code ec;
      for (const fs::path& p : created)
        if (!fs::is_directory(p, ec) || !fs::is_empty(p, ec) || !fs::remove(p, ec)) break;
    }
    return result;
  }
  const std::vector<fs::path> created = missing_folders(run);
  NIB_RETURN_IF_ERROR(make_dirs(run.string()));
  Result<TrainResult> result = Status::ok();
  {
    auto lock = RunLock::acquire(run.string());
    result = lock ? run_pretraining_locked(cfg, opt) : Result<TrainResult>(lock.status());
  }  // the lock (and its file) is released here
  if (!result) {
    // A failed run removes the folders it created, if they are still empty; nothing else.
    std::error_code ec;
    for (const fs::path& p : created)
      if (!fs::is_directory(p, ec) || !fs::is_empty(p, ec) || !fs::remove(p, ec)) break;
  }
  return result;
}

namespace {

Result<TrainResult> run_pretraining_locked(const RunConfig& cfg, const TrainOptions& opt) {
  if (cfg.threads > 0) set_num_threads(cfg.threads);
  const fs::path run(opt.run_dir);
  // Data parallelism: every rank trains on its rows; rank 0 (the writer) alone writes files.
  const bool dp = data_parallel(opt);
  dist::ProcessGroup* group = dp ? opt.group : nullptr;
  const int world = dp ? group->world_size() : 1, rank = dp ? group->rank() : 0;
  const bool writer = rank == 0;
  // A setup error every rank must share (else the ranks still running would wait for this one).
  auto agreed = [&](const Status& s) { return dp ? dist::agree(*group, s) : s; };

  Checkpoint ck;
  bool already_finished = false;
  Status pre = [&]() -> Status {
    if (!cfg.task.name.empty() && !opt.row_data)
      return invalid_argument("task.name '{}' is for nibble sft: pretraining trains on data.files", cfg.task.name);
    if (dp && opt.row_data) return invalid_argument("nibble sft does not train data-parallel: run it as one process");
    if (dp && cfg.batch_size % world != 0)
      return invalid_argument("batch_size {} is not a multiple of the world size {}: each rank takes batch_size/{} "
                              "rows of every micro-batch", cfg.batch_size, world, world);
    if (opt.resume) {
      NIB_ASSIGN_OR_RETURN(std::string dir, latest_checkpoint_dir(run.string()));
      NIB_ASSIGN_OR_RETURN(ck, open_checkpoint(dir));
      // A resume with nothing left to do: say so before touching data, metrics or checkpoints.
      if (ck.step > cfg.steps)
        return invalid_argument("steps={} is below the step the run is at: its latest checkpoint '{}' is at step {} "
                                "(to continue it, --set steps=N with N > {})", cfg.steps, ck.dir, ck.step, ck.step);
      if (opt.stop_after_step > 0 && opt.stop_after_step <= ck.step && ck.step < cfg.steps)
        return invalid_argument("--stop-after {} is not after the step the run is at: its latest checkpoint '{}' is "
                                "at step {}", opt.stop_after_step, ck.dir, ck.step);
      already_finished = ck.step == cfg.steps;
    } else if (fs::exists(run / "checkpoints" / "latest")) {
      return invalid_argument("'{}' already holds checkpoints: pass --resume to continue it, or choose another --out",
                              run.string());
    } else if (writer) {
      NIB_RETURN_IF_ERROR(check_fresh_run_folder(run));
    }
    return Status::ok();
  }();
  NIB_RETURN_IF_ERROR(agreed(pre));
  if (already_finished) {
    TrainResult done;
    done.start_step = done.end_step = ck.step;
    done.checkpoint_dir = ck.dir;
    done.already_finished = true;
    return done;
  }
  // Under the run lock every temporary of the run's own files is stale, whatever its pid.
  if (writer)
    for (const char* name : {"metrics.jsonl", "loss.png", "data"}) io::remove_stale_temporaries((run / name).string(), true);

  // ---- data ----
  Dataset ds;
  RowData given;  // opt.row_data's rows (nibble sft)
  if (opt.row_data) {
    auto given_or = opt.row_data(cfg, opt.resume ? ck.dir : std::string());
    if (!given_or) return Status(given_or.status().code(), "data: " + given_or.status().message());
    given = std::move(given_or).value();
    ds.tokenizer_path = given.tokenizer_path;
    NIB_LOG_INFO("data: {}", given.description);
  } else {
    DatasetOptions dopt;
    dopt.text_files = cfg.data_files;
    dopt.vocab_size = static_cast<int>(cfg.vocab_size);
    dopt.tokenizer_file = cfg.tokenizer_file;
    dopt.val_shard_files = cfg.val_files;
    dopt.vocab_size_name = "data.vocab_size";
    // A loaded tokenizer may have any size up to the model's vocabulary.
    if (!cfg.tokenizer_file.empty()) dopt.vocab_size = static_cast<int>(cfg.model.vocab_size);
    dopt.val_fraction = cfg.val_fraction;
    const std::string data_dir = cfg.data_dir.empty() ? (run / "data").string() : cfg.data_dir;
    // Rank 0 prepares the data folder; the others open it once it is there (a shared file system).
    Status data_status = Status::ok();
    if (writer) {
      auto ds_or = prepare_dataset(data_dir, dopt);
      if (ds_or) ds = std::move(ds_or).value();
      else data_status = Status(ds_or.status().code(), "data: " + ds_or.status().message());
    }
    NIB_RETURN_IF_ERROR(agreed(data_status));
    if (!writer) {
      auto ds_or = open_dataset(data_dir);
      if (!ds_or) return Status(ds_or.status().code(), "data (rank " + std::to_string(rank) + "): " + ds_or.status().message());
      ds = std::move(ds_or).value();
    }
    if (ds.vocab_size > cfg.model.vocab_size)
      return data_loss("data: tokenizer vocabulary {} exceeds the model's vocab_size {}", ds.vocab_size,
                       cfg.model.vocab_size);
    NIB_LOG_INFO("data: {} ({} train / {} val tokens, vocab {}{})", ds.dir, ds.summary.train_tokens,
                 ds.summary.val_tokens, ds.vocab_size, ds.reused ? ", reused" : "");
  }

  // ---- model, optimizer, loaders ----
  backend::Backend& be = opt.backend != nullptr ? *opt.backend : backend::cpu_backend();
  NIB_ASSIGN_OR_RETURN(auto model, model::Model::create(cfg.model, cfg.recipe, &be));
  model->init_weights(cfg.seed);
  set_recipe_total_steps(*model, cfg.steps);
  AdamW adamw(cfg.adamw, &model->backend());
  const int64_t B = cfg.batch_size, T = cfg.seq_len;
  if (given.train != nullptr && (given.train->seq_len != T || given.val == nullptr || given.val->seq_len != T))
    return invalid_argument("data: the given rows are not of seq_len {}", T);
  auto loader_or = given.train != nullptr ? TrainLoader::from_rows(given.train, B, cfg.seed)
                                         : TrainLoader::open({ds.train_path}, B, T, cfg.seed);
  if (!loader_or) return Status(loader_or.status().code(), "data: " + loader_or.status().message());
  TrainLoader loader = std::move(loader_or).value();
  auto val_or = given.val != nullptr ? ValLoader::from_rows(given.val, B, cfg.eval_batches)
                                    : ValLoader::open({ds.val_path}, B, T, cfg.eval_batches);
  if (!val_or) return Status(val_or.status().code(), "data: validation split: " + val_or.status().message());
  ValLoader val = std::move(val_or).value();
  if (val.num_batches() == 0) return data_loss("data: the validation split has no full batch of {}x{}", B, T + 1);

  std::vector<ParamView> views;
  for (auto& p : model->param_refs()) views.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  // ZeRO-1 (dist.zero = 1, a data-parallel run whose group reaches the model's memory): the
  // optimizer sees this rank's owned slices (owned), else every parameter (views).
  std::optional<Zero1> zero;
  std::vector<ParamView> owned;
  if (dp && cfg.zero == 1) {
    if (group->device_memory() == (model->backend().device() != Device::kCPU)) {
      std::vector<int64_t> numels;
      int64_t at = 0;
      for (const ParamView& v : views) {
        if (v.value != model->flat_values() + at || v.grad != model->flat_grads() + at)
          return Status(StatusCode::kInternal, "zero: the parameters are not one contiguous buffer in order");
        numels.push_back(v.numel);
        at += v.numel;
      }
      NIB_ASSIGN_OR_RETURN(ZeroLayout layout, ZeroLayout::create(numels, cfg.bucket_elems, world, rank));
      zero.emplace(*group, model->backend(), std::move(layout));
      owned = owned_views(views, zero->layout());
    } else {
      NIB_LOG_INFO("ZeRO-1 off: the {} process group cannot reach the model's memory on {} (gradients are "
                   "all-reduced through the host)", group->kind(), model->backend().name());
    }
  }
  // dist.overlap: the buckets reduced during the last micro-batch's backward, as the model makes
  // their gradients final; not where the gradients are staged through the host (MPI + CUDA).
  std::optional<OverlappedGradReduce> overlap;
  if (dp && cfg.overlap == 1) {
    if (group->device_memory() == (model->backend().device() != Device::kCPU))
      overlap.emplace(*group, model->flat_grads(), model->num_params(), zero ? &*zero : nullptr, cfg.bucket_elems);
    else
      NIB_LOG_INFO("dist.overlap off: the {} process group cannot reach the model's memory on {}", group->kind(),
                   model->backend().name());
  }
  const std::vector<ParamView>& optimizer_views = zero ? owned : views;
  const int64_t moment_bytes = 2 * static_cast<int64_t>(sizeof(float)) *
                               (zero ? zero->layout().owned_elems() : model->num_params());

  int64_t start = 0, bad_in_row = 0, skipped_total = 0;
  // The newest checkpoint whose weights are trained (at least one optimizer update) and finite:
  // what the non-finite abort names.
  std::string last_good_checkpoint;
  // Read through a host copy: the weights live in the backend's memory (a GPU's under CUDA).
  std::vector<float> host_weights;
  auto weights_finite = [&] {
    host_weights.resize(static_cast<size_t>(model->num_params()));
    model->download_parameters(host_weights.data());
    for (float w : host_weights)
      if (!std::isfinite(w)) return false;
    return true;
  };
  if (opt.resume) {
    NIB_RETURN_IF_ERROR(load_model_state(model.get(), ck.dir));
    const std::string opath = (fs::path(ck.dir) / "optimizer.safetensors").string();
    if (!fs::exists(opath))
      return not_found("incomplete checkpoint '{}': missing optimizer.safetensors (needed to resume)", ck.dir);
    auto of = io::SafetensorsFile::open(opath);
    if (!of) return data_loss("corrupt checkpoint file '{}': {}", opath, of.status().message());
    std::vector<io::NamedTensor> ostate;
    for (auto& n : of->names()) {
      NIB_ASSIGN_OR_RETURN(Tensor t, of->get(n));
      ostate.push_back({n, t});
    }
    Status s = adamw.import_state(ostate, optimizer_views);
    if (!s) return data_loss("checkpoint '{}': optimizer state: {}", opath, s.message());
    s = loader.restore_json(ck.trainer.value("loader", json::object()));
    if (!s) return data_loss("checkpoint '{}': data loader state: {}", ck.dir, s.message());
    start = ck.step;
    bad_in_row = ck.trainer.value("bad_steps_in_row", int64_t{0});
    skipped_total = ck.trainer.value("skipped_steps", int64_t{0});
    if (adamw.step_count() > 0 && weights_finite()) last_good_checkpoint = ck.dir;
    NIB_LOG_INFO("resumed from {} (step {})", ck.dir, start);
  }
  NIB_ASSIGN_OR_RETURN(LrSchedule schedule, LrSchedule::create(cfg.schedule, cfg.lr, cfg.steps));
  const RowRange rows = dp ? rank_rows(B, rank, world) : RowRange{0, B};
  if (dp) {
    // Every rank must train the same run from the same state: compare hashes with rank 0's.
    host_weights.resize(static_cast<size_t>(model->num_params()));
    model->download_parameters(host_weights.data());
    const std::string weight_bytes(reinterpret_cast<const char*>(host_weights.data()),
                                   host_weights.size() * sizeof(float));
    NIB_RETURN_IF_ERROR(dist::check_ranks_agree(
        *group, {{"run config", cfg.json.dump()},
                 {"data", fmt::format("{} {} {} {}", ds.fingerprint, ds.summary.train_tokens, ds.summary.val_tokens,
                                      loader.windows_per_epoch())},
                 {"starting step", std::to_string(start)},
                 {"weights", weight_bytes}}));
    NIB_LOG_INFO("data parallel: {} ranks over {}; rank {} takes rows [{}, {}) of every {}-row micro-batch; "
                 "gradients {} {} backward",
                 world, group->kind(), rank, rows.begin, rows.end, B,
                 zero ? "reduce-scattered (ZeRO-1)" : "all-reduced (summed in rank order)",
                 overlap ? fmt::format("in {} buckets overlapped with", overlap->num_buckets()) : std::string("after"));
    if (zero)
      NIB_LOG_INFO("ZeRO-1: rank {} holds AdamW moments for {} of {} parameters: {:.3f} MiB (unsharded {:.3f} MiB); "
                   "{} buckets reduce-scattered, the updated weights all-gathered",
                   rank, zero->layout().owned_elems(), model->num_params(), moment_bytes / 1048576.0,
                   8.0 * static_cast<double>(model->num_params()) / 1048576.0, zero->layout().buckets().size());
  }

  // ---- metrics and plot ----
  const std::string metrics_path = (run / "metrics.jsonl").string();
  std::vector<PlotPoint> train_pts, val_pts;
  if (opt.resume && writer) {
    NIB_RETURN_IF_ERROR(drop_metrics_after_step(metrics_path, start));
    auto old = read_metrics(metrics_path);
    if (old) {
      for (auto& e : *old) {
        if (e.contains("ce") && e["ce"].is_number()) train_pts.push_back({e["step"].get<double>(), e["ce"].get<double>()});
        if (e.contains("val_loss") && e["val_loss"].is_number())
          val_pts.push_back({e["step"].get<double>(), e["val_loss"].get<double>()});
      }
    }
  }
  // Only the writer (rank 0) has a metrics file; write_metrics is a no-op on the other ranks.
  std::optional<MetricsWriter> metrics;
  if (writer) {
    NIB_ASSIGN_OR_RETURN(MetricsWriter mw, MetricsWriter::open(metrics_path, /*truncate=*/!opt.resume));
    metrics.emplace(std::move(mw));
  }
  auto write_metrics = [&](const json& event) { return metrics ? metrics->write(event) : Status::ok(); };
  if (!opt.resume) {
    NIB_RETURN_IF_ERROR(write_metrics(json{{"event", "start"}, {"step", 0}, {"recipe", cfg.recipe.name},
                                           {"params", model->num_params()}, {"threads", num_threads()},
                                           {"device", be.name()}, {"world_size", world},
                                           {"process_group", dp ? group->kind() : std::string("single")},
                                           {"zero", zero ? 1 : 0}, {"adamw_moment_bytes", moment_bytes}}));
  } else {  // the device (and the world) may differ from the ones the run started on
    NIB_RETURN_IF_ERROR(write_metrics(json{{"event", "resume"}, {"step", start}, {"device", be.name()},
                                           {"threads", num_threads()}, {"world_size", world},
                                           {"process_group", dp ? group->kind() : std::string("single")},
                                           {"zero", zero ? 1 : 0}, {"adamw_moment_bytes", moment_bytes}}));
  }

  TrainResult res;
  int64_t saved_step = -1;  // the step of the last checkpoint this call wrote
  res.start_step = start;
  res.end_step = start;
  if (opt.resume) res.checkpoint_dir = ck.dir;
  const std::string tokenizer_path = ds.tokenizer_path;
  json run_config_json = cfg.json;
  auto save = [&](int64_t step_done) -> Status {
    // ZeRO-1: every rank sends its moments; the writer gets the full per-parameter state.
    std::vector<io::NamedTensor> zero_state;
    if (zero && adamw.step_count() > 0) {
      NIB_ASSIGN_OR_RETURN(zero_state, zero->gather_state(adamw, views, writer));
    }
    if (!writer) {  // rank 0 writes the checkpoint (the same weights on every rank)
      saved_step = step_done;
      return Status::ok();
    }
    if (adamw.step_count() == 0) {  // the weights are still the initial ones: nothing to save
      NIB_LOG_WARN("step {}: no checkpoint written: no update has been applied yet (every step so far was skipped)",
                   step_done);
      return Status::ok();
    }
    CheckpointWrite w;
    w.model = model.get();
    w.optimizer = &adamw;
    w.optimizer_state = zero ? &zero_state : nullptr;
    w.trainer = json{{"format", "nibble-trainer-1"},
                     {"loader", loader.state_json()},
                     {"bad_steps_in_row", bad_in_row},
                     {"skipped_steps", skipped_total},
                     {"seed", cfg.seed},
                     {"total_steps", cfg.steps},
                     {"next_lr", schedule.lr(step_done)},
                     {"optimizer_updates", adamw.step_count()},
                     {"recipe", cfg.recipe.to_json()},
                     {"data_dir", ds.dir}};
    w.run_config = run_config_json;
    w.tokenizer_path = tokenizer_path;
    w.keep_last = cfg.keep_last;
    w.hook = opt.checkpoint_hook;
    auto d = write_checkpoint(run.string(), step_done, w);
    if (!d) return Status(d.status().code(), "checkpoint at step " + std::to_string(step_done) + ": " + d.status().message());
    res.checkpoint_dir = *d;
    saved_step = step_done;
    if (weights_finite()) last_good_checkpoint = *d;
    return Status::ok();
  };
  auto run_eval = [&](int64_t step_done) -> Status {
    NIB_ASSIGN_OR_RETURN(EvalResult e, evaluate(model.get(), val, false, group));
    res.validated = true;
    res.val_loss = e.loss;
    res.val_ppl = e.ppl;
    val_pts.push_back({static_cast<double>(step_done), e.loss});
    json ev{{"step", step_done}, {"val_loss", e.loss}, {"val_ppl", e.ppl}, {"val_tokens", e.tokens}};
    for (const auto& [k, v] : recipe_stats(*model)) ev["recipe." + k] = v;
    if (opt.after_validation) {
      NIB_ASSIGN_OR_RETURN(json extra, opt.after_validation(*model, step_done));
      ev.update(extra);
      res.validation_extra = std::move(extra);
    }
    NIB_RETURN_IF_ERROR(write_metrics(ev));
    if (!opt.progress)
      NIB_LOG_DEBUG("step {}: val loss {:.4f} ppl {}", step_done, e.loss, ProgressBar::format_perplexity(e.ppl));
    if (!writer) return Status::ok();
    Status s = write_loss_plot((run / "loss.png").string(), train_pts, val_pts);
    if (!s) NIB_LOG_WARN("loss plot not written: {}", s.message());
    return Status::ok();
  };

  const model::LossOptions loss_opt{cfg.z_loss};
  const double tokens_per_step = static_cast<double>(B * T * cfg.grad_accum);
  std::optional<ProgressBar> bar;
  if (opt.progress && writer) bar.emplace(cfg.steps, start, cfg.log_interval);
  const auto t0 = std::chrono::steady_clock::now();
  Batch batch;
  std::vector<float> hook_grads, grad_stage;
  bool stop_requested = false;  // data parallel: a SIGINT/SIGTERM seen by any rank (agreed per step)
  const int64_t end = opt.stop_after_step > 0 ? std::min(cfg.steps, opt.stop_after_step) : cfg.steps;
  if (interrupt_signal() != 0)
    return cancelled_status(start > 0 ? fmt::format("before step {}: checkpoint {}", start + 1, ck.dir)
                                      : std::string("before the first step"));
  for (int64_t s = start; s < end; ++s) {
    model->set_step(s, cfg.seed);
    model->zero_grad();
    double loss = 0, ce = 0, zl = 0;
    for (int64_t a = 0; a < cfg.grad_accum; ++a) {
      NIB_RETURN_IF_ERROR(loader.next(&batch, rows.begin, rows.end));
      model->set_micro_step(s * cfg.grad_accum + a);
      const bool reduce_in_backward = overlap && a + 1 == cfg.grad_accum;  // the last micro-batch alone
      if (reduce_in_backward) {
        overlap->begin();
        model->set_grads_final_hook([&](int64_t final_from) { overlap->on_grads_final(final_from); });
      }
      model::LossParts lp = model->forward_backward(batch.tokens.data(), batch.targets.data(), batch.batch, batch.seq_len,
                                                    loss_opt);
      if (reduce_in_backward) model->set_grads_final_hook(nullptr);
      loss += lp.loss;
      ce += lp.ce;
      zl += lp.z_loss;
    }
    if (dp) {
      // Gradients and losses summed over ranks (each rank's are means over its rows: the sum over
      // ranks is world times the global mean, folded into grad_scale and the divisions below).
      const auto reduce_t0 = std::chrono::steady_clock::now();
      if (overlap) {
        NIB_RETURN_IF_ERROR(overlap->finish());  // every bucket done (started during backward)
      } else if (zero) {
        NIB_RETURN_IF_ERROR(zero->reduce_scatter(model->flat_grads()));
      } else {
        NIB_RETURN_IF_ERROR(all_reduce_gradients(*group, model->backend(), model->flat_grads(), model->num_params(),
                                                 &grad_stage, cfg.bucket_elems));
      }
      // The reduce time left after backward (what the overlap hides), for docs/benchmarks.md.
      NIB_LOG_DEBUG("step {}: gradient reduce after backward {:.2f} ms{}", s + 1,
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - reduce_t0).count(),
                    overlap ? fmt::format(" ({} of {} buckets started during backward, {} of them done by its end)",
                                          overlap->started_during_backward(), overlap->num_buckets(),
                                          overlap->done_at_backward_end())
                            : std::string());
      double sums[4] = {loss, ce, zl, interrupt_signal() != 0 ? 1.0 : 0.0};
      NIB_RETURN_IF_ERROR(group->all_reduce_sum_host(sums, 4));
      loss = sums[0] / world;
      ce = sums[1] / world;
      zl = sums[2] / world;
      stop_requested = sums[3] > 0;
    }
    loss /= cfg.grad_accum;
    ce /= cfg.grad_accum;
    zl /= cfg.grad_accum;
    if (opt.grad_hook) {
      // host round trip: the hook is host code (tests inject non-finite gradients through it)
      hook_grads.resize(static_cast<size_t>(model->num_params()));
      model->download_gradients(hook_grads.data());
      opt.grad_hook(s, hook_grads.data(), model->num_params());
      model->upload_gradients(hook_grads.data());
    }
    const float grad_scale = static_cast<float>(1.0 / static_cast<double>(cfg.grad_accum * world));
    GradNorm gn;
    if (zero) {  // the owned slices' sums of squares, summed over ranks
      NIB_ASSIGN_OR_RETURN(const double sum_squares, zero->grad_sum_squares(owned, grad_scale));
      gn = grad_norm_from_sum_squares(sum_squares, cfg.grad_clip);
    } else {
      gn = global_grad_norm(views, cfg.grad_clip, grad_scale, model->backend());
    }
    const double lr = schedule.lr(s);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double tps = elapsed > 0 ? tokens_per_step * static_cast<double>(s + 1 - start) / elapsed : 0;
    if (!std::isfinite(loss) || !gn.finite) {
      ++bad_in_row;
      ++skipped_total;
      ++res.skipped_steps;
      res.losses.push_back(std::numeric_limits<double>::quiet_NaN());
      const char* why = !std::isfinite(loss) ? "non-finite loss" : "non-finite gradient norm";
      NIB_LOG_WARN("step {}: {} (loss {}, grad norm {}): update skipped ({} in a row, limit {})", s + 1, why, loss,
                   gn.norm, bad_in_row, cfg.max_bad_steps);
      NIB_RETURN_IF_ERROR(write_metrics(json{{"step", s + 1}, {"skipped", true}, {"reason", why}, {"loss", loss},
                                             {"grad_norm", gn.norm}, {"lr", lr}}));
      if (bad_in_row >= cfg.max_bad_steps) {
        if (dp) group->set_failed_together();  // decided on reduced values: every rank stops here
        return Status(StatusCode::kInternal,
                      fmt::format("aborting at step {}: {} consecutive steps with non-finite loss or gradients "
                                  "(max_bad_steps); last good checkpoint: {}",
                                  s + 1, bad_in_row, last_good_checkpoint.empty() ? "none" : last_good_checkpoint));
      }
    } else {
      bad_in_row = 0;
      NIB_RETURN_IF_ERROR(adamw.step(optimizer_views, lr, grad_scale * gn.clip_scale));
      if (zero) NIB_RETURN_IF_ERROR(zero->all_gather(model->flat_values()));  // every rank's updated slices
      const int64_t resets = recipe_after_optimizer_step(*model, s);  // OsciReset may move weights
      if (resets > 0) NIB_LOG_DEBUG("step {}: OsciReset moved {} weights onto their grid points", s + 1, resets);
      res.losses.push_back(loss);
      train_pts.push_back({static_cast<double>(s + 1), ce});
      NIB_RETURN_IF_ERROR(write_metrics(json{{"step", s + 1}, {"loss", loss}, {"ce", ce}, {"z_loss", zl}, {"lr", lr},
                                             {"grad_norm", gn.norm}, {"tokens_per_s", tps}, {"elapsed_s", elapsed}}));
    }
    if (bar) bar->update(s + 1, ce, tps);
    res.end_step = s + 1;
    const bool last = s + 1 == cfg.steps;
    if (last || (cfg.eval_interval > 0 && (s + 1) % cfg.eval_interval == 0)) NIB_RETURN_IF_ERROR(run_eval(s + 1));
    if (last || s + 1 == end || (cfg.checkpoint_interval > 0 && (s + 1) % cfg.checkpoint_interval == 0))
      NIB_RETURN_IF_ERROR(save(s + 1));
    if (dp ? stop_requested : interrupt_signal() != 0) {  // a safe point: the step is done; keep it in a checkpoint
      if (bar) bar->finish();
      if (saved_step != s + 1) NIB_RETURN_IF_ERROR(save(s + 1));
      if (dp) group->set_failed_together();  // every rank saw the same reduced flag
      return cancelled_status(fmt::format("after step {}/{}: checkpoint {}", s + 1, cfg.steps, res.checkpoint_dir));
    }
  }
  if (bar) bar->finish();
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  res.tokens_per_second = res.seconds > 0 ? tokens_per_step * static_cast<double>(res.end_step - start) / res.seconds : 0;
  json end_event{{"event", "end"}, {"step", res.end_step}, {"seconds", res.seconds},
                 {"skipped_steps", res.skipped_steps}};
  if (res.validated) end_event.update({{"val_loss", res.val_loss}, {"val_ppl", res.val_ppl}});
  if (res.validation_extra.is_object()) end_event.update(res.validation_extra);
  NIB_RETURN_IF_ERROR(write_metrics(end_event));
  return res;
}

}  // namespace

}  // namespace nibble::train
