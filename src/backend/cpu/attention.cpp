// Causal GQA attention forward/backward on the CPU (see attention.h), flash-style contract: the
// forward saves the log-sum-exp per query row, the backward recomputes the probabilities. Per
// (batch, head) the score, PV and gradient products are GEMMs on strided views of the (B,T,H,D)
// tensors (gemm_serial, one BLAS call per product on the calling thread); the full T x T score
// matrix of one head is computed in scratch and the causal mask applied before the softmax.
// Forward work items are (batch, query head); backward items are (batch, kv head) with all query
// heads of the group, so dk/dv have a single writer. The BF16-precision reference at the end is
// scalar and readable (no GEMMs): it states the rounding contract the CUDA kernels follow.
#include "backend/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/gemm.h"
#include "backend/cpu/work_grain.h"
#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"

namespace nibble::cpu {

// Scores of one (batch, head): a (T,T) = scale q k^T, causal entries only are meaningful.
template <typename T>
void attention_scores(T* a, const T* qb, int64_t ldq, const T* kb, int64_t ldk, int64_t Tn, int64_t D, T scale) {
  gemm_serial<T>(false, true, Tn, Tn, D, scale, qb, ldq, kb, ldk, T(0), a, Tn);
}

template <typename T>
void attention_forward(T* out, T* lse, const T* q, const T* k, const T* v, int64_t B, int64_t Tn, int64_t H,
                       int64_t Hkv, int64_t D) {
  NIB_CHECK(H % Hkv == 0);
  const int64_t group = H / Hkv;
  const T scale = T(1) / std::sqrt(static_cast<T>(D));
  parallel_for(B * H, grain_for(Tn * Tn * D), [&](int64_t b0, int64_t e0) {
    std::vector<T> att(static_cast<size_t>(Tn * Tn));  // one (T,T) scratch per work chunk
    for (int64_t bh = b0; bh < e0; ++bh) {
      const int64_t b = bh / H, h = bh % H, hk = h / group;
      const T* qb = q + (b * Tn * H + h) * D;      // (T,D) ld H*D
      const T* kb = k + (b * Tn * Hkv + hk) * D;   // (T,D) ld Hkv*D
      const T* vb = v + (b * Tn * Hkv + hk) * D;   // (T,D) ld Hkv*D
      T* a = att.data();                           // (T,T)
      T* lrow = lse + bh * Tn;                     // (T) of lse (B,H,T)
      attention_scores(a, qb, H * D, kb, Hkv * D, Tn, D, scale);
      for (int64_t t = 0; t < Tn; ++t) {
        T* row = a + t * Tn;
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t t2 = 0; t2 <= t; ++t2) mx = row[t2] > mx ? row[t2] : mx;
        T sum = 0;
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          row[t2] = std::exp(row[t2] - mx);
          sum += row[t2];
        }
        T inv = T(1) / sum;
        for (int64_t t2 = 0; t2 <= t; ++t2) row[t2] *= inv;
        for (int64_t t2 = t + 1; t2 < Tn; ++t2) row[t2] = T(0);  // causal mask
        lrow[t] = mx + std::log(sum);
      }
      // out (T,D) ld H*D = a (T,T) . v (T,D)
      gemm_serial<T>(false, false, Tn, D, Tn, T(1), a, Tn, vb, Hkv * D, T(0), out + (b * Tn * H + h) * D, H * D);
    }
  });
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* out, const T* lse, const T* q, const T* k,
                        const T* v, int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D) {
  NIB_CHECK(H % Hkv == 0);
  const int64_t group = H / Hkv;
  const T scale = T(1) / std::sqrt(static_cast<T>(D));
  parallel_for(B * Hkv, grain_for(group * Tn * Tn * D), [&](int64_t b0, int64_t e0) {
    std::vector<T> att(static_cast<size_t>(Tn * Tn)), ds(att.size());  // (T,T) scratch per work chunk
    for (int64_t bk = b0; bk < e0; ++bk) {
      const int64_t b = bk / Hkv, hk = bk % Hkv;
      const T* kb = k + (b * Tn * Hkv + hk) * D;
      const T* vb = v + (b * Tn * Hkv + hk) * D;
      T* dkb = dk + (b * Tn * Hkv + hk) * D;
      T* dvb = dv + (b * Tn * Hkv + hk) * D;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const T beta = h == hk * group ? T(0) : T(1);  // first head of the group overwrites dk, dv
        const T* qb = q + (b * Tn * H + h) * D;
        const T* dob = dout + (b * Tn * H + h) * D;
        const T* ob = out + (b * Tn * H + h) * D;
        const T* lrow = lse + (b * H + h) * Tn;
        // recompute the probabilities from the saved log-sum-exp: a = exp(s - lse), 0 above the diagonal
        T* a = att.data();
        attention_scores(a, qb, H * D, kb, Hkv * D, Tn, D, scale);
        for (int64_t t = 0; t < Tn; ++t) {
          T* row = a + t * Tn;
          for (int64_t t2 = 0; t2 <= t; ++t2) row[t2] = std::exp(row[t2] - lrow[t]);
          for (int64_t t2 = t + 1; t2 < Tn; ++t2) row[t2] = T(0);
        }
        // out = a v:  dv += a^T dout;  da = dout v^T
        gemm_serial<T>(true, false, Tn, D, Tn, T(1), a, Tn, dob, H * D, beta, dvb, Hkv * D);
        gemm_serial<T>(false, true, Tn, Tn, D, T(1), dob, H * D, vb, Hkv * D, T(0), ds.data(), Tn);
        // softmax backward: ds = a (da - delta) * scale with delta_t = sum_d dout[t,d] out[t,d]
        // (= sum_t2 a da, the flash-attention form); masked entries have a = 0
        for (int64_t t = 0; t < Tn; ++t) {
          const T* ar = a + t * Tn;
          T* dr = ds.data() + t * Tn;
          T delta = 0;
          for (int64_t d = 0; d < D; ++d) delta += dob[t * H * D + d] * ob[t * H * D + d];
          for (int64_t t2 = 0; t2 <= t; ++t2) dr[t2] = ar[t2] * (dr[t2] - delta) * scale;
          for (int64_t t2 = t + 1; t2 < Tn; ++t2) dr[t2] = T(0);
        }
        // scores = scale q k^T:  dq = ds k;  dk += ds^T q
        gemm_serial<T>(false, false, Tn, D, Tn, T(1), ds.data(), Tn, kb, Hkv * D, T(0), dq + (b * Tn * H + h) * D,
                       H * D);
        gemm_serial<T>(true, false, Tn, D, Tn, T(1), ds.data(), Tn, qb, H * D, beta, dkb, Hkv * D);
      }
    }
  });
}

// ---- BF16 precision: the readable scalar reference --------------------------------------------

namespace {

std::vector<float> rounded_to_bf16(const float* x, int64_t n) {
  std::vector<float> r(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) r[i] = round_to_bf16(x[i]);
  return r;
}

// scale * sum_d a[d] b[d] in double (a, b: D values each).
double scaled_dot(const float* a, const float* b, int64_t D, double scale) {
  double acc = 0;
  for (int64_t d = 0; d < D; ++d) acc += double(a[d]) * b[d];
  return acc * scale;
}

}  // namespace

void attention_forward_bf16(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                            int64_t Tn, int64_t H, int64_t Hkv, int64_t D) {
  NIB_CHECK(H % Hkv == 0);
  const int64_t group = H / Hkv;
  const double scale = 1.0 / std::sqrt(double(D));
  const std::vector<float> qb = rounded_to_bf16(q, B * Tn * H * D), kb = rounded_to_bf16(k, B * Tn * Hkv * D),
                           vb = rounded_to_bf16(v, B * Tn * Hkv * D);
  parallel_for(B * H, grain_for(Tn * Tn * D), [&](int64_t b0, int64_t e0) {
    std::vector<double> s(static_cast<size_t>(Tn)), o(static_cast<size_t>(D));
    for (int64_t bh = b0; bh < e0; ++bh) {
      const int64_t b = bh / H, h = bh % H, hk = h / group;
      auto q_row = [&](int64_t t) { return &qb[((b * Tn + t) * H + h) * D]; };
      auto k_row = [&](int64_t t) { return &kb[((b * Tn + t) * Hkv + hk) * D]; };
      auto v_row = [&](int64_t t) { return &vb[((b * Tn + t) * Hkv + hk) * D]; };
      for (int64_t i = 0; i < Tn; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          s[j] = scaled_dot(q_row(i), k_row(j), D, scale);
          mx = std::max(mx, s[j]);
        }
        double l = 0;
        for (int64_t j = 0; j <= i; ++j) l += std::exp(s[j] - mx);
        const double lse_i = mx + std::log(l);
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t j = 0; j <= i; ++j) {
          const double p = round_to_bf16(static_cast<float>(std::exp(s[j] - lse_i)));  // P enters P v as BF16
          for (int64_t d = 0; d < D; ++d) o[d] += p * v_row(j)[d];
        }
        float* out_row = out + ((b * Tn + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) out_row[d] = static_cast<float>(o[d]);
        lse[bh * Tn + i] = static_cast<float>(lse_i);
      }
    }
  });
}

void attention_backward_bf16(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                             const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                             int64_t Hkv, int64_t D) {
  NIB_CHECK(H % Hkv == 0);
  const int64_t group = H / Hkv;
  const double scale = 1.0 / std::sqrt(double(D));
  const int64_t nq = B * Tn * H * D, nkv = B * Tn * Hkv * D;
  const std::vector<float> qb = rounded_to_bf16(q, nq), kb = rounded_to_bf16(k, nkv), vb = rounded_to_bf16(v, nkv),
                           dob = rounded_to_bf16(dout, nq), ob = rounded_to_bf16(out, nq);
  // work items (batch, kv head): dk, dv rows of one kv head have this single writer; so do the
  // dq rows of the group's query heads.
  parallel_for(B * Hkv, grain_for(group * Tn * Tn * D), [&](int64_t b0, int64_t e0) {
    std::vector<double> ds(static_cast<size_t>(Tn)), dq_acc(static_cast<size_t>(D));
    std::vector<double> dk_acc(static_cast<size_t>(Tn * D)), dv_acc(static_cast<size_t>(Tn * D));
    for (int64_t bk = b0; bk < e0; ++bk) {
      const int64_t b = bk / Hkv, hk = bk % Hkv;
      auto k_row = [&](int64_t t) { return &kb[((b * Tn + t) * Hkv + hk) * D]; };
      auto v_row = [&](int64_t t) { return &vb[((b * Tn + t) * Hkv + hk) * D]; };
      std::fill(dk_acc.begin(), dk_acc.end(), 0.0);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.0);
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = 0; i < Tn; ++i) {
          const float* q_i = &qb[((b * Tn + i) * H + h) * D];
          const float* do_i = &dob[((b * Tn + i) * H + h) * D];
          const double lse_i = lse[(b * H + h) * Tn + i];
          const double delta = scaled_dot(do_i, &ob[((b * Tn + i) * H + h) * D], D, 1.0);
          std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
          for (int64_t j = 0; j <= i; ++j) {
            const double p = std::exp(scaled_dot(q_i, k_row(j), D, scale) - lse_i);
            const double dp = scaled_dot(do_i, v_row(j), D, 1.0);
            const double ds_ij = round_to_bf16(static_cast<float>(p * (dp - delta)));  // dS enters as BF16
            const double p_bf = round_to_bf16(static_cast<float>(p));                  // so does P in dv
            for (int64_t d = 0; d < D; ++d) {
              dq_acc[d] += ds_ij * k_row(j)[d];
              dk_acc[j * D + d] += ds_ij * q_i[d];
              dv_acc[j * D + d] += p_bf * do_i[d];
            }
          }
          float* dq_row = dq + ((b * Tn + i) * H + h) * D;
          for (int64_t d = 0; d < D; ++d) dq_row[d] = static_cast<float>(dq_acc[d] * scale);
        }
      }
      for (int64_t j = 0; j < Tn; ++j)
        for (int64_t d = 0; d < D; ++d) {
          dk[((b * Tn + j) * Hkv + hk) * D + d] = static_cast<float>(dk_acc[j * D + d] * scale);
          dv[((b * Tn + j) * Hkv + hk) * D + d] = static_cast<float>(dv_acc[j * D + d]);
        }
    }
  });
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                       int64_t, int64_t, int64_t);
template void attention_forward<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                        int64_t, int64_t, int64_t, int64_t);
template void attention_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                        const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,
                                        int64_t);
template void attention_backward<double>(double*, double*, double*, const double*, const double*, const double*,
                                         const double*, const double*, const double*, int64_t, int64_t, int64_t,
                                         int64_t, int64_t);

}  // namespace nibble::cpu
