// tetrajet-v2 LinearRecipe and OsciReset (see recipe_tetrajet_v2.h): the six nvfp4-2level
// quantizers as backend ops (the fused quantize + BF16 operand ops, plain and backward-operand),
// MXFP8 outlier channels, BF16 GEMMs. Every quantizer is one op on a zero-padded, BF16-rounded
// FP32 operand, so tests can recompose each step from the drivers. Only the quantized X̂, Ŵ (codes
// + scales) are kept between forward and backward; the backward operands' parts are skipped
// (Backend::operand_only); the rest lives in the model's LinearWorkspace, slots numbered where
// they are taken.
#include "model/recipe_tetrajet_v2.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/check.h"
#include "core/parallel.h"
#include "formats/nvfp4.h"
#include "formats/rht.h"

namespace nibble::model {

namespace {

using backend::QuantFormat;
using backend::QuantizedTensor;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

template <typename V>
void ensure(V& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

// deq (rows, cols) <- quantize-dequantize of src (rows, cols) along cols in `format` (RTN or SR),
// the quantized parts kept in q (returned).
QuantizedTensor fake_quant(backend::Backend& be, float* deq, backend::QuantizedBuffer& q, QuantFormat format,
                           const float* src, int64_t rows, int64_t cols, const formats::SrKey* sr) {
  QuantizedTensor t = q.view(be, format, rows, cols);
  be.quantize(t, src, sr);
  be.dequantize(deq, t);
  return t;
}

// y (rows, cols) bf16 operand <- quantize src (rows, cols) along cols in `format` (RTN or SR) into
// t (returned; its parts skipped where t is Backend::operand_only), the operand in the same pass.
QuantizedTensor quant_operand(backend::Backend& be, uint16_t* y, QuantizedTensor t, const float* src,
                              const formats::SrKey* sr) {
  be.quantize_operand(t, y, src, sr);
  return t;
}

// The backward operands' parts are not kept: only their BF16 operands are written.
QuantizedTensor operand_slot(backend::Backend& be, LinearWorkspace& ws, QuantFormat format, int64_t rows,
                             int64_t cols) {
  return backend::Backend::operand_only(ws.quantized(be, 0, format, rows, cols));
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

backend::Backend& TetraJetV2LinearRecipe::backend_or_cpu() const {
  return be_ != nullptr ? *be_ : backend::cpu_backend();
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
  idx_dirty_ = true;
}

void TetraJetV2LinearRecipe::upload_channels(backend::Backend& be) const {
  if (!idx_dirty_ && idx_be_ == &be) return;
  auto up = [&](backend::Buffer<int64_t>& dst, const std::vector<int64_t>& src) {
    int64_t* p = dst.ensure(be, static_cast<int64_t>(src.size()), "tetrajet-v2: channel ids");
    if (!src.empty()) be.copy_to_device(p, src.data(), src.size() * sizeof(int64_t));
  };
  up(main_idx_dev_, main_idx_);
  up(out_idx_dev_, out_idx_);
  idx_be_ = &be;
  idx_dirty_ = false;
}

std::vector<double> TetraJetV2LinearRecipe::calibration_sums_host() const {
  if (!calib_ready_) return calib_loaded_;
  // host round trip: the outlier selection and checkpoints read the sums on the host
  std::vector<double> h(static_cast<size_t>(info_.K));
  be_->copy_to_host(h.data(), calib_sumsq_.data(), h.size() * sizeof(double));
  return h;
}

int64_t TetraJetV2LinearRecipe::select_outliers() {
  const int64_t K = info_.K;
  if (calib_calls_ == 0) {  // no calibration data (e.g. resumed past the window without state)
    set_outliers({});
    return 0;
  }
  const std::vector<double> sums = calibration_sums_host();
  const double c = config_.outliers.fraction * static_cast<double>(K);
  int64_t n = static_cast<int64_t>(std::ceil(c - 1e-9 * std::max(1.0, c)));
  n = std::min(K, round_up(n, config_.outliers.round_to));
  std::vector<int64_t> order(static_cast<size_t>(K));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sums[a] > sums[b]; });
  order.resize(static_cast<size_t>(n));
  set_outliers(std::move(order));
  calib_sumsq_.reset();
  calib_ready_ = false;
  std::vector<double>().swap(calib_loaded_);
  return n;
}

void TetraJetV2LinearRecipe::calibrate(backend::Backend& be, const float* x, int64_t M, const LinearCall& call) {
  const OutlierConfig& oc = config_.outliers;
  if (!oc.enabled || selected_) return;
  if (call.step > oc.calibration_end) {
    select_outliers();
    return;
  }
  if (call.step < oc.calibration_start || !call.needs_backward) return;
  const int64_t K = info_.K;
  if (!calib_ready_) {
    double* sums = calib_sumsq_.ensure(be, K, "tetrajet-v2: calibration sums");
    if (!calib_loaded_.empty()) be.copy_to_device(sums, calib_loaded_.data(), static_cast<size_t>(K) * sizeof(double));
    else be.fill_zero(sums, static_cast<size_t>(K) * sizeof(double));
    std::vector<double>().swap(calib_loaded_);
    calib_ready_ = true;
  }
  be.column_sumsq_accumulate(calib_sumsq_.data(), x, M, K);
  ++calib_calls_;
}

void TetraJetV2LinearRecipe::fake_quantize_weight(float* wq, float* scale, const float* w) const {
  // host round trip: OsciReset keeps its per-element bookkeeping on the host; w, wq, scale are
  // host arrays, the quantization runs on the backend.
  backend::Backend& be = backend_or_cpu();
  upload_channels(be);
  const int64_t N = info_.N, K = info_.K;
  const int64_t nm = static_cast<int64_t>(main_idx_.size()), Km = round_up(nm, 16);
  const int64_t no = static_cast<int64_t>(out_idx_.size()), No = round_up(no, 32);
  float* wd = fq_w_.ensure(be, N * K, "tetrajet-v2: OsciReset weight");
  float* src = fq_src_.ensure(be, N * std::max(Km, No), "tetrajet-v2: OsciReset operand");
  float* deq = fq_deq_.ensure(be, N * std::max(Km, No), "tetrajet-v2: OsciReset Q(w)");
  be.copy_to_device(wd, w, static_cast<size_t>(N * K) * sizeof(float));
  std::vector<float> h;
  if (nm > 0) {
    be.gather_columns_bf16(src, wd, N, N, K, main_idx_dev_.data(), nm, Km);
    QuantizedTensor q = fake_quant(be, deq, fq_q_, QuantFormat::kNvfp4TwoLevel, src, N, Km, nullptr);
    h.resize(static_cast<size_t>(N * Km));
    be.copy_to_host(h.data(), deq, h.size() * sizeof(float));
    std::vector<uint8_t> inner;
    std::vector<float> outer;
    const int64_t nob = (Km + 127) / 128;
    if (scale) {
      inner.resize(static_cast<size_t>(N * (Km / 16)));
      outer.resize(static_cast<size_t>(N * nob));
      be.copy_to_host(inner.data(), q.scales, inner.size());
      be.copy_to_host(outer.data(), q.outer, outer.size() * sizeof(float));
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < nm; ++j) {
        wq[n * K + main_idx_[j]] = h[n * Km + j];
        if (scale)
          scale[n * K + main_idx_[j]] =
              formats::nvfp4_2level_block_scale(inner[n * (Km / 16) + j / 16], outer[n * nob + j / 128]);
      }
  }
  if (no > 0) {
    be.gather_columns_bf16(src, wd, N, N, K, out_idx_dev_.data(), no, No);
    fake_quant(be, deq, fq_q_, QuantFormat::kMxfp8, src, N, No, nullptr);
    h.resize(static_cast<size_t>(N * No));
    be.copy_to_host(h.data(), deq, h.size() * sizeof(float));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < no; ++j) {
        wq[n * K + out_idx_[j]] = h[n * No + j];
        if (scale) scale[n * K + out_idx_[j]] = 0.0f;
      }
  }
}

TetraJetV2LinearRecipe::Shapes TetraJetV2LinearRecipe::shapes(int64_t M, int64_t N) const {
  const int64_t nm = static_cast<int64_t>(main_idx_.size()), no = static_cast<int64_t>(out_idx_.size());
  return Shapes{round_up(M, 128), round_up(N, 128), nm, round_up(nm, 16), no, round_up(no, 32)};
}

void TetraJetV2LinearRecipe::prepare_forward(backend::Backend& be, const float* x, int64_t M, const LinearCall& call) {
  be_ = &be;
  calibrate(be, x, M, call);
  upload_channels(be);
}

void TetraJetV2LinearRecipe::forward(backend::Backend& be, float* y, const float* x, const float* w, int64_t M,
                                     int64_t N, int64_t K, const LinearCall& call) {
  NIB_CHECK_MSG(N == info_.N && K == info_.K, "tetrajet-v2: shape ({}, {}) differs from the layer's ({}, {})", N, K,
                info_.N, info_.K);
  prepare_forward(be, x, M, call);
  forward_prepared(be, y, x, w, M, N, K, call);
}

void TetraJetV2LinearRecipe::forward_operands(backend::Backend& be, uint16_t* xq, uint16_t* wq, uint16_t* xoq,
                                              uint16_t* woq, const float* x, const float* w, int64_t M, int64_t N,
                                              int64_t K, const LinearCall& call) {
  const auto [Mp, Np, nm, Km, no, No] = shapes(M, N);
  const int64_t* midx = no > 0 ? main_idx_dev_.data() : nullptr;  // identity gather without outliers
  M_ = M, N_ = N, K_ = K;
  x_saved_ = x;
  w_saved_ = w;
  LinearWorkspace& ws = workspace(call);
  // Q1, Q2: nvfp4-2level RTN along K of the main channels (zero-padded rows Mp, Np).
  if (nm > 0) {
    float* xs = ws.get<float>(be, 0, Mp * Km, "tetrajet-v2: bf16 X");
    float* wsrc = ws.get<float>(be, 1, Np * Km, "tetrajet-v2: bf16 W");
    be.gather_columns_bf16(xs, x, M, Mp, K, midx, nm, Km);
    be.gather_columns_bf16(wsrc, w, N, Np, K, midx, nm, Km);
    xhat_ = quant_operand(be, xq, xhat_buf_.view(be, QuantFormat::kNvfp4TwoLevel, Mp, Km), xs, nullptr);
    what_ = quant_operand(be, wq, what_buf_.view(be, QuantFormat::kNvfp4TwoLevel, Np, Km), wsrc, nullptr);
  }
  if (no > 0) {
    // outlier channels: MXFP8 along the gathered channels (exact BF16 operands)
    float* xos = ws.get<float>(be, 4, Mp * No, "tetrajet-v2: bf16 X outliers");
    float* wos = ws.get<float>(be, 5, N * No, "tetrajet-v2: bf16 W outliers");
    be.gather_columns_bf16(xos, x, M, Mp, K, out_idx_dev_.data(), no, No);
    xohat_ = quant_operand(be, xoq, xohat_buf_.view(be, QuantFormat::kMxfp8, Mp, No), xos, nullptr);
    be.gather_columns_bf16(wos, w, N, N, K, out_idx_dev_.data(), no, No);
    wohat_ = quant_operand(be, woq, wohat_buf_.view(be, QuantFormat::kMxfp8, N, No), wos, nullptr);
  }
}

void TetraJetV2LinearRecipe::forward_prepared(backend::Backend& be, float* y, const float* x, const float* w,
                                              int64_t M, int64_t N, int64_t K, const LinearCall& call) {
  const auto [Mp, Np, nm, Km, no, No] = shapes(M, N);
  LinearWorkspace& ws = workspace(call);
  uint16_t* xq = nm > 0 ? ws.get<uint16_t>(be, 2, Mp * Km, "tetrajet-v2: X^ operand") : nullptr;
  uint16_t* wq = nm > 0 ? ws.get<uint16_t>(be, 3, Np * Km, "tetrajet-v2: W^ operand") : nullptr;
  uint16_t* xoq = no > 0 ? ws.get<uint16_t>(be, 6, Mp * No, "tetrajet-v2: X^ outlier operand") : nullptr;
  uint16_t* woq = no > 0 ? ws.get<uint16_t>(be, 7, N * No, "tetrajet-v2: W^ outlier operand") : nullptr;
  forward_operands(be, xq, wq, xoq, woq, x, w, M, N, K, call);
  // Y = X̂_m Ŵ_m^T + X̂_o Ŵ_o^T
  if (nm > 0) be.matmul_bf16_nt(y, xq, wq, M, N, Km);
  else be.fill_zero(y, static_cast<size_t>(M * N) * sizeof(float));
  if (no > 0) be.matmul_bf16_nt(y, xoq, woq, M, N, No, /*alpha=*/nullptr, /*accumulate=*/true);
  be.round_to_bf16(y, y, M * N);  // the GEMM writes BF16
}

void TetraJetV2LinearRecipe::backward_operands(backend::Backend& be, uint16_t* q3, uint16_t* q4, uint16_t* q5,
                                               uint16_t* q6, uint16_t* q6o, const float* dy, int64_t M, int64_t N,
                                               int64_t K, const LinearCall& call) {
  NIB_CHECK_MSG(M == M_ && N == N_ && K == K_ && w_saved_ != nullptr && x_saved_ != nullptr,
                "tetrajet-v2: backward without a matching forward");
  be_ = &be;
  upload_channels(be);
  const auto [Mp, Np, nm, Km, no, No] = shapes(M, N);
  const int64_t* midx = no > 0 ? main_idx_dev_.data() : nullptr;
  const bool sr = config_.sr, rht = config_.rht, align = config_.alignment;
  const formats::SrKey k3{call.seed, linear_call_stream(call, kTetraStreamQ3)};
  const formats::SrKey k4{call.seed, linear_call_stream(call, kTetraStreamQ4)};
  const formats::SrKey k5{call.seed, linear_call_stream(call, kTetraStreamQ5)};
  const formats::SrKey k6{call.seed, linear_call_stream(call, kTetraStreamQ6)};
  const uint32_t sign_d = formats::rht_random_sign_mask(call.seed, linear_call_stream(call, kTetraStreamRhtDgrad));
  const uint32_t sign_w = formats::rht_random_sign_mask(call.seed, linear_call_stream(call, kTetraStreamRhtWgrad));
  const QuantFormat f2 = QuantFormat::kNvfp4TwoLevel;
  // Every slot is taken once, at its largest size in this call.
  LinearWorkspace& ws = workspace(call);
  // t: the staging operand of every quantizer below, large enough for each.
  float* t = ws.get<float>(be, 0, std::max({M * Np, Np * K, K * Np, Np * Mp, Km * Mp, No * Mp}), "tetrajet-v2: operand");
  float* dyb = ws.get<float>(be, 1, Mp * Np, "tetrajet-v2: bf16 dY");
  // Only the unfused paths need these (the default switches with no outliers take none):
  const bool fused_dgrad = align && sr && rht && no == 0, fused_wgrad = align && sr && rht;
  // src: Ŵ (Np,K) rebuilt for Q4; slot 4 is also backward()'s wgrad part (N, Km or No), at one size
  float* src = !fused_dgrad || no > 0 ? ws.get<float>(be, 4, std::max(Np * K, N * std::max(Km, No)),
                                                       "tetrajet-v2: W source / wgrad part")
                                      : nullptr;
  // the FP32 sources the unfused paths re-quantize: X̂ / Ŵ dequantized (alignment) or X re-gathered
  float* main_src = nm > 0 && (!fused_dgrad || !fused_wgrad)
                        ? ws.get<float>(be, 7, std::max(Mp, Np) * Km, "tetrajet-v2: main source")
                        : nullptr;
  float* out_src = no > 0 ? ws.get<float>(be, 8, std::max(Mp, N) * No, "tetrajet-v2: outlier source") : nullptr;

  // dY (Mp, Np), BF16, zero-padded.
  be.gather_columns_bf16(dyb, dy, M, Mp, N, nullptr, N, Np);

  // ---- dgrad operands: dX (M,K) = Q3 (M,Np) · Q4 (K,Np)^T ----
  if (rht) be.rht16_rows(t, dyb, M, Np, sign_d);
  else be.copy(t, dyb, static_cast<size_t>(M * Np) * sizeof(float));
  quant_operand(be, q3, operand_slot(be, ws, f2, M, Np), t, sr ? &k3 : nullptr);
  if (fused_dgrad) {
    // fused: dequantize Ŵ (Np,K) -> transpose -> RHT along N -> SR requantize along N
    QuantizedTensor o = operand_slot(be, ws, f2, K, Np);
    be.backward_operand_two_level_bf16(o, q4, what_, sign_d, k4);
  } else {
    // source (Np, K): Ŵ rebuilt from both parts (alignment) or BF16 W (fresh quantization)
    if (align) {
      be.fill_zero(src, static_cast<size_t>(Np * K) * sizeof(float));
      if (nm > 0) {
        be.dequantize(main_src, what_);  // (Np, Km)
        be.scatter_columns(src, main_src, N, K, main_idx_dev_.data(), nm, Km);
      }
      if (no > 0) {
        be.dequantize(out_src, wohat_);  // (N, No)
        be.scatter_columns(src, out_src, N, K, out_idx_dev_.data(), no, No);
      }
    } else {
      be.gather_columns_bf16(src, w_saved_, N, Np, K, nullptr, K, K);
    }
    be.transpose(t, src, Np, K);
    if (rht) be.rht16_rows(t, t, K, Np, sign_d);
    quant_operand(be, q4, operand_slot(be, ws, f2, K, Np), t, sr ? &k4 : nullptr);
  }

  // ---- wgrad operands: dW (N,K) += Q5 (N,Mp) · Q6 (K,Mp)^T ----
  be.transpose(t, dyb, Mp, Np);
  if (rht) be.rht16_rows(t, t, Np, Mp, sign_w);
  quant_operand(be, q5, operand_slot(be, ws, f2, Np, Mp), t, sr ? &k5 : nullptr);
  if (nm > 0) {
    if (fused_wgrad) {
      QuantizedTensor o = operand_slot(be, ws, f2, Km, Mp);
      be.backward_operand_two_level_bf16(o, q6, xhat_, sign_w, k6);
    } else {
      // X̂ (Mp, Km) dequantized (alignment) or the BF16 X re-gathered from the saved x
      if (align) be.dequantize(main_src, xhat_);
      else be.gather_columns_bf16(main_src, x_saved_, M, Mp, K, midx, nm, Km);
      be.transpose(t, main_src, Mp, Km);
      if (rht) be.rht16_rows(t, t, Km, Mp, sign_w);
      quant_operand(be, q6, operand_slot(be, ws, f2, Km, Mp), t, sr ? &k6 : nullptr);
    }
  }
  if (no > 0) {
    // outlier channels: X operand = MXFP8_RTN(RHT_w(X̂_o^T)) along tokens (aligned) or of X_o^T
    if (align) be.dequantize(out_src, xohat_);  // (Mp, No)
    else be.gather_columns_bf16(out_src, x_saved_, M, Mp, K, out_idx_dev_.data(), no, No);
    be.transpose(t, out_src, Mp, No);
    if (rht) be.rht16_rows(t, t, No, Mp, sign_w);
    quant_operand(be, q6o, operand_slot(be, ws, QuantFormat::kMxfp8, No, Mp), t, nullptr);
  }
}

void TetraJetV2LinearRecipe::backward(backend::Backend& be, float* dx, float* dw, const float* dy, int64_t M,
                                      int64_t N, int64_t K, const LinearCall& call) {
  const auto [Mp, Np, nm, Km, no, No] = shapes(M, N);
  LinearWorkspace& ws = workspace(call);
  uint16_t* q3 = ws.get<uint16_t>(be, 2, M * Np, "tetrajet-v2: Q3 operand");
  uint16_t* q4 = ws.get<uint16_t>(be, 3, K * Np, "tetrajet-v2: Q4 operand");
  uint16_t* q5 = ws.get<uint16_t>(be, 5, Np * Mp, "tetrajet-v2: Q5 operand");
  uint16_t* q6 = nm > 0 ? ws.get<uint16_t>(be, 6, Km * Mp, "tetrajet-v2: Q6 operand") : nullptr;
  uint16_t* q6o = no > 0 ? ws.get<uint16_t>(be, 9, No * Mp, "tetrajet-v2: Q6 outlier operand") : nullptr;
  // the wgrad partial products (N, Km or No) with outliers: slot 4, which backward_operands takes
  // at this same size for Ŵ's rebuild (done before these GEMMs)
  float* part = no > 0 ? ws.get<float>(be, 4, std::max(Np * K, N * std::max(Km, No)),
                                       "tetrajet-v2: W source / wgrad part")
                       : nullptr;
  backward_operands(be, q3, q4, q5, q6, q6o, dy, M, N, K, call);
  be.matmul_bf16_nt(dx, q3, q4, M, K, Np);
  be.round_to_bf16(dx, dx, M * K);
  if (nm > 0) {
    if (no == 0) {
      be.matmul_bf16_nt(dw, q5, q6, N, K, Mp, /*alpha=*/nullptr, /*accumulate=*/true);
    } else {
      be.matmul_bf16_nt(part, q5, q6, N, Km, Mp);
      be.scatter_add_columns(dw, part, N, K, main_idx_dev_.data(), nm, Km);
    }
  }
  if (no > 0) {
    be.matmul_bf16_nt(part, q5, q6o, N, No, Mp);
    be.scatter_add_columns(dw, part, N, K, out_idx_dev_.data(), no, No);
  }
}

// ---- grouped experts: each expert's operands into the layer's buffers, one grouped GEMM each ----
// The GEMM shapes must agree: every routed expert has as many outlier channels (experts select
// them at their own first forward after calibration, so they may differ for a while); otherwise
// each expert runs its own GEMMs. Workspace slots from kGroupedSlot (g0): forward g0 X̂ operands,
// g0+1 Ŵ operands (E,Np,Km), g0+2 X̂_o, g0+3 Ŵ_o (E,N,No); backward g0 Q3 (rows,Np), g0+1 Q4
// (E,K,Np), g0+2 Q5 blocks (Np, padded rows), g0+3 Q6 blocks, g0+4 Q6 outlier blocks, g0+5 the
// wgrad parts (E,N,Km or No).
std::optional<TetraJetV2LinearRecipe::Shapes> TetraJetV2LinearRecipe::common_shapes(const ExpertGroup& group,
                                                                                 const ExpertRowPlan& plan,
                                                                                 int64_t N) {
  std::optional<Shapes> common;
  for (int64_t e = 0; e < group.E; ++e) {
    if (plan.off[e + 1] == plan.off[e]) continue;
    const Shapes s = group_expert<TetraJetV2LinearRecipe>(group, e)->shapes(0, N);
    if (!common) common = s;
    else if (common->no != s.no) return std::nullopt;
  }
  return common ? common : group_expert<TetraJetV2LinearRecipe>(group, 0)->shapes(0, N);
}

void TetraJetV2LinearRecipe::forward_experts(backend::Backend& be, float* y, const float* x, const float* w,
                                             int64_t N, int64_t K, const ExpertGroup& group) {
  NIB_CHECK_MSG(N == info_.N && K == info_.K, "tetrajet-v2: shape ({}, {}) differs from the layer's ({}, {})", N, K,
                info_.N, info_.K);
  LinearWorkspace& ws = workspace(group.calls[0]);
  ExpertRowPlan& plan = expert_plan_;  // kept: its host arrays are reused, not reallocated
  if (!plan.build(be, group, 128, ws)) return LinearRecipe::forward_experts(be, y, x, w, N, K, group);
  const int64_t E = group.E, rows = plan.rows();
  auto expert = [&](int64_t e) { return group_expert<TetraJetV2LinearRecipe>(group, e); };
  for (int64_t e = 0; e < E; ++e) {  // calibration / outlier selection first: it decides the shapes
    const int64_t r0 = plan.off[e], m = plan.off[e + 1] - r0;
    if (m > 0) expert(e)->prepare_forward(be, x + r0 * K, m, group.calls[e]);
  }
  const std::optional<Shapes> common = common_shapes(group, plan, N);
  if (!common) {  // the experts' GEMM shapes differ: each runs its own
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = plan.off[e], m = plan.off[e + 1] - r0;
      if (m > 0)
        expert(e)->forward_prepared(be, y + r0 * N, x + r0 * K, w + e * group.w_stride, m, N, K, group.calls[e]);
    }
    return;
  }
  const int64_t Np = common->Np, nm = common->nm, Km = common->Km, no = common->no, No = common->No;
  constexpr int g0 = LinearWorkspace::kGroupedSlot;
  // X̂ operands (Mp_e, Km) each at row off[e]: an expert's zero pad rows run into the next expert's
  // rows, which that expert writes after it (in order); 128 spare rows take the last one's.
  uint16_t* xq = nm > 0 ? ws.get<uint16_t>(be, g0, (rows + 128) * Km, "tetrajet-v2 experts: X^ operands") : nullptr;
  uint16_t* wq = nm > 0 ? ws.get<uint16_t>(be, g0 + 1, E * Np * Km, "tetrajet-v2 experts: W^ operands") : nullptr;
  uint16_t* xoq =
      no > 0 ? ws.get<uint16_t>(be, g0 + 2, (rows + 128) * No, "tetrajet-v2 experts: X^o operands") : nullptr;
  uint16_t* woq = no > 0 ? ws.get<uint16_t>(be, g0 + 3, E * N * No, "tetrajet-v2 experts: W^o operands") : nullptr;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = plan.off[e], m = plan.off[e + 1] - r0;
    if (m == 0) continue;
    expert(e)->forward_operands(be, xq ? xq + r0 * Km : nullptr, wq ? wq + e * Np * Km : nullptr,
                                xoq ? xoq + r0 * No : nullptr, woq ? woq + e * N * No : nullptr, x + r0 * K,
                                w + e * group.w_stride, m, N, K, group.calls[e]);
  }
  if (nm > 0) be.grouped_matmul_bf16_nt(y, xq, wq, plan.off_dev, E, rows, N, Km, Np * Km);
  else be.fill_zero(y, static_cast<size_t>(rows * N) * sizeof(float));
  if (no > 0)
    be.grouped_matmul_bf16_nt(y, xoq, woq, plan.off_dev, E, rows, N, No, N * No, /*alpha=*/nullptr,
                              /*accumulate=*/true);
  be.round_to_bf16(y, y, rows * N);  // the GEMM writes BF16
}

void TetraJetV2LinearRecipe::backward_experts(backend::Backend& be, float* dx, float* dw, const float* dy,
                                              int64_t N, int64_t K, const ExpertGroup& group) {
  LinearWorkspace& ws = workspace(group.calls[0]);
  ExpertRowPlan& plan = expert_plan_;  // kept: its host arrays are reused, not reallocated
  if (!plan.build(be, group, 128, ws)) return LinearRecipe::backward_experts(be, dx, dw, dy, N, K, group);
  auto expert = [&](int64_t e) { return group_expert<TetraJetV2LinearRecipe>(group, e); };
  const std::optional<Shapes> common = common_shapes(group, plan, N);
  if (!common) return LinearRecipe::backward_experts(be, dx, dw, dy, N, K, group);
  const int64_t E = group.E, rows = plan.rows(), padded = plan.padded_rows();
  const int64_t Np = common->Np, nm = common->nm, Km = common->Km, no = common->no, No = common->No;
  constexpr int g0 = LinearWorkspace::kGroupedSlot;
  uint16_t* q3 = ws.get<uint16_t>(be, g0, rows * Np, "tetrajet-v2 experts: Q3 operands");
  uint16_t* q4 = ws.get<uint16_t>(be, g0 + 1, E * K * Np, "tetrajet-v2 experts: Q4 operands");
  uint16_t* q5 = ws.get<uint16_t>(be, g0 + 2, Np * padded, "tetrajet-v2 experts: Q5 blocks");
  uint16_t* q6 = nm > 0 ? ws.get<uint16_t>(be, g0 + 3, Km * padded, "tetrajet-v2 experts: Q6 blocks") : nullptr;
  uint16_t* q6o =
      no > 0 ? ws.get<uint16_t>(be, g0 + 4, No * padded, "tetrajet-v2 experts: Q6 outlier blocks") : nullptr;
  float* part = no > 0 ? ws.get<float>(be, g0 + 5, E * N * std::max(Km, No), "tetrajet-v2 experts: wgrad parts")
                       : nullptr;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = plan.off[e], p0 = plan.pad[e], m = plan.off[e + 1] - r0;
    if (m == 0) continue;
    expert(e)->backward_operands(be, q3 + r0 * Np, q4 + e * K * Np, q5 + Np * p0, q6 ? q6 + Km * p0 : nullptr,
                                 q6o ? q6o + No * p0 : nullptr, dy + r0 * N, m, N, K, group.calls[e]);
  }
  // dgrad: dX_e (m,K) = Q3_e (m,Np) · Q4_e (K,Np)^T
  be.grouped_matmul_bf16_nt(dx, q3, q4, plan.off_dev, E, rows, K, Np, K * Np);
  be.round_to_bf16(dx, dx, rows * K);
  // wgrad: dW_e (N,K) += Q5_e (N of Np, Mp_e) · Q6_e (Km, Mp_e)^T over expert e's padded rows
  auto scatter = [&](const float* parts, int64_t cols, bool outliers) {
    for (int64_t e = 0; e < E; ++e) {
      if (plan.off[e + 1] == plan.off[e]) continue;
      const auto& idx = outliers ? expert(e)->out_idx_dev_ : expert(e)->main_idx_dev_;
      be.scatter_add_columns(dw + e * group.w_stride, parts + e * N * cols, N, K, idx.data(), outliers ? no : nm, cols);
    }
  };
  if (nm > 0) {
    if (no == 0) {
      be.grouped_matmul_bf16_nt_blocks(dw, q5, q6, plan.pad_dev, E, padded, N, K, Np, Km, group.w_stride,
                                       /*alpha=*/nullptr, /*accumulate=*/true);
    } else {
      be.grouped_matmul_bf16_nt_blocks(part, q5, q6, plan.pad_dev, E, padded, N, Km, Np, Km, N * Km);
      scatter(part, Km, false);
    }
  }
  if (no > 0) {
    be.grouped_matmul_bf16_nt_blocks(part, q5, q6o, plan.pad_dev, E, padded, N, No, Np, No, N * No);
    scatter(part, No, true);
  }
}

void TetraJetV2LinearRecipe::after_optimizer_step(backend::Backend& be, float* w, int64_t N, int64_t K,
                                                  int64_t step) {
  if (!config_.oscireset.enabled) return;
  NIB_CHECK(N == info_.N && K == info_.K);
  const int64_t start = oscireset_.start_step();
  if (!oscireset_.active() && !(start >= 0 && step >= start && step % config_.oscireset.period == 0)) return;
  be_ = &be;
  std::vector<uint8_t> eligible;  // FP4 elements only: outlier channels are excluded
  if (!out_idx_.empty()) {
    eligible.assign(static_cast<size_t>(N * K), 1);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c : out_idx_) eligible[n * K + c] = 0;
  }
  // host round trip: OsciReset's per-element bookkeeping runs on a host copy of w; resets go back.
  const size_t bytes = static_cast<size_t>(N * K) * sizeof(float);
  w_host_.resize(static_cast<size_t>(N * K));
  be.copy_to_host(w_host_.data(), w, bytes);
  const int64_t resets = oscireset_.on_step(
      w_host_.data(), N, K, step,
      [this](float* wq, float* scale, const float* ww) { fake_quantize_weight(wq, scale, ww); }, eligible);
  if (resets > 0) be.copy_to_device(w, w_host_.data(), bytes);
}

std::map<std::string, Tensor> TetraJetV2LinearRecipe::state() const {
  std::map<std::string, Tensor> s;
  if (config_.outliers.enabled) {
    s["outliers.selected"] = i64_tensor({selected_ ? 1 : 0});
    if (selected_) s["outliers.channels"] = i64_tensor(out_idx_);
    if (!selected_ && calib_calls_ > 0) {
      const std::vector<double> sums = calibration_sums_host();
      Tensor t(DType::kF32, Shape{info_.K});
      for (int64_t k = 0; k < info_.K; ++k) t.data<float>()[k] = static_cast<float>(sums[k]);
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
      idx_dirty_ = true;
      auto st = state.find("outliers.calib_sumsq");
      auto cc = state.find("outliers.calib_calls");
      if (st != state.end() && cc != state.end()) {
        if (st->second.dtype() != DType::kF32 || st->second.numel() != info_.K || cc->second.dtype() != DType::kI64)
          return invalid_argument("tetrajet-v2 state of '{}': bad calibration tensors", info_.name);
        // Uploaded into the running sums at the next calibrated forward.
        calib_loaded_.assign(st->second.data<float>(), st->second.data<float>() + info_.K);
        calib_ready_ = false;
        calib_sumsq_.reset();
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
    // the weights OsciReset may move: the FP4 elements (outlier channels are excluded)
    s["oscireset.eligible"] = static_cast<double>(info_.N * (info_.K - static_cast<int64_t>(out_idx_.size())));
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
