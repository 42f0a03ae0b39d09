// The tiny run the CLI tests train (train_cli_test.cpp, dp_cli_test.cpp): a run config with an
// inline tiny OLMo-2 (vocab 300, hidden 64, 2 layers, bf16, 6 steps of 4 x 32 tokens, eval and
// checkpoints every 3 steps, 1 thread) and a ~40 KB text corpus beside it, in a scratch folder.
#pragma once

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/tiny_olmo2_test_util.h"
#include "tools/cli_test_util.h"

namespace nibble::tools::test {

// Tiny model inline (vocab 300, hidden 64, 2 layers), text of ~40 KB, 1 thread.
inline std::string write_tiny_config(const ScratchDir& d) {
  nlohmann::json cfg{{"model", model::test::tiny_olmo2_model_json(300)},
           {"recipe", "bf16"},
           {"batch_size", 4},
           {"seq_len", 32},
           {"steps", 6},
           {"optimizer", {{"lr", 1e-2}}},
           {"schedule", {{"type", "cosine"}, {"warmup_steps", 1}}},
           {"eval", {{"interval", 3}, {"batches", 2}}},
           {"checkpoint", {{"interval", 3}, {"keep_last", 2}}},
           {"threads", 1}};
  std::ofstream(d / "run.json") << cfg.dump(2);
  std::string text;
  for (int i = 0; i < 600; ++i)
    text += "And the " + std::to_string(i % 37) + " sheep went over the hill, and the shepherd followed them.\n" +
            (i % 20 == 19 ? "\n" : "");
  std::ofstream(d / "corpus.txt") << text;
  return d / "run.json";
}

}  // namespace nibble::tools::test
