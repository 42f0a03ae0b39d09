// Tests of the learning-rate schedules at their key steps and of the JSON configuration.
#include "train/schedule.h"

#include <gtest/gtest.h>

#include <cmath>

namespace nibble::train {
namespace {

// Values are a few double operations from exact inputs: relative error ~1e-15; 1e-12 allowed.
constexpr double kTol = 1e-12;

TEST(Schedule, CosineKeySteps) {
  auto c = schedule_from_json(nlohmann::json::parse(R"({"type":"cosine","warmup_steps":10,"final_lr_fraction":0.1})"));
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  auto s = LrSchedule::create(*c, 4e-4, 111);  // decay over steps 10..110 (100 intervals)
  ASSERT_TRUE(s.is_ok());
  EXPECT_NEAR(s->lr(0), 4e-4 * 1 / 10, kTol);   // warmup start
  EXPECT_NEAR(s->lr(4), 4e-4 * 5 / 10, kTol);
  EXPECT_NEAR(s->lr(9), 4e-4, kTol);            // warmup end reaches the peak
  EXPECT_NEAR(s->lr(10), 4e-4, kTol);           // decay start
  EXPECT_NEAR(s->lr(60), 4e-4 * 0.55, kTol);    // midpoint: (1 + f) / 2 of the peak
  EXPECT_NEAR(s->lr(35), 4e-4 * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI / 4))), kTol);
  EXPECT_NEAR(s->lr(110), 4e-4 * 0.1, kTol);    // last step: final fraction (spec: 10%)
  EXPECT_NEAR(s->lr(500), 4e-4 * 0.1, kTol);    // past the end: stays
  for (int64_t t = 10; t < 110; ++t) EXPECT_GE(s->lr(t), s->lr(t + 1));  // monotone decay
}

TEST(Schedule, CosineDefaultsAndNoWarmup) {
  auto c = schedule_from_json(nlohmann::json{{"type", "cosine"}});
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->final_lr_fraction, 0.1);
  EXPECT_EQ(c->warmup_steps, 0);
  auto s = LrSchedule::create(*c, 1.0, 3);
  ASSERT_TRUE(s.is_ok());
  EXPECT_NEAR(s->lr(0), 1.0, kTol);
  EXPECT_NEAR(s->lr(1), 0.55, kTol);
  EXPECT_NEAR(s->lr(2), 0.1, kTol);
  auto one = LrSchedule::create(*c, 1.0, 1);  // a single step: no decay interval
  ASSERT_TRUE(one.is_ok());
  EXPECT_NEAR(one->lr(0), 0.1, kTol);
}

TEST(Schedule, WsdLinearAndSqrt) {
  auto c = schedule_from_json(nlohmann::json::parse(R"({"type":"wsd","warmup_steps":4,"decay_fraction":0.21})"));
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->final_lr_fraction, 0.0);
  // decay starts at 101 - round(0.21 * 101) = 80 and runs 20 intervals to the last step 100.
  auto s = LrSchedule::create(*c, 1e-3, 101);
  ASSERT_TRUE(s.is_ok());
  EXPECT_EQ(s->decay_start(), 80);
  EXPECT_NEAR(s->lr(0), 0.25e-3, kTol);
  EXPECT_NEAR(s->lr(3), 1e-3, kTol);
  EXPECT_NEAR(s->lr(50), 1e-3, kTol);   // stable
  EXPECT_NEAR(s->lr(79), 1e-3, kTol);
  EXPECT_NEAR(s->lr(80), 1e-3, kTol);   // decay start
  EXPECT_NEAR(s->lr(90), 0.5e-3, kTol); // halfway through the linear decay (q = 10/20)
  EXPECT_NEAR(s->lr(100), 0.0, kTol);   // end
  ScheduleConfig sq = *c;
  sq.decay_shape = DecayShape::kOneMinusSqrt;
  sq.final_lr_fraction = 0.1;
  auto r = LrSchedule::create(sq, 1e-3, 101);
  ASSERT_TRUE(r.is_ok());
  EXPECT_NEAR(r->lr(85), 1e-3 * (0.1 + 0.9 * (1 - std::sqrt(0.25))), kTol);  // q = 5/20
  EXPECT_NEAR(r->lr(100), 1e-4, kTol);
}

TEST(Schedule, Constant) {
  auto c = schedule_from_json(nlohmann::json{{"type", "constant"}, {"warmup_steps", 2}});
  ASSERT_TRUE(c.is_ok());
  auto s = LrSchedule::create(*c, 0.5, 10);
  ASSERT_TRUE(s.is_ok());
  EXPECT_NEAR(s->lr(0), 0.25, kTol);
  EXPECT_NEAR(s->lr(1), 0.5, kTol);
  EXPECT_NEAR(s->lr(9), 0.5, kTol);
}

TEST(Schedule, JsonRoundTripAndErrors) {
  auto c = schedule_from_json(
      nlohmann::json::parse(R"({"type":"wsd","warmup_steps":3,"decay_fraction":0.3,"decay_shape":"1-sqrt","final_lr_fraction":0.05})"));
  ASSERT_TRUE(c.is_ok());
  auto again = schedule_from_json(schedule_to_json(*c));
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(schedule_to_json(*again), schedule_to_json(*c));
  for (const char* bad : {R"({"type":"linear"})", R"({"warmup_steps":3})", R"({"type":"cosine","warmup_steps":-1})",
                          R"({"type":"cosine","warmup_steps":2.5})", R"({"type":"cosine","final_lr_fraction":1.5})",
                          R"({"type":"cosine","final_lr_fraction":"x"})", R"({"type":"wsd","decay_fraction":0})",
                          R"({"type":"wsd","decay_shape":"cubic"})", R"({"type":"cosine","warmup":3})", R"([1,2])"}) {
    auto r = schedule_from_json(nlohmann::json::parse(bad));
    EXPECT_FALSE(r.is_ok()) << bad;
    if (!r.is_ok()) {
      EXPECT_NE(r.status().message().find("schedule"), std::string::npos);
    }
  }
  ScheduleConfig w;
  w.warmup_steps = 10;
  EXPECT_FALSE(LrSchedule::create(w, 1e-3, 10).is_ok());  // warmup must leave a step
  EXPECT_FALSE(LrSchedule::create(ScheduleConfig{}, 0.0, 10).is_ok());
  EXPECT_FALSE(LrSchedule::create(ScheduleConfig{}, 1e-3, 0).is_ok());
}

}  // namespace
}  // namespace nibble::train
