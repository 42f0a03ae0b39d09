// Tensor, dtype and bit-conversion tests.
#include "core/tensor.h"

#include <cmath>

#include <gtest/gtest.h>

#include "core/bits.h"
#include "core/status.h"

namespace nibble {
namespace {

TEST(Tensor, ShapeNumelAndReshape) {
  Tensor t(DType::kF32, {2, 3, 4});
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.dim(-1), 4);
  Tensor r = t.reshape({6, 4});
  r.data<float>()[5] = 2.5f;
  EXPECT_EQ(t.data<float>()[5], 2.5f);  // shares storage
  EXPECT_THROW(t.reshape({5, 5}), CheckError);
  EXPECT_THROW((void)t.data<uint8_t>(), CheckError);
}

TEST(Tensor, CloneIsDeep) {
  Tensor t = Tensor::from_floats({1, 2, 3, 4}, {2, 2});
  Tensor c = t.clone();
  c.data<float>()[0] = 9;
  EXPECT_EQ(t.data<float>()[0], 1);
}

TEST(Tensor, ToF32FromBf16AndF16) {
  Tensor b(DType::kBF16, {3});
  auto* p = b.data<uint16_t>();
  p[0] = f32_to_bf16_bits(1.5f);
  p[1] = f32_to_bf16_bits(-3.0f);
  p[2] = f32_to_bf16_bits(0.1f);
  Tensor f = b.to_f32();
  EXPECT_EQ(f.data<float>()[0], 1.5f);
  EXPECT_EQ(f.data<float>()[1], -3.0f);
  EXPECT_EQ(f.data<float>()[2], round_to_bf16(0.1f));
}

TEST(Bits, Bf16RoundsToNearestEven) {
  // 1 + 2^-8 is exactly halfway between bf16 1 and 1 + 2^-7: ties to even -> 1.
  EXPECT_EQ(round_to_bf16(1.0f + 0x1.0p-8f), 1.0f);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even) -> 1+2^-6.
  EXPECT_EQ(round_to_bf16(1.0f + 3 * 0x1.0p-8f), 1.0f + 0x1.0p-6f);
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(std::nanf("")))));
}

TEST(Bits, F16RoundTrip) {
  for (float v : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f, 0.333251953125f}) {
    EXPECT_EQ(f16_bits_to_f32(f32_to_f16_bits(v)), v) << v;
  }
  EXPECT_TRUE(std::isinf(f16_bits_to_f32(f32_to_f16_bits(70000.0f))));
}

TEST(Status, ResultCarriesValueOrError) {
  Result<int> ok = 3;
  EXPECT_TRUE(ok.is_ok());
  EXPECT_EQ(*ok, 3);
  Result<int> bad = invalid_argument("bad value {}", 7);
  EXPECT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().message(), "bad value 7");
}

}  // namespace
}  // namespace nibble
