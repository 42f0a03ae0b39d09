// MoE router, dispatch and combine on the CPU (see moe.h). Everything is deterministic: the
// dispatch is a stable counting sort, and each output row has one writer.
#include "backend/cpu/moe.h"

#include <cmath>
#include <limits>

#include "backend/cpu/work_grain.h"
#include "core/check.h"
#include "core/parallel.h"

namespace nibble::cpu {

template <typename T>
void moe_router_forward(T* probs, T* lse, int32_t* topk_idx, T* topk_w, const T* logits, const int32_t* forced_idx,
                        int64_t N, int64_t E, int64_t k, bool norm_topk_prob) {
  NIB_CHECK(k >= 1 && k <= E);
  if (forced_idx) {  // serially, before the parallel region (exceptions must not leave it)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < k; ++j) {
        int32_t id = forced_idx[n * k + j];
        NIB_CHECK_MSG(id >= 0 && id < E, "forced expert id {} (token {}) outside [0, {})", id, n, E);
        for (int64_t j2 = 0; j2 < j; ++j2)
          NIB_CHECK_MSG(forced_idx[n * k + j2] != id, "forced expert id {} repeated for token {}", id, n);
      }
  }
  parallel_for(N, grain_for(E * (k + 2)), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* l = logits + n * E;
      T* p = probs + n * E;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t i = 0; i < E; ++i) mx = l[i] > mx ? l[i] : mx;
      T sum = 0;
      for (int64_t i = 0; i < E; ++i) {
        p[i] = std::exp(l[i] - mx);
        sum += p[i];
      }
      for (int64_t i = 0; i < E; ++i) p[i] /= sum;
      lse[n] = mx + std::log(sum);
      int32_t* idx = topk_idx + n * k;
      T* w = topk_w + n * k;
      if (forced_idx) {
        for (int64_t j = 0; j < k; ++j) idx[j] = forced_idx[n * k + j];
      } else {
        // selection of the k largest, descending; strict '>' keeps the lower id on ties
        for (int64_t j = 0; j < k; ++j) {
          int32_t best = -1;
          for (int64_t i = 0; i < E; ++i) {
            bool taken = false;
            for (int64_t j2 = 0; j2 < j; ++j2) taken |= idx[j2] == i;
            if (taken) continue;
            if (best < 0 || p[i] > p[best]) best = static_cast<int32_t>(i);
          }
          idx[j] = best;
        }
      }
      T s = 0;
      for (int64_t j = 0; j < k; ++j) s += p[idx[j]];
      // a forced (R3) set takes the model's own gate formula: renormalised only with norm_topk_prob
      for (int64_t j = 0; j < k; ++j) w[j] = norm_topk_prob ? p[idx[j]] / s : p[idx[j]];
    }
  });
}

template <typename T>
void moe_router_backward(T* dlogits, const T* dtopk_w, const T* probs, const T* lse, const int32_t* topk_idx,
                         const T* topk_w, const T* dprobs_extra, double z_scale, int64_t N, int64_t E, int64_t k,
                         bool renormalized) {
  parallel_for(N, grain_for(E * (k + 2)), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* p = probs + n * E;
      const int32_t* idx = topk_idx + n * k;
      const T* w = topk_w + n * k;
      const T* dw = dtopk_w + n * k;
      T* dl = dlogits + n * E;  // holds dL/dp first, then dL/dlogits
      for (int64_t i = 0; i < E; ++i) dl[i] = dprobs_extra ? dprobs_extra[i] : T(0);
      if (renormalized) {
        // w_j = p_j / S, S = sum_sel p:  dL/dp_i = (dw_i - sum_j dw_j w_j) / S
        T s = 0, dww = 0;
        for (int64_t j = 0; j < k; ++j) {
          s += p[idx[j]];
          dww += dw[j] * w[j];
        }
        for (int64_t j = 0; j < k; ++j) dl[idx[j]] += (dw[j] - dww) / s;
      } else {
        for (int64_t j = 0; j < k; ++j) dl[idx[j]] += dw[j];
      }
      // softmax backward, plus d(z_scale lse^2)/dl = 2 z_scale lse p
      T pdp = 0;
      for (int64_t i = 0; i < E; ++i) pdp += p[i] * dl[i];
      T zc = T(2) * static_cast<T>(z_scale) * lse[n];
      for (int64_t i = 0; i < E; ++i) dl[i] = p[i] * (dl[i] - pdp) + zc * p[i];
    }
  });
}

void moe_dispatch_plan(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row, const int32_t* topk_idx,
                       int64_t N, int64_t E, int64_t k) {
  for (int64_t e = 0; e <= E; ++e) expert_offsets[e] = 0;
  for (int64_t s = 0; s < N * k; ++s) {
    NIB_CHECK(topk_idx[s] >= 0 && topk_idx[s] < E);
    expert_offsets[topk_idx[s] + 1] += 1;
  }
  for (int64_t e = 0; e < E; ++e) expert_offsets[e + 1] += expert_offsets[e];
  // stable fill: assignments in (token, slot) order; a small cursor array on the stack would
  // need E bounded, so reuse the offsets by walking a copy.
  int64_t cursor_storage[256];
  int64_t* cursor = E <= 256 ? cursor_storage : new int64_t[E];
  for (int64_t e = 0; e < E; ++e) cursor[e] = expert_offsets[e];
  for (int64_t s = 0; s < N * k; ++s) {
    int64_t r = cursor[topk_idx[s]]++;
    row_of_slot[s] = static_cast<int32_t>(r);
    token_of_row[r] = static_cast<int32_t>(s / k);
  }
  if (cursor != cursor_storage) delete[] cursor;
}

template <typename T>
void moe_gather(T* xe, const T* x, const int32_t* token_of_row, int64_t rows, int64_t C) {
  parallel_for(rows, grain_for(C), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* src = x + (int64_t)token_of_row[r] * C;
      T* dst = xe + r * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = src[c];
    }
  });
}

template <typename T>
void moe_gather_backward(T* dx, const T* dxe, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
  parallel_for(N, grain_for(k * C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      T* d = dx + n * C;
      for (int64_t c = 0; c < C; ++c) d[c] = T(0);
      for (int64_t j = 0; j < k; ++j) {
        const T* src = dxe + (int64_t)row_of_slot[n * k + j] * C;
        for (int64_t c = 0; c < C; ++c) d[c] += src[c];
      }
    }
  });
}

template <typename T>
void moe_combine(T* out, const T* ye, const T* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
  parallel_for(N, grain_for(k * C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      T* o = out + n * C;
      for (int64_t c = 0; c < C; ++c) o[c] = T(0);
      for (int64_t j = 0; j < k; ++j) {
        T w = topk_w[n * k + j];
        const T* y = ye + (int64_t)row_of_slot[n * k + j] * C;
        for (int64_t c = 0; c < C; ++c) o[c] += w * y[c];
      }
    }
  });
}

template <typename T>
void moe_combine_backward(T* dye, T* dtopk_w, const T* dout, const T* ye, const T* topk_w,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C) {
  parallel_for(N, grain_for(k * C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* d = dout + n * C;
      for (int64_t j = 0; j < k; ++j) {
        int64_t r = row_of_slot[n * k + j];
        T w = topk_w[n * k + j];
        const T* y = ye + r * C;
        T* dy = dye + r * C;
        T dot = 0;
        for (int64_t c = 0; c < C; ++c) {
          dot += d[c] * y[c];
          dy[c] = w * d[c];
        }
        dtopk_w[n * k + j] = dot;
      }
    }
  });
}

template <typename T>
void moe_accumulate_load(double* count, double* prob_sum, const T* probs, const int32_t* topk_idx, int64_t N,
                         int64_t E, int64_t k) {
  for (int64_t s = 0; s < N * k; ++s) count[topk_idx[s]] += 1.0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) prob_sum[e] += static_cast<double>(probs[n * E + e]);
}

#define NIB_INSTANTIATE_MOE(T)                                                                                    \
  template void moe_router_forward<T>(T*, T*, int32_t*, T*, const T*, const int32_t*, int64_t, int64_t, int64_t, \
                                      bool);                                                                     \
  template void moe_router_backward<T>(T*, const T*, const T*, const T*, const int32_t*, const T*, const T*,      \
                                       double, int64_t, int64_t, int64_t, bool);                                 \
  template void moe_gather<T>(T*, const T*, const int32_t*, int64_t, int64_t);                                   \
  template void moe_gather_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t);                 \
  template void moe_combine<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t);               \
  template void moe_combine_backward<T>(T*, T*, const T*, const T*, const T*, const int32_t*, int64_t, int64_t,   \
                                        int64_t);                                                                \
  template void moe_accumulate_load<T>(double*, double*, const T*, const int32_t*, int64_t, int64_t, int64_t);

NIB_INSTANTIATE_MOE(float)
NIB_INSTANTIATE_MOE(double)

}  // namespace nibble::cpu
