// evaluate() with stop_on_interrupt (what `nibble eval` uses so that a Ctrl-C removes its
// temporary shards instead of killing the process): a recorded SIGINT ends it between batches
// with "interrupted by SIGINT"; without the flag (the trainer's validation) it runs to the end.
#include <gtest/gtest.h>

#include <csignal>
#include <filesystem>
#include <unistd.h>

#include "core/interrupt.h"
#include "model/config.h"
#include "model/transformer.h"
#include "train/loader.h"
#include "train/shards.h"
#include "train/trainer.h"

namespace nibble::train {
namespace {

TEST(EvalInterrupt, RecordedSignalStopsBetweenBatchesOnlyWhenAsked) {
  const std::string dir = (std::filesystem::temp_directory_path() / ("nibble_eval_int_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  const std::string shard = dir + "/val.bin";
  std::vector<int32_t> t(4 * 16 + 1);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<int32_t>(i % 100);
  ASSERT_TRUE(write_token_shard(shard, t, 4096).is_ok());
  auto val = ValLoader::open({shard}, 2, 16, 0);
  ASSERT_TRUE(val.is_ok()) << val.status().message();
  auto cfg = model::load_model_config(std::string(NIBBLE_SOURCE_DIR) + "/configs/tiny-dense.json");
  ASSERT_TRUE(cfg.is_ok());
  model::RecipeConfig rc;
  auto m = model::Model::create(*cfg, rc);
  ASSERT_TRUE(m.is_ok());
  (*m)->init_weights(1);

  install_interrupt_handlers();
  std::raise(SIGINT);  // recorded by the handler, not fatal
  ASSERT_EQ(interrupt_signal(), SIGINT);
  auto stopped = evaluate(m->get(), *val, /*stop_on_interrupt=*/true);
  ASSERT_FALSE(stopped.is_ok());
  EXPECT_NE(stopped.status().message().find("interrupted by SIGINT"), std::string::npos) << stopped.status().message();
  auto full = evaluate(m->get(), *val);  // the trainer's call: not stopped
  ASSERT_TRUE(full.is_ok()) << full.status().message();
  EXPECT_EQ(full->batches, val->num_batches());
  clear_interrupt();
  install_interrupt_handlers();  // re-arm (SA_RESETHAND) for later tests in this program
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace nibble::train
