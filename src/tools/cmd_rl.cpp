// `nibble rl --config FILE --out RUN_DIR [--resume] [--device cpu|cuda]`: GRPO with TIS, R3 and
// the TRACE arms (rl/rl_loop.h) on a task of rl/task.h, from an SFT/pretrain checkpoint or a
// fresh model; metrics.jsonl, reward.png, logp_gap.png and checkpoints in --out. The run folder
// is locked while it works; a folder that holds a run needs --resume, which takes the config
// saved in the latest checkpoint (--config is then optional) and continues bit-identically on
// the CPU. A bad config or option is one line and exit 2; a missing or bad input exit 1. Under
// `mpirun -np N` (N >= 2) the run is disaggregated: rank 0 trains, ranks 1..N-1 roll out, each a
// share of every step's prompt groups (rl/mpi_rollout.h); more rollout ranks than prompts per
// step is exit 2. --weight-transport picks how the weights travel (rl/weight_transport.h; auto:
// NCCL GPU to GPU on CUDA, host broadcasts otherwise); every rank must be given the same.
#include <cstdio>
#include <limits>
#include <memory>

#include <nlohmann/json.hpp>

#include "core/interrupt.h"
#include "core/log.h"
#include "rl/mpi_rollout.h"
#include "rl/rl_loop.h"
#include "rl/task.h"
#include "tools/command.h"
#include "tools/device_option.h"
#include "tools/option_check.h"
#include "tools/process_group_setup.h"
#include "train/checkpoint.h"

namespace nibble::tools {
namespace {

struct RlArgs {
  std::string config, out, device, weight_transport = "auto";
  bool resume = false;
  int64_t stop_after = -1;
};

Result<rl::RlConfig> config_of(const RlArgs& a) {
  if (a.resume) {
    NIB_ASSIGN_OR_RETURN(std::string dir, train::latest_checkpoint_dir(a.out));
    NIB_ASSIGN_OR_RETURN(train::Checkpoint ck, train::open_checkpoint(dir));
    if (!ck.run_config.contains("rl"))
      return invalid_argument("--resume: '{}' is not an rl run (its checkpoint has no rl config)", a.out);
    if (!a.config.empty()) NIB_LOG_INFO("--resume: using the rl config saved in the checkpoint (--config ignored)");
    auto c = rl::parse_rl_config(ck.run_config["rl"]);
    if (!c) return data_loss("checkpoint '{}': rl config: {}", ck.dir, c.status().message());
    return c;
  }
  if (a.config.empty()) return invalid_argument("--config is required (unless --resume)");
  return rl::load_rl_config(a.config);
}

int run_rl_command(const RlArgs& a) {
  auto launch = read_launch();
  if (!launch) return report_error("rl", launch.status());
  auto cfg = config_of(a);
  if (!cfg) return report_error("rl", cfg.status());
  auto transport = rl::parse_weight_transport(a.weight_transport);
  if (!transport) return report_error("rl", transport.status());
  auto task = rl::make_task(cfg->task);
  if (!task) return report_error("rl", task.status());
  auto be = open_device(device_for_launch(a.device, *launch));
  if (!be) return report_error("rl", be.status());
  rl::RlOptions o;
  o.run_dir = a.out;
  o.resume = a.resume;
  o.stop_after_step = a.stop_after;
  o.backend = be->get();
  o.progress = true;
  o.weight_transport = *transport;
  std::unique_ptr<ProcessGroupSetup> pg;
  if (launch->world_size > 1) {
    // disaggregated (rl/mpi_rollout.h): rank 0 trains, ranks 1..N-1 roll out
    auto opened = open_process_group(*launch, **be);
    if (!opened) return report_error("rl", opened.status());
    pg = std::move(opened).value();
  }
  dist::ProcessGroup* group = pg ? pg->group.get() : nullptr;
  const bool rank0 = group == nullptr || group->rank() == 0;
  if (!rank0) spdlog::set_level(spdlog::level::warn);
  // an error every rank returned together is printed by rank 0; one this rank alone saw ends the world
  auto fail = [&](const Status& st) {
    const bool together = group != nullptr && group->failed_together();
    int rc = st.code() == StatusCode::kInvalidArgument ? 2 : 1;
    if (rank0 || !together)
      rc = report_error("rl", rank0 ? st : Status(st.code(), fmt::format("{} (rank {})", st.message(), group->rank())));
    if (group != nullptr && !together) group->abort_world(rc);
    return rc;
  };
  if (group != nullptr) {
    Status st = dist::agree(*group, rl::check_rollout_world(group->world_size(), cfg->prompts_per_step));
    if (st)
      st = dist::check_ranks_agree(*group, {{"rl config", cfg->to_json().dump()}, {"weight transport", a.weight_transport}});
    if (!st) return fail(st);
    if (!rank0) {
      Status served = rl::serve_rl_rollouts(*cfg, *group, be->get(), *transport);
      return served ? 0 : fail(served);
    }
    o.group = group;
    NIB_LOG_INFO("rl: disaggregated, {} ({}): rank 0 trains, ranks 1..{} roll out", launch->describe(), group->kind(),
                 group->world_size() - 1);
  }
  auto r = rl::run_rl(*cfg, **task, o);
  if (!r) return fail(r.status());
  const double reward = r->steps.empty() ? 0.0 : r->steps.back().reward_mean;
  std::printf("rl: %s step %lld/%lld  reward %.3f  checkpoint %s\n", rl::arm_name(cfg->arm),
              static_cast<long long>(r->end_step), static_cast<long long>(cfg->steps), reward,
              r->checkpoint_dir.c_str());
  return 0;
}

}  // namespace

NIBBLE_REGISTER_COMMAND(kRlCommand, "rl",
                        "RL with GRPO (TIS, R3) and the TRACE arms on a task; checkpoints, metrics.jsonl, plots",
                        [](CLI::App& app) -> CommandRun {
                          auto a = std::make_shared<RlArgs>();
                          app.add_option("--config", a->config, "RL config JSON (see docs/rl.md)");
                          app.add_option("--out", a->out, "Run folder (checkpoints/, metrics.jsonl, reward.png)")
                              ->required();
                          app.add_flag("--resume", a->resume, "Continue from the run folder's latest checkpoint");
                          app.add_option("--stop-after", a->stop_after,
                                         "Stop after this step with a checkpoint, as if interrupted (for testing --resume)")
                              ->check(IntegerIn(1, std::numeric_limits<int64_t>::max()));
                          app.add_option("--weight-transport", a->weight_transport,
                                         "Disaggregated runs (mpirun): how the weights reach the rollout ranks: auto "
                                         "(NCCL GPU to GPU on CUDA, else host), host, or device (packed in backend memory)")
                              ->check(CLI::IsMember({"auto", "host", "device"}));
                          add_device_option(app, &a->device);
                          return [a] { return run_rl_command(*a); };
                        });

}  // namespace nibble::tools
