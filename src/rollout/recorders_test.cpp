// Tests of the rollout engine's recorders (issue #15 items 3 and 6): in w4a4 the codes and scales
// recorded at guided sites equal the trainer's quantizer (formats::nvfp4_2level_quantize_cpu, what
// the tetrajet-v2 recipe runs) on the same inputs bit for bit; the engine records every position
// of every sample (prompt rows shared by G samples once per sample), only the chosen layers,
// mantissa-bit records that are the full records' bit 0; routed experts' inputs recorded per
// (token, expert) under the expert's own sites, exactly for the experts the token's routing
// record names; R3 routing records equal the expert ids the routing hook sees; guidance outside
// w4a4 is refused. With an NVFP4 KV cache the K and V slots of every recorded position are
// recorded per kv head (version 2) at kKeyCache / kValueCache, equal to the page bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <tuple>
#include <vector>

#include <cstring>

#include "backend/kv_page_codec.h"
#include "formats/quantize_cpu.h"
#include "model/tiny_olmo2_test_util.h"
#include "rollout/engine.h"
#include "rollout/routing_record.h"

namespace nibble::rollout {
namespace {

// moe_intermediate 32 (not 16) gives the experts' down_proj K % 32 == 0: the fused MoE decode.
std::unique_ptr<model::Model> tiny_model(bool moe, int64_t moe_intermediate = 16) {
  nlohmann::json j = moe ? nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 40, "max_position_embeddings": 48, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [1]})")
                         : model::test::tiny_olmo2_model_json(40);
  j["initializer_range"] = 0.3;
  if (moe) j["moe_intermediate_size"] = moe_intermediate;
  auto cfg = model::parse_model_config(j);
  EXPECT_TRUE(cfg.is_ok()) << cfg.status().message();
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = model::Model::create(cfg.value(), rc);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  m.value()->init_weights(5);
  return std::move(m).value();
}

std::unique_ptr<RecordStore> open_store(const char* name) {
  RecordStoreOptions o;
  o.name = name;
  auto s = RecordStore::open(o);
  EXPECT_TRUE(s.is_ok()) << s.status().message();
  return std::move(s).value();
}

// Passes every call on to the w4a4 linears and keeps each call's BF16-rounded input by linear id.
class InputTap final : public model::LinearOverride {
 public:
  explicit InputTap(QuantizedLinears& q) : q_(q) {}
  void forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
               const model::LinearInfo& info, const model::LinearCall& call) override {
    std::vector<float>& xb = inputs[info.id];
    xb.resize(static_cast<size_t>(M * info.K));
    model::round_to_bf16_array(xb.data(), x, M * info.K);
    if (call.token_of_row != nullptr) tokens[info.id].assign(call.token_of_row, call.token_of_row + M);
    q_.forward(be, y, x, w, M, info, call);
  }
  // grouped: the routed experts of a part in one call (the fused MoE decode), each expert's rows
  // kept as above (CPU memory: the offsets and tokens are readable here)
  bool grouped = false;
  int64_t grouped_calls = 0;
  bool runs_experts_grouped(backend::Backend& be) const override { return grouped && q_.runs_experts_grouped(be); }
  void forward_experts(backend::Backend& be, float* y, const float* x, int64_t rows, const model::LinearInfo* infos,
                       int64_t E, const int64_t* offsets, const int32_t* token_of_row,
                       const model::LinearCall& call) override {
    ++grouped_calls;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = offsets[e], M = offsets[e + 1] - r0, K = infos[e].K;
      if (M == 0) continue;
      std::vector<float>& xb = inputs[infos[e].id];
      xb.resize(static_cast<size_t>(M * K));
      model::round_to_bf16_array(xb.data(), x + r0 * K, M * K);
      tokens[infos[e].id].assign(token_of_row + r0, token_of_row + r0 + M);
    }
    q_.forward_experts(be, y, x, rows, infos, E, offsets, token_of_row, call);
  }
  std::map<int, std::vector<float>> inputs;
  std::map<int, std::vector<int32_t>> tokens;  // routed experts: each row's step row (CPU memory)

 private:
  QuantizedLinears& q_;
};

// One recorded prefill step: kPromptRows prompt rows (tokens (mul i + add) % 40 at positions
// 0..kPromptRows-1) of request id 3, shared by 2 samples, into a new sequence of `cache` through
// `linears`, with `recorder` told the rows and finishing the step (its records are then in the
// store). *seq: the sequence.
constexpr int64_t kPromptRows = 9;
void run_recorded_prompt(model::Model& m, PagedKvCache& cache, model::LinearOverride* linears,
                         GuidanceRecorder& recorder, int32_t mul, int32_t add, PagedKvCache::SeqId* seq) {
  const int64_t N = kPromptRows;
  std::vector<int32_t> tokens, pos;
  for (int64_t i = 0; i < N; ++i)
    tokens.push_back(static_cast<int32_t>((mul * i + add) % 40)), pos.push_back(static_cast<int32_t>(i));
  *seq = cache.add_sequence();
  ASSERT_TRUE(cache.grow(*seq, N).is_ok());
  ASSERT_TRUE(cache.begin_batch(std::vector<PagedKvCache::SeqId>(N, *seq), pos).is_ok());
  std::vector<uint64_t> ids(N, 3);
  std::vector<int64_t> samples(N, -1), samples_of(N, 2);
  recorder.set_rows(RecordedRows{ids, samples, samples_of, pos});
  std::vector<float> logits(static_cast<size_t>(N * m.config().vocab_size));
  model::DecodeBatch b;
  b.tokens = tokens.data(), b.positions = pos.data(), b.N = N, b.kv = &cache, b.linears = linears;
  m.forward_decode(logits.data(), b);
  ASSERT_TRUE(recorder.finish_step().is_ok()) << recorder.status().message();
  cache.finish_batch();
}

// One prefill of 9 prompt rows of request id 3, shared by 2 samples, through the w4a4 linears with
// the guidance recorder on: every record equals the trainer's quantizer on the linear's input row
// (sequence of the sample, position of the row's token). A routed expert's rows are the tokens the
// dispatch plan sent to it, so its records sit at those tokens' positions under its own site.
// grouped: the MoE experts through the fused MoE decode (one recorder call per layer part).
void expect_w4a4_codes_equal_the_trainer_quantizer(bool moe, bool grouped = false) {
  auto m = tiny_model(moe, grouped ? 32 : 16);
  auto q = QuantizedLinears::create(*m, PrecisionMode::kW4A4, "tetrajet-v2");
  ASSERT_TRUE(q.is_ok()) << q.status().message();
  auto store = open_store("guidance store");
  RolloutRecorders rec;
  rec.guidance = store.get();
  GuidanceRecorder recorder(rec, m->config().num_hidden_layers);
  q.value()->set_observer(&recorder);
  InputTap tap(*q.value());
  tap.grouped = grouped;
  KvCacheConfig kc{m->config().num_hidden_layers, m->config().num_attention_heads, m->config().num_key_value_heads,
                   m->config().head_dim, 16, 4, backend::KvPageFormat::kF32, backend::AttentionPrecision::kFp32};
  auto cache = PagedKvCache::create(m->backend(), kc);
  ASSERT_TRUE(cache.is_ok());
  PagedKvCache::SeqId seq = -1;
  run_recorded_prompt(*m, *cache.value(), &tap, recorder, 5, 2, &seq);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  ASSERT_TRUE(store->flush().is_ok());

  int64_t checked = 0, rows_recorded = 0, routed_rows = 0;
  for (const model::LinearInfo& info : m->linear_infos()) {
    const auto site = guidance_site(info);
    ASSERT_TRUE(site.has_value());
    const auto in = tap.inputs.find(info.id);
    if (in == tap.inputs.end()) {  // only a routed expert no token was sent to is never called
      EXPECT_TRUE(is_routed_expert(info.kind)) << info.name;
      continue;
    }
    const std::vector<float>& x = in->second;
    const int64_t K = info.K, rows = static_cast<int64_t>(x.size()) / K;
    // the position of each row's token (step row i is at position i): the row's own, or (routed
    // expert) its token's
    std::vector<uint32_t> row_pos(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r)
      row_pos[r] = static_cast<uint32_t>(is_routed_expert(info.kind) ? tap.tokens.at(info.id)[r] : r);
    if (is_routed_expert(info.kind)) routed_rows += rows;
    std::vector<uint8_t> codes(static_cast<size_t>(rows * K / 2)), inner(static_cast<size_t>(rows * K / 16));
    std::vector<float> outer(static_cast<size_t>(rows * ((K + 127) / 128)));
    formats::nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), x.data(), rows, K);
    for (int64_t sample = 0; sample < 2; ++sample) {
      const std::vector<uint64_t> row_seq(static_cast<size_t>(rows), recorded_sequence(3, sample));
      auto g = gather_guidance(*store, row_seq.data(), row_pos.data(), rows, static_cast<uint16_t>(info.block), *site);
      ASSERT_TRUE(g.is_ok()) << info.name << ": " << g.status().message();
      EXPECT_EQ(g.value().guide, codes) << info.name;
      EXPECT_EQ(g.value().scales, inner) << info.name;
      EXPECT_EQ(g.value().outer, outer) << info.name;
      ++checked, rows_recorded += rows;
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(store->stats().records, rows_recorded);  // nothing else was recorded
  // every token went through top_k experts' gate/up and down in the MoE layer (layer 1 is dense)
  EXPECT_EQ(routed_rows, moe ? 2 * kPromptRows * m->config().num_experts_per_tok : 0);
  EXPECT_EQ(tap.grouped_calls, grouped ? 2 : 0);  // gate/up and down of the one MoE layer
}

TEST(RolloutRecorders, W4a4GuidanceCodesEqualTheTrainerQuantizerOnTheSameInputs) {
  expect_w4a4_codes_equal_the_trainer_quantizer(false);
}

TEST(RolloutRecorders, W4a4RoutedExpertCodesEqualTheTrainerQuantizerOnTheirTokens) {
  expect_w4a4_codes_equal_the_trainer_quantizer(true);
}

// The same through the fused MoE decode: one quantization of all routed rows, one grouped record
// call per part, split into each expert's site by the offsets.
TEST(RolloutRecorders, W4a4FusedMoeDecodeRecordsEachExpertsCodesOnItsTokens) {
  expect_w4a4_codes_equal_the_trainer_quantizer(true, /*grouped=*/true);
}

// One prefill of 9 rows of request 3 (2 samples) into NVFP4 pages with the recorder watching the
// cache: each row's kKeyCache / kValueCache record (per sample) holds its slot's scales, outer
// scales and codes (or their mantissa bits) head by head.
TEST(RolloutRecorders, Nvfp4KvSlotsAreRecordedPerKvHead) {
  for (GuidanceMode mode : {GuidanceMode::kTraceFull, GuidanceMode::kTrace}) {
    SCOPED_TRACE(guidance_mode_name(mode));
    auto m = tiny_model(true);  // 2 kv heads of 16
    auto q = QuantizedLinears::create(*m, PrecisionMode::kW4A4, "tetrajet-v2");
    ASSERT_TRUE(q.is_ok()) << q.status().message();
    auto store = open_store("guidance store");
    RolloutRecorders rec;
    rec.guidance = store.get();
    rec.guidance_mode = mode;
    rec.guidance_layers = {1};
    GuidanceRecorder recorder(rec, m->config().num_hidden_layers);
    const model::ModelConfig& c = m->config();
    const int64_t Hkv = c.num_key_value_heads, D = c.head_dim;
    KvCacheConfig kc{c.num_hidden_layers, c.num_attention_heads, Hkv, D, 4, 8, backend::KvPageFormat::kNvfp4,
                     backend::AttentionPrecision::kFp32};
    auto cache = PagedKvCache::create(m->backend(), kc);
    ASSERT_TRUE(cache.is_ok());
    cache.value()->set_write_observer(&recorder);
    PagedKvCache::SeqId seq = -1;
    run_recorded_prompt(*m, *cache.value(), q.value().get(), recorder, 3, 1, &seq);
    ASSERT_FALSE(::testing::Test::HasFatalFailure());
    ASSERT_TRUE(store->flush().is_ok());
    const int64_t N = kPromptRows;
    EXPECT_EQ(store->stats().records, 2 * 2 * N);  // 2 samples x 2 sites x N rows, layer 1 only
    const backend::kv::TokenLayout L = backend::kv::token_layout(backend::KvPageFormat::kNvfp4, Hkv, D);
    const std::vector<int32_t>& pages = cache.value()->pages_of(seq);
    for (bool values : {false, true})
      for (int64_t n = 0; n < N; ++n) {
        const std::vector<uint8_t> page = cache.value()->page_bytes(1, pages[n / 4], values);
        const uint8_t* slot = page.data() + (n % 4) * L.bytes;
        for (int64_t sample = 0; sample < 2; ++sample) {
          auto payload = store->read(RecordKey{recorded_sequence(3, sample), static_cast<uint32_t>(n), 1,
                                               values ? kValueCache : kKeyCache});
          ASSERT_TRUE(payload.is_ok()) << payload.status().message();
          auto v = parse_guidance_record(payload.value(), "kv");
          ASSERT_TRUE(v.is_ok()) << v.status().message();
          ASSERT_EQ(v->rows, Hkv);
          ASSERT_EQ(v->cols, D);
          EXPECT_EQ(0, std::memcmp(v->scales, slot + L.inner, static_cast<size_t>(Hkv * D / 16)));
          for (int64_t o = 0; o < Hkv * L.outer_per_head; ++o) {
            float so;
            std::memcpy(&so, slot + L.scales + 4 * o, 4);
            EXPECT_EQ(v->outer_at(o), so);
          }
          for (int64_t i = 0; i < Hkv * D; ++i) {
            const uint32_t code = formats::e2m1_unpack(slot + L.codes, i);
            ASSERT_EQ(v->guide_at(i), mode == GuidanceMode::kTraceFull ? code : (code & 1u)) << "element " << i;
          }
        }
      }
    EXPECT_FALSE(store->contains(RecordKey{recorded_sequence(3, 0), 0, 0, kKeyCache}));  // layer 0 not recorded
  }
}

Request sampled(std::vector<int32_t> prompt, uint64_t id, int64_t G, int64_t n) {
  Request r;
  r.prompt = std::move(prompt);
  r.id = id;
  r.params.sampling = SamplingParams{0.9, 0, 1.0};
  r.params.max_new_tokens = n;
  r.params.num_samples = G;
  r.params.seed = 11;
  return r;
}

// An engine in w4a4 with the trainer's two-level format (what the trace arms roll out with).
Result<std::unique_ptr<Engine>> w4a4_engine(model::Model& m) {
  EngineOptions o;
  o.mode = PrecisionMode::kW4A4;
  o.recipe_name = "tetrajet-v2";
  return Engine::create(m, o);
}

TEST(RolloutRecorders, EngineRecordsEveryPositionOfEverySampleAtTheChosenLayers) {
  auto m = tiny_model(false);
  auto e = w4a4_engine(*m);
  ASSERT_TRUE(e.is_ok()) << e.status().message();
  auto full = open_store("guidance store");
  std::vector<Request> reqs = {sampled({1, 2, 3, 4, 5}, 7, 3, 6), sampled({9, 8, 7}, 2, 2, 4)};
  RolloutRecorders rec;
  rec.guidance = full.get();
  rec.guidance_layers = {1};
  EngineCallbacks cb;
  cb.recorders = &rec;
  auto out = e.value()->generate(reqs, cb);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  ASSERT_TRUE(full->flush().is_ok());
  // the last token is never fed: prompt + new - 1 positions per sample, 4 sites in layer 1 only
  int64_t want = 0;
  for (const Completion& c : out.value()) {
    const uint64_t seq = recorded_sequence(reqs[c.request].id, c.sample);
    const int64_t positions = static_cast<int64_t>(reqs[c.request].prompt.size() + c.tokens.size()) - 1;
    want += positions * 4;
    for (int64_t p = 0; p < positions; ++p) {
      EXPECT_TRUE(full->read(RecordKey{seq, static_cast<uint32_t>(p), 1, kMlpDownInput}).is_ok()) << seq << " " << p;
      EXPECT_FALSE(full->read(RecordKey{seq, static_cast<uint32_t>(p), 0, kAttnInput}).is_ok());
    }
  }
  EXPECT_EQ(full->stats().records, want);

  // the same run in mantissa-bit mode: each record's bits are bit 0 of the full record's codes
  auto mbit = open_store("guidance store");
  rec.guidance = mbit.get();
  rec.guidance_mode = GuidanceMode::kTrace;
  auto out2 = e.value()->generate(reqs, cb);
  ASSERT_TRUE(out2.is_ok()) << out2.status().message();
  ASSERT_EQ(mbit->stats().records, want);
  for (uint64_t seq : full->sequences()) {
    ASSERT_TRUE(full->for_each_in_sequence(seq, [&](const RecordKey& key, std::span<const uint8_t> payload) -> Status {
      auto f = parse_guidance_record(payload, "full");
      NIB_RETURN_IF_ERROR(f.status());
      NIB_ASSIGN_OR_RETURN(std::vector<uint8_t> other, mbit->read(key));
      auto b = parse_guidance_record(other, "mbit");
      NIB_RETURN_IF_ERROR(b.status());
      for (int64_t i = 0; i < f.value().cols; ++i) EXPECT_EQ(f.value().guide_at(i) & 1u, b.value().guide_at(i));
      EXPECT_EQ(0, std::memcmp(f.value().scales, b.value().scales, static_cast<size_t>(f.value().cols / 16)));
      return Status::ok();
    }).is_ok());
  }
}

// With R3 and guidance recorded together (as the trace arms run a MoE model), a token has records
// at routed expert e's two sites exactly when its routing record names e: the key says which
// expert, and no other expert of the layer has one.
TEST(RolloutRecorders, EngineRecordsRoutedExpertSitesOfTheTokensExpertsOnly) {
  auto m = tiny_model(true);
  auto e = w4a4_engine(*m);
  ASSERT_TRUE(e.is_ok()) << e.status().message();
  auto routing = open_store("routing store");
  auto guidance = open_store("guidance store");
  RolloutRecorders rec;
  rec.routing = routing.get();
  rec.guidance = guidance.get();
  rec.guidance_mode = GuidanceMode::kTrace;
  EngineCallbacks cb;
  cb.recorders = &rec;
  std::vector<Request> reqs = {sampled({1, 2, 3, 4, 5}, 6, 2, 5)};
  auto out = e.value()->generate(reqs, cb);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  const int64_t topk = m->config().num_experts_per_tok, E = m->config().num_experts;
  ASSERT_EQ(m->num_moe_layers(), 1);  // layer 0; layer 1 is dense
  int64_t checked = 0;
  for (const Completion& c : out.value()) {
    const uint64_t seq = recorded_sequence(6, c.sample);
    const int64_t T = 5 + static_cast<int64_t>(c.tokens.size()) - 1;
    std::vector<int32_t> forced(static_cast<size_t>(T * topk));
    ASSERT_TRUE(gather_routing(forced.data(), *routing, &seq, nullptr, 1, T, 1, topk, E).is_ok());
    for (int64_t t = 0; t < T; ++t)
      for (int64_t x = 0; x < E; ++x) {
        const bool routed = std::find(forced.begin() + t * topk, forced.begin() + (t + 1) * topk, x) !=
                            forced.begin() + (t + 1) * topk;
        for (int part : {0, 1})
          EXPECT_EQ(guidance->contains(RecordKey{seq, static_cast<uint32_t>(t), 0, routed_expert_site(x, part)}), routed)
              << "position " << t << " expert " << x << " part " << part;
        ++checked;
      }
  }
  EXPECT_GT(checked, 0);
}

TEST(RolloutRecorders, RoutingRecordsEqualTheRoutingHookIds) {
  auto m = tiny_model(true);
  auto e = Engine::create(*m, EngineOptions{});
  ASSERT_TRUE(e.is_ok()) << e.status().message();
  auto store = open_store("routing store");
  RolloutRecorders rec;
  rec.routing = store.get();
  EngineCallbacks cb;
  cb.recorders = &rec;
  const int64_t topk = m->config().num_experts_per_tok, Lm = m->num_moe_layers();
  // (request, sample or -1, position, moe layer) -> ids seen by the hook
  std::map<std::tuple<int64_t, int64_t, int32_t, int64_t>, std::vector<int32_t>> seen;
  cb.on_routing = [&](const RoutingStep& s) -> Status {
    const int64_t N = static_cast<int64_t>(s.positions.size());
    for (int64_t l = 0; l < Lm; ++l)
      for (int64_t n = 0; n < N; ++n)
        seen[{s.requests[n], s.samples[n], s.positions[n], l}] =
            std::vector<int32_t>(s.expert_ids + (l * N + n) * topk, s.expert_ids + (l * N + n + 1) * topk);
    return Status::ok();
  };
  std::vector<Request> reqs = {sampled({1, 2, 3, 4}, 4, 2, 5)};
  auto out = e.value()->generate(reqs, cb);
  ASSERT_TRUE(out.is_ok()) << out.status().message();
  int64_t compared = 0;
  for (const Completion& c : out.value()) {
    const int64_t T = 4 + static_cast<int64_t>(c.tokens.size()) - 1;
    std::vector<int32_t> forced(static_cast<size_t>(Lm * T * topk));
    const uint64_t seq = recorded_sequence(4, c.sample);
    ASSERT_TRUE(gather_routing(forced.data(), *store, &seq, nullptr, 1, T, Lm, topk, m->config().num_experts).is_ok());
    for (int64_t l = 0; l < Lm; ++l)
      for (int32_t t = 0; t < T; ++t) {
        auto it = seen.find({0, t < 4 ? -1 : c.sample, t, l});
        ASSERT_NE(it, seen.end());
        EXPECT_EQ(std::vector<int32_t>(forced.begin() + (l * T + t) * topk, forced.begin() + (l * T + t + 1) * topk),
                  it->second);
        ++compared;
      }
  }
  EXPECT_GT(compared, 0);
}

// The engine with NVFP4 pages records the KV sites of every position of every sample at the
// chosen layers besides the activation sites (none with BF16 pages).
TEST(RolloutRecorders, EngineWithNvfp4PagesRecordsKvSitesOfEveryPosition) {
  auto m = tiny_model(false);
  for (backend::KvPageFormat f : {backend::KvPageFormat::kBf16, backend::KvPageFormat::kNvfp4}) {
    SCOPED_TRACE(backend::kv_page_format_name(f));
    EngineOptions o;
    o.mode = PrecisionMode::kW4A4;
    o.recipe_name = "tetrajet-v2";
    o.kv_format = f;
    auto e = Engine::create(*m, o);
    ASSERT_TRUE(e.is_ok()) << e.status().message();
    auto store = open_store("guidance store");
    RolloutRecorders rec;
    rec.guidance = store.get();
    rec.guidance_layers = {0};
    EngineCallbacks cb;
    cb.recorders = &rec;
    std::vector<Request> reqs = {sampled({1, 2, 3, 4, 5}, 7, 3, 6)};
    auto out = e.value()->generate(reqs, cb);
    ASSERT_TRUE(out.is_ok()) << out.status().message();
    ASSERT_TRUE(store->flush().is_ok());
    const bool kv = f == backend::KvPageFormat::kNvfp4;
    int64_t want = 0;
    for (const Completion& c : out.value()) {
      const uint64_t seq = recorded_sequence(7, c.sample);
      const int64_t positions = 5 + static_cast<int64_t>(c.tokens.size()) - 1;
      want += positions * (kv ? 6 : 4);
      for (int64_t p = 0; p < positions; ++p)
        for (uint16_t site : {kKeyCache, kValueCache})
          EXPECT_EQ(store->contains(RecordKey{seq, static_cast<uint32_t>(p), 0, site}), kv) << seq << " " << p;
    }
    EXPECT_EQ(store->stats().records, want);
    // the bytes-per-token figure counts the KV sites' version-2 records
    const int64_t layers[] = {0};
    const int64_t token_rows = want / (kv ? 6 : 4);
    EXPECT_EQ(store->stats().payload_bytes,
              token_rows * guidance_bytes_per_token(backend::QuantFormat::kNvfp4TwoLevel, m->config(), layers,
                                                    GuidanceMode::kTraceFull, true, kv));
  }
}

TEST(RolloutRecorders, GuidanceOutsideW4a4IsRefused) {
  auto m = tiny_model(false);
  EngineOptions o;
  o.mode = PrecisionMode::kW4A16;
  auto e = Engine::create(*m, o);
  ASSERT_TRUE(e.is_ok());
  auto store = open_store("guidance store");
  RolloutRecorders rec;
  rec.guidance = store.get();
  EngineCallbacks cb;
  cb.recorders = &rec;
  auto out = e.value()->generate({sampled({1, 2}, 0, 1, 2)}, cb);
  ASSERT_FALSE(out.is_ok());
  EXPECT_NE(out.status().message().find("w4a4"), std::string::npos) << out.status().message();
}

}  // namespace
}  // namespace nibble::rollout
