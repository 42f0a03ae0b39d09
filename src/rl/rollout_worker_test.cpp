// The RL weight sync and rollout worker (rollout_worker.h): the worker's quantized weights are the
// trainer's quantizer output bit for bit; its rollouts equal those of an engine running the
// trainer's own model (the colocated loop before the worker) in every precision mode, dense and
// MoE; the rest segments are exactly the parameters outside the block linears; the checkpoint
// form round-trips and names a missing member; versions not sent, or dropped, are errors. The
// packed form (the device weight transport's): packing the trainer in its backend memory gives the
// host snapshot's bits, a host version uploads and reads back unchanged, its checkpoint form is
// the host one's, and a worker given a packed version rolls out as with the host one (a version
// in another backend's memory is an error).
#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "rl/policy_test_util.h"
#include "rl/rollout_worker.h"
#include "rollout/precision.h"

namespace nibble::rl {
namespace {

using nlohmann::json;
using rollout::PrecisionMode;

json model_json(bool moe) {
  json j = json::parse(R"({"architectures": ["Olmo2ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": 64, "max_position_embeddings": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "initializer_range": 0.1})");
  if (moe) {
    j["architectures"] = json::array({"Qwen3MoeForCausalLM"});
    j["num_experts"] = 4, j["num_experts_per_tok"] = 2, j["moe_intermediate_size"] = 16;
  }
  return j;
}

model::RecipeConfig bf16_recipe() {
  model::RecipeConfig rc;
  rc.name = "bf16";
  return rc;
}

std::unique_ptr<model::Model> trainer_model(bool moe, uint64_t seed) {
  auto mc = model::parse_model_config(model_json(moe));
  EXPECT_TRUE(mc.is_ok());
  auto m = model::Model::create(mc.value(), bf16_recipe(), &backend::cpu_backend());
  EXPECT_TRUE(m.is_ok());
  m.value()->init_weights(seed);
  return std::move(m).value();
}

rollout::EngineOptions engine_options(PrecisionMode mode) {
  rollout::EngineOptions eo;
  eo.mode = mode;
  eo.recipe_name = "tetrajet-v2";
  eo.max_batch = 6;
  return eo;
}

std::vector<rollout::Request> requests() { return test::small_requests(3, 6); }

struct Worker {
  std::unique_ptr<backend::Backend> be;
  std::unique_ptr<ThreadRolloutWorker> w;
};
Worker make_worker(const model::Model& trainer, PrecisionMode mode) {
  Worker out;
  auto be = backend::make_backend("cpu");
  EXPECT_TRUE(be.is_ok());
  out.be = std::move(be).value();
  auto w = ThreadRolloutWorker::create(trainer.config(), bf16_recipe(), out.be.get(), engine_options(mode));
  EXPECT_TRUE(w.is_ok()) << w.status().message();
  out.w = std::move(w).value();
  return out;
}

Status send_version(ThreadRolloutWorker& w, model::Model& trainer, PrecisionMode mode, int64_t version) {
  NIB_ASSIGN_OR_RETURN(PolicyWeights p, snapshot_policy(trainer, mode, "tetrajet-v2", version));
  return w.send(std::make_shared<const PolicyWeights>(std::move(p)));
}

Result<RolloutBatch> roll(ThreadRolloutWorker& w, int64_t step, int64_t version) {
  RolloutJob job;
  job.step = step, job.version = version, job.requests = requests();
  NIB_RETURN_IF_ERROR(w.start(std::move(job)));
  return w.finish();
}

std::vector<uint8_t> bytes_of(backend::Backend& be, const void* p, int64_t n) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  be.copy_to_host(v.data(), p, v.size());
  return v;
}

TEST(RolloutWorker, QuantizedWeightsEqualTheTrainersQuantizerOutputBitForBit) {
  for (PrecisionMode mode : {PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
    auto trainer = trainer_model(true, 5);
    Worker wk = make_worker(*trainer, mode);
    ASSERT_TRUE(send_version(*wk.w, *trainer, mode, 0).is_ok());
    auto b = roll(*wk.w, 0, 0);
    ASSERT_TRUE(b.is_ok()) << b.status().message();
    EXPECT_EQ(wk.w->applied_version(), 0);
    auto ref = rollout::QuantizedLinears::create(*trainer, mode, "tetrajet-v2");
    ASSERT_TRUE(ref.is_ok());
    const rollout::QuantizedLinears* got = wk.w->engine().linears();
    ASSERT_NE(got, nullptr);
    for (const model::LinearInfo& info : trainer->linear_infos()) {
      const backend::QuantizedTensor &r = ref.value()->quantized_weight(info.id), &g = got->quantized_weight(info.id);
      const int64_t cb = backend::QuantizedTensor::code_bytes(r.format, info.N, info.K);
      const int64_t sb = backend::QuantizedTensor::scale_bytes(r.format, info.N, info.K);
      const int64_t ob = 4 * backend::QuantizedTensor::outer_count(r.format, info.N, info.K);
      EXPECT_EQ(bytes_of(trainer->backend(), r.codes, cb), bytes_of(*wk.be, g.codes, cb)) << info.name;
      EXPECT_EQ(bytes_of(trainer->backend(), r.scales, sb), bytes_of(*wk.be, g.scales, sb)) << info.name;
      EXPECT_EQ(bytes_of(trainer->backend(), r.outer, ob), bytes_of(*wk.be, g.outer, ob)) << info.name;
    }
    // what the sync carries: the engine's weight bytes + the FP32 rest
    PolicyWeights p = snapshot_policy(*trainer, mode, "tetrajet-v2", 0).value();
    EXPECT_EQ(p.bytes(), ref.value()->weight_bytes() + static_cast<int64_t>(p.rest.nbytes()));
  }
}

TEST(RolloutWorker, RolloutsEqualAnEngineOnTheTrainersModel) {
  for (bool moe : {false, true})
    for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
      const std::string what = std::string(moe ? "moe " : "dense ") + rollout::precision_mode_name(mode);
      auto trainer = trainer_model(moe, 9);
      auto colocated = rollout::Engine::create(*trainer, engine_options(mode));
      ASSERT_TRUE(colocated.is_ok()) << what;
      auto want = colocated.value()->generate(requests());
      ASSERT_TRUE(want.is_ok()) << what;
      Worker wk = make_worker(*trainer, mode);
      ASSERT_TRUE(send_version(*wk.w, *trainer, mode, 0).is_ok()) << what;
      auto got = roll(*wk.w, 0, 0);
      ASSERT_TRUE(got.is_ok()) << what << ": " << got.status().message();
      EXPECT_EQ(got.value().version, 0);
      test::expect_same_completions(got.value().completions, want.value(), what);
    }
}

TEST(RolloutWorker, RestSegmentsAreTheParametersOutsideTheBlockLinears) {
  auto m = trainer_model(true, 1);
  int64_t linear = 0, rest = 0, end = 0;
  for (const model::LinearInfo& info : m->linear_infos()) linear += info.N * info.K;
  for (const ParamSegment& s : rest_segments(*m)) {
    EXPECT_GE(s.offset, end);  // ascending, disjoint
    EXPECT_GT(s.count, 0);
    end = s.offset + s.count;
    rest += s.count;
  }
  EXPECT_EQ(rest + linear, m->num_params());
  EXPECT_GT(rest, 0);
}

TEST(RolloutWorker, CheckpointFormRoundTripsAndNamesAMissingMember) {
  for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A4}) {
    auto m = trainer_model(false, 2);
    std::vector<io::NamedTensor> named;
    PolicyWeights a = snapshot_policy(*m, mode, "tetrajet-v2", 3).value();
    PolicyWeights b = snapshot_policy(*m, mode, "tetrajet-v2", 4).value();
    a.append_named(named), b.append_named(named);
    auto back = policies_from_named(named, *m, mode, "tetrajet-v2");
    ASSERT_TRUE(back.is_ok()) << back.status().message();
    ASSERT_EQ(back.value().size(), 2u);
    EXPECT_EQ(back.value()[0].version, 3);
    EXPECT_EQ(back.value()[1].version, 4);
    std::vector<io::NamedTensor> again;
    back.value()[0].append_named(again);
    std::vector<io::NamedTensor> first(named.begin(), named.begin() + static_cast<int64_t>(again.size()));
    ASSERT_EQ(again.size(), first.size());
    for (size_t i = 0; i < again.size(); ++i) {
      EXPECT_EQ(again[i].name, first[i].name);
      ASSERT_EQ(again[i].tensor.nbytes(), first[i].tensor.nbytes());
      EXPECT_EQ(0, std::memcmp(again[i].tensor.raw(), first[i].tensor.raw(), again[i].tensor.nbytes())) << again[i].name;
    }
    named.erase(named.begin());
    auto broken = policies_from_named(named, *m, mode, "tetrajet-v2");
    ASSERT_FALSE(broken.is_ok());
    EXPECT_EQ(broken.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(broken.status().message().find("policy.v3.0."), std::string::npos) << broken.status().message();
  }
}

TEST(RolloutWorker, AVersionNotSentOrDroppedIsAnError) {
  auto trainer = trainer_model(false, 3);
  Worker wk = make_worker(*trainer, PrecisionMode::kW4A4);
  auto none = roll(*wk.w, 0, 0);
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
  for (int64_t v : {0, 1, 2}) ASSERT_TRUE(send_version(*wk.w, *trainer, PrecisionMode::kW4A4, v).is_ok());
  auto two = roll(*wk.w, 5, 2);
  ASSERT_TRUE(two.is_ok()) << two.status().message();
  EXPECT_EQ(two.value().version, 2);
  EXPECT_EQ(two.value().step, 5);
  EXPECT_FALSE(roll(*wk.w, 6, 1).is_ok());  // dropped when version 2 was asked for
  // a version for another precision mode is refused
  PolicyWeights bf = snapshot_policy(*trainer, PrecisionMode::kBf16, "tetrajet-v2", 3).value();
  EXPECT_FALSE(wk.w->send(std::make_shared<const PolicyWeights>(std::move(bf))).is_ok());
}

using test::expect_same_policy;
using test::raw;

TEST(RolloutWorker, PackedVersionsCarryTheHostSnapshotsBitsAndRollTheSame) {
  for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
    const std::string what = rollout::precision_mode_name(mode);
    auto trainer = trainer_model(true, 11);
    PolicyWeights host = snapshot_policy(*trainer, mode, "tetrajet-v2", 3).value();
    auto packed = pack_policy(*trainer, mode, "tetrajet-v2");
    ASSERT_TRUE(packed.is_ok()) << what << ": " << packed.status().message();
    const PolicyLayout& l = packed.value()->layout;
    EXPECT_EQ(l.total_bytes % PolicyLayout::kPackedAlign, 0) << what;
    expect_same_policy(unpack_policy(*packed.value(), 3), host, what + " packed from the trainer");
    PolicyWeights pw;
    pw.version = 3, pw.mode = mode, pw.format = l.format, pw.packed = packed.value();
    // the sync's byte count: exactly the host form's in every mode (the bf16 mode's weights
    // travel as BF16 bits, not widened)
    EXPECT_EQ(pw.bytes(), host.bytes()) << what;
    std::vector<io::NamedTensor> a, b;  // the checkpoint form
    pw.append_named(a), host.append_named(b);
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].name, b[i].name) << what;
      EXPECT_EQ(raw({a[i].tensor}), raw({b[i].tensor})) << what << " " << a[i].name;
    }

    // a host version uploaded into a worker's backend memory; rollouts as from the host form
    Worker from_host = make_worker(*trainer, mode), from_packed = make_worker(*trainer, mode);
    ASSERT_TRUE(from_host.w->send(std::make_shared<const PolicyWeights>(host)).is_ok()) << what;
    auto up = allocate_packed(*from_packed.be, policy_layout(from_packed.w->model(), mode, "tetrajet-v2"));
    ASSERT_TRUE(up.is_ok()) << what;
    ASSERT_TRUE(pack_host_policy(host, *up.value()).is_ok()) << what;
    expect_same_policy(unpack_policy(*up.value(), 3), host, what + " uploaded");
    PolicyWeights in_worker = pw;
    in_worker.packed = up.value();
    ASSERT_TRUE(from_packed.w->send(std::make_shared<const PolicyWeights>(in_worker)).is_ok()) << what;
    auto want = roll(*from_host.w, 0, 3), got = roll(*from_packed.w, 0, 3);
    ASSERT_TRUE(want.is_ok()) << what << ": " << want.status().message();
    ASSERT_TRUE(got.is_ok()) << what << ": " << got.status().message();
    test::expect_same_completions(got.value().completions, want.value().completions, what);

    // the trainer's packed version lives in the trainer's backend, not the worker's
    pw.version = 4;
    ASSERT_TRUE(from_packed.w->send(std::make_shared<const PolicyWeights>(pw)).is_ok()) << what;
    auto wrong = roll(*from_packed.w, 1, 4);
    EXPECT_EQ(wrong.status().code(), StatusCode::kInvalidArgument) << what;
    // a host version of another mode does not upload
    PolicyWeights other = host;
    other.mode = mode == PrecisionMode::kBf16 ? PrecisionMode::kW4A4 : PrecisionMode::kBf16;
    EXPECT_EQ(pack_host_policy(other, *up.value()).code(), StatusCode::kInvalidArgument) << what;
  }
}

}  // namespace
}  // namespace nibble::rl
