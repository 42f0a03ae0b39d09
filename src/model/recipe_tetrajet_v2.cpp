// tetrajet-v2 LinearRecipe and OsciReset (see recipe_tetrajet_v2.h): the six nvfp4-2level
// quantizers through the formats drivers (quantize_cpu.h, including the fused backward-operand
// op), MXFP8 outlier channels, OpenBLAS FP32 GEMMs. Every quantizer is one driver call on a
// zero-padded, BF16-rounded FP32 operand, so tests can recompose each step from the drivers.
#include "model/recipe_tetrajet_v2.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "backend/cpu/gemm.h"
#include "core/bits.h"
#include "core/check.h"
#include "core/parallel.h"
#include "formats/quantize_cpu.h"

namespace nibble::model {

namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

template <typename V>
void ensure(V& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

// dst (rows_p, cols_p) <- bf16(src[r, idx[j]]) for r < rows, j < idx.size() (idx null: j), else 0.
// src: (rows, K) f32.
void gather_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t K, const int64_t* idx,
                 int64_t n_idx, int64_t cols_p) {
  parallel_for(rows_p, grain(cols_p), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* d = dst + r * cols_p;
      if (r >= rows) {
        std::fill(d, d + cols_p, 0.0f);
        continue;
      }
      const float* s = src + r * K;
      for (int64_t j = 0; j < n_idx; ++j) d[j] = round_to_bf16(s[idx ? idx[j] : j]);
      std::fill(d + n_idx, d + cols_p, 0.0f);
    }
  });
}

// dst (cols, rows) <- src (rows, cols)^T, in 32 x 32 tiles (the 32 source rows of a tile stay in
// L1 while its 32 destination rows are written; reading whole columns strided missed the cache).
void transpose(float* dst, const float* src, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 32;
  const int64_t col_tiles = (cols + kTile - 1) / kTile;
  parallel_for(col_tiles, std::max<int64_t>(1, grain(rows) / kTile), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * kTile, c1 = std::min(cols, c0 + kTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
        const int64_t r1 = std::min(rows, r0 + kTile);
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
      }
    }
  });
}

// deq (rows, cols) <- nvfp4-2level quantize-dequantize of src (rows, cols) along cols (RTN or SR),
// codes/inner/outer kept in the given buffers (resized).
void twolevel_fake_quant(float* deq, std::vector<uint8_t>& codes, std::vector<uint8_t>& inner,
                         std::vector<float>& outer, const float* src, int64_t rows, int64_t cols,
                         const formats::SrKey* sr) {
  ensure(codes, rows * cols / 2);
  ensure(inner, rows * cols / 16);
  ensure(outer, rows * ((cols + 127) / 128));
  formats::nvfp4_2level_quantize_cpu(codes.data(), inner.data(), outer.data(), src, rows, cols, sr);
  formats::nvfp4_2level_dequantize_cpu(deq, codes.data(), inner.data(), outer.data(), rows, cols);
}

// deq (rows, cols) <- MXFP8 (E4M3, E8M0 rounded up) quantize-dequantize of src along cols (cols % 32 == 0).
void mxfp8_fake_quant(float* deq, const float* src, int64_t rows, int64_t cols) {
  std::vector<uint8_t> elems(static_cast<size_t>(rows * cols)), scales(static_cast<size_t>(rows * cols / 32));
  formats::mxfp8_quantize_cpu(elems.data(), scales.data(), src, rows, cols, formats::MxScaleRule::kRceil);
  formats::mxfp8_dequantize_cpu(deq, elems.data(), scales.data(), rows, cols);
}

// dw[n, idx[j]] += t[n, j] for n < N, j < n_idx; t: (N, ld) f32, dw: (N, K).
void scatter_add(float* dw, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx, int64_t ld) {
  parallel_for(N, grain(n_idx), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t j = 0; j < n_idx; ++j) dw[n * K + idx[j]] += t[n * ld + j];
  });
}

Tensor i64_tensor(const std::vector<int64_t>& v) {
  Tensor t(DType::kI64, Shape{static_cast<int64_t>(v.size())});
  if (!v.empty()) std::memcpy(t.data<int64_t>(), v.data(), v.size() * sizeof(int64_t));
  return t;
}

}  // namespace

// ---- OsciReset ------------------------------------------------------------------------------------

int64_t OsciReset::start_step() const {
  if (config_.start_step >= 0) return config_.start_step;
  if (total_steps_ <= 0) return -1;
  return static_cast<int64_t>(std::floor(config_.start_fraction * static_cast<double>(total_steps_)));
}

float OsciReset::threshold_score(float w, float sp) {
  if (!(sp > 0.0f)) return 0.0f;
  float v = std::fabs(w) / sp;
  if (!(v < 6.0f)) return 0.0f;
  uint32_t di = formats::e2m1_sr_index(v, 1.0f);  // u = 1: never rounds up -> the grid value below v
  float down = formats::e2m1_magnitude(di);
  float gap = di < 4u ? 0.5f : (di < 6u ? 1.0f : 2.0f);
  float d = std::min(v - down, down + gap - v);
  return d / gap;
}

int64_t OsciReset::on_step(float* w, int64_t N, int64_t K, int64_t step, const QuantFn& quant,
                           const std::vector<uint8_t>& eligible) {
  const int64_t n = N * K;
  NIB_CHECK(eligible.empty() || static_cast<int64_t>(eligible.size()) == n);
  int64_t resets = 0;
  if (snapshot_step_ >= 0 && step > snapshot_step_) {
    ensure(wq_, n);
    quant(wq_.data(), nullptr, w);
    const size_t m = index_.size();
    if (step <= snapshot_step_ + config_.window) {
      // accumulate |w_t - w_{t-1}| and |Q(w_t) - Q(w_{t-1})|
      parallel_for(static_cast<int64_t>(m), 4096, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          int64_t e = index_[i];
          dist_w_[i] += std::fabs(w[e] - w_prev_[i]);
          dist_q_[i] += std::fabs(wq_[e] - q_prev_[i]);
          w_prev_[i] = w[e];
          q_prev_[i] = wq_[e];
        }
      });
    } else {
      // decision at snapshot + window + 1: w <- Q(w) where risk = dist_Q / dist_W >= threshold
      const float thr = static_cast<float>(config_.threshold);
      for (size_t i = 0; i < m; ++i) {
        int64_t e = index_[i];
        if (!eligible.empty() && !eligible[e]) continue;
        float risk = dist_w_[i] > 0.0f ? dist_q_[i] / dist_w_[i] : 0.0f;
        if (risk >= thr) {
          w[e] = wq_[e];
          ++resets;
        }
      }
      resets_last_ = resets;
      resets_total_ += resets;
      ++decisions_;
      snapshot_step_ = -1;
      for (auto* v : {&w_prev_, &q_prev_, &dist_w_, &dist_q_, &wq_, &scale_}) std::vector<float>().swap(*v);
      std::vector<int64_t>().swap(index_);
    }
  }
  const int64_t start = start_step();
  if (snapshot_step_ < 0 && start >= 0 && step >= start && step % config_.period == 0) {
    const bool tracked = config_.variant == "tracked";
    ensure(wq_, n);
    if (tracked) ensure(scale_, n);
    quant(wq_.data(), tracked ? scale_.data() : nullptr, w);
    index_.clear();
    for (int64_t e = 0; e < n; ++e)
      if (eligible.empty() || eligible[e]) index_.push_back(e);
    if (tracked) {
      // keep the ceil(tracked_fraction * eligible) elements closest to a rounding threshold
      const int64_t keep = std::min<int64_t>(
          static_cast<int64_t>(index_.size()),
          static_cast<int64_t>(std::ceil(config_.tracked_fraction * static_cast<double>(index_.size()) - 1e-9)));
      std::vector<float> score(index_.size());
      for (size_t i = 0; i < index_.size(); ++i) score[i] = threshold_score(w[index_[i]], scale_[index_[i]]);
      std::vector<int64_t> order(index_.size());
      std::iota(order.begin(), order.end(), 0);
      auto better = [&](int64_t a, int64_t b) { return score[a] != score[b] ? score[a] > score[b] : a < b; };
      if (keep < static_cast<int64_t>(order.size())) std::nth_element(order.begin(), order.begin() + keep, order.end(), better);
      order.resize(static_cast<size_t>(keep));
      std::sort(order.begin(), order.end());
      for (size_t i = 0; i < order.size(); ++i) order[i] = index_[order[i]];
      index_.swap(order);
      std::vector<float>().swap(scale_);
    }
    const size_t m = index_.size();
    w_prev_.resize(m);
    q_prev_.resize(m);
    dist_w_.assign(m, 0.0f);
    dist_q_.assign(m, 0.0f);
    for (size_t i = 0; i < m; ++i) {
      w_prev_[i] = w[index_[i]];
      q_prev_[i] = wq_[index_[i]];
    }
    snapshot_step_ = step;
  }
  return resets;
}

void OsciReset::save(std::map<std::string, Tensor>& out) const {
  out["oscireset.counters"] = i64_tensor({snapshot_step_, resets_total_, decisions_});
  if (snapshot_step_ < 0) return;
  out["oscireset.index"] = i64_tensor(index_);
  const int64_t m = static_cast<int64_t>(index_.size());
  Tensor b(DType::kF32, Shape{4, m});
  float* p = b.data<float>();
  const std::vector<float>* parts[4] = {&w_prev_, &q_prev_, &dist_w_, &dist_q_};
  for (int r = 0; r < 4; ++r)
    if (m > 0) std::memcpy(p + r * m, parts[r]->data(), static_cast<size_t>(m) * sizeof(float));
  out["oscireset.buffers"] = b;
}

Status OsciReset::load(const std::map<std::string, Tensor>& in, int64_t numel) {
  auto it = in.find("oscireset.counters");
  if (it == in.end()) return Status::ok();
  const Tensor& c = it->second;
  if (c.dtype() != DType::kI64 || c.numel() != 3) return invalid_argument("oscireset state: 'oscireset.counters' must be I64 (3)");
  int64_t snap = c.data<int64_t>()[0];
  if (snap >= 0) {
    auto ii = in.find("oscireset.index");
    auto bi = in.find("oscireset.buffers");
    if (ii == in.end() || bi == in.end()) return invalid_argument("oscireset state: an open window needs 'oscireset.index' and 'oscireset.buffers'");
    const Tensor& ti = ii->second;
    const Tensor& tb = bi->second;
    const int64_t m = ti.numel();
    if (ti.dtype() != DType::kI64 || tb.dtype() != DType::kF32 || tb.numel() != 4 * m)
      return invalid_argument("oscireset state: index must be I64 (n) and buffers F32 (4, n)");
    const int64_t* ip = ti.data<int64_t>();
    for (int64_t i = 0; i < m; ++i)
      if (ip[i] < 0 || ip[i] >= numel || (i > 0 && ip[i] <= ip[i - 1]))
        return invalid_argument("oscireset state: index must be ascending element ids in [0, {})", numel);
    index_.assign(ip, ip + m);
    const float* p = tb.data<float>();
    std::vector<float>* parts[4] = {&w_prev_, &q_prev_, &dist_w_, &dist_q_};
    for (int r = 0; r < 4; ++r) parts[r]->assign(p + r * m, p + (r + 1) * m);
  } else {
    index_.clear();
    for (auto* v : {&w_prev_, &q_prev_, &dist_w_, &dist_q_}) v->clear();
  }
  snapshot_step_ = snap;
  resets_total_ = c.data<int64_t>()[1];
  decisions_ = c.data<int64_t>()[2];
  return Status::ok();
}

// ---- the recipe -------------------------------------------------------------------------------------

TetraJetV2LinearRecipe::TetraJetV2LinearRecipe(const RecipeConfig& config, const LinearInfo& info)
    : config_(config), info_(info), oscireset_(config.oscireset) {
  main_idx_.resize(static_cast<size_t>(info.K));
  std::iota(main_idx_.begin(), main_idx_.end(), 0);
}

void TetraJetV2LinearRecipe::set_outliers(std::vector<int64_t> channels) {
  std::sort(channels.begin(), channels.end());
  out_idx_ = std::move(channels);
  main_idx_.clear();
  size_t j = 0;
  for (int64_t k = 0; k < info_.K; ++k) {
    if (j < out_idx_.size() && out_idx_[j] == k) {
      ++j;
      continue;
    }
    main_idx_.push_back(k);
  }
  selected_ = true;
}

int64_t TetraJetV2LinearRecipe::select_outliers() {
  const int64_t K = info_.K;
  if (calib_calls_ == 0) {  // no calibration data (e.g. resumed past the window without state)
    set_outliers({});
    return 0;
  }
  const double c = config_.outliers.fraction * static_cast<double>(K);
  int64_t n = static_cast<int64_t>(std::ceil(c - 1e-9 * std::max(1.0, c)));
  n = std::min(K, round_up(n, config_.outliers.round_to));
  std::vector<int64_t> order(static_cast<size_t>(K));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return calib_sumsq_[a] > calib_sumsq_[b]; });
  order.resize(static_cast<size_t>(n));
  set_outliers(std::move(order));
  std::vector<double>().swap(calib_sumsq_);
  return n;
}

void TetraJetV2LinearRecipe::calibrate(const float* x, int64_t M, const LinearCall& call) {
  const OutlierConfig& oc = config_.outliers;
  if (!oc.enabled || selected_) return;
  if (call.step > oc.calibration_end) {
    select_outliers();
    return;
  }
  if (call.step < oc.calibration_start || !call.needs_backward) return;
  const int64_t K = info_.K;
  if (calib_sumsq_.empty()) calib_sumsq_.assign(static_cast<size_t>(K), 0.0);
  parallel_for(K, 16, [&](int64_t k0, int64_t k1) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = k0; k < k1; ++k) {
        double v = x[m * K + k];
        calib_sumsq_[k] += v * v;
      }
  });
  ++calib_calls_;
}

void TetraJetV2LinearRecipe::fake_quantize_weight(float* wq, float* scale, const float* w) const {
  const int64_t N = info_.N, K = info_.K;
  const int64_t nm = static_cast<int64_t>(main_idx_.size()), Km = round_up(nm, 16);
  const int64_t no = static_cast<int64_t>(out_idx_.size()), No = round_up(no, 32);
  std::vector<float> src(static_cast<size_t>(N * std::max(Km, No))), deq(src.size());
  if (nm > 0) {
    std::vector<uint8_t> codes, inner;
    std::vector<float> outer;
    gather_bf16(src.data(), w, N, N, K, main_idx_.data(), nm, Km);
    twolevel_fake_quant(deq.data(), codes, inner, outer, src.data(), N, Km, nullptr);
    const int64_t nob = (Km + 127) / 128;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < nm; ++j) {
        wq[n * K + main_idx_[j]] = deq[n * Km + j];
        if (scale)
          scale[n * K + main_idx_[j]] =
              formats::nvfp4_2level_block_scale(inner[n * (Km / 16) + j / 16], outer[n * nob + j / 128]);
      }
  }
  if (no > 0) {
    gather_bf16(src.data(), w, N, N, K, out_idx_.data(), no, No);
    mxfp8_fake_quant(deq.data(), src.data(), N, No);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < no; ++j) {
        wq[n * K + out_idx_[j]] = deq[n * No + j];
        if (scale) scale[n * K + out_idx_[j]] = 0.0f;
      }
  }
}

void TetraJetV2LinearRecipe::forward(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                                     const LinearCall& call) {
  NIB_CHECK_MSG(N == info_.N && K == info_.K, "tetrajet-v2: shape ({}, {}) differs from the layer's ({}, {})", N, K,
                info_.N, info_.K);
  calibrate(x, M, call);
  const int64_t Mp = round_up(M, 128), Np = round_up(N, 128);
  const int64_t nm = static_cast<int64_t>(main_idx_.size()), Km = round_up(nm, 16);
  const int64_t no = static_cast<int64_t>(out_idx_.size()), No = round_up(no, 32);
  const int64_t* midx = no > 0 ? main_idx_.data() : nullptr;  // identity gather without outliers
  M_ = M, N_ = N, K_ = K;
  w_saved_ = w;
  // Q1, Q2: nvfp4-2level RTN along K of the main channels (zero-padded rows Mp, Np).
  ensure(xs_, Mp * Km);
  ensure(ws_, Np * Km);
  ensure(xq_, Mp * Km);
  ensure(wq_, Np * Km);
  if (nm > 0) {
    gather_bf16(xs_.data(), x, M, Mp, K, midx, nm, Km);
    gather_bf16(ws_.data(), w, N, Np, K, midx, nm, Km);
    twolevel_fake_quant(xq_.data(), xc_, xi_, xo_, xs_.data(), Mp, Km, nullptr);
    twolevel_fake_quant(wq_.data(), wc_, wi_, wo_, ws_.data(), Np, Km, nullptr);
    cpu::matmul_nt(y, xq_.data(), wq_.data(), M, N, Km);
  } else {
    std::fill(y, y + M * N, 0.0f);
  }
  if (no > 0) {
    // outlier channels: MXFP8 along the gathered channels, Y += X̂_o Ŵ_o^T
    ensure(xos_, Mp * No);
    ensure(xoq_, Mp * No);
    ensure(woq_, N * No);
    gather_bf16(xos_.data(), x, M, Mp, K, out_idx_.data(), no, No);
    mxfp8_fake_quant(xoq_.data(), xos_.data(), Mp, No);
    std::vector<float> wos(static_cast<size_t>(N * No));
    gather_bf16(wos.data(), w, N, N, K, out_idx_.data(), no, No);
    mxfp8_fake_quant(woq_.data(), wos.data(), N, No);
    cpu::matmul_nt(y, xoq_.data(), woq_.data(), M, N, No, /*accumulate=*/true);
  }
  round_to_bf16_array(y, y, M * N);  // the GEMM writes BF16
}

void TetraJetV2LinearRecipe::backward(float* dx, float* dw, const float* dy, int64_t M, int64_t N, int64_t K,
                                      const LinearCall& call) {
  NIB_CHECK_MSG(M == M_ && N == N_ && K == K_ && w_saved_ != nullptr, "tetrajet-v2: backward without a matching forward");
  const int64_t Mp = round_up(M, 128), Np = round_up(N, 128);
  const int64_t nm = static_cast<int64_t>(main_idx_.size()), Km = round_up(nm, 16);
  const int64_t no = static_cast<int64_t>(out_idx_.size()), No = round_up(no, 32);
  const bool sr = config_.sr, rht = config_.rht, align = config_.alignment;
  const formats::SrKey k3{call.seed, linear_call_stream(call, kTetraStreamQ3)};
  const formats::SrKey k4{call.seed, linear_call_stream(call, kTetraStreamQ4)};
  const formats::SrKey k5{call.seed, linear_call_stream(call, kTetraStreamQ5)};
  const formats::SrKey k6{call.seed, linear_call_stream(call, kTetraStreamQ6)};
  const uint32_t sign_d = formats::rht_random_sign_mask(call.seed, linear_call_stream(call, kTetraStreamRhtDgrad));
  const uint32_t sign_w = formats::rht_random_sign_mask(call.seed, linear_call_stream(call, kTetraStreamRhtWgrad));
  std::vector<uint8_t> codes, inner;
  std::vector<float> outer;

  // dY (Mp, Np), BF16, zero-padded.
  std::vector<float> dyb(static_cast<size_t>(Mp * Np));
  gather_bf16(dyb.data(), dy, M, Mp, N, nullptr, N, Np);

  // ---- dgrad: dX (M,K) = Q3 (M,Np) · Q4 (K,Np)^T ----
  {
    std::vector<float> a(static_cast<size_t>(M * Np)), q3(a.size());
    if (rht) formats::rht16_rows_f32_cpu(a.data(), dyb.data(), M, Np, sign_d);
    else std::memcpy(a.data(), dyb.data(), a.size() * sizeof(float));
    twolevel_fake_quant(q3.data(), codes, inner, outer, a.data(), M, Np, sr ? &k3 : nullptr);
    std::vector<float> q4(static_cast<size_t>(K * Np));
    if (align && sr && rht && no == 0) {
      // fused: dequantize Ŵ (Np,K) -> transpose -> RHT along N -> SR requantize along N
      ensure(codes, K * Np / 2);
      ensure(inner, K * Np / 16);
      ensure(outer, K * (Np / 128));
      formats::nvfp4_2level_backward_operand_cpu(codes.data(), inner.data(), outer.data(), wc_.data(), wi_.data(),
                                                 wo_.data(), Np, K, sign_d, k4);
      formats::nvfp4_2level_dequantize_cpu(q4.data(), codes.data(), inner.data(), outer.data(), K, Np);
    } else {
      // source (Np, K): Ŵ rebuilt from both parts (alignment) or BF16 W (fresh quantization)
      std::vector<float> s(static_cast<size_t>(Np * K), 0.0f), t(static_cast<size_t>(K * Np));
      if (align) {
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t j = 0; j < nm; ++j) s[n * K + main_idx_[j]] = wq_[n * Km + j];
          for (int64_t j = 0; j < no; ++j) s[n * K + out_idx_[j]] = woq_[n * No + j];
        }
      } else {
        gather_bf16(s.data(), w_saved_, N, Np, K, nullptr, K, K);
      }
      transpose(t.data(), s.data(), Np, K);
      if (rht) formats::rht16_rows_f32_cpu(t.data(), t.data(), K, Np, sign_d);
      twolevel_fake_quant(q4.data(), codes, inner, outer, t.data(), K, Np, sr ? &k4 : nullptr);
    }
    cpu::matmul_nt(dx, q3.data(), q4.data(), M, K, Np);
    round_to_bf16_array(dx, dx, M * K);
  }

  // ---- wgrad: dW (N,K) += Q5 (N,Mp) · Q6 (K,Mp)^T ----
  std::vector<float> q5(static_cast<size_t>(Np * Mp));
  {
    std::vector<float> t(q5.size());
    transpose(t.data(), dyb.data(), Mp, Np);
    if (rht) formats::rht16_rows_f32_cpu(t.data(), t.data(), Np, Mp, sign_w);
    twolevel_fake_quant(q5.data(), codes, inner, outer, t.data(), Np, Mp, sr ? &k5 : nullptr);
  }
  if (nm > 0) {
    std::vector<float> q6(static_cast<size_t>(Km * Mp));
    if (align && sr && rht) {
      ensure(codes, Km * Mp / 2);
      ensure(inner, Km * Mp / 16);
      ensure(outer, Km * (Mp / 128));
      formats::nvfp4_2level_backward_operand_cpu(codes.data(), inner.data(), outer.data(), xc_.data(), xi_.data(),
                                                 xo_.data(), Mp, Km, sign_w, k6);
      formats::nvfp4_2level_dequantize_cpu(q6.data(), codes.data(), inner.data(), outer.data(), Km, Mp);
    } else {
      std::vector<float> t(q6.size());
      transpose(t.data(), align ? xq_.data() : xs_.data(), Mp, Km);
      if (rht) formats::rht16_rows_f32_cpu(t.data(), t.data(), Km, Mp, sign_w);
      twolevel_fake_quant(q6.data(), codes, inner, outer, t.data(), Km, Mp, sr ? &k6 : nullptr);
    }
    if (no == 0) {
      cpu::matmul_nt(dw, q5.data(), q6.data(), N, K, Mp, /*accumulate=*/true);
    } else {
      std::vector<float> part(static_cast<size_t>(N * Km));
      cpu::matmul_nt(part.data(), q5.data(), q6.data(), N, Km, Mp);
      scatter_add(dw, part.data(), N, K, main_idx_.data(), nm, Km);
    }
  }
  if (no > 0) {
    // outlier channels: X operand = MXFP8_RTN(RHT_w(X̂_o^T)) along tokens (aligned) or of X_o^T
    std::vector<float> t(static_cast<size_t>(No * Mp)), q(t.size()), part(static_cast<size_t>(N * No));
    transpose(t.data(), align ? xoq_.data() : xos_.data(), Mp, No);
    if (rht) formats::rht16_rows_f32_cpu(t.data(), t.data(), No, Mp, sign_w);
    mxfp8_fake_quant(q.data(), t.data(), No, Mp);
    cpu::matmul_nt(part.data(), q5.data(), q.data(), N, No, Mp);
    scatter_add(dw, part.data(), N, K, out_idx_.data(), no, No);
  }
}

void TetraJetV2LinearRecipe::after_optimizer_step(float* w, int64_t N, int64_t K, int64_t step) {
  if (!config_.oscireset.enabled) return;
  NIB_CHECK(N == info_.N && K == info_.K);
  const int64_t start = oscireset_.start_step();
  if (!oscireset_.active() && !(start >= 0 && step >= start && step % config_.oscireset.period == 0)) return;
  std::vector<uint8_t> eligible;  // FP4 elements only: outlier channels are excluded
  if (!out_idx_.empty()) {
    eligible.assign(static_cast<size_t>(N * K), 1);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c : out_idx_) eligible[n * K + c] = 0;
  }
  oscireset_.on_step(w, N, K, step, [this](float* wq, float* scale, const float* ww) { fake_quantize_weight(wq, scale, ww); },
                     eligible);
}

std::map<std::string, Tensor> TetraJetV2LinearRecipe::state() const {
  std::map<std::string, Tensor> s;
  if (config_.outliers.enabled) {
    s["outliers.selected"] = i64_tensor({selected_ ? 1 : 0});
    if (selected_) s["outliers.channels"] = i64_tensor(out_idx_);
    if (!selected_ && calib_calls_ > 0) {
      Tensor t(DType::kF32, Shape{info_.K});
      for (int64_t k = 0; k < info_.K; ++k) t.data<float>()[k] = static_cast<float>(calib_sumsq_[k]);
      s["outliers.calib_sumsq"] = t;
      s["outliers.calib_calls"] = i64_tensor({calib_calls_});
    }
  }
  if (config_.oscireset.enabled) oscireset_.save(s);
  return s;
}

Status TetraJetV2LinearRecipe::load_state(const std::map<std::string, Tensor>& state) {
  if (auto it = state.find("outliers.selected"); it != state.end()) {
    if (it->second.dtype() != DType::kI64 || it->second.numel() != 1)
      return invalid_argument("tetrajet-v2 state of '{}': 'outliers.selected' must be I64 (1)", info_.name);
    if (it->second.data<int64_t>()[0] != 0) {
      auto ct = state.find("outliers.channels");
      if (ct == state.end() || ct->second.dtype() != DType::kI64)
        return invalid_argument("tetrajet-v2 state of '{}': missing I64 'outliers.channels'", info_.name);
      const int64_t* p = ct->second.data<int64_t>();
      std::vector<int64_t> ch(p, p + ct->second.numel());
      for (size_t i = 0; i < ch.size(); ++i)
        if (ch[i] < 0 || ch[i] >= info_.K || (i > 0 && ch[i] <= ch[i - 1]))
          return invalid_argument("tetrajet-v2 state of '{}': outlier channels must be ascending ids in [0, {})",
                                  info_.name, info_.K);
      set_outliers(std::move(ch));
    } else {
      selected_ = false;
      out_idx_.clear();
      main_idx_.resize(static_cast<size_t>(info_.K));
      std::iota(main_idx_.begin(), main_idx_.end(), 0);
      auto st = state.find("outliers.calib_sumsq");
      auto cc = state.find("outliers.calib_calls");
      if (st != state.end() && cc != state.end()) {
        if (st->second.dtype() != DType::kF32 || st->second.numel() != info_.K || cc->second.dtype() != DType::kI64)
          return invalid_argument("tetrajet-v2 state of '{}': bad calibration tensors", info_.name);
        calib_sumsq_.assign(st->second.data<float>(), st->second.data<float>() + info_.K);
        calib_calls_ = cc->second.data<int64_t>()[0];
      }
    }
  }
  return oscireset_.load(state, info_.N * info_.K);
}

std::map<std::string, double> TetraJetV2LinearRecipe::stats() const {
  std::map<std::string, double> s;
  if (config_.outliers.enabled) {
    s["outliers.selected"] = selected_ ? 1 : 0;
    s["outliers.channels"] = static_cast<double>(out_idx_.size());
  }
  if (config_.oscireset.enabled) {
    s["oscireset.resets_total"] = static_cast<double>(oscireset_.resets_total());
    s["oscireset.resets_last"] = static_cast<double>(oscireset_.resets_last());
    s["oscireset.decisions"] = static_cast<double>(oscireset_.decisions());
    s["oscireset.tracked"] = static_cast<double>(oscireset_.tracked());
    s["oscireset.start_step"] = static_cast<double>(oscireset_.start_step());
  }
  return s;
}

Result<std::unique_ptr<LinearRecipe>> make_tetrajet_v2_recipe(const RecipeConfig& config, const LinearInfo& info) {
  if (config.bf16_last_blocks > 0)
    return invalid_argument("tetrajet-v2: 'bf16_last_blocks' is an nvfp4-nvidia option (TetraJet-v2 quantizes every block)");
  if (info.K % 16 != 0)
    return invalid_argument("tetrajet-v2: linear '{}' has shape ({}, {}); K must be a multiple of 16", info.name,
                            info.N, info.K);
  return std::unique_ptr<LinearRecipe>(new TetraJetV2LinearRecipe(config, info));
}

}  // namespace nibble::model
