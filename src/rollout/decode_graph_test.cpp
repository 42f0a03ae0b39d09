// Tests of the engine's CUDA-graph decode steps (decode_graph.h): the padded sizes; the KV cache's
// graph layout (fixed buffers, strides of powers of two up to the context's pages, padding rows on
// the scratch page that no sequence ever gets); the
// engine with the graph layout run eagerly on the CPU (DecodeGraphMode::kEagerLayout) gives the
// tokens and log-probs of plain eager decoding bit for bit (bf16 and w4a16, greedy and sampled,
// batches of 1, 3 and 16 with sequences joining and leaving), and with padding (3 rows run as 4)
// the same tokens with log-probs within the bf16 tolerance; on a CUDA device (skipped without one)
// graphs on equal graphs off bit for bit, and padded graphs equal the padded layout run eagerly
// bit for bit, with graphs captured and replayed. Bit equality is the contract without padding:
// a graph replays the eager step's kernels with the same shapes and arguments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/graph_capture.h"
#include "rollout/decode_graph.h"
#include "rollout/engine.h"
#include "rollout/engine_test_util.h"

#ifdef NIBBLE_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace nibble::rollout {
namespace {

TEST(DecodeGraphs, PaddedSizesArePowersOfTwoCappedAtTheMaxBatch) {
  EXPECT_EQ(padded_decode_rows(1, 16), 1);
  EXPECT_EQ(padded_decode_rows(2, 16), 2);
  EXPECT_EQ(padded_decode_rows(3, 16), 4);
  EXPECT_EQ(padded_decode_rows(5, 16), 8);
  EXPECT_EQ(padded_decode_rows(9, 16), 16);
  EXPECT_EQ(padded_decode_rows(16, 16), 16);
  EXPECT_EQ(padded_decode_rows(9, 12), 12);
  EXPECT_EQ(padded_decode_rows(1, 1), 1);
  EXPECT_EQ(decode_graph_sizes(16), (std::vector<int64_t>{1, 2, 4, 8, 16}));
  EXPECT_EQ(decode_graph_sizes(12), (std::vector<int64_t>{1, 2, 4, 8, 12}));
  EXPECT_EQ(decode_graph_sizes(1), (std::vector<int64_t>{1}));
  for (int64_t max : {1, 5, 12, 16, 64})
    for (int64_t n = 1; n <= max; ++n) {
      const int64_t p = padded_decode_rows(n, max);
      EXPECT_GE(p, n);
      const std::vector<int64_t> sizes = decode_graph_sizes(max);
      EXPECT_NE(std::find(sizes.begin(), sizes.end(), p), sizes.end()) << n << " of " << max;
    }
  EXPECT_THROW(padded_decode_rows(0, 4), CheckError);
  EXPECT_THROW(padded_decode_rows(5, 4), CheckError);
}

KvCacheConfig small_cache(int64_t graph_rows) {
  KvCacheConfig c;
  c.num_layers = 1, c.num_heads = 2, c.num_kv_heads = 1, c.head_dim = 8;
  c.page_size = 4, c.num_pages = 6;
  c.format = backend::KvPageFormat::kF32;
  c.graph_rows = graph_rows;
  c.max_context = 18;  // 5 pages a sequence
  return c;
}

TEST(DecodeGraphs, GraphLayoutHasPowerOfTwoStridesAndPaddingRowsOnTheScratchPage) {
  auto kv = PagedKvCache::create(backend::cpu_backend(), small_cache(4));
  ASSERT_TRUE(kv.is_ok()) << kv.status().message();
  PagedKvCache& c = **kv;
  EXPECT_EQ(c.graph_blocks(), 5);  // ceil(18 / 4)
  EXPECT_EQ(c.graph_stride(1), 1);
  EXPECT_EQ(c.graph_stride(2), 2);
  EXPECT_EQ(c.graph_stride(3), 4);
  EXPECT_EQ(c.graph_stride(4), 4);
  EXPECT_EQ(c.graph_stride(5), 5);  // capped at the context's pages
  EXPECT_EQ(c.scratch_page(), 6);
  EXPECT_EQ(c.free_pages(), 6);  // the scratch page is never free
  const PagedKvCache::SeqId a = c.add_sequence(), b = c.add_sequence();
  ASSERT_TRUE(c.grow(a, 1).is_ok());  // 1 page
  ASSERT_TRUE(c.grow(b, 1).is_ok());  // 1 page
  // the rows of an unpadded batch, then rows of 3 and 1 pages padded to 4 rows
  ASSERT_TRUE(c.begin_batch({a, b}, {0, 0}).is_ok());
  EXPECT_EQ(c.table_stride(), 1);
  const std::vector<int32_t> ctx = c.batch_context_lengths();
  c.finish_batch();
  const PagedKvCache::SeqId a2 = c.add_sequence(), b2 = c.add_sequence();
  ASSERT_TRUE(c.grow(a2, 9).is_ok());  // 3 pages
  ASSERT_TRUE(c.grow(b2, 1).is_ok());  // 1 page
  ASSERT_TRUE(c.begin_padded_batch({a2, b2}, {0, 0}, 4).is_ok());
  ASSERT_EQ(c.table_stride(), 4);  // 3 pages: stride 4
  const std::vector<int32_t>& ps = c.batch_slots();
  const std::vector<int32_t>& pc = c.batch_context_lengths();
  const std::vector<int32_t>& pt = c.batch_block_tables();
  ASSERT_EQ(ps.size(), 4u);
  ASSERT_EQ(pc.size(), 4u);
  ASSERT_EQ(pt.size(), 16u);
  for (int r = 0; r < 2; ++r) {  // real rows: their pages, positions and contexts
    const PagedKvCache::SeqId s = r == 0 ? a2 : b2;
    EXPECT_EQ(ps[r], c.pages_of(s)[0] * 4) << r;
    EXPECT_EQ(pc[r], ctx[r]) << r;
    for (size_t j = 0; j < c.pages_of(s).size(); ++j) EXPECT_EQ(pt[r * 4 + j], c.pages_of(s)[j]) << r;
  }
  for (int r = 2; r < 4; ++r) {  // padding rows: slot 0 of the scratch page, context 1
    EXPECT_EQ(ps[r], 6 * 4) << r;
    EXPECT_EQ(pc[r], 1) << r;
    for (int j = 0; j < 4; ++j) EXPECT_EQ(pt[r * 4 + j], 6) << r;
  }
  c.finish_batch();
  EXPECT_EQ(c.length(a2), 1);
  EXPECT_EQ(c.length(b2), 1);
  // the scratch page is never handed out, whatever is taken
  const PagedKvCache::SeqId big = c.add_sequence();
  EXPECT_EQ(c.free_pages(), 0);  // a, b, a2, b2 hold all 6
  ASSERT_FALSE(c.grow(big, 1).is_ok());
  c.release(a), c.release(b);
  ASSERT_TRUE(c.grow(big, 2 * 4).is_ok());
  for (int32_t p : c.pages_of(big)) EXPECT_NE(p, c.scratch_page());
  // bad padded batches are one-line errors, the cache unchanged
  EXPECT_FALSE(c.begin_padded_batch({a2, b2}, {1, 1}, 1).is_ok());  // fewer padded rows than rows
  EXPECT_FALSE(c.begin_padded_batch({a2}, {1}, 5).is_ok());         // more than graph_rows
  auto plain = PagedKvCache::create(backend::cpu_backend(), small_cache(0));
  ASSERT_TRUE(plain.is_ok());
  const PagedKvCache::SeqId s = (*plain)->add_sequence();
  ASSERT_TRUE((*plain)->grow(s, 1).is_ok());
  const Status st = (*plain)->begin_padded_batch({s}, {0}, 1);
  EXPECT_TRUE(!st.is_ok());
  EXPECT_NE(st.message().find("graph rows 0"), std::string::npos) << st.message();
  KvCacheConfig bad = small_cache(4);
  bad.max_context = 0;
  EXPECT_FALSE(PagedKvCache::create(backend::cpu_backend(), bad).is_ok());
}

// `count` requests joining and leaving a batch: prompts of 2..9 tokens, 3..12 new tokens, request
// 1 of `g1` samples (a forked prompt); sampled ones with top-p, a stop id and their own seeds.
std::vector<Request> churn_requests(int64_t vocab, int count, int64_t g1, bool sampled) {
  std::vector<Request> rs(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    Request& r = rs[static_cast<size_t>(i)];
    for (int t = 0; t < 2 + (i * 5) % 8; ++t) r.prompt.push_back(static_cast<int32_t>((t * 11 + i * 7 + 3) % vocab));
    r.params.max_new_tokens = 3 + (i * 7) % 10;
    r.params.num_samples = i == 1 ? g1 : 1;
    r.params.seed = 100 + static_cast<uint64_t>(i);
    r.id = static_cast<uint64_t>(i);
    if (sampled) {
      r.params.sampling.temperature = 0.9;
      r.params.sampling.top_p = 0.95;
      r.params.stop_ids = {5};
    } else {
      r.params.sampling.temperature = 0;
    }
  }
  return rs;
}

struct GenRun {
  std::vector<Completion> out;
  EngineStats stats;
  std::string status;
};

GenRun generate(model::Model& m, EngineOptions o, DecodeGraphMode graphs, bool pad, const std::vector<Request>& reqs) {
  o.decode_graphs = graphs;
  o.decode_graph_padding = pad;
  auto e = Engine::create(m, o);
  EXPECT_TRUE(e.is_ok()) << e.status().message();
  if (!e.is_ok()) return {};
  auto r = (*e)->generate(reqs);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ((*e)->cache().free_pages(), (*e)->cache().num_pages());
  if (!r.is_ok()) return {};
  return GenRun{std::move(r).value(), (*e)->stats(), (*e)->decode_graphs_status()};
}

// Tokens and finish reasons equal; log-probs bit for bit (compared as the doubles' bytes) or,
// with `tol` > 0, within tol.
void expect_same(const std::vector<Completion>& a, const std::vector<Completion>& b, double tol = 0) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE("completion " + std::to_string(i));
    EXPECT_EQ(a[i].tokens, b[i].tokens);
    EXPECT_EQ(a[i].finish, b[i].finish);
    ASSERT_EQ(a[i].logprobs.size(), b[i].logprobs.size());
    if (tol == 0)
      EXPECT_EQ(std::memcmp(a[i].logprobs.data(), b[i].logprobs.data(), a[i].logprobs.size() * sizeof(double)), 0);
    else
      for (size_t t = 0; t < a[i].logprobs.size(); ++t) EXPECT_NEAR(a[i].logprobs[t], b[i].logprobs[t], tol) << t;
  }
}

std::unique_ptr<model::Model> dense_model(backend::Backend* be) {
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto m = model::Model::create(test::dense_olmo_config(), rc, be);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  m.value()->init_weights(11);
  return std::move(m).value();
}

// A Qwen3-MoE of 3 layers (test::mixed_moe_config: 4 experts, top-2, a dense middle layer, a shared
// expert) with moe_intermediate_size 32, so the experts' down_proj has K % 32 == 0 and every mode
// runs the fused MoE decode (QuantizedLinears::forward_experts on device offsets).
std::unique_ptr<model::Model> moe_model(backend::Backend* be) {
  model::RecipeConfig rc;
  rc.name = "bf16";
  model::ModelConfig cfg = test::mixed_moe_config();
  cfg.moe_intermediate_size = 32;
  auto m = model::Model::create(cfg, rc, be);
  EXPECT_TRUE(m.is_ok()) << m.status().message();
  m.value()->init_weights(11);
  return std::move(m).value();
}

// The cases: bf16 and w4a16, greedy and sampled, batches of 1 (2 requests one after the other),
// 3 (three requests in a batch of 4: padded to 4 where padding is on) and 16 (22 requests, one of
// 2 samples: joining and leaving at most steps).
struct Case {
  PrecisionMode mode;
  bool sampled;
  int64_t max_batch;
  int requests;
  int64_t g1;
  std::string name() const {
    return std::string(precision_mode_name(mode)) + (sampled ? " sampled" : " greedy") + " batch " +
           std::to_string(max_batch) + " requests " + std::to_string(requests);
  }
};
std::vector<Case> cases() {
  std::vector<Case> out;
  for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16})
    for (bool sampled : {false, true}) {
      out.push_back({mode, sampled, 1, 2, 1});
      out.push_back({mode, sampled, 4, 3, 1});
      out.push_back({mode, sampled, 16, 22, 2});
    }
  return out;
}
GenRun run_case(model::Model& m, const Case& c, DecodeGraphMode graphs, bool pad) {
  EngineOptions o;
  o.mode = c.mode;
  o.recipe_name = "tetrajet-v2";
  o.page_size = 4;
  o.max_batch = c.max_batch;
  return generate(m, o, graphs, pad, churn_requests(m.config().vocab_size, c.requests, c.g1, c.sampled));
}

// Padding changes only the FP32 summation order of GEMM rows (relative K * 2^-24 per dot), which
// can flip an activation's BF16 rounding (2^-8 of it): the mechanism and bound of the CPU-versus-
// device comparison in engine_device_test.cpp (engine_test.cpp's bf16 tolerance).
constexpr double kPaddingLogprobTolerance = 0.05;

// Graph-layout steps (kEagerLayout on `be`, or kOn) against eager ones: the same bits without
// padding; with padding the same tokens, log-probs within kPaddingLogprobTolerance.
void expect_graph_layout_equals_eager(backend::Backend* be, DecodeGraphMode graphs, bool moe = false) {
  auto m = moe ? moe_model(be) : dense_model(be);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name());
    const GenRun eager = run_case(*m, c, DecodeGraphMode::kOff, false);
    EXPECT_EQ(eager.stats.graph_steps, 0);
    EXPECT_EQ(eager.status, "off: turned off (--no-cuda-graphs)");
    for (bool pad : {false, true}) {
      SCOPED_TRACE(pad ? "padded" : "not padded");
      const GenRun g = run_case(*m, c, graphs, pad);
      expect_same(eager.out, g.out, pad ? kPaddingLogprobTolerance : 0);
      EXPECT_EQ(g.status, std::string(decode_graph_mode_name(graphs)) + (pad ? " (padded)" : ""));
      EXPECT_GT(g.stats.graph_steps, 0);
      EXPECT_EQ(g.stats.steps, eager.stats.steps);
      if (pad && c.max_batch == 4) {
        EXPECT_GT(g.stats.padding_rows, 0);  // 3 rows run as 4
      }
      if (!pad) {
        EXPECT_EQ(g.stats.padding_rows, 0);
      }
      if (graphs == DecodeGraphMode::kOn) {
        EXPECT_GT(g.stats.graph_captures, 0);
        EXPECT_GT(g.stats.graph_replays, 0);
        EXPECT_EQ(g.stats.graph_replays + g.stats.graph_captures, g.stats.graph_steps);
      } else {
        EXPECT_EQ(g.stats.graph_replays + g.stats.graph_captures, 0);
      }
    }
  }
}

TEST(DecodeGraphs, GraphLayoutRunEagerlyEqualsEagerSteps) {
  expect_graph_layout_equals_eager(&backend::cpu_backend(), DecodeGraphMode::kEagerLayout);
}
// MoE: the routing plan and the experts stay in backend memory (no host offsets), so MoE decode
// steps take the graph layout too; without padding the eager bits, padded the same tokens.
TEST(DecodeGraphs, MoeGraphLayoutRunEagerlyEqualsEagerSteps) {
  expect_graph_layout_equals_eager(&backend::cpu_backend(), DecodeGraphMode::kEagerLayout, /*moe=*/true);
}

// The fused MoE decode against the per-expert walk (NIBBLE_FUSED_MOE_DECODE=off) on the CPU: the
// same tokens and log-prob bits in every mode (each expert's rows meet the same roundings and
// GEMMs; the activation formats are row-local), for a churning sampled batch of 16.
TEST(DecodeGraphs, FusedMoeDecodeGivesThePerExpertWalksBits) {
  auto m = moe_model(&backend::cpu_backend());
  for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16, PrecisionMode::kW4A4}) {
    SCOPED_TRACE(precision_mode_name(mode));
    EngineOptions o;
    o.mode = mode;
    o.recipe_name = "tetrajet-v2";
    o.page_size = 4;
    o.max_batch = 16;
    const std::vector<Request> reqs = churn_requests(m->config().vocab_size, 22, 2, /*sampled=*/true);
    ::setenv("NIBBLE_FUSED_MOE_DECODE", "off", 1);
    const GenRun walk = generate(*m, o, DecodeGraphMode::kOff, false, reqs);
    ::unsetenv("NIBBLE_FUSED_MOE_DECODE");
    const GenRun fused = generate(*m, o, DecodeGraphMode::kOff, false, reqs);
    expect_same(walk.out, fused.out);
    // the layout of graph steps is only open to the fused form
    ::setenv("NIBBLE_FUSED_MOE_DECODE", "off", 1);
    const GenRun walk_layout = generate(*m, o, DecodeGraphMode::kEagerLayout, false, reqs);
    ::unsetenv("NIBBLE_FUSED_MOE_DECODE");
    EXPECT_EQ(walk_layout.status, "off: MoE layers walk their experts with host offsets");
  }
}

// Greedy steps sampled where the logits are (Backend::greedy_rows, forced on the CPU backend with
// NIBBLE_DEVICE_GREEDY=on) against the host sampler: the same tokens and log-prob bits, eager and
// in the graph layout, dense and MoE; a batch that mixes greedy and sampled requests (the sampled
// steps go to the host) too.
TEST(DecodeGraphs, DeviceGreedyGivesTheHostSamplersBits) {
  for (const bool moe : {false, true}) {
    auto m = moe ? moe_model(&backend::cpu_backend()) : dense_model(&backend::cpu_backend());
    for (PrecisionMode mode : {PrecisionMode::kBf16, PrecisionMode::kW4A16}) {
      for (DecodeGraphMode graphs : {DecodeGraphMode::kOff, DecodeGraphMode::kEagerLayout}) {
        SCOPED_TRACE(std::string(moe ? "moe " : "dense ") + precision_mode_name(mode) + " " +
                     decode_graph_mode_name(graphs));
        EngineOptions o;
        o.mode = mode;
        o.recipe_name = "tetrajet-v2";
        o.page_size = 4;
        o.max_batch = 16;
        std::vector<Request> reqs = churn_requests(m->config().vocab_size, 22, 2, /*sampled=*/false);
        std::vector<Request> mixed = reqs;
        for (size_t i = 0; i < mixed.size(); i += 3) mixed[i].params.sampling.temperature = 0.8;
        for (const auto* rs : {&reqs, &mixed}) {
          ::setenv("NIBBLE_DEVICE_GREEDY", "off", 1);
          const GenRun host = generate(*m, o, graphs, false, *rs);
          ::setenv("NIBBLE_DEVICE_GREEDY", "on", 1);
          const GenRun dev = generate(*m, o, graphs, false, *rs);
          ::unsetenv("NIBBLE_DEVICE_GREEDY");
          expect_same(host.out, dev.out);
          EXPECT_EQ(host.stats.device_greedy_steps, 0);
          if (rs == &reqs) {  // all greedy: every step on the device (the mixed batch's steps have sampled rows)
            EXPECT_EQ(dev.stats.device_greedy_steps, dev.stats.steps);
          }
        }
      }
    }
  }
}

TEST(DecodeGraphs, EnginesSayWhyGraphsAreOff) {
  auto m = dense_model(&backend::cpu_backend());
  EngineOptions o;
  EXPECT_EQ(o.decode_graphs, DecodeGraphMode::kOn);  // on by default
  auto e = Engine::create(*m, o);  // kOn on the CPU: no capture
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ((*e)->decode_graphs_status(), "off: backend 'cpu' cannot capture graphs");
  o.decode_graphs = DecodeGraphMode::kOff;
  e = Engine::create(*m, o);
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ((*e)->decode_graphs_status(), "off: turned off (--no-cuda-graphs)");
  ::setenv("NIBBLE_CUDA_GRAPHS", "on", 1);  // turns them on for every engine
  e = Engine::create(*m, o);
  ::unsetenv("NIBBLE_CUDA_GRAPHS");
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ((*e)->decode_graphs_status(), "off: backend 'cpu' cannot capture graphs");
  o.decode_graphs = DecodeGraphMode::kOn;
  o.mode = PrecisionMode::kRecipe;
  e = Engine::create(*m, o);
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ((*e)->decode_graphs_status(), "off: the recipe mode runs the model's own recipes");
  o.mode = PrecisionMode::kBf16;
  model::RecipeConfig rc;
  rc.name = "bf16";
  auto moe = model::Model::create(test::mixed_moe_config(), rc);
  ASSERT_TRUE(moe.is_ok());
  o.decode_graphs = DecodeGraphMode::kEagerLayout;
  e = Engine::create(**moe, o);
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ((*e)->decode_graphs_status(), "eager-layout");  // the fused MoE decode: no host offsets
  o.mode = PrecisionMode::kW4A16;  // but its experts' down_proj has K = 16: the packed GEMV needs K % 32
  e = Engine::create(**moe, o);
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ((*e)->decode_graphs_status(), "off: MoE layers walk their experts with host offsets");
  o.mode = PrecisionMode::kBf16;
  ::setenv("NIBBLE_CUDA_GRAPHS", "off", 1);
  o.decode_graphs = DecodeGraphMode::kOn;
  e = Engine::create(*m, o);
  ::unsetenv("NIBBLE_CUDA_GRAPHS");
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ((*e)->decode_graphs_status(), "off: NIBBLE_CUDA_GRAPHS=off");
  // the graph layout's fixed buffers count as workspace
  o.decode_graphs = DecodeGraphMode::kOff;
  auto off = Engine::create(*m, o);
  o.decode_graphs = DecodeGraphMode::kEagerLayout;
  auto padded = Engine::create(*m, o);
  ASSERT_TRUE(off.is_ok() && padded.is_ok());
  EXPECT_GT((*padded)->memory().workspace, (*off)->memory().workspace);
  EXPECT_GT((*padded)->memory().kv_pages, (*off)->memory().kv_pages);  // the scratch page
}

// On the device (CUDA; skipped without one): graphs captured and replayed give the eager bits,
// the graph layout run eagerly too; padded graphs give the padded layout's eager bits (the same
// kernels on the same shapes). NIBBLE_ENGINE_TEST_DEVICE=cpu runs the eager-layout part on the CPU.
TEST(DecodeGraphsDevice, GraphStepsEqualEagerStepsBitForBit) {
  std::unique_ptr<backend::Backend> dev;
  std::string why = "built without the CUDA backend (NIBBLE_CUDA=OFF)";
  if (const char* kind = std::getenv("NIBBLE_ENGINE_TEST_DEVICE"); kind && std::string(kind) == "cpu") {
    dev = backend::make_backend("cpu").value();
  } else {
#ifdef NIBBLE_HAVE_CUDA
    cuda::register_cuda_backend();
    auto r = backend::make_backend("cuda");
    if (r.is_ok()) dev = std::move(r).value();
    else why = "no CUDA device: " + r.status().message();
#endif
  }
  if (!dev) GTEST_SKIP() << why;
  {
    SCOPED_TRACE("eager layout");
    expect_graph_layout_equals_eager(dev.get(), DecodeGraphMode::kEagerLayout);
  }
  if (backend::graph_capture(*dev) == nullptr) return;
  {
    SCOPED_TRACE("graphs on");
    expect_graph_layout_equals_eager(dev.get(), DecodeGraphMode::kOn);
  }
  {
    SCOPED_TRACE("MoE, graphs on");
    expect_graph_layout_equals_eager(dev.get(), DecodeGraphMode::kOn, /*moe=*/true);
  }
  auto m = dense_model(dev.get());
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name() + " padded graphs against the padded layout run eagerly");
    const GenRun eager = run_case(*m, c, DecodeGraphMode::kEagerLayout, true);
    const GenRun graphs = run_case(*m, c, DecodeGraphMode::kOn, true);
    expect_same(eager.out, graphs.out);
    EXPECT_EQ(graphs.stats.padding_rows, eager.stats.padding_rows);
    EXPECT_GT(graphs.stats.graph_replays, 0);
  }
}

}  // namespace
}  // namespace nibble::rollout
