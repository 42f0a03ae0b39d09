// Host cost of TRACE guidance in one RL step (Google Benchmark): the rollout's recorder appending
// every guided site's record to the RecordStore, the store's writer indexing them, and the
// trainer's per-linear gathers (gather_guidance; a routed expert's rows the rollout may have routed
// elsewhere are looked up in the same pass). The workload is `nibble bench rl --config configs/qwen3moe-768.json`'s step
// (docs/benchmarks.md "RL step time"): 64 sequences of 45 tokens, guidance on the later half
// (layers 6..11), per token and layer the QKV and o_proj inputs (768 columns), 8 of 64 routed
// experts' gate/up (768) and down (256) inputs, and K and V (4 kv heads of 64) in `trace` mode:
// 345,600 records a step. Phases (append, drain, one forward's gathers, close: the RL loop opens
// and closes a store each step) are timed separately and printed; `--benchmark_filter=trace`.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/check.h"
#include "rollout/guidance_store.h"

namespace {

using nibble::backend::QuantFormat;
using namespace nibble::rollout;

constexpr int64_t kSequences = 64, kPositions = 45, kFirstLayer = 6, kLayers = 12, kExperts = 64, kTopK = 8;
constexpr int64_t kHidden = 768, kMoeInter = 256, kKvHeads = 4, kHeadDim = 64;
constexpr GuidanceMode kMode = GuidanceMode::kTrace;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<uint8_t> activation_record(int64_t cols) {
  const int64_t bytes = guidance_record_bytes(QuantFormat::kNvfp4TwoLevel, cols, kMode) - kGuidanceHeaderBytes;
  std::vector<uint8_t> payload(static_cast<size_t>(bytes), 0x11);
  auto rec = guidance_record_from_payload(QuantFormat::kNvfp4TwoLevel, cols, kMode, payload);
  NIB_CHECK(rec.is_ok());
  return std::move(rec).value();
}

std::vector<uint8_t> kv_record() {  // version 2: kKvHeads rows of kHeadDim
  std::vector<uint8_t> rec(static_cast<size_t>(guidance_rows_record_bytes(kKvHeads, kHeadDim, kMode)), 0x22);
  rec[0] = static_cast<uint8_t>(QuantFormat::kNvfp4TwoLevel);
  rec[1] = static_cast<uint8_t>(kMode);
  const uint16_t version = kGuidanceRowsRecordVersion;
  const uint32_t cols = kHeadDim, rows = kKvHeads;
  std::memcpy(rec.data() + 2, &version, 2);
  std::memcpy(rec.data() + 4, &cols, 4);
  std::memcpy(rec.data() + 8, &rows, 4);
  return rec;
}

struct Token {
  uint64_t sequence;
  uint32_t position;
};

void BM_trace_guidance_step(benchmark::State& state) {
  // the tokens and, per guided layer and token, its 8 experts (the same in rollout and trainer)
  std::vector<Token> tokens;
  for (int64_t s = 0; s < kSequences; ++s)
    for (int64_t p = 0; p < kPositions; ++p) tokens.push_back({static_cast<uint64_t>(s), static_cast<uint32_t>(p)});
  const auto T = static_cast<int64_t>(tokens.size());
  std::mt19937 rng(7);
  std::vector<std::vector<std::vector<int64_t>>> rows_of_expert(static_cast<size_t>(kLayers));  // [layer][e] token ids
  for (int64_t l = kFirstLayer; l < kLayers; ++l) {
    rows_of_expert[l].resize(kExperts);
    std::vector<int64_t> ids(kExperts);
    for (int64_t t = 0; t < T; ++t) {
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      for (int64_t j = 0; j < kTopK; ++j) rows_of_expert[l][ids[j]].push_back(t);
    }
  }
  const std::vector<uint8_t> rec_hidden = activation_record(kHidden), rec_inter = activation_record(kMoeInter),
                             rec_kv = kv_record();
  double append_s = 0, drain_s = 0, gather_s = 0, close_s = 0;
  int64_t records = 0, gathered = 0;
  for (auto _ : state) {
    RecordStoreOptions o;
    o.name = "guidance store";
    o.memory_budget_bytes = int64_t{4} << 30;
    auto opened = RecordStore::open(o);
    NIB_CHECK(opened.is_ok());
    RecordStore& store = *opened.value();
    // rollout: per position (an engine step) and guided layer, each call's rows as the recorder
    // appends them (one record per row)
    auto t0 = std::chrono::steady_clock::now();
    records = 0;
    for (int64_t p = 0; p < kPositions; ++p)
      for (int64_t l = kFirstLayer; l < kLayers; ++l) {
        const auto layer = static_cast<uint16_t>(l);
        RecordBatch batch;  // a recorder step's records go in one append_batch
        auto site_rows = [&](uint16_t site, const std::vector<uint8_t>& rec) {
          for (int64_t s = 0; s < kSequences; ++s) {
            batch.add(RecordKey{static_cast<uint64_t>(s), static_cast<uint32_t>(p), layer, site}, rec);
            ++records;
          }
        };
        site_rows(kAttnInput, rec_hidden);
        site_rows(kKeyCache, rec_kv);
        site_rows(kValueCache, rec_kv);
        site_rows(kAttnOutputInput, rec_hidden);
        for (int part = 0; part < 2; ++part)
          for (int64_t e = 0; e < kExperts; ++e)
            for (int64_t t : rows_of_expert[l][e]) {
              if (tokens[t].position != p) continue;
              batch.add(RecordKey{tokens[t].sequence, tokens[t].position, layer, routed_expert_site(e, part)},
                        part == 0 ? rec_hidden : rec_inter);
              ++records;
            }
        NIB_CHECK(store.append_batch(std::move(batch)).is_ok());
      }
    append_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    NIB_CHECK(store.flush().is_ok());
    drain_s = seconds_since(t0);
    // trainer: one forward's gathers (the π_old forward and the training forward each do this)
    t0 = std::chrono::steady_clock::now();
    gathered = 0;
    std::vector<uint64_t> seq;
    std::vector<uint32_t> pos;
    auto gather = [&](const std::vector<int64_t>& rows, uint16_t layer, uint16_t site, bool routed) {
      seq.clear(), pos.clear();
      for (int64_t t : rows) seq.push_back(tokens[t].sequence), pos.push_back(tokens[t].position);
      std::vector<uint8_t> found;  // a routed expert's rows may have no record (routed elsewhere)
      auto g = gather_guidance(store, seq.data(), pos.data(), static_cast<int64_t>(seq.size()), layer, site,
                               routed ? &found : nullptr);
      NIB_CHECK(g.is_ok());
      gathered += g.value().rows / g.value().rows_per_record;
      benchmark::DoNotOptimize(g.value().guide.data());
    };
    std::vector<int64_t> all(static_cast<size_t>(T));
    std::iota(all.begin(), all.end(), 0);
    for (int64_t l = kFirstLayer; l < kLayers; ++l) {
      const auto layer = static_cast<uint16_t>(l);
      gather(all, layer, kAttnInput, false);
      gather(all, layer, kKeyCache, false);
      gather(all, layer, kValueCache, false);
      gather(all, layer, kAttnOutputInput, false);
      for (int part = 0; part < 2; ++part)
        for (int64_t e = 0; e < kExperts; ++e) gather(rows_of_expert[l][e], layer, routed_expert_site(e, part), true);
    }
    gather_s = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    NIB_CHECK(store.close().is_ok());  // the RL loop closes each step's store
    close_s = seconds_since(t0);
  }
  state.counters["records"] = static_cast<double>(records);
  state.counters["append_s"] = append_s;
  state.counters["drain_s"] = drain_s;
  state.counters["gather_s"] = gather_s;
  state.counters["close_s"] = close_s;
  std::printf("trace guidance step: %lld records appended in %.3f s, writer drained %.3f s later; one forward's "
              "gathers (%lld rows) %.3f s; close %.3f s\n",
              static_cast<long long>(records), append_s, drain_s, static_cast<long long>(gathered), gather_s, close_s);
}
BENCHMARK(BM_trace_guidance_step)->Iterations(1)->Unit(benchmark::kMillisecond);

}  // namespace
BENCHMARK_MAIN();
