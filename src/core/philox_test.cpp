// Philox4x32-10 known-answer tests (Random123's kat_vectors) and stream properties.
#include "core/philox.h"

#include <gtest/gtest.h>

namespace nibble {
namespace {

// One Random123 known answer: philox4x32_10(counter, key0, key1) equals want word for word, and
// so does the form that takes the precomputed round keys of (key0, key1).
void expect_known_answer(Philox4x32 counter, uint32_t key0, uint32_t key1, Philox4x32 want) {
  const Philox4x32 r = philox4x32_10(counter, key0, key1);
  const Philox4x32 rk = philox4x32_10(counter, philox_round_keys((static_cast<uint64_t>(key1) << 32) | key0));
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(r.v[i], want.v[i]) << "word " << i;
    EXPECT_EQ(rk.v[i], want.v[i]) << "word " << i << " (round-key form)";
  }
}

TEST(Philox, KnownAnswerZero) {
  expect_known_answer({{0, 0, 0, 0}}, 0, 0, {{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}});
}

TEST(Philox, KnownAnswerOnes) {
  expect_known_answer({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu,
                      {{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}});
}

TEST(Philox, KnownAnswerPi) {
  expect_known_answer({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u,
                      {{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}});
}

TEST(Philox, UniformRangeAndMean) {
  double sum = 0;
  const int n = 1 << 16;
  for (int i = 0; i < n; ++i) {
    float u = philox_uniform(42, 7, static_cast<uint64_t>(i));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    sum += u;
  }
  // Mean of n uniforms has std 1/sqrt(12 n) = 0.00113; 6 sigma bound.
  EXPECT_NEAR(sum / n, 0.5, 6 * 0.00113);
}

TEST(Philox, StreamsAndSeedsDiffer) {
  EXPECT_NE(philox_word(1, 0, 0), philox_word(2, 0, 0));
  EXPECT_NE(philox_word(1, 0, 0), philox_word(1, 1, 0));
  EXPECT_NE(philox_word(1, 0, 0), philox_word(1, 0, 1));
}

TEST(Philox, StreamIsResumable) {
  PhiloxStream a(9, 3);
  for (int i = 0; i < 10; ++i) a.next_u32();
  PhiloxStream b(9, 3, a.position());
  EXPECT_EQ(a.next_u64(), b.next_u64());
}

}  // namespace
}  // namespace nibble
