// The multi-process benches of `nibble bench` (issue #17 item 4), run in the launched process group
// (mpirun -np N, the RANK/WORLD_SIZE/MASTER_* environment, or one process):
// `bench collectives`: all-reduce, reduce-scatter, all-gather and broadcast bandwidth through
// nibble's ProcessGroup and through the group's library on the same buffers (dist/collectives_bench.h);
// `bench weight-sync`: the RL weight sync's time per transport and precision mode for a model config
// (rl/weight_sync_bench.h). Rank 0 prints one JSON line per row; the other ranks print nothing.
// Arguments are checked before the group opens (exit 2 on every rank, one line each).
#include "tools/bench_dist.h"

#include <cmath>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "dist/collectives_bench.h"
#include "model/config.h"
#include "rl/weight_sync_bench.h"
#include "tools/device_option.h"
#include "tools/option_check.h"
#include "tools/process_group_setup.h"
#ifdef NIBBLE_HAVE_CUDA
#include "dist/nccl/nccl_group.h"
#endif

namespace nibble::tools {

namespace {

constexpr int64_t kMaxCalls = 100000;

struct CollectivesArgs {
  std::string min_bytes = "1K", max_bytes = "256M", ops = "all_reduce,reduce_scatter,all_gather,broadcast", device;
  int64_t factor = 2, warmup = 5, iters = 20;
  CLI::App* app = nullptr;
};

struct WeightSyncArgs {
  std::string config, transports = "host,device", modes = "bf16,w4a16", recipe = "tetrajet-v2", device;
  int64_t warmup = 1, iters = 5;
  uint64_t seed = 1;
  CLI::App* app = nullptr;
};

// The items of a comma list (empty items kept, so that "a,,b" is refused by the item parser).
std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> items;
  for (size_t at = 0;;) {
    const size_t comma = s.find(',', at);
    items.push_back(s.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) return items;
    at = comma + 1;
  }
}

// "4096", "1K", "256M", "1G" (also "KiB", "KB"; binary units) in bytes; else invalid_argument.
Result<int64_t> parse_byte_size(const std::string& text) {
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  std::string unit = text.substr(digits);
  if (unit.size() > 1 && (unit.back() == 'B' || unit.back() == 'b')) unit.pop_back();  // "KiB", "KB", "MB"
  if (unit.size() == 2 && unit[1] == 'i') unit.pop_back();
  int shift = -1;
  if (unit.empty() || unit == "B" || unit == "b") shift = 0;
  else if (unit == "K" || unit == "k") shift = 10;
  else if (unit == "M" || unit == "m") shift = 20;
  else if (unit == "G" || unit == "g") shift = 30;
  if (digits == 0 || digits > 12 || shift < 0)
    return invalid_argument("'{}': expected a byte count such as 4096, 1K, 256M or 1G (binary units)", text);
  const int64_t n = std::stoll(text.substr(0, digits));
  if (n > (int64_t{1} << 40) >> shift) return invalid_argument("'{}': too large", text);
  return n << shift;
}

// After the group exists: an error all ranks agreed on is printed by rank 0 and every rank exits
// normally; one this rank alone saw is printed here and ends the world (as `pretrain` does).
int fail_in_group(dist::ProcessGroup& group, const Status& st) {
  const bool rank0 = group.rank() == 0, multi = group.world_size() > 1, together = group.failed_together();
  int rc = st.code() == StatusCode::kInvalidArgument ? 2 : 1;
  if (rank0 || !together)
    rc = report_error("bench", rank0 || !multi ? st : Status(st.code(), fmt::format("{} (rank {})", st.message(), group.rank())));
  if (multi && !together) group.abort_world(rc);
  return rc;
}

// The launched world: this rank's device and the process group over it (the group declared last:
// destroyed first). Errors before the group exists are this rank's alone.
struct World {
  std::unique_ptr<backend::Backend> backend;
  std::unique_ptr<ProcessGroupSetup> setup;
};

Result<World> open_world(const std::string& device) {
  NIB_ASSIGN_OR_RETURN(dist::LaunchEnv launch, read_launch());
  World w;
  NIB_ASSIGN_OR_RETURN(w.backend, open_device(device_for_launch(device, launch)));
  NIB_ASSIGN_OR_RETURN(w.setup, open_process_group(launch, *w.backend));
  return w;
}

nlohmann::json number_or_null(double v, bool present = true) {
  return present && std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
}

int run_collectives(const CollectivesArgs& a) {
  dist::CollectivesBenchOptions o;
  auto lo = parse_byte_size(a.min_bytes), hi = parse_byte_size(a.max_bytes);
  if (!lo) return report_error("bench", invalid_argument("--min-bytes {}", lo.status().message()));
  if (!hi) return report_error("bench", invalid_argument("--max-bytes {}", hi.status().message()));
  o.min_bytes = *lo, o.max_bytes = *hi, o.factor = a.factor;
  o.warmup = static_cast<int>(a.warmup), o.iters = static_cast<int>(a.iters);
  o.ops.clear();
  for (const std::string& name : split_commas(a.ops)) {
    auto op = dist::parse_collective_op(name);
    if (!op) return report_error("bench", invalid_argument("--ops: {}", op.status().message()));
    o.ops.push_back(*op);
  }
  if (auto sizes = dist::bench_sizes(o); !sizes) return report_error("bench", sizes.status());

  auto world = open_world(a.device);
  if (!world) return report_error("bench", world.status());
  dist::ProcessGroup& group = *world->setup->group;
  const dist::LaunchEnv* launch = &world->setup->launch;
  backend::Backend& be = *world->backend;
  std::unique_ptr<dist::GroupMemory> memory;
  if (group.device_memory()) {
#ifdef NIBBLE_HAVE_CUDA
    memory = dist::make_cuda_group_memory();
#endif
  } else {
    memory = dist::make_host_memory();
  }
  if (memory == nullptr) return fail_in_group(group, Status(StatusCode::kInternal, "no memory for the group's kind"));
  auto library = group.library_collectives();  // the one-rank world has none: nibble rows only
  const bool rank0 = group.rank() == 0;
  if (rank0)
    std::fprintf(stderr, "bench collectives: %s (%s) on %s; median of %d timed calls after %d warm-up, each the slowest "
                 "rank's; ratio = nibble algbw / %s algbw, same buffers, same run%s\n",
                 launch->describe().c_str(), group.kind().c_str(), be.name().c_str(), o.iters, o.warmup,
                 library.is_ok() ? (*library)->library().c_str() : "library",
                 group.world_size() == 1 ? "; one rank: no data crosses a link, busbw is undefined (bus factor 0) "
                                           "and only algbw is reported"
                                         : "");
  auto rows = dist::bench_collectives(group, library.is_ok() ? library->get() : nullptr, *memory, o);
  if (!rows) return fail_in_group(group, rows.status());
  if (!rank0) return 0;
  for (const dist::CollectiveRow& r : *rows) {
    nlohmann::json j{{"bench", "collectives"}, {"group", group.kind()}, {"world", r.world}, {"op", r.op},
                     {"path", r.path}, {"bytes", r.bytes}, {"count", r.count}, {"time_us", r.seconds * 1e6},
                     {"algbw_gbps", r.algbw_gbps}, {"bus_factor", r.bus_factor},
                     {"busbw_gbps", number_or_null(r.busbw_gbps, r.bus_factor > 0)}, {"iters", o.iters},
                     {"verified", r.verified}};
    if (r.path == "nibble") j["ratio_to_library"] = number_or_null(r.ratio_to_library, r.ratio_to_library >= 0);
    std::printf("%s\n", j.dump().c_str());
  }
  std::fflush(stdout);
  return 0;
}

int run_weight_sync(const WeightSyncArgs& a) {
  rl::WeightSyncBenchOptions o;
  o.transports.clear();
  o.modes.clear();
  for (const std::string& name : split_commas(a.transports)) {
    auto k = rl::parse_weight_transport(name);
    if (!k) return report_error("bench", invalid_argument("--transport: {}", k.status().message()));
    o.transports.push_back(*k);
  }
  for (const std::string& name : split_commas(a.modes)) {
    auto m = rollout::parse_precision_mode(name);
    if (!m || *m == rollout::PrecisionMode::kRecipe)
      return report_error("bench", invalid_argument("--mode '{}': bf16, w4a16 or w4a4", name));
    o.modes.push_back(*m);
  }
  o.recipe_name = a.recipe;
  if (!model::has_linear_recipe(a.recipe)) return report_error("bench", invalid_argument("--recipe '{}': unknown recipe", a.recipe));
  o.warmup = static_cast<int>(a.warmup), o.iters = static_cast<int>(a.iters);
  auto config = model::load_model_config(a.config);
  if (!config) return report_error("bench", Status(config.status().code(), "--config: " + config.status().message()));

  auto world = open_world(a.device);
  if (!world) return report_error("bench", world.status());
  dist::ProcessGroup& group = *world->setup->group;
  const dist::LaunchEnv* launch = &world->setup->launch;
  backend::Backend& be = *world->backend;
  model::RecipeConfig rc;
  rc.name = "bf16";  // the trainer's own recipe does not change the policy the sync carries
  auto m = model::Model::create(*config, rc, &be);
  if (!m) return fail_in_group(group, m.status());
  (*m)->init_weights(a.seed);
  const bool rank0 = group.rank() == 0;
  if (rank0)
    std::fprintf(stderr, "bench weight-sync: %s (%s) on %s, %s; median of %lld timed versions after %lld warm-up, each "
                 "the slowest rank's; GB/s = payload bytes / sync time%s\n",
                 launch->describe().c_str(), group.kind().c_str(), be.name().c_str(), a.config.c_str(),
                 static_cast<long long>(a.iters), static_cast<long long>(a.warmup),
                 group.world_size() == 1 ? "; one rank: nobody receives, the time is the send path alone" : "");
  auto rows = rl::bench_weight_sync(group, **m, o);
  if (!rows) return fail_in_group(group, rows.status());
  if (!rank0) return 0;
  for (const rl::WeightSyncRow& r : *rows) {
    nlohmann::json j{{"bench", "weight_sync"}, {"config", a.config}, {"device", be.name()},
                     {"group", group.kind()}, {"world", r.world}, {"transport", r.transport}, {"mode", r.mode},
                     {"payload_bytes", r.payload_bytes}, {"bf16_bytes", r.bf16_bytes},
                     {"ratio_to_bf16", number_or_null(static_cast<double>(r.payload_bytes) / static_cast<double>(r.bf16_bytes))},
                     {"prepare_ms", r.prepare_seconds * 1e3}, {"sync_ms", r.sync_seconds * 1e3},
                     {"gb_per_s", r.gbps}, {"iters", a.iters}};
    std::printf("%s\n", j.dump().c_str());
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

CommandRun setup_dist_benches(CLI::App& bench) {
  auto c = std::make_shared<CollectivesArgs>();
  c->app = bench.add_subcommand("collectives", "All-reduce / reduce-scatter / all-gather / broadcast bus bandwidth "
                                               "through nibble and through MPI or NCCL directly (JSON lines)");
  c->app->add_option("--min-bytes", c->min_bytes, "Smallest size (bytes, or with K/M/G; default 1K)");
  c->app->add_option("--max-bytes", c->max_bytes, "Largest size (default 256M, at most 1G)");
  c->app->add_option("--factor", c->factor, "Each size is the previous times this (default 2)")->check(IntegerIn(2, 1024));
  c->app->add_option("--ops", c->ops, "Comma list of all_reduce, reduce_scatter, all_gather, broadcast (default all)");
  c->app->add_option("--warmup", c->warmup, "Untimed calls per row after the checked one (default 5)")
      ->check(IntegerIn(0, kMaxCalls));
  c->app->add_option("--iters", c->iters, "Timed calls per row (median; default 20)")->check(IntegerIn(1, kMaxCalls));
  add_device_option(*c->app, &c->device);

  auto w = std::make_shared<WeightSyncArgs>();
  w->app = bench.add_subcommand("weight-sync", "RL weight sync time per transport and precision mode: one policy "
                                               "version from rank 0 to the other ranks (JSON lines)");
  w->app->add_option("--config", w->config, "Model config.json")->required();
  w->app->add_option("--transport", w->transports, "Comma list of host, device, auto (default host,device)");
  w->app->add_option("--mode", w->modes, "Comma list of bf16, w4a16, w4a4 (default bf16,w4a16)");
  w->app->add_option("--recipe", w->recipe, "The rollout quantizer's recipe (default tetrajet-v2)");
  w->app->add_option("--warmup", w->warmup, "Untimed versions first (default 1; at least one is sent)")
      ->check(IntegerIn(0, kMaxCalls));
  w->app->add_option("--iters", w->iters, "Timed versions (median; default 5)")->check(IntegerIn(1, kMaxCalls));
  w->app->add_option("--seed", w->seed, "Random weights' seed (default 1)");
  add_device_option(*w->app, &w->device);
  return [c, w]() -> int {
    if (c->app->parsed()) return run_collectives(*c);
    if (w->app->parsed()) return run_weight_sync(*w);
    return -1;
  };
}

}  // namespace nibble::tools
