// Causal GQA attention forward/backward on the CPU (see attention.h). One parallel work item is
// one (batch, key/value head) pair with all of its query heads, so dk/dv have a single writer.
#include "backend/cpu/attention.h"

#include <cmath>
#include <limits>

#include "core/check.h"
#include "core/parallel.h"

namespace nibble::cpu {

template <typename T>
void attention_forward(T* out, T* att, const T* q, const T* k, const T* v, int64_t B, int64_t Tn, int64_t H,
                       int64_t Hkv, int64_t D) {
  NIB_CHECK(H % Hkv == 0);
  const int64_t group = H / Hkv;
  const T scale = T(1) / std::sqrt(static_cast<T>(D));
  parallel_for(B * H, 1, [&](int64_t b0, int64_t e0) {
    for (int64_t bh = b0; bh < e0; ++bh) {
      int64_t b = bh / H, h = bh % H, hk = h / group;
      for (int64_t t = 0; t < Tn; ++t) {
        const T* qt = q + ((b * Tn + t) * H + h) * D;
        T* a = att + ((b * H + h) * Tn + t) * Tn;
        // scores s = q.k * scale over t2 <= t, then a numerically stable softmax
        T mx = -std::numeric_limits<T>::infinity();
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          const T* kt = k + ((b * Tn + t2) * Hkv + hk) * D;
          T s = 0;
          for (int64_t d = 0; d < D; ++d) s += qt[d] * kt[d];
          s *= scale;
          a[t2] = s;
          mx = s > mx ? s : mx;
        }
        T sum = 0;
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          T e = std::exp(a[t2] - mx);
          a[t2] = e;
          sum += e;
        }
        T inv = T(1) / sum;
        for (int64_t t2 = 0; t2 <= t; ++t2) a[t2] *= inv;
        for (int64_t t2 = t + 1; t2 < Tn; ++t2) a[t2] = T(0);
        // out = sum_t2 a[t2] v[t2]
        T* o = out + ((b * Tn + t) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = T(0);
        for (int64_t t2 = 0; t2 <= t; ++t2) {
          const T* vt = v + ((b * Tn + t2) * Hkv + hk) * D;
          T p = a[t2];
          for (int64_t d = 0; d < D; ++d) o[d] += p * vt[d];
        }
      }
    }
  });
}

template <typename T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* att, const T* q, const T* k, const T* v,
                        int64_t B, int64_t Tn, int64_t H, int64_t Hkv, int64_t D) {
  NIB_CHECK(H % Hkv == 0);
  const int64_t group = H / Hkv;
  const T scale = T(1) / std::sqrt(static_cast<T>(D));
  parallel_for(B * Hkv, 1, [&](int64_t b0, int64_t e0) {
    T* dp = new T[Tn];  // one scratch row per work chunk
    for (int64_t bk = b0; bk < e0; ++bk) {
      int64_t b = bk / Hkv, hk = bk % Hkv;
      for (int64_t t = 0; t < Tn; ++t) {
        T* dkt = dk + ((b * Tn + t) * Hkv + hk) * D;
        T* dvt = dv + ((b * Tn + t) * Hkv + hk) * D;
        for (int64_t d = 0; d < D; ++d) dkt[d] = dvt[d] = T(0);
      }
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t t = 0; t < Tn; ++t) {
          const T* a = att + ((b * H + h) * Tn + t) * Tn;
          const T* dot = dout + ((b * Tn + t) * H + h) * D;
          const T* qt = q + ((b * Tn + t) * H + h) * D;
          T* dqt = dq + ((b * Tn + t) * H + h) * D;
          // out = sum a v: dv[t2] += a[t2] dout; da[t2] = dout . v[t2]
          T sum_adp = 0;
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            const T* vt = v + ((b * Tn + t2) * Hkv + hk) * D;
            T* dvt = dv + ((b * Tn + t2) * Hkv + hk) * D;
            T p = a[t2];
            T s = 0;
            for (int64_t d = 0; d < D; ++d) {
              s += dot[d] * vt[d];
              dvt[d] += p * dot[d];
            }
            dp[t2] = s;
            sum_adp += p * s;
          }
          // softmax backward: ds = a (da - sum a da); scores = scale q.k
          for (int64_t d = 0; d < D; ++d) dqt[d] = T(0);
          for (int64_t t2 = 0; t2 <= t; ++t2) {
            T ds = a[t2] * (dp[t2] - sum_adp) * scale;
            const T* kt = k + ((b * Tn + t2) * Hkv + hk) * D;
            T* dkt = dk + ((b * Tn + t2) * Hkv + hk) * D;
            for (int64_t d = 0; d < D; ++d) {
              dqt[d] += ds * kt[d];
              dkt[d] += ds * qt[d];
            }
          }
        }
      }
    }
    delete[] dp;
  });
}

template void attention_forward<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                       int64_t, int64_t, int64_t);
template void attention_forward<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                        int64_t, int64_t, int64_t, int64_t);
template void attention_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                        const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_backward<double>(double*, double*, double*, const double*, const double*, const double*,
                                         const double*, const double*, int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace nibble::cpu
