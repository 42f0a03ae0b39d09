// Text generation from a trained model: autoregressive sampling with temperature and nucleus
// (top-p) filtering, one Philox draw per new token from PhiloxStream(seed, kGenerateStream), so a
// seed gives the same text on every machine and thread count. Each step recomputes the logits of
// the whole context (at most max_position_embeddings tokens, the most recent ones): simple and
// exact for the tiny models this runs on (no KV cache yet). Mirrors llm.c's sample loop and HF
// generate(do_sample=True, temperature, top_p).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/philox.h"
#include "core/status.h"
#include "model/transformer.h"

namespace nibble::train {

// Philox stream tag of generation ("GENR" << 32).
inline constexpr uint64_t kGenerateStream = uint64_t{0x47454E52} << 32;

struct SamplingOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.8;  // <= 0: greedy (argmax, lowest id on ties)
  double top_p = 0.95;       // nucleus mass in (0, 1]; 1 = no filtering
  uint64_t seed = 0;
  int32_t stop_id = -1;      // stop after sampling this id (e.g. eos); < 0: never
};

// One token from logits: (V) f32, drawing one uniform from `rng` (none when greedy).
int32_t sample_token(const float* logits, int64_t V, double temperature, double top_p, PhiloxStream* rng);

// out: (T, V) f32 logits of every position of `tokens` (1 <= T <= max_position_embeddings).
Status context_logits(std::vector<float>* out, model::Model* model, std::span<const int32_t> tokens);

// Called with each new token as soon as it is sampled (before the next one is computed), so a
// caller can stream text; a non-ok Status stops the generation and is returned.
using TokenCallback = std::function<Status(int32_t token)>;

// The new tokens (without the prompt). An empty prompt is an error. Past the model's context
// the window slides (the most recent max_position_embeddings tokens); the CLI caps instead.
Result<std::vector<int32_t>> generate_tokens(model::Model* model, std::span<const int32_t> prompt,
                                             const SamplingOptions& options, const TokenCallback& on_token = {});

}  // namespace nibble::train
