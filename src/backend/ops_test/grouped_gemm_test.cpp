// Op tests of the grouped BF16 GEMMs (grouped_matmul_bf16_nt / nn / tn / nt_blocks, MoE experts, issue #13)
// against per-group cpu::matmul_* of the widened BF16 operands: ragged groups, empty ones (first,
// inside, last), a single group, rows past offsets[G], per-group alpha, overwrite and accumulate.
// Bound (as gemm_test.cpp's): BF16 products are exact in FP32; an n-term FP32 sum is within
// (n+1) u sum|terms| (Higham Thm 3.5), tensor cores may truncate (<= 2u per addition, Fasi et al.
// 2021), alpha is one more rounding and y0 one more term: |y - ref| <= (3n + 8) u (|alpha_g|
// sum|a b| + |y0|), n the group's reduction length (K; its rows for tn; its columns for blocks). A wrong group, stride or
// layout is off by O(1) relative, a missing alpha by a factor of 2 or more.
#include <cmath>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/ops_test/ops_test_util.h"
#include "backend/ops_test/tolerance_util.h"
#include "core/bits.h"

namespace nibble::backend::testing {
namespace {

enum class Layout { kNT, kNN, kTN, kBlocks };

// Rows of each group (kNT/kNN) or reduction rows (kTN); extent may exceed their sum.
struct GroupedCase {
  std::vector<int64_t> sizes;
  int64_t extent_extra;  // rows past offsets[G]
  int64_t M, N, K;       // kNT/kNN: N, K (M unused); kTN, kBlocks: M, N (K unused)
};

class GroupedGemmOpsTest : public OpsTest {
 protected:
  static std::vector<uint16_t> bf16_bits(int64_t n, uint64_t seed, std::vector<float>& widened) {
    std::vector<float> v = normal_vector(n, seed);
    std::vector<uint16_t> bits(v.size());
    widened.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16_bits(v[i]), widened[i] = bf16_bits_to_f32(bits[i]);
    return bits;
  }

  void check(Layout layout, const GroupedCase& c, bool accumulate, bool with_alpha, uint64_t seed) {
    const int64_t G = static_cast<int64_t>(c.sizes.size());
    std::vector<int64_t> off(G + 1, 0);
    for (int64_t g = 0; g < G; ++g) off[g + 1] = off[g] + c.sizes[g];
    const int64_t extent = off[G] + c.extent_extra;
    const bool blocks = layout == Layout::kBlocks, tn = layout == Layout::kTN || blocks;  // tn: reduction grouped
    const int64_t M = c.M, N = c.N, K = c.K;
    // per-group operand / output stride: a few elements of slack between groups
    const int64_t stride = tn ? M * N + 3 : N * K + 5;
    // kBlocks: each group's blocks hold a few rows more than the M / N used
    const int64_t a_rows = M + 2, b_rows = N + 1;
    std::vector<float> a, b;
    const std::vector<uint16_t> ab = bf16_bits(extent * (blocks ? a_rows : tn ? M : K), seed, a);
    const std::vector<uint16_t> bb =
        bf16_bits(blocks ? extent * b_rows : tn ? extent * N : (G > 0 ? (G - 1) * stride + N * K : 0), seed + 1, b);
    const int64_t y_count = tn ? (G > 0 ? (G - 1) * stride + M * N : 0) : extent * N;
    const std::vector<float> y0 = normal_vector(y_count, seed + 2);
    std::vector<float> alpha(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) alpha[g] = std::ldexp(1.0f + 0.125f * static_cast<float>(g % 7), -int(g % 5) - 1);

    // reference: untouched elements (rows past offsets[G], slack between tn outputs) keep y0
    // (accumulate) or the NaN the output starts with (overwrite: an unwritten element stays NaN)
    const float fill = accumulate ? 0.0f : std::nanf("");
    std::vector<float> start = accumulate ? y0 : std::vector<float>(static_cast<size_t>(y_count), fill);
    std::vector<float> ref = start;
    std::vector<double> bound(static_cast<size_t>(y_count), 0.0);
    std::vector<double> abs_a(a.begin(), a.end()), abs_b(b.begin(), b.end());
    for (double& v : abs_a) v = std::fabs(v);
    for (double& v : abs_b) v = std::fabs(v);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t rows = off[g + 1] - off[g], r0 = off[g];
      const double s = with_alpha ? alpha[g] : 1.0;
      // out: the group's output block (out_rows, N) with leading dimension N; n: reduction length
      const int64_t out_rows = tn ? M : rows, n = tn ? rows : K;
      const int64_t out0 = tn ? g * stride : r0 * N;
      if (out_rows == 0) continue;
      std::vector<float> sum(static_cast<size_t>(out_rows * N), 0.0f);
      std::vector<double> mag(sum.size(), 0.0);
      if (n > 0) {
        switch (layout) {
          case Layout::kNT:
            cpu::matmul_nt(sum.data(), a.data() + r0 * K, b.data() + g * stride, rows, N, K);
            cpu::matmul_nt(mag.data(), abs_a.data() + r0 * K, abs_b.data() + g * stride, rows, N, K);
            break;
          case Layout::kNN:
            cpu::matmul_nn(sum.data(), a.data() + r0 * K, b.data() + g * stride, rows, N, K);
            cpu::matmul_nn(mag.data(), abs_a.data() + r0 * K, abs_b.data() + g * stride, rows, N, K);
            break;
          case Layout::kTN:
            cpu::matmul_tn(sum.data(), a.data() + r0 * M, b.data() + r0 * N, M, N, rows);
            cpu::matmul_tn(mag.data(), abs_a.data() + r0 * M, abs_b.data() + r0 * N, M, N, rows);
            break;
          case Layout::kBlocks:  // (M, rows) and (N, rows) blocks, leading dimension rows
            cpu::matmul_nt(sum.data(), a.data() + r0 * a_rows, b.data() + r0 * b_rows, M, N, rows);
            cpu::matmul_nt(mag.data(), abs_a.data() + r0 * a_rows, abs_b.data() + r0 * b_rows, M, N, rows);
            break;
        }
      }
      for (size_t i = 0; i < sum.size(); ++i) {
        const size_t at = static_cast<size_t>(out0) + i;
        const double y_old = accumulate ? double(y0[at]) : 0.0;
        ref[at] = static_cast<float>(s * sum[i] + y_old);
        bound[at] = double(3 * n + 8) * kUnitRoundoff * (std::fabs(s) * mag[i] + std::fabs(y_old));
      }
    }

    float* y = upload(start);
    const uint16_t* ad = upload(ab);
    const uint16_t* bd = upload(bb);
    const int64_t* offd = upload(off);
    const float* ald = with_alpha ? upload(alpha) : nullptr;
    switch (layout) {
      case Layout::kNT: be().grouped_matmul_bf16_nt(y, ad, bd, offd, G, extent, N, K, stride, ald, accumulate); break;
      case Layout::kNN: be().grouped_matmul_bf16_nn(y, ad, bd, offd, G, extent, N, K, stride, ald, accumulate); break;
      case Layout::kTN: be().grouped_matmul_bf16_tn(y, ad, bd, offd, G, extent, M, N, stride, ald, accumulate); break;
      case Layout::kBlocks:
        be().grouped_matmul_bf16_nt_blocks(y, ad, bd, offd, G, extent, M, N, a_rows, b_rows, stride, ald, accumulate);
        break;
    }
    EXPECT_TRUE(within_bound(download(y, y_count), ref, bound))
        << "layout " << int(layout) << " G=" << G << " M=" << M << " N=" << N << " K=" << K
        << " accumulate=" << accumulate << " alpha=" << with_alpha;
  }
};

// Ragged groups with empty ones first, inside and last; sizes off the 128-row tile (1, 37, 129,
// 200); N and K below, at and off multiples of 8 (vector and scalar loads on CUDA).
const GroupedCase kRowCases[] = {
    {{0, 37, 1, 0, 200, 129, 0}, 0, 0, 72, 136},
    {{0, 37, 1, 0, 200, 129, 0}, 11, 0, 21, 13},
    {{300}, 0, 0, 136, 64},         // a single group
    {{5, 0, 130}, 2, 0, 1, 9},      // N = 1
    {{0, 0, 0}, 4, 0, 16, 16},      // no rows at all: y untouched
};
const GroupedCase kReductionCases[] = {
    {{0, 37, 1, 0, 200, 129, 0}, 0, 136, 72, 0},
    {{0, 37, 1, 0, 200, 129, 0}, 11, 13, 21, 0},
    {{300}, 0, 64, 136, 0},         // a single group
    {{0, 0, 0}, 4, 24, 40, 0},      // every group empty: zero-filled (accumulate: left)
};

TEST_P(GroupedGemmOpsTest, RowsGroupedNtAndNnMatchPerGroupGemms) {
  uint64_t seed = 5100;
  for (Layout l : {Layout::kNT, Layout::kNN})
    for (const GroupedCase& c : kRowCases)
      for (bool acc : {false, true})
        for (bool al : {false, true}) check(l, c, acc, al, seed += 3);
}

TEST_P(GroupedGemmOpsTest, ReductionGroupedTnMatchesPerGroupGemms) {
  uint64_t seed = 5300;
  for (const GroupedCase& c : kReductionCases)
    for (bool acc : {false, true})
      for (bool al : {false, true}) check(Layout::kTN, c, acc, al, seed += 3);
}

// The blocks form (each group's operands contiguous, K_g columns): reduction lengths off and at
// multiples of 8 (scalar and vector loads), empty groups, blocks with rows past M / N.
TEST_P(GroupedGemmOpsTest, BlocksGroupedNtMatchesPerGroupGemms) {
  uint64_t seed = 5500;
  const GroupedCase kBlockCases[] = {
      {{0, 37, 1, 0, 200, 129, 0}, 0, 136, 72, 0},
      {{16, 0, 48, 256, 0}, 8, 40, 24, 0},  // the FP4 recipes' shape: groups padded to 16
      {{0, 0, 0}, 4, 24, 40, 0},
  };
  for (const GroupedCase& c : kBlockCases)
    for (bool acc : {false, true})
      for (bool al : {false, true}) check(Layout::kBlocks, c, acc, al, seed += 3);
}

NIB_INSTANTIATE_OPS_TEST(GroupedGemmOpsTest);

}  // namespace
}  // namespace nibble::backend::testing
