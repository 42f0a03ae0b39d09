// GPU checks of flash_decoding (flash_decoding.h) that the op suite cannot reach through the
// Backend: a batch run in row groups (a workspace of two rows) gives the same bits as in one
// pass, and flash decoding agrees with the one-block-per-head kernel (paged_attention.h, kept
// selectable) within twice a first-order FP32 bound. Pages are written on the host with the
// codec (kv_page_codec.h: the bytes every backend stores). Skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/flash_decoding.h"
#include "backend/cuda/paged_attention.h"
#include "backend/kv_page_codec.h"
#include "core/philox.h"

namespace nibble::cuda {
namespace {

bool gpu_ok() {
  static bool ok = init().is_ok();
  return ok;
}

// Device copy of a host vector, freed at scope end.
template <typename T>
struct DeviceVec {
  T* p = nullptr;
  explicit DeviceVec(const std::vector<T>& h) {
    NIB_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(h.size(), 1) * sizeof(T)));
    NIB_CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit DeviceVec(size_t n) {
    NIB_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)));
    NIB_CUDA_CHECK(cudaMemset(p, 0, n * sizeof(T)));
  }
  ~DeviceVec() { cudaFree(p); }
  DeviceVec(const DeviceVec&) = delete;
  DeviceVec& operator=(const DeviceVec&) = delete;
  std::vector<T> download(size_t n) const {
    std::vector<T> h(n);
    NIB_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

std::vector<float> normals(int64_t n, uint64_t seed, float sigma) {
  PhiloxStream rng(seed, 0);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = sigma * static_cast<float>(rng.next_normal());
  return x;
}

TEST(FlashDecoding, RowGroupsGiveTheSameBitsAndTheOneBlockKernelAgrees) {
  if (!gpu_ok()) GTEST_SKIP() << "no CUDA device";
  const int64_t N = 5, H = 8, Hkv = 2, D = 64, page = 16, pages = 40, slots = pages * page, W = Hkv * D;
  const backend::KvPageFormat f = backend::KvPageFormat::kF32;
  const backend::kv::TokenLayout L = backend::kv::token_layout(f, Hkv, D);
  const std::vector<float> k = normals(slots * W, 41, 1.0f), v = normals(slots * W, 42, 1.0f);
  const std::vector<float> q = normals(N * H * D, 43, 1.0f);
  std::vector<uint8_t> kh(static_cast<size_t>(slots * L.bytes)), vh(kh.size());
  for (int64_t s = 0; s < slots; ++s)
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      backend::kv::encode_head(kh.data() + s * L.bytes, L, f, D, hk, &k[s * W + hk * D]);
      backend::kv::encode_head(vh.data() + s * L.bytes, L, f, D, hk, &v[s * W + hk * D]);
    }
  std::vector<int32_t> table(static_cast<size_t>(N * pages));
  PhiloxStream rng(7, 0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> perm(static_cast<size_t>(pages));
    for (int64_t i = 0; i < pages; ++i) perm[i] = static_cast<int32_t>(i);
    for (int64_t i = pages - 1; i > 0; --i) std::swap(perm[i], perm[rng.next_u32() % (i + 1)]);
    std::copy(perm.begin(), perm.end(), table.begin() + n * pages);
  }
  const std::vector<int32_t> len{1, 17, static_cast<int32_t>(slots), 65, 300};
  DeviceVec<uint8_t> kd(kh), vd(vh);
  DeviceVec<float> qd(q);
  DeviceVec<int32_t> td(table), ld(len);
  const size_t per_row = flash_decoding_workspace_bytes_per_row(H, slots, D);
  DeviceVec<uint8_t> ws(per_row * N);
  DeviceVec<float> one_pass(N * H * D), groups(N * H * D), one_block(N * H * D);
  ASSERT_TRUE(flash_decoding_supports(f, qd.p, kd.p, vd.p, H, Hkv, D));
  EXPECT_EQ(flash_decoding(one_pass.p, qd.p, kd.p, vd.p, f, td.p, pages, ld.p, N, H, Hkv, D, page, false, ws.p,
                           per_row * N, nullptr),
            cudaSuccess);
  // two rows per pass: passes of rows {0,1}, {2,3}, {4}
  EXPECT_EQ(flash_decoding(groups.p, qd.p, kd.p, vd.p, f, td.p, pages, ld.p, N, H, Hkv, D, page, false, ws.p,
                           per_row * 2, nullptr),
            cudaSuccess);
  EXPECT_EQ(flash_decoding(groups.p, qd.p, kd.p, vd.p, f, td.p, pages, ld.p, N, H, Hkv, D, page, false, ws.p,
                           per_row - 1, nullptr),
            cudaErrorInvalidValue)
      << "a workspace below one row is refused";
  EXPECT_EQ(paged_attention(one_block.p, qd.p, kd.p, vd.p, f, td.p, pages, ld.p, N, H, Hkv, D, page, false, nullptr),
            cudaSuccess);
  NIB_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> a = one_pass.download(N * H * D), b = groups.download(N * H * D),
                           c = one_block.download(N * H * D);
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof(float)), 0) << "element " << i;
  // Both kernels evaluate out_d = sum_j p_j v_jd in FP32 (u = 2^-24), each within
  // (ep + (n + 3) u) max_j |v_jd| of the exact value, ep = 2 (D + 2) u S + u (4 S + n + 11) with
  // S = max_j scale sum_d |q_d k_jd| (the op suite's bound with the chunked form's extra terms,
  // paged_attention_test.cpp); their difference is within twice that.
  const double u = 0x1.0p-24, scale = 1.0 / std::sqrt(double(D));
  const int64_t G = H / Hkv;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / G, len_n = len[n];
      double S = 0;
      std::vector<double> vmax(static_cast<size_t>(D), 0.0);
      for (int64_t j = 0; j < len_n; ++j) {
        const int64_t slot = static_cast<int64_t>(table[n * pages + j / page]) * page + j % page;
        double mag = 0;
        for (int64_t d = 0; d < D; ++d) {
          mag += std::fabs(double(q[(n * H + h) * D + d]) * k[slot * W + hk * D + d]);
          vmax[d] = std::max(vmax[d], std::fabs(double(v[slot * W + hk * D + d])));
        }
        S = std::max(S, scale * mag);
      }
      const double ep = 2 * (D + 2) * u * S + u * (4 * S + double(len_n) + 11);
      for (int64_t d = 0; d < D; ++d) {
        const size_t i = static_cast<size_t>((n * H + h) * D + d);
        const double tol = 2 * (ep + (double(len_n) + 3) * u) * vmax[d];
        ASSERT_LE(std::fabs(double(a[i]) - c[i]), tol) << "row " << n << " head " << h << " d " << d;
      }
    }
}

}  // namespace
}  // namespace nibble::cuda
