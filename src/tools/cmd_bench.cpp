// `nibble bench quantize`: bandwidth of the format quantizers, each row next to a copy of the
// same bytes measured in the same run (05-performance-anchors.md: speed is a ratio to a baseline
// measured alongside). CPU table from formats/cpu_bench.h (vs threaded memcpy); GPU table from
// backend/cuda/bench.h (vs device-to-device copy) when built with CUDA and a device is present.
// `nibble bench train`: tokens/s, MFU and peak memory of whole training steps per recipe on a
// backend (train/train_bench.h), each row next to bf16's tokens/s; `--linear MxNxK` times one
// linear layer per recipe against cuBLASLt BF16 (backend/cuda/linear_bench.h) on CUDA.
// `nibble bench attention`: causal GQA attention forward/backward ms and TFLOP/s on CUDA in FP32
// and BF16 precision (backend/cuda/attention_bench.h), BF16 next to FP32 measured in the same run.
// `nibble bench decode`: the rollout engine's decode tokens/s per batch next to its bytes-per-step
// bound at the device-copy bandwidth of the same run (rollout/decode_bench.h), JSON lines.
// `nibble bench collectives` and `bench weight-sync` (the process group's benches): cmd_bench_dist.cpp.
// `nibble bench rl`: RL step time split (rollout, log-prob recompute, train, weight sync) per arm
// on a model config with random weights, the trace overhead over fp4-naive and the NVFP4 / BF16
// sync-byte ratio (rl/rl_bench.h), JSON lines.
#include <unistd.h>

#include <cmath>
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/parallel.h"
#include "formats/cpu_bench.h"
#include "model/config.h"
#include "model/linear.h"
#include "rl/rl_bench.h"
#include "rollout/decode_bench.h"
#include "tools/bench_dist.h"
#include "tools/command.h"
#include "tools/device_option.h"
#include "tools/option_check.h"
#include "train/train_bench.h"
#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/attention_bench.h"
#include "backend/cuda/bench.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/device.h"
#include "backend/cuda/linear_bench.h"
#endif

namespace nibble::tools {
namespace {

constexpr int64_t kMaxRepeats = 100000, kMaxThreads = 4096;
constexpr int64_t kMaxBatch = 1 << 20, kMaxSeq = 1 << 20, kMaxSteps = 100000;

struct TrainBenchArgs {
  std::string config;                // empty: configs/olmo2-70m.json (here, else in the source tree)
  std::vector<std::string> recipes;  // empty: bf16, nvfp4-nvidia, tetrajet-v2
  std::string device, linear;        // linear: "MxNxK"
  int64_t batch = 8, seq = 4096, steps = 5, warmup = 2;
  bool json = false, profile = false;
  CLI::App* train = nullptr;
};

struct BenchArgs {
  std::string size;  // "MxK"; empty: CPU 2048x4096, GPU the bench's default shapes
  int repeats = 0;   // not given: CPU 5, GPU the bench's default (given: 1..kMaxRepeats)
  int threads = 0;   // not given: all of OpenMP's (given: 1..kMaxThreads)
  std::string filter;
  bool cpu_only = false;
  CLI::App* quantize = nullptr;
};

struct DecodeBenchArgs {
  std::string config;  // empty: configs/olmo2-1b.json (here, else in the source tree)
  std::string mode = "bf16", kv_dtype = "bf16", device, batches = "1,16,64,256", init = "training";
  int64_t prompt = 512, new_tokens = 128;
  double temperature = 0, top_p = 1;  // 0: greedy
  bool profile = false, reference_sampler = false, no_cuda_graphs = false, cuda_graph_padding = false;
  CLI::App* decode = nullptr;
};

struct AttentionBenchArgs {
  std::vector<std::string> shapes;  // "BxTxHxHkvxD"; empty: the OLMo-2 70M and 370M training shapes
  int repeats = 5;
  bool json = false;
  CLI::App* attention = nullptr;
};

struct RlBenchArgs {
  std::string config;  // empty: configs/qwen3moe-768.json (here, else in the source tree)
  std::string device, arms = "fp4-naive,trace,bf16-rollout", task = "arithmetic";
  int64_t steps = 4, rounds = 1, prompts = 8, group = 8, max_new = 32, level = 0;
  CLI::App* rl = nullptr;
};

// The machine's physical memory in bytes (0 if unknown).
double physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
}

Status parse_size(const std::string& s, int64_t* M, int64_t* K) {
  long long m = 0, k = 0;
  char x = 0, extra = 0;
  if (std::sscanf(s.c_str(), "%lld%c%lld%c", &m, &x, &k, &extra) != 3 || x != 'x' || m <= 0 || k <= 0)
    return invalid_argument("--size {}: expected MxK, e.g. 4096x4096", s);
  *M = m;
  *K = k;
  return Status::ok();
}

int run_bench_quantize(const BenchArgs& a) {
  int64_t M = 2048, K = 4096;
  if (!a.size.empty()) {
    Status st = parse_size(a.size, &M, &K);
    if (!st) return report_error("bench", st);
    if (M % 128 != 0 || K % 128 != 0)
      return report_error("bench", invalid_argument("--size {}: M and K must be multiples of 128", a.size));
    // Refuse up front what cannot be allocated (it ended in "std::bad_alloc").
    const double need = formats::bench_quantize_cpu_memory_bytes(M, K), have = physical_memory_bytes();
    if (have > 0 && need > have)
      return report_error("bench", invalid_argument("--size {}: the CPU bench needs {:.1f} GiB of memory at this size, "
                                                    "more than this machine's {:.1f} GiB",
                                                    a.size, need / double(1ull << 30), have / double(1ull << 30)));
  }
  if (a.threads > 0) set_num_threads(a.threads);
  const int cpu_repeats = a.repeats > 0 ? a.repeats : 5;

  std::printf("CPU quantizers, %lldx%lld N(0,1) input, %d threads, best of %d (ratio = GB/s / memcpy GB/s of the "
              "same bytes, same run)\n",
              static_cast<long long>(M), static_cast<long long>(K), num_threads(), cpu_repeats);
  auto rows = formats::bench_quantize_cpu(M, K, cpu_repeats, a.filter);
  std::printf("  %-32s %10s %10s %10s %12s %8s\n", "kernel", "MB moved", "ms", "GB/s", "memcpy GB/s", "ratio");
  for (const auto& r : rows)
    std::printf("  %-32s %10.4g %10.4g %10.4g %12.4g %8.3g\n", r.name.c_str(), r.bytes / 1e6, r.seconds * 1e3, r.gbps,
                r.memcpy_gbps, r.ratio_to_memcpy);
  if (a.cpu_only) return 0;

#ifdef NIBBLE_HAVE_CUDA
  if (nibble::cuda::device_count() == 0) {
    std::printf("no CUDA device: GPU table skipped\n");
    return 0;
  }
  if (Status st = nibble::cuda::init(0); !st) {
    std::printf("no CUDA device: GPU table skipped (%s)\n", st.message().c_str());
    return 0;
  }
  if (auto info = nibble::cuda::device_info(0)) std::printf("GPU: %s\n", nibble::cuda::describe(*info).c_str());
  nibble::cuda::BandwidthBenchConfig config;
  if (!a.size.empty()) config.shapes = {{M, K}};
  if (a.repeats > 0) config.repeats = a.repeats;
  auto gpu = nibble::cuda::run_quantize_bandwidth_bench(config);
  if (!gpu) return report_error("bench", gpu.status());
  std::printf("GPU quantizers (ratio = GB/s / device-to-device copy GB/s, same shape, same run)\n%s",
              nibble::cuda::format_bandwidth_table(*gpu).c_str());
#else
  std::printf("no CUDA device: GPU table skipped (this nibble was built without CUDA)\n");
#endif
  return 0;
}

// A --recipe value: a registered name, or a JSON object as in a run config's "recipe".
Result<model::RecipeConfig> parse_recipe_arg(const std::string& text) {
  nlohmann::json j = text;
  if (!text.empty() && text.front() == '{') {
    j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return invalid_argument("--recipe {}: not a JSON object", text);
  }
  auto rc = model::parse_recipe_config(j);
  if (!rc) return invalid_argument("--recipe {}: {}", text, rc.status().message());
  if (!model::has_linear_recipe(rc->name)) {
    std::string names;
    for (const std::string& n : model::linear_recipe_names()) names += (names.empty() ? "" : ", ") + n;
    return invalid_argument("--recipe {}: unknown recipe (recipes: {})", text, names);
  }
  return rc;
}

Status parse_linear_shape(const std::string& s, int64_t* M, int64_t* N, int64_t* K) {
  long long m = 0, n = 0, k = 0;
  char x1 = 0, x2 = 0, extra = 0;
  if (std::sscanf(s.c_str(), "%lld%c%lld%c%lld%c", &m, &x1, &n, &x2, &k, &extra) != 5 || x1 != 'x' || x2 != 'x' ||
      m <= 0 || n <= 0 || k <= 0 || m > (1ll << 24) || n > (1ll << 24) || k > (1ll << 24))
    return invalid_argument("--linear {}: expected MxNxK (tokens x out x in), e.g. 16384x4096x4096", s);
  *M = m, *N = n, *K = k;
  return Status::ok();
}

std::string json_number(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : std::string("null"); }

int run_bench_linear(const TrainBenchArgs& a, backend::Backend& be, const std::vector<model::RecipeConfig>& recipes) {
  int64_t M = 0, N = 0, K = 0;
  if (Status st = parse_linear_shape(a.linear, &M, &N, &K); !st) return report_error("bench", st);
  const int repeats = static_cast<int>(a.steps);
  // The baseline: cuBLASLt BF16 on CUDA; on the CPU the bf16 recipe when it is listed.
  double base_s = NAN;
  std::string base_name = "none";
#ifdef NIBBLE_HAVE_CUDA
  if (be.device() == Device::kCUDA) {
    auto* cb = dynamic_cast<nibble::cuda::CudaBackend*>(&be);
    auto t = nibble::cuda::bench_bf16_linear_cublaslt(M, N, K, repeats, cb != nullptr ? cb->stream() : nullptr);
    if (!t) return report_error("bench", t.status());
    base_s = t->total_s();
    base_name = "cuBLASLt BF16";
    if (a.json) {
      std::printf("{\"recipe\":\"cublaslt-bf16\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"forward_ms\":%s,"
                  "\"backward_ms\":%s,\"total_ms\":%s,\"ratio\":1}\n",
                  static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                  json_number(t->forward_s * 1e3).c_str(), json_number((t->dgrad_s + t->wgrad_s) * 1e3).c_str(),
                  json_number(t->total_s() * 1e3).c_str());
    }
  }
#endif
  std::vector<train::LinearBenchResult> rows;
  for (const auto& rc : recipes) {
    auto r = train::bench_linear(be, rc, M, N, K, repeats);
    if (!r) return report_error("bench", r.status());
    rows.push_back(*r);
    if (std::isnan(base_s) && be.device() != Device::kCUDA && rc.name == "bf16") {
      base_s = r->total_s();
      base_name = "the bf16 recipe";
    }
  }
  if (!a.json) {
    std::printf("linear %lldx%lldx%lld (Y = X W^T, X %lldx%lld, W %lldx%lld) forward + backward on %s, median of %d "
                "(ratio = time / %s time, same run)\n",
                static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N),
                static_cast<long long>(K), be.name().c_str(), repeats, base_name.c_str());
    std::printf("  GEMMs: BF16 operands, FP32 accumulation (matmul_bf16_*; TE scales as alpha); saved = bytes a "
                "linear keeps for its backward, scratch = the model-shared workspace it needs\n");
    std::printf("  %-20s %12s %12s %12s %8s %10s %11s\n", "recipe", "forward ms", "backward ms", "total ms", "ratio",
                "saved MiB", "scratch MiB");
    if (base_name == "cuBLASLt BF16")
      std::printf("  %-20s %12s %12s %12.4g %8.3f\n", "cublaslt-bf16", "", "", base_s * 1e3, 1.0);
  }
  for (const auto& r : rows) {
    const double ratio = r.total_s() / base_s;
    if (a.json) {
      std::printf("{\"recipe\":\"%s\",\"M\":%lld,\"N\":%lld,\"K\":%lld,\"forward_ms\":%s,\"backward_ms\":%s,"
                  "\"total_ms\":%s,\"ratio\":%s,\"saved_bytes\":%lld,\"workspace_bytes\":%lld}\n",
                  r.recipe.c_str(), static_cast<long long>(M), static_cast<long long>(N), static_cast<long long>(K),
                  json_number(r.forward_s * 1e3).c_str(), json_number(r.backward_s * 1e3).c_str(),
                  json_number(r.total_s() * 1e3).c_str(), json_number(ratio).c_str(),
                  static_cast<long long>(r.saved_bytes), static_cast<long long>(r.workspace_bytes));
    } else {
      auto mib = [](int64_t b) { return b < 0 ? std::string("-") : fmt::format("{:.1f}", double(b) / (1 << 20)); };
      std::printf("  %-20s %12.4g %12.4g %12.4g %8s %10s %11s\n", r.recipe.c_str(), r.forward_s * 1e3,
                  r.backward_s * 1e3, r.total_s() * 1e3, std::isfinite(ratio) ? fmt::format("{:.3f}", ratio).c_str() : "-",
                  mib(r.saved_bytes).c_str(), mib(r.workspace_bytes).c_str());
    }
  }
  return 0;
}

struct AttentionShapeArg {
  int64_t B, Tn, H, Hkv, D;
};

Status parse_attention_shape(const std::string& s, AttentionShapeArg* out) {
  long long v[5] = {};
  char x[4] = {}, extra = 0;
  const int n = std::sscanf(s.c_str(), "%lld%c%lld%c%lld%c%lld%c%lld%c", &v[0], &x[0], &v[1], &x[1], &v[2], &x[2],
                            &v[3], &x[3], &v[4], &extra);
  bool ok = n == 9;
  for (int i = 0; ok && i < 4; ++i) ok = x[i] == 'x';
  for (int i = 0; ok && i < 5; ++i) ok = v[i] > 0 && v[i] <= (1ll << 20);
  if (!ok || v[2] % v[3] != 0 || v[4] > 128)
    return invalid_argument("--shape {}: expected BxTxHxHkvxD with H a multiple of Hkv and D <= 128, e.g. "
                            "16x4096x8x8x64",
                            s);
  *out = {v[0], v[1], v[2], v[3], v[4]};
  return Status::ok();
}

int run_bench_attention(const AttentionBenchArgs& a) {
  std::vector<AttentionShapeArg> shapes;
  for (const std::string& s : a.shapes) {
    AttentionShapeArg sh{};
    if (Status st = parse_attention_shape(s, &sh); !st) return report_error("bench", st);
    shapes.push_back(sh);
  }
  if (shapes.empty()) shapes = {{16, 4096, 8, 8, 64}, {8, 4096, 16, 16, 64}};
#ifdef NIBBLE_HAVE_CUDA
  if (nibble::cuda::device_count() == 0) {
    std::printf("no CUDA device: attention bench skipped\n");
    return 0;
  }
  if (Status st = nibble::cuda::init(0); !st) {
    std::printf("no CUDA device: attention bench skipped (%s)\n", st.message().c_str());
    return 0;
  }
  if (!a.json) {
    if (auto info = nibble::cuda::device_info(0)) std::printf("GPU: %s\n", nibble::cuda::describe(*info).c_str());
    std::printf("causal attention, median of %d; TFLOP/s at 2 B H T^2 D forward, 2.5x that backward; BF16 includes "
                "its FP32->BF16 pre-passes; ratio = FP32 time / BF16 time, same run\n",
                a.repeats);
    std::printf("  %-22s %-9s %10s %9s %10s %9s %8s\n", "B x T x H x Hkv x D", "precision", "fwd ms", "fwd TF/s",
                "bwd ms", "bwd TF/s", "ratio");
  }
  for (const AttentionShapeArg& s : shapes) {
    const std::string name = fmt::format("{}x{}x{}x{}x{}", s.B, s.Tn, s.H, s.Hkv, s.D);
    double fp32_total = NAN;
    for (const auto precision : {backend::AttentionPrecision::kFp32, backend::AttentionPrecision::kBf16}) {
      const bool bf16 = precision == backend::AttentionPrecision::kBf16;
      auto t = nibble::cuda::bench_attention(s.B, s.Tn, s.H, s.Hkv, s.D, a.repeats, nullptr, precision);
      if (!t) return report_error("bench", t.status());
      const double total = t->forward_s + t->backward_s;
      if (!bf16) fp32_total = total;
      const double ratio = bf16 ? fp32_total / total : 1.0;
      const double fwd_tf = t->forward_flops / t->forward_s * 1e-12, bwd_tf = t->backward_flops / t->backward_s * 1e-12;
      if (a.json) {
        nlohmann::json j{{"shape", name},          {"precision", bf16 ? "bf16" : "fp32"},
                         {"forward_ms", t->forward_s * 1e3}, {"forward_tflops", fwd_tf},
                         {"backward_ms", t->backward_s * 1e3}, {"backward_tflops", bwd_tf},
                         {"ratio_to_fp32", ratio}};
        std::printf("%s\n", j.dump().c_str());
      } else {
        std::printf("  %-22s %-9s %10.4g %9.1f %10.4g %9.1f %8.2f\n", name.c_str(), bf16 ? "bf16" : "fp32",
                    t->forward_s * 1e3, fwd_tf, t->backward_s * 1e3, bwd_tf, ratio);
      }
    }
  }
#else
  std::printf("no CUDA device: attention bench skipped (this nibble was built without CUDA)\n");
#endif
  return 0;
}

int run_bench_train(const TrainBenchArgs& a) {
  if (!a.linear.empty() && a.profile)
    return report_error("bench", invalid_argument("--profile times the ops of training steps, not --linear"));
  auto be = open_device(a.device);
  if (!be) return report_error("bench", be.status());
  std::vector<model::RecipeConfig> recipes;
  for (const std::string& text : a.recipes.empty() ? std::vector<std::string>{"bf16", "nvfp4-nvidia", "tetrajet-v2"}
                                                   : a.recipes) {
    auto rc = parse_recipe_arg(text);
    if (!rc) return report_error("bench", rc.status());
    recipes.push_back(*rc);
  }
  if (!a.linear.empty()) return run_bench_linear(a, **be, recipes);

  std::string config_path = a.config;
  if (config_path.empty()) {
    config_path = "configs/olmo2-70m.json";
#ifdef NIBBLE_SOURCE_DIR
    if (::access(config_path.c_str(), F_OK) != 0) config_path = std::string(NIBBLE_SOURCE_DIR) + "/" + config_path;
#endif
  }
  auto config = model::load_model_config(config_path);
  if (!config) return report_error("bench", Status(config.status().code(), "--config: " + config.status().message()));
  train::TrainBenchOptions o;
  o.batch = a.batch;
  o.seq_len = a.seq;
  o.timed_steps = static_cast<int>(a.steps);
  o.warmup_steps = static_cast<int>(a.warmup);
  o.profile = a.profile;
  const bool gpu = (*be)->device() == Device::kCUDA;  // MFU is against the H200's BF16 peak
  if (!a.json)
    std::printf("training step of %s on %s: batch %lld x seq %lld, %lld warm-up + %lld timed steps (median); MFU "
                "against %.0f TFLOP/s%s; ratio = tokens/s / bf16 tokens/s, same run\n",
                config_path.c_str(), (*be)->name().c_str(), static_cast<long long>(a.batch),
                static_cast<long long>(a.seq), static_cast<long long>(a.warmup), static_cast<long long>(a.steps),
                o.peak_tflops, gpu ? "" : " (GPU only)");
  std::vector<train::TrainBenchResult> rows;
  for (const auto& rc : recipes) {
    auto r = train::bench_train_step(**be, *config, rc, o);
    if (!r) return report_error("bench", r.status());
    rows.push_back(*r);
  }
  double bf16_tps = NAN;
  for (const auto& r : rows)
    if (r.recipe == "bf16") bf16_tps = r.tokens_per_second;
  if (!a.json)
    std::printf("  %-16s %10s %12s %7s %9s %10s %10s %9s\n", "recipe", "step ms", "tokens/s", "MFU", "peak GiB",
                "first loss", "last loss", "vs bf16");
  for (const auto& r : rows) {
    const double ratio = r.tokens_per_second / bf16_tps;
    const double peak_gib = r.peak_bytes >= 0 ? static_cast<double>(r.peak_bytes) / double(1ull << 30) : NAN;
    if (a.json) {
      nlohmann::json j{{"recipe", r.recipe},       {"device", (*be)->name()}, {"config", config_path},
                       {"batch", a.batch},         {"seq", a.seq},            {"step_ms", r.step_seconds * 1e3},
                       {"tokens_per_s", r.tokens_per_second},                 {"flops_per_token", r.flops_per_token},
                       {"first_loss", r.first_loss}, {"last_loss", r.last_loss}};
      j["mfu"] = gpu ? nlohmann::json(r.mfu) : nlohmann::json(nullptr);
      j["peak_bytes"] = r.peak_bytes >= 0 ? nlohmann::json(r.peak_bytes) : nlohmann::json(nullptr);
      j["ratio_to_bf16"] = std::isfinite(ratio) ? nlohmann::json(ratio) : nlohmann::json(nullptr);
      if (r.profiled) {
        nlohmann::json ops = nlohmann::json::array();
        for (const auto& op : r.profile.ops)
          ops.push_back({{"op", op.name}, {"category", op.category}, {"count", op.count}, {"ms", op.ms},
                         {"share", op.share}});
        j["profile"] = {{"step_ms", r.profile.step_ms}, {"op_ms", r.profile.op_ms}, {"ops", ops}};
      }
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf("  %-16s %10.4g %12.4g %7s %9s %10.4f %10.4f %9s\n", r.recipe.c_str(), r.step_seconds * 1e3,
                  r.tokens_per_second, gpu ? fmt::format("{:.1f}%", r.mfu * 100).c_str() : "-",
                  std::isfinite(peak_gib) ? fmt::format("{:.3f}", peak_gib).c_str() : "-", r.first_loss, r.last_loss,
                  std::isfinite(ratio) ? fmt::format("{:.3f}", ratio).c_str() : "-");
    }
  }
  if (!a.json)
    for (const auto& r : rows)
      if (r.profiled)
        std::printf("\n%s", backend::format_step_profile(r.profile, fmt::format("recipe {} on {}", r.recipe,
                                                                                  (*be)->name())).c_str());
  return 0;
}

// The config path as given, or `fallback` here or in the source tree.
std::string config_or_default(const std::string& given, const std::string& fallback) {
  if (!given.empty()) return given;
#ifdef NIBBLE_SOURCE_DIR
  if (::access(fallback.c_str(), F_OK) != 0) return std::string(NIBBLE_SOURCE_DIR) + "/" + fallback;
#endif
  return fallback;
}

int run_bench_decode(const DecodeBenchArgs& a) {
  rollout::DecodeBenchOptions o;
  auto mode = rollout::parse_precision_mode(a.mode);
  if (!mode || *mode == rollout::PrecisionMode::kRecipe)
    return report_error("bench", invalid_argument("--mode '{}': bf16, w4a16 or w4a4", a.mode));
  o.mode = *mode;
  if (a.kv_dtype == "fp8") o.kv_format = backend::KvPageFormat::kFp8;
  else if (a.kv_dtype == "nvfp4") o.kv_format = backend::KvPageFormat::kNvfp4;
  else if (a.kv_dtype != "bf16") return report_error("bench", invalid_argument("--kv-dtype '{}': bf16, fp8 or nvfp4", a.kv_dtype));
  if (a.init == "uniform") o.init = rollout::Engine::WeightInit::kUniform;
  else if (a.init != "training") return report_error("bench", invalid_argument("--init '{}': training or uniform", a.init));
  std::vector<int64_t> batches;
  for (size_t at = 0; at <= a.batches.size();) {
    const size_t comma = std::min(a.batches.find(',', at), a.batches.size());
    const std::string item = a.batches.substr(at, comma - at);
    char* end = nullptr;
    const long long b = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || b < 1 || b > kMaxBatch)
      return report_error("bench", invalid_argument("--batch '{}': a comma list of sizes in [1, {}]", a.batches, kMaxBatch));
    batches.push_back(b);
    at = comma + 1;
  }
  const std::string config_path = config_or_default(a.config, "configs/olmo2-1b.json");
  auto config = model::load_model_config(config_path);
  if (!config) return report_error("bench", Status(config.status().code(), "--config: " + config.status().message()));
  auto be = open_device(a.device);
  if (!be) return report_error("bench", be.status());
  o.prompt = a.prompt;
  o.new_tokens = a.new_tokens;
  o.profile = a.profile;
  o.temperature = a.temperature;
  o.top_p = a.top_p;
  o.reference_sampler = a.reference_sampler;
  o.cuda_graphs = !a.no_cuda_graphs;
  o.graph_padding = a.cuda_graph_padding;
  if ((*be)->device() != Device::kCUDA) o.copy_bytes = int64_t{64} << 20;  // the CPU: a smaller copy suffices
  // one JSON line per batch, printed as each is measured
  auto print = [&](const rollout::DecodeBenchResult& r) -> Status {
    const int64_t b = r.batch;
    nlohmann::json j{{"bench", "decode"}, {"config", config_path}, {"device", (*be)->name()},
                     {"mode", a.mode}, {"kv_dtype", a.kv_dtype}, {"batch", b}, {"prompt", a.prompt},
                     {"new_tokens", a.new_tokens}, {"temperature", a.temperature}, {"top_p", a.top_p},
                     {"reference_sampler", a.reference_sampler}, {"prefill_s", r.prefill_seconds}, {"decode_s", r.decode_seconds},
                     {"decode_tokens_per_s", r.decode_tokens_per_s}, {"weight_bytes", r.weight_bytes},
                     {"kv_bytes_per_token", r.kv_bytes_per_token}, {"bytes_per_step", r.bytes_per_step},
                     {"copy_gb_per_s", r.copy_bytes_per_s / 1e9}, {"bound_tokens_per_s", r.bound_tokens_per_s},
                     {"fraction_of_bound", r.fraction_of_bound}, {"init", a.init}, {"init_s", r.init_seconds},
                     {"cuda_graphs", r.cuda_graphs}, {"graph_replays", r.graph_replays},
                     {"device_greedy_steps", r.device_greedy_steps},
                     {"graph_captures", r.graph_captures}};
    j["host_ms_per_step"] = {{"forward", r.host_forward_ms}, {"sample", r.host_sample_ms},
                             {"metadata", r.host_metadata_ms}, {"step", r.host_step_ms}};
    // backend memory by kind (rollout::EngineMemory) and the peak since the model was built
    const rollout::EngineMemory& mem = r.memory;
    j["memory_bytes"] = {{"packed_weights", mem.packed_weights}, {"high_precision_weights", mem.high_precision_weights},
                         {"master_weights", mem.master_weights}, {"gradients", mem.gradients},
                         {"kv_pages", mem.kv_pages}, {"workspace", mem.workspace}, {"total", mem.total()}};
    j["peak_bytes"] = r.peak_bytes >= 0 ? nlohmann::json(r.peak_bytes) : nlohmann::json(nullptr);
    if (r.profiled) {
      // JSON: op -> [calls, ms]; the tables go to stderr (stdout stays JSON lines)
      auto ops = [](const backend::StepProfile& p) {
        nlohmann::json o = nlohmann::json::object();
        for (const auto& op : p.ops) o[op.name] = {op.count, op.ms};
        return nlohmann::json{{"ms", p.step_ms}, {"op_ms", p.op_ms}, {"ops", o}};
      };
      j["profile"] = {{"prefill", ops(r.prefill_profile)}, {"decode_step", ops(r.decode_step_profile)}};
      const std::string what = fmt::format("{} {} batch {} on {}", config_path, a.mode, b, (*be)->name());
      std::fprintf(stderr, "%s\n%s\n",
                   backend::format_step_profile(r.prefill_profile, "prefill + first token, " + what).c_str(),
                   backend::format_step_profile(r.decode_step_profile, "decode step (per step), " + what).c_str());
    }
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
    return Status::ok();
  };
  const Status st = rollout::bench_decode(**be, *config, o, batches, print);
  if (!st.is_ok()) return report_error("bench", st);
  return 0;
}

int run_bench_rl(const RlBenchArgs& a) {
  rl::RlBenchOptions o;
  o.arms.clear();
  for (size_t at = 0; at <= a.arms.size();) {
    const size_t comma = std::min(a.arms.find(',', at), a.arms.size());
    auto arm = rl::parse_arm(a.arms.substr(at, comma - at));
    if (!arm) return report_error("bench", Status(arm.status().code(), "--arms: " + arm.status().message()));
    o.arms.push_back(*arm);
    at = comma + 1;
  }
  auto task = rl::make_task(a.task);
  if (!task) return report_error("bench", Status(task.status().code(), "--task: " + task.status().message()));
  if (a.level >= (*task)->num_levels())
    return report_error("bench", invalid_argument("--level {}: task '{}' has levels 0..{}", a.level, a.task,
                                                  (*task)->num_levels() - 1));
  const std::string config_path = config_or_default(a.config, "configs/qwen3moe-768.json");
  auto config = model::load_model_config(config_path);
  if (!config) return report_error("bench", Status(config.status().code(), "--config: " + config.status().message()));
  auto be = open_device(a.device);
  if (!be) return report_error("bench", be.status());
  o.model = config->to_json();
  o.steps = a.steps, o.rounds = a.rounds, o.prompts_per_step = a.prompts, o.group_size = a.group, o.max_new_tokens = a.max_new;
  o.level = a.level;
  o.backend = be->get();
  const std::string device = (*be)->name();
  // one JSON line per arm as it is measured, then the summary
  auto print = [&](nlohmann::json j) {
    j["config"] = config_path, j["device"] = device, j["prompts"] = a.prompts, j["group"] = a.group;
    j["max_new"] = a.max_new, j["task"] = a.task, j["level"] = a.level;
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  };
  auto rows = rl::bench_rl(o, **task, [&](const rl::RlBenchRow& r) { print(r.to_json()); });
  if (!rows) return report_error("bench", rows.status());
  print(rl::summarize_rl_bench(*rows).to_json());
  return 0;
}

CommandRun setup_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  app.require_subcommand(1);
  a->quantize = app.add_subcommand("quantize", "Bandwidth of the format quantizers vs memcpy / device copy");
  a->quantize->add_option("--size", a->size, "MxK (multiples of 128); default CPU 2048x4096, GPU the bench's shapes");
  a->quantize->add_option("--repeats", a->repeats, "Timed runs per row (best on CPU, median on GPU; default CPU 5)")
      ->check(IntegerIn(1, kMaxRepeats));
  a->quantize->add_option("--threads", a->threads, "CPU threads (default: all)")->check(IntegerIn(1, kMaxThreads));
  a->quantize->add_option("--filter", a->filter, "CPU rows whose name contains this");
  a->quantize->add_flag("--cpu-only", a->cpu_only, "Skip the GPU table");

  auto t = std::make_shared<TrainBenchArgs>();
  t->train = app.add_subcommand("train", "Training-step speed per recipe (tokens/s, MFU, peak memory); --linear: one layer");
  t->train->add_option("--config", t->config, "Model config.json (default configs/olmo2-70m.json)");
  t->train->add_option("--recipe", t->recipes,
                       "Recipe name or JSON object (repeatable; default bf16, nvfp4-nvidia, tetrajet-v2)")
      ->allow_extra_args(false);
  t->train->add_option("--batch", t->batch, "Sequences per step (default 8)")->check(IntegerIn(1, kMaxBatch));
  t->train->add_option("--seq", t->seq, "Sequence length (default 4096)")->check(IntegerIn(1, kMaxSeq));
  t->train->add_option("--steps", t->steps, "Timed steps (--linear: timed runs; default 5)")
      ->check(IntegerIn(1, kMaxSteps));
  t->train->add_option("--warmup", t->warmup, "Warm-up steps before timing (default 2)")->check(IntegerIn(0, kMaxSteps));
  add_device_option(*t->train, &t->device);
  t->train->add_option("--linear", t->linear,
                       "MxNxK: time one linear layer per recipe instead (on CUDA against cuBLASLt BF16)");
  t->train->add_flag("--json", t->json, "One JSON object per row");
  t->train->add_flag("--profile", t->profile,
                     "After the timed steps, one more step per recipe with every op synchronised and timed: "
                     "a table of time per op and per op category");
  auto at = std::make_shared<AttentionBenchArgs>();
  at->attention = app.add_subcommand("attention", "Causal attention fwd/bwd TFLOP/s on CUDA, FP32 and BF16");
  at->attention->add_option("--shape", at->shapes,
                            "BxTxHxHkvxD (repeatable; default 16x4096x8x8x64 and 8x4096x16x16x64)")
      ->allow_extra_args(false);
  at->attention->add_option("--repeats", at->repeats, "Timed runs per pass (median; default 5)")
      ->check(IntegerIn(1, kMaxRepeats));
  at->attention->add_flag("--json", at->json, "One JSON object per row");
  auto d = std::make_shared<DecodeBenchArgs>();
  d->decode = app.add_subcommand("decode", "Rollout engine decode tokens/s per batch vs its bytes-per-step bound "
                                           "(random weights; JSON lines)");
  d->decode->add_option("--config", d->config, "Model config.json (default configs/olmo2-1b.json)");
  d->decode->add_option("--mode", d->mode, "bf16 (default), w4a16 or w4a4");
  d->decode->add_option("--kv-dtype", d->kv_dtype, "KV cache pages: bf16 (default), fp8 or nvfp4");
  d->decode->add_option("--init", d->init,
                        "Random weights: training (default: the training init's bits) or uniform (fast: block "
                        "linears uniform with the same standard deviation, for shapes like Qwen3-30B-A3B)");
  d->decode->add_option("--batch", d->batches, "Comma list of batch sizes (default 1,16,64,256)");
  d->decode->add_option("--prompt", d->prompt, "Prompt tokens per sequence (default 512)")->check(IntegerIn(1, kMaxSeq));
  d->decode->add_option("--new", d->new_tokens, "New tokens per sequence (default 128)")->check(IntegerIn(2, kMaxSeq));
  d->decode->add_option("--temperature", d->temperature, "Sampling temperature (default 0: greedy)")
      ->check(FiniteIn(0, INFINITY));
  d->decode->add_option("--top-p", d->top_p, "Nucleus mass in (0, 1] (default 1: off)")
      ->check(FiniteIn(0, 1, /*lo_open=*/true));
  d->decode->add_flag("--reference-sampler", d->reference_sampler,
                      "Sample with the reference sampler, one row at a time (host-time comparison)");
  d->decode->add_flag("--no-cuda-graphs", d->no_cuda_graphs,
                      "Run every decode step eagerly (default: decode-only steps replay CUDA graphs where the engine "
                      "can; the JSON's cuda_graphs says whether it did)");
  d->decode->add_flag("--cuda-graph-padding", d->cuda_graph_padding,
                      "Pad graph steps to 1, 2, 4, ... rows (fewer graphs; log-probs may differ from eager ones in "
                      "the last bits)");
  d->decode->add_flag("--profile", d->profile,
                      "Then time every op of the prefill run and of the decode steps (tables on stderr, "
                      "\"profile\" in the JSON)");
  add_device_option(*d->decode, &d->device);
  CommandRun dist_benches = setup_dist_benches(app);
  auto r = std::make_shared<RlBenchArgs>();
  r->rl = app.add_subcommand("rl", "RL step time split per arm (rollout, log-prob recompute, train, weight sync), "
                                   "trace overhead and NVFP4/BF16 sync bytes (random weights; JSON lines)");
  r->rl->add_option("--config", r->config, "Model config.json (default configs/qwen3moe-768.json)");
  r->rl->add_option("--arms", r->arms, "Comma list of arms (default fp4-naive,trace,bf16-rollout)");
  r->rl->add_option("--steps", r->steps, "RL steps per arm, the first a warm-up (default 4)")
      ->check(IntegerIn(2, kMaxSteps));
  r->rl->add_option("--rounds", r->rounds,
                    "Run the arm list this many times in turn, pooling each arm's timed steps (default 1)")
      ->check(IntegerIn(1, 1000));
  r->rl->add_option("--prompts", r->prompts, "Prompts per step (default 8)")->check(IntegerIn(1, 65535));
  r->rl->add_option("--group", r->group, "Samples per prompt (default 8)")->check(IntegerIn(2, kMaxBatch));
  r->rl->add_option("--max-new", r->max_new, "Most new tokens per sample (default 32)")->check(IntegerIn(1, kMaxSeq));
  r->rl->add_option("--task", r->task, "Task (default arithmetic)");
  r->rl->add_option("--level", r->level, "Task level (default 0)")->check(IntegerIn(0, 1000));
  add_device_option(*r->rl, &r->device);
  return [a, t, at, d, dist_benches, r]() -> int {
    if (const int rc = dist_benches(); rc >= 0) return rc;
    if (r->rl->parsed()) return run_bench_rl(*r);
    if (d->decode->parsed()) return run_bench_decode(*d);
    if (a->quantize->parsed()) return run_bench_quantize(*a);
    if (t->train->parsed()) return run_bench_train(*t);
    if (at->attention->parsed()) return run_bench_attention(*at);
    return 2;
  };
}

}  // namespace

NIBBLE_REGISTER_COMMAND(bench_command, "bench",
                        "Benchmarks (bench quantize: quantizer bandwidth vs memcpy; bench train: training-step speed; "
                        "bench attention: attention TFLOP/s; bench decode: rollout decode tokens/s; bench collectives: "
                        "collective bus bandwidth vs MPI/NCCL; bench weight-sync: RL weight sync time; bench rl: RL step "
                        "time split)",
                        setup_bench);

}  // namespace nibble::tools
