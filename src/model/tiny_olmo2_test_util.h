// Test helper (tests only): the `model` object of a tiny OLMo-2 (hidden 64, 2 layers, 2 heads,
// intermediate 128, 64 positions) that the trainer tests and the CLI tests train in seconds; each
// test picks the vocabulary size and adds what else its run needs.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

namespace nibble::model::test {

// An HF-style config.json object (Olmo2ForCausalLM) with the given vocab_size.
inline nlohmann::json tiny_olmo2_model_json(int64_t vocab_size) {
  return {{"architectures", {"Olmo2ForCausalLM"}},
          {"model_type", "olmo2"},
          {"hidden_size", 64},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 2},
          {"intermediate_size", 128},
          {"vocab_size", vocab_size},
          {"max_position_embeddings", 64},
          {"rope_theta", 500000.0}};
}

}  // namespace nibble::model::test
