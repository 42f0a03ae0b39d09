// The RL weight sync's device transport (rl/weight_transport.h) on the NCCL group as a one-rank
// world on one GPU (what one H200 can check): a real policy snapshot of a tiny MoE model on CUDA,
// packed in device memory and sent in 4 KiB buckets (several ncclBroadcast calls on the device
// buffer; over one rank each is the identity), reads back bit for bit as the host snapshot of
// the same weights in every precision mode; a host version (a checkpoint's) uploads and sends;
// auto picks "device" for a CUDA model on an NCCL group and "host" for a CPU one; a worker
// on another CUDA backend fed the packed version rolls out exactly as one fed the host version;
// the group's device broadcast keeps its bytes and refuses a root outside the world. Skips
// without a device. The rollout ranks' receive needs a world of 2 GPUs (docs/rl.md).
#include <cuda_runtime_api.h>

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "dist/nccl/nccl_group.h"
#include "model/transformer.h"
#include "rl/mpi_rollout.h"
#include "rl/policy_test_util.h"
#include "rl/rollout_worker.h"
#include "rl/weight_transport.h"

namespace nibble::dist {
namespace {

using rollout::PrecisionMode;

bool gpu_ok() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<model::Model> tiny_moe(backend::Backend* be) {
  auto mc = model::parse_model_config(nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 32,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "initializer_range": 0.1})"));
  EXPECT_TRUE(mc.is_ok()) << mc.status().message();
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = model::Model::create(mc.value(), rc, be);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  m.value()->init_weights(7);
  return std::move(m).value();
}

using rl::test::expect_same_policy;

Result<rl::RolloutBatch> roll(rl::ThreadRolloutWorker& w, int64_t version) {
  rl::RolloutJob job;
  job.version = version;
  job.requests = rl::test::small_requests(2, 5);
  NIB_RETURN_IF_ERROR(w.start(std::move(job)));
  return w.finish();
}

TEST(NcclWeightTransportTest, OneRankWorldSendsAPackedPolicyBitForBit) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  auto g = make_nccl_group(LaunchEnv{}, nullptr, NcclOptions{});
  ASSERT_TRUE(g) << g.status().message();
  ProcessGroup& pg = **g;
  cuda::register_cuda_backend();
  auto trainer_be = backend::make_backend("cuda");
  ASSERT_TRUE(trainer_be.is_ok()) << trainer_be.status().message();
  auto trainer = tiny_moe(trainer_be.value().get());
  auto cpu_model = tiny_moe(&backend::cpu_backend());

  // the group's device broadcast: bytes kept over one rank; a root outside the world refused
  const std::vector<uint8_t> pattern = {1, 2, 3, 250, 0, 77, 9};
  uint8_t* d = nullptr;
  NIB_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), pattern.size()));
  NIB_CUDA_CHECK(cudaMemcpy(d, pattern.data(), pattern.size(), cudaMemcpyHostToDevice));
  ASSERT_TRUE(pg.broadcast(d, static_cast<int64_t>(pattern.size()), 0));
  std::vector<uint8_t> back(pattern.size());
  NIB_CUDA_CHECK(cudaMemcpy(back.data(), d, back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(back, pattern);
  EXPECT_FALSE(pg.broadcast(d, 4, 1));
  NIB_CUDA_CHECK(cudaFree(d));

  for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
    const std::string what = rollout::precision_mode_name(mode);
    using rl::WeightTransportKind;
    auto picked = rl::make_weight_transport(pg, *trainer, mode, "tetrajet-v2", 2, WeightTransportKind::kAuto);
    ASSERT_TRUE(picked.is_ok()) << what << ": " << picked.status().message();
    EXPECT_STREQ(picked.value()->name(), "device") << what;
    auto forced = rl::make_weight_transport(pg, *trainer, mode, "tetrajet-v2", 2, WeightTransportKind::kHost);
    ASSERT_TRUE(forced.is_ok()) << what;
    EXPECT_STREQ(forced.value()->name(), "host") << what;
    auto on_cpu = rl::make_weight_transport(pg, *cpu_model, mode, "tetrajet-v2", 2, WeightTransportKind::kAuto);
    ASSERT_TRUE(on_cpu.is_ok()) << what;
    EXPECT_STREQ(on_cpu.value()->name(), "host") << what;
    // host memory (the CPU model) cannot go through the NCCL group's device broadcast
    EXPECT_FALSE(rl::make_weight_transport(pg, *cpu_model, mode, "tetrajet-v2", 2, WeightTransportKind::kDevice).is_ok());

    const int64_t bucket = 4096;
    auto transport = rl::make_device_weight_transport(pg, *trainer, mode, "tetrajet-v2", 2, bucket);
    ASSERT_TRUE(transport.is_ok()) << what << ": " << transport.status().message();
    EXPECT_TRUE(transport.value()->wants_packed());
    const rl::PolicyWeights host = rl::snapshot_policy(*trainer, mode, "tetrajet-v2", 2).value();
    auto packed = rl::pack_policy(*trainer, mode, "tetrajet-v2");
    ASSERT_TRUE(packed.is_ok()) << what << ": " << packed.status().message();
    ASSERT_GT(packed.value()->layout.total_bytes, 4 * bucket) << what << ": several buckets";
    rl::PolicyWeights pw;
    pw.version = 2, pw.mode = mode, pw.format = packed.value()->layout.format, pw.packed = packed.value();
    ASSERT_TRUE(transport.value()->send(pw)) << what;
    expect_same_policy(rl::unpack_policy(*packed.value(), 2), host, what + " after the device broadcasts");
    ASSERT_TRUE(transport.value()->send(host)) << what << ": a host version, uploaded";

    // a worker on its own CUDA backend: the packed version (uploaded into its memory) rolls out
    // as the host version does
    rollout::EngineOptions eo;
    eo.mode = mode, eo.recipe_name = "tetrajet-v2", eo.max_batch = 4;
    model::RecipeConfig rc;
    rc.name = "bf16";
    auto be_a = backend::make_backend("cuda"), be_b = backend::make_backend("cuda");
    ASSERT_TRUE(be_a.is_ok() && be_b.is_ok());
    auto wa = rl::ThreadRolloutWorker::create(trainer->config(), rc, be_a.value().get(), eo);
    auto wb = rl::ThreadRolloutWorker::create(trainer->config(), rc, be_b.value().get(), eo);
    ASSERT_TRUE(wa.is_ok() && wb.is_ok()) << what;
    ASSERT_TRUE(wa.value()->send(std::make_shared<const rl::PolicyWeights>(host)));
    auto up = rl::allocate_packed(*be_b.value(), packed.value()->layout);
    ASSERT_TRUE(up.is_ok()) << what;
    ASSERT_TRUE(rl::pack_host_policy(host, *up.value())) << what;
    rl::PolicyWeights in_b = pw;
    in_b.packed = up.value();
    ASSERT_TRUE(wb.value()->send(std::make_shared<const rl::PolicyWeights>(in_b)));
    auto want = roll(*wa.value(), 2), got = roll(*wb.value(), 2);
    ASSERT_TRUE(want.is_ok()) << what << ": " << want.status().message();
    ASSERT_TRUE(got.is_ok()) << what << ": " << got.status().message();
    rl::test::expect_same_completions(got.value().completions, want.value().completions, what);
  }
  // a host-memory group has no device transport
  auto single = make_single_group();
  EXPECT_FALSE(rl::make_device_weight_transport(*single, *trainer, PrecisionMode::kW4A4, "tetrajet-v2", 2).is_ok());
}

}  // namespace
}  // namespace nibble::dist
