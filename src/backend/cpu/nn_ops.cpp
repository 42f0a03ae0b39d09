// CPU forward/backward of embedding, RMSNorm, RoPE, SwiGLU and softmax cross-entropy with
// z-loss (see nn_ops.h for shapes and conventions). Row-parallel with parallel_for; parameter
// gradients are reduced over rows in a column-parallel pass so results do not depend on threads.
#include "backend/cpu/nn_ops.h"

#include <cmath>
#include <limits>

#include "backend/cpu/work_grain.h"
#include "core/check.h"
#include "core/parallel.h"

namespace nibble::cpu {

// ---- embedding ---------------------------------------------------------------------------
// Checks run serially before any parallel region: an exception must never leave an OpenMP
// parallel region (that would terminate the process instead of reaching the caller).
static void check_ids(const int32_t* ids, int64_t n, int64_t lo, int64_t V, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    NIB_CHECK_MSG(ids[i] >= lo && ids[i] < V, "{} id {} at {} outside [{}, {})", what, ids[i], i, lo, V);
}

template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, int64_t N, int64_t V, int64_t C) {
  check_ids(tokens, N, 0, V, "token");
  parallel_for(N, grain_for(C), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      int32_t tok = tokens[n];
      const T* row = wte + (int64_t)tok * C;
      T* o = out + n * C;
      for (int64_t c = 0; c < C; ++c) o[c] = row[c];
    }
  });
}

template <typename T>
void embedding_backward(T* dwte, const T* dout, const int32_t* tokens, int64_t N, int64_t V, int64_t C) {
  // Column-parallel: each thread owns a slice of channels and walks the tokens in order.
  parallel_for(C, grain_for(N), [&](int64_t cb, int64_t ce) {
    for (int64_t n = 0; n < N; ++n) {
      T* row = dwte + (int64_t)tokens[n] * C;
      const T* d = dout + n * C;
      for (int64_t c = cb; c < ce; ++c) row[c] += d[c];
    }
  });
}

// ---- RMSNorm -----------------------------------------------------------------------------
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* x, const T* w, int64_t R, int64_t C, double eps) {
  parallel_for(R, grain_for(C), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * C;
      T ss = 0;
      for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
      T s = T(1) / std::sqrt(ss / T(C) + T(eps));
      rstd[r] = s;
      T* o = out + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = w[c] * (xr[c] * s);
    }
  });
}

template <typename T>
void rmsnorm_backward(T* dx, T* dw, const T* dout, const T* x, const T* w, const T* rstd, int64_t R, int64_t C) {
  // y_c = w_c x_c s, s = (mean(x^2)+eps)^-1/2, ds/dx_c = -s^3 x_c / C. With g_c = dout_c w_c:
  // dx_c = s g_c - s^3 x_c (sum_j g_j x_j) / C.
  parallel_for(R, grain_for(C), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * C;
      const T* dr = dout + r * C;
      T s = rstd[r];
      T dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += dr[c] * w[c] * xr[c];
      T k = s * s * s * dot / T(C);
      T* o = dx + r * C;
      for (int64_t c = 0; c < C; ++c) o[c] = s * (dr[c] * w[c]) - k * xr[c];
    }
  });
  parallel_for(C, grain_for(R), [&](int64_t cb, int64_t ce) {
    for (int64_t r = 0; r < R; ++r) {
      const T* xr = x + r * C;
      const T* dr = dout + r * C;
      T s = rstd[r];
      for (int64_t c = cb; c < ce; ++c) dw[c] += dr[c] * (xr[c] * s);
    }
  });
}

// ---- RoPE ------------------------------------------------------------------------------------
template <typename T>
void rope_table(T* cos, T* sin, int64_t P, int64_t D, double theta) {
  NIB_CHECK(D % 2 == 0);
  int64_t half = D / 2;
  for (int64_t j = 0; j < half; ++j) {
    // transformers: inv_freq = 1 / base ** (arange(0, dim, 2).float() / dim), all in f32.
    float expo = static_cast<float>(2 * j) / static_cast<float>(D);
    float inv_freq = 1.0f / std::pow(static_cast<float>(theta), expo);
    for (int64_t p = 0; p < P; ++p) {
      float ang = static_cast<float>(p) * inv_freq;
      cos[p * half + j] = static_cast<T>(std::cos(ang));
      sin[p * half + j] = static_cast<T>(std::sin(ang));
    }
  }
}

template <typename T>
static void rope_apply(T* out, const T* x, const T* cos, const T* sin, const int32_t* positions, int64_t B,
                       int64_t Tn, int64_t H, int64_t D, T sign) {
  int64_t half = D / 2;
  parallel_for(B * Tn, grain_for(H * D), [&](int64_t b, int64_t e) {
    for (int64_t bt = b; bt < e; ++bt) {
      int64_t pos = positions ? positions[bt] : bt % Tn;
      const T* c = cos + pos * half;
      const T* s = sin + pos * half;
      for (int64_t h = 0; h < H; ++h) {
        const T* xi = x + (bt * H + h) * D;
        T* o = out + (bt * H + h) * D;
        for (int64_t j = 0; j < half; ++j) {
          T x1 = xi[j], x2 = xi[j + half];
          T sj = sign * s[j];
          o[j] = x1 * c[j] - x2 * sj;
          o[j + half] = x2 * c[j] + x1 * sj;
        }
      }
    }
  });
}

template <typename T>
void rope_forward(T* out, const T* x, const T* cos, const T* sin, const int32_t* positions, int64_t B, int64_t Tn,
                  int64_t H, int64_t D) {
  rope_apply(out, x, cos, sin, positions, B, Tn, H, D, T(1));
}

template <typename T>
void rope_backward(T* dx, const T* dout, const T* cos, const T* sin, const int32_t* positions, int64_t B, int64_t Tn,
                   int64_t H, int64_t D) {
  // The rotation is orthogonal: its transpose is the rotation by -angle.
  rope_apply(dx, dout, cos, sin, positions, B, Tn, H, D, T(-1));
}

// ---- SwiGLU --------------------------------------------------------------------------------
template <typename T>
void swiglu_forward(T* out, const T* gu, int64_t N, int64_t I) {
  parallel_for(N, grain_for(I), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* g = gu + n * 2 * I;
      const T* u = g + I;
      T* o = out + n * I;
      for (int64_t i = 0; i < I; ++i) {
        T sg = T(1) / (T(1) + std::exp(-g[i]));
        o[i] = g[i] * sg * u[i];
      }
    }
  });
}

template <typename T>
void swiglu_backward(T* dgu, const T* dout, const T* gu, int64_t N, int64_t I) {
  // silu(g) = g s(g); silu'(g) = s (1 + g (1 - s)).
  parallel_for(N, grain_for(I), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* g = gu + n * 2 * I;
      const T* u = g + I;
      const T* d = dout + n * I;
      T* dg = dgu + n * 2 * I;
      T* du = dg + I;
      for (int64_t i = 0; i < I; ++i) {
        T sg = T(1) / (T(1) + std::exp(-g[i]));
        T silu = g[i] * sg;
        dg[i] = d[i] * u[i] * (sg * (T(1) + g[i] * (T(1) - sg)));
        du[i] = d[i] * silu;
      }
    }
  });
}

// ---- cross-entropy with z-loss ---------------------------------------------------------------
template <typename T>
CrossEntropySums cross_entropy_forward(T* lse, T* token_ce, const T* logits, const int32_t* targets, int64_t N,
                                       int64_t V) {
  for (int64_t n = 0; n < N; ++n) NIB_CHECK_MSG(targets[n] < V, "target id {} at {} >= vocab {}", targets[n], n, V);
  parallel_for(N, grain_for(V), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* l = logits + n * V;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t v = 0; v < V; ++v) mx = l[v] > mx ? l[v] : mx;
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) sum += static_cast<double>(std::exp(l[v] - mx));
      T ls = mx + static_cast<T>(std::log(sum));
      lse[n] = ls;
      int32_t t = targets[n];
      if (token_ce) token_ce[n] = t >= 0 ? ls - l[t] : T(0);
    }
  });
  // Sums in row order (deterministic regardless of threads).
  CrossEntropySums s;
  for (int64_t n = 0; n < N; ++n) {
    int32_t t = targets[n];
    if (t < 0) continue;
    double ls = static_cast<double>(lse[n]);
    s.ce_sum += static_cast<double>(static_cast<T>(lse[n] - logits[n * V + t]));  // the per-token ce in T
    s.z_sum += ls * ls;
    s.n_valid += 1;
  }
  return s;
}

template <typename T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets, int64_t N, int64_t V,
                            double ce_scale, double z_scale) {
  parallel_for(N, grain_for(V), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* l = logits + n * V;
      T* d = dlogits + n * V;
      int32_t t = targets[n];
      if (t < 0) {
        for (int64_t v = 0; v < V; ++v) d[v] = T(0);
        continue;
      }
      T ls = lse[n];
      // d/dl_v [ce_scale (lse - l_t) + z_scale lse^2] = (ce_scale + 2 z_scale lse) p_v - ce_scale [v==t]
      T coef = static_cast<T>(ce_scale) + T(2) * static_cast<T>(z_scale) * ls;
      for (int64_t v = 0; v < V; ++v) d[v] = coef * std::exp(l[v] - ls);
      d[t] -= static_cast<T>(ce_scale);
    }
  });
}

template <typename T>
CrossEntropySums cross_entropy_forward_backward(T* dlogits, T* lse, T* token_ce, const T* logits,
                                                const int32_t* targets, int64_t N, int64_t V, double ce_scale,
                                                double z_scale) {
  NIB_CHECK(token_ce != nullptr);
  for (int64_t n = 0; n < N; ++n) NIB_CHECK_MSG(targets[n] < V, "target id {} at {} >= vocab {}", targets[n], n, V);
  parallel_for(N, grain_for(V), [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      const T* l = logits + n * V;
      T* d = dlogits + n * V;
      int32_t t = targets[n];
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t v = 0; v < V; ++v) mx = l[v] > mx ? l[v] : mx;
      const T lt = t >= 0 ? l[t] : T(0);  // read before d (which may alias l) is written
      double sum = 0;
      for (int64_t v = 0; v < V; ++v) {
        T ev = std::exp(l[v] - mx);
        d[v] = ev;
        sum += static_cast<double>(ev);
      }
      T ls = mx + static_cast<T>(std::log(sum));
      lse[n] = ls;
      token_ce[n] = t >= 0 ? ls - lt : T(0);
      if (t < 0) {
        for (int64_t v = 0; v < V; ++v) d[v] = T(0);
        continue;
      }
      // p_v = exp(l_v - mx) / sum = exp(l_v - lse) up to rounding; d = coef p - ce_scale [v == t]
      T coef = (static_cast<T>(ce_scale) + T(2) * static_cast<T>(z_scale) * ls) / static_cast<T>(sum);
      for (int64_t v = 0; v < V; ++v) d[v] *= coef;
      d[t] -= static_cast<T>(ce_scale);
    }
  });
  CrossEntropySums s;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    double ls = static_cast<double>(lse[n]);
    s.ce_sum += static_cast<double>(token_ce[n]);
    s.z_sum += ls * ls;
    s.n_valid += 1;
  }
  return s;
}

template <typename T>
void add_inplace(T* y, const T* x, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) y[i] += x[i];
  });
}

template <typename T>
void add(T* y, const T* a, const T* b, int64_t n) {
  parallel_for(n, 1 << 14, [&](int64_t bb, int64_t e) {
    for (int64_t i = bb; i < e; ++i) y[i] = a[i] + b[i];
  });
}

#define NIB_INSTANTIATE_NN_OPS(T)                                                                                  \
  template void embedding_forward<T>(T*, const int32_t*, const T*, int64_t, int64_t, int64_t);                    \
  template void embedding_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t);                   \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, double);                         \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t, int64_t);            \
  template void rope_table<T>(T*, T*, int64_t, int64_t, double);                                                  \
  template void rope_forward<T>(T*, const T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t,      \
                                int64_t);                                                                         \
  template void rope_backward<T>(T*, const T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t,     \
                                 int64_t);                                                                        \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t);                                                \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t);                                     \
  template CrossEntropySums cross_entropy_forward<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t);         \
  template void cross_entropy_backward<T>(T*, const T*, const T*, const int32_t*, int64_t, int64_t, double,       \
                                          double);                                                                \
  template CrossEntropySums cross_entropy_forward_backward<T>(T*, T*, T*, const T*, const int32_t*, int64_t,        \
                                                              int64_t, double, double);                           \
  template void add_inplace<T>(T*, const T*, int64_t);                                                            \
  template void add<T>(T*, const T*, const T*, int64_t);

NIB_INSTANTIATE_NN_OPS(float)
NIB_INSTANTIATE_NN_OPS(double)

}  // namespace nibble::cpu
