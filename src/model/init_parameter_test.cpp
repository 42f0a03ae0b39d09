// Model::init_parameter (issue #15 item 4: weights drawn one tensor at a time, large ones in
// parallel) gives the values of the sequential draw that init_weights always made: parameter i
// from PhiloxStream(seed, i), a truncated normal (|z| <= 3, rejected candidates skipped) times
// the init std; norm weights 1. Checked on tiny-moe, whose embedding and lm_head (4096 x 128)
// take the parallel path and whose other matrices the serial one.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/parallel.h"
#include "core/philox.h"
#include "model/config.h"
#include "model/transformer.h"

namespace nibble::model {
namespace {

// The sequential reference: what init_weights drew before init_parameter existed.
std::vector<float> sequential_draw(const ParamRef<float>& p, size_t index, uint64_t seed, double std) {
  std::vector<float> v(static_cast<size_t>(p.numel));
  if (p.shape.size() == 1) {
    for (float& x : v) x = 1.0f;
    return v;
  }
  PhiloxStream rng(seed, index);
  for (float& x : v) {
    double z;
    do z = rng.next_normal();
    while (std::fabs(z) > 3.0);
    x = static_cast<float>(z * std);
  }
  return v;
}

TEST(InitParameter, EqualsTheSequentialDrawForEveryParameterAndThreadCount) {
  auto cfg = load_model_config(std::string(NIBBLE_SOURCE_DIR) + "/configs/tiny-moe.json").value();
  RecipeConfig rc;
  rc.name = "bf16";
  auto m = Model::create(cfg, rc, &backend::cpu_backend(), ParameterStorage::kInference).value();
  const int saved = num_threads();
  int64_t parallel_sized = 0;
  for (size_t i = 0; i < m->param_refs().size(); ++i) {
    const ParamRef<float>& p = m->param_refs()[i];
    const std::vector<float> want = sequential_draw(p, i, 23, cfg.initializer_range);
    const bool large = p.numel >= 4 * 65536;  // drawn in parallel ranges with 2 threads
    parallel_sized += large ? 1 : 0;
    for (int threads : {2, 1}) {
      if (threads == 1 && !large) continue;  // small ones take the serial loop at any count
      set_num_threads(threads);
      std::vector<float> got(static_cast<size_t>(p.numel));
      m->init_parameter(got.data(), i, 23);
      ASSERT_EQ(got, want) << p.name << " threads " << threads;
    }
  }
  set_num_threads(saved);
  EXPECT_EQ(parallel_sized, 2);  // the embedding and the lm_head
}

}  // namespace
}  // namespace nibble::model
