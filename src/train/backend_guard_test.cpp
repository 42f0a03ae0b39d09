// Device-neutrality of the model, the recipes and the optimizer, checked on the CPU: a Backend
// that forwards every op to a CpuBackend and records any pointer argument outside the memory it
// allocated (host pointers where the contract wants backend memory: on CUDA those would be
// illegal addresses). Training steps of the tiny dense and MoE configs with every recipe, an
// eval forward, logits and a checkpoint-style download must pass only backend memory to ops,
// and give the same bits as the plain CPU backend; every attention call of these (non-fp32)
// recipes asks for BF16 precision.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/parallel.h"
#include "core/philox.h"
#include "model/transformer.h"
#include "train/optimizer.h"
#include "train/oscireset.h"

namespace nibble::train {
namespace {

using backend::QuantizedTensor;

// Forwards to a CpuBackend; every pointer an op receives must lie in a live allocation of this
// backend (host-side arguments by contract excepted), else the op's name is recorded.
class GuardBackend final : public backend::Backend {
 public:
  GuardBackend() : cpu_(backend::make_backend("cpu").value()) {}
  std::vector<std::string> violations;
  std::vector<backend::AttentionPrecision> attention_precisions;  // of every attention call, in order

  Device device() const override { return Device::kCPU; }
  std::string name() const override { return "guard(cpu)"; }
  bool supports(backend::Op op) const override { return cpu_->supports(op); }

  Result<void*> allocate(size_t bytes, const std::string& what) override {
    Result<void*> r = cpu_->allocate(bytes, what);
    if (r.is_ok()) live_[reinterpret_cast<uintptr_t>(r.value())] = std::max<size_t>(bytes, 1);
    return r;
  }
  void deallocate(void* p) override {
    live_.erase(reinterpret_cast<uintptr_t>(p));
    cpu_->deallocate(p);
  }
  void copy_to_device(void* dst, const void* host_src, size_t bytes) override {
    dev("copy_to_device", dst, bytes);
    cpu_->copy_to_device(dst, host_src, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    dev("copy_to_host", src, bytes);
    cpu_->copy_to_host(host_dst, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    dev("copy", dst, bytes), dev("copy", src, bytes);
    cpu_->copy(dst, src, bytes);
  }
  void fill_zero(void* dst, size_t bytes) override {
    dev("fill_zero", dst, bytes);
    cpu_->fill_zero(dst, bytes);
  }
  void synchronize() override {}

  void matmul_nt(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, bool acc,
                 bool bf16) override {
    all("matmul_nt", {y, x, w});
    cpu_->matmul_nt(y, x, w, M, N, K, acc, bf16);
  }
  void matmul_nn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool acc,
                 bool bf16) override {
    all("matmul_nn", {y, a, b});
    cpu_->matmul_nn(y, a, b, M, N, K, acc, bf16);
  }
  void matmul_tn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool acc,
                 bool bf16) override {
    all("matmul_tn", {y, a, b});
    cpu_->matmul_tn(y, a, b, M, N, K, acc, bf16);
  }
  void matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha, bool acc) override {
    all("matmul_bf16_nt", {y, a, b}), opt("matmul_bf16_nt", alpha);
    cpu_->matmul_bf16_nt(y, a, b, M, N, K, alpha, acc);
  }
  void matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha, bool acc) override {
    all("matmul_bf16_nn", {y, a, b}), opt("matmul_bf16_nn", alpha);
    cpu_->matmul_bf16_nn(y, a, b, M, N, K, alpha, acc);
  }
  void matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                      const float* alpha, bool acc) override {
    all("matmul_bf16_tn", {y, a, b}), opt("matmul_bf16_tn", alpha);
    cpu_->matmul_bf16_tn(y, a, b, M, N, K, alpha, acc);
  }
  void guided_overwrite_rows(QuantizedTensor& t, int64_t* stats, const float* x, const int32_t* rows, int64_t R,
                             const uint8_t* scales, const float* outer, const uint8_t* guide,
                             formats::GuidanceKind kind) override {
    q("guided_overwrite_rows", t), all("guided_overwrite_rows", {stats, x});
    if (R > 0) all("guided_overwrite_rows", {rows, scales, outer, guide});
    cpu_->guided_overwrite_rows(t, stats, x, rows, R, scales, outer, guide, kind);
  }
  void guidance_payload_rows(uint8_t* out, const QuantizedTensor& t, formats::GuidanceKind kind) override {
    q("guidance_payload_rows", t), all("guidance_payload_rows", {out});
    cpu_->guidance_payload_rows(out, t, kind);
  }
  void grouped_matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, const int64_t* off, int64_t G,
                              int64_t extent, int64_t N, int64_t K, int64_t b_stride, const float* alpha,
                              bool acc) override {
    all("grouped_matmul_bf16_nt", {y, a, b, off}), opt("grouped_matmul_bf16_nt", alpha);
    cpu_->grouped_matmul_bf16_nt(y, a, b, off, G, extent, N, K, b_stride, alpha, acc);
  }
  void grouped_matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* off, int64_t G,
                              int64_t extent, int64_t N, int64_t K, int64_t b_stride, const float* alpha,
                              bool acc) override {
    all("grouped_matmul_bf16_nn", {y, a, b, off}), opt("grouped_matmul_bf16_nn", alpha);
    cpu_->grouped_matmul_bf16_nn(y, a, b, off, G, extent, N, K, b_stride, alpha, acc);
  }
  void grouped_matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* off, int64_t G,
                              int64_t extent, int64_t M, int64_t N, int64_t y_stride, const float* alpha,
                              bool acc) override {
    all("grouped_matmul_bf16_tn", {y, a, b, off}), opt("grouped_matmul_bf16_tn", alpha);
    cpu_->grouped_matmul_bf16_tn(y, a, b, off, G, extent, M, N, y_stride, alpha, acc);
  }
  void grouped_matmul_bf16_nt_blocks(float* y, const uint16_t* a, const uint16_t* b, const int64_t* off, int64_t G,
                                     int64_t extent, int64_t M, int64_t N, int64_t a_rows, int64_t b_rows,
                                     int64_t y_stride, const float* alpha, bool acc) override {
    all("grouped_matmul_bf16_nt_blocks", {y, a, b, off}), opt("grouped_matmul_bf16_nt_blocks", alpha);
    cpu_->grouped_matmul_bf16_nt_blocks(y, a, b, off, G, extent, M, N, a_rows, b_rows, y_stride, alpha, acc);
  }
  void dequantize_bf16(uint16_t* y, const QuantizedTensor& in) override {
    q("dequantize_bf16", in), all("dequantize_bf16", {y});
    cpu_->dequantize_bf16(y, in);
  }
  void nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) override {
    all("nvfp4_te_alpha", {alpha, amax_a, amax_b});
    cpu_->nvfp4_te_alpha(alpha, amax_a, amax_b);
  }
  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V,
                         int64_t C) override {
    all("embedding_forward", {out, tokens, wte});
    cpu_->embedding_forward(out, tokens, wte, N, V, C);
  }
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V,
                          int64_t C) override {
    all("embedding_backward", {dwte, dout, tokens});
    cpu_->embedding_backward(dwte, dout, tokens, N, V, C);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                       double eps) override {
    all("rmsnorm_forward", {out, rstd, x, w});
    cpu_->rmsnorm_forward(out, rstd, x, w, R, C, eps);
  }
  void rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w, const float* rstd,
                        int64_t R, int64_t C) override {
    all("rmsnorm_backward", {dx, dw, dout, x, w, rstd});
    cpu_->rmsnorm_backward(dx, dw, dout, x, w, rstd, R, C);
  }
  void rope_forward(float* out, const float* x, const float* c, const float* s, const int32_t* pos, int64_t B,
                    int64_t Tn, int64_t H, int64_t D) override {
    all("rope_forward", {out, x, c, s}), opt("rope_forward", pos);
    cpu_->rope_forward(out, x, c, s, pos, B, Tn, H, D);
  }
  void rope_backward(float* dx, const float* dout, const float* c, const float* s, const int32_t* pos, int64_t B,
                     int64_t Tn, int64_t H, int64_t D) override {
    all("rope_backward", {dx, dout, c, s}), opt("rope_backward", pos);
    cpu_->rope_backward(dx, dout, c, s, pos, B, Tn, H, D);
  }
  void swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) override {
    all("swiglu_forward", {out, gu});
    cpu_->swiglu_forward(out, gu, N, I);
  }
  void swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) override {
    all("swiglu_backward", {dgu, dout, gu});
    cpu_->swiglu_backward(dgu, dout, gu, N, I);
  }
  void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                         int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                         backend::AttentionPrecision precision) override {
    all("attention_forward", {out, lse, q, k, v});
    attention_precisions.push_back(precision);
    cpu_->attention_forward(out, lse, q, k, v, B, Tn, H, Hkv, D, precision);
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out, const float* lse,
                          const float* q, const float* k, const float* v, int64_t B, int64_t Tn, int64_t H,
                          int64_t Hkv, int64_t D, backend::AttentionPrecision precision) override {
    all("attention_backward", {dq, dk, dv, dout, out, lse, q, k, v});
    attention_precisions.push_back(precision);
    cpu_->attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D, precision);
  }
  backend::CrossEntropySums cross_entropy_forward(float* lse, float* token_ce, const float* logits,
                                                  const int32_t* targets, int64_t N, int64_t V) override {
    all("cross_entropy_forward", {lse, logits, targets}), opt("cross_entropy_forward", token_ce);
    return cpu_->cross_entropy_forward(lse, token_ce, logits, targets, N, V);
  }
  backend::CrossEntropySums cross_entropy_forward_backward(float* dlogits, float* lse, float* token_ce,
                                                           const float* logits, const int32_t* targets, int64_t N,
                                                           int64_t V, double ce_scale, double z_scale) override {
    all("cross_entropy_forward_backward", {dlogits, lse, token_ce, logits, targets});
    return cpu_->cross_entropy_forward_backward(dlogits, lse, token_ce, logits, targets, N, V, ce_scale, z_scale);
  }
  void add_inplace(float* y, const float* x, int64_t n) override {
    all("add_inplace", {y, x});
    cpu_->add_inplace(y, x, n);
  }
  void add(float* y, const float* a, const float* b, int64_t n) override {
    all("add", {y, a, b});
    cpu_->add(y, a, b, n);
  }
  void copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) override {
    all("copy_2d", {dst, src});
    cpu_->copy_2d(dst, dst_ld, src, src_ld, rows, cols);
  }
  void moe_router_forward(float* probs, float* lse, int32_t* idx, float* w, const float* logits, const int32_t* forced,
                          int64_t N, int64_t E, int64_t k, bool norm) override {
    all("moe_router_forward", {probs, lse, idx, w, logits}), opt("moe_router_forward", forced);
    cpu_->moe_router_forward(probs, lse, idx, w, logits, forced, N, E, k, norm);
  }
  void moe_router_backward(float* dlogits, const float* dw, const float* probs, const float* lse, const int32_t* idx,
                           const float* w, const float* extra, double z, int64_t N, int64_t E, int64_t k,
                           bool renorm) override {
    all("moe_router_backward", {dlogits, dw, probs, lse, idx, w}), opt("moe_router_backward", extra);
    cpu_->moe_router_backward(dlogits, dw, probs, lse, idx, w, extra, z, N, E, k, renorm);
  }
  void moe_dispatch_plan(int64_t* offsets_host, int32_t* row_of_slot, int32_t* token_of_row, const int32_t* idx,
                         int64_t N, int64_t E, int64_t k) override {
    all("moe_dispatch_plan", {row_of_slot, token_of_row, idx});
    cpu_->moe_dispatch_plan(offsets_host, row_of_slot, token_of_row, idx, N, E, k);
  }
  void moe_dispatch_plan_device(int64_t* offsets, int32_t* row_of_slot, int32_t* token_of_row, const int32_t* idx,
                                int64_t N, int64_t E, int64_t k) override {
    all("moe_dispatch_plan_device", {offsets, row_of_slot, token_of_row, idx});
    cpu_->moe_dispatch_plan_device(offsets, row_of_slot, token_of_row, idx, N, E, k);
  }
  void moe_gather(float* xe, const float* x, const int32_t* tok, int64_t rows, int64_t C) override {
    all("moe_gather", {xe, x, tok});
    cpu_->moe_gather(xe, x, tok, rows, C);
  }
  void moe_gather_backward(float* dx, const float* dxe, const int32_t* ros, int64_t N, int64_t k,
                           int64_t C) override {
    all("moe_gather_backward", {dx, dxe, ros});
    cpu_->moe_gather_backward(dx, dxe, ros, N, k, C);
  }
  void moe_combine(float* out, const float* ye, const float* w, const int32_t* ros, int64_t N, int64_t k,
                   int64_t C) override {
    all("moe_combine", {out, ye, w, ros});
    cpu_->moe_combine(out, ye, w, ros, N, k, C);
  }
  void moe_combine_backward(float* dye, float* dw, const float* dout, const float* ye, const float* w,
                            const int32_t* ros, int64_t N, int64_t k, int64_t C) override {
    all("moe_combine_backward", {dye, dw, dout, ye, w, ros});
    cpu_->moe_combine_backward(dye, dw, dout, ye, w, ros, N, k, C);
  }
  double moe_accumulate_load(double* count_host, double* prob_host, const float* probs, const float* lse,
                             const int32_t* idx, int64_t N, int64_t E, int64_t k) override {
    all("moe_accumulate_load", {probs, lse, idx});
    return cpu_->moe_accumulate_load(count_host, prob_host, probs, lse, idx, N, E, k);
  }
  double sum_squares(const float* g, int64_t n, float s) override {
    all("sum_squares", {g});
    return cpu_->sum_squares(g, n, s);
  }
  void adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const backend::AdamWStep& s) override {
    all("adamw_update", {w, m, v, g});
    cpu_->adamw_update(w, m, v, g, n, s);
  }
  void scale(float* x, int64_t n, float s) override {
    all("scale", {x});
    cpu_->scale(x, n, s);
  }
  void round_to_bf16(float* dst, const float* src, int64_t n) override {
    all("round_to_bf16", {dst, src});
    cpu_->round_to_bf16(dst, src, n);
  }
  void to_bf16_bits(uint16_t* dst, const float* src, int64_t n) override {
    all("to_bf16_bits", {dst, src});
    cpu_->to_bf16_bits(dst, src, n);
  }
  void from_bf16_bits(float* dst, const uint16_t* src, int64_t n) override {
    all("from_bf16_bits", {dst, src});
    cpu_->from_bf16_bits(dst, src, n);
  }
  void gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                           const int64_t* idx, int64_t n_idx, int64_t cols_p) override {
    all("gather_columns_bf16", {dst, src}), opt("gather_columns_bf16", idx);
    cpu_->gather_columns_bf16(dst, src, rows, rows_p, src_cols, idx, n_idx, cols_p);
  }
  void scatter_add_columns(float* dw, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                           int64_t ld) override {
    all("scatter_add_columns", {dw, t, idx});
    cpu_->scatter_add_columns(dw, t, N, K, idx, n_idx, ld);
  }
  void scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                       int64_t ld) override {
    all("scatter_columns", {dst, t, idx});
    cpu_->scatter_columns(dst, t, N, K, idx, n_idx, ld);
  }
  void transpose(float* dst, const float* src, int64_t rows, int64_t cols) override {
    all("transpose", {dst, src});
    cpu_->transpose(dst, src, rows, cols);
  }
  void transpose(uint16_t* dst, const uint16_t* src, int64_t rows, int64_t cols) override {
    all("transpose", {dst, src});
    cpu_->transpose(dst, src, rows, cols);
  }
  void rht16_rows(float* y, const float* x, int64_t rows, int64_t cols, uint32_t mask) override {
    all("rht16_rows", {y, x});
    cpu_->rht16_rows(y, x, rows, cols, mask);
  }
  void column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K) override {
    all("column_sumsq_accumulate", {sums, x});
    cpu_->column_sumsq_accumulate(sums, x, M, K);
  }
  void quantize(QuantizedTensor& out, const float* x, const formats::SrKey* sr) override {
    q("quantize", out), all("quantize", {x});
    cpu_->quantize(out, x, sr);
  }
  void quantize(QuantizedTensor& out, const uint16_t* x, const formats::SrKey* sr) override {
    q("quantize", out), all("quantize", {x});
    cpu_->quantize(out, x, sr);
  }
  void dequantize(float* y, const QuantizedTensor& in) override {
    q("dequantize", in), all("dequantize", {y});
    cpu_->dequantize(y, in);
  }
  void quantize_te_rht_transpose(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K,
                                 const formats::SrKey* sr) override {
    q("quantize_te_rht_transpose", out), all("quantize_te_rht_transpose", {y_t, x});
    cpu_->quantize_te_rht_transpose(out, y_t, x, M, K, sr);
  }
  void backward_operand_two_level(QuantizedTensor& out, const QuantizedTensor& in, uint32_t mask,
                                  const formats::SrKey& sr) override {
    q("backward_operand_two_level", out), q("backward_operand_two_level", in);
    cpu_->backward_operand_two_level(out, in, mask, sr);
  }

 private:
  bool inside(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = live_.upper_bound(a);
    if (it == live_.begin()) return false;
    --it;
    return a < it->first + it->second;
  }
  void dev(const char* op, const void* p, size_t bytes) {
    if (bytes > 0 && !inside(p)) violations.push_back(op);
  }
  void opt(const char* op, const void* p) {
    if (p != nullptr && !inside(p)) violations.push_back(op);
  }
  void all(const char* op, std::initializer_list<const void*> ps) {
    for (const void* p : ps)
      if (!inside(p)) violations.push_back(op);
  }
  void q(const char* op, const QuantizedTensor& t) { all(op, {t.codes, t.scales}), opt(op, t.outer); }

  std::unique_ptr<backend::Backend> cpu_;
  std::map<uintptr_t, size_t> live_;  // allocation start -> bytes
};

model::ModelConfig load_config(const char* file) {
  std::ifstream in(std::string(NIBBLE_SOURCE_DIR) + "/configs/" + file);
  EXPECT_TRUE(in.good()) << file;
  model::ModelConfig cfg = model::parse_model_config(nlohmann::json::parse(in)).value();
  cfg.vocab_size = 512;
  cfg.num_hidden_layers = 2;
  return cfg;
}

struct Outputs {
  std::vector<double> losses;
  std::vector<float> values, logits, token_ce;
  std::vector<int32_t> routes;
};

// Three optimizer steps, then an eval forward with per-token CE, logits and recorded routes.
Outputs run(backend::Backend& be, const model::ModelConfig& cfg, const model::RecipeConfig& rc) {
  Outputs r;
  auto m = model::Model::create(cfg, rc, &be).value();
  m->init_weights(5);
  set_recipe_total_steps(*m, 3);
  AdamW opt(AdamWConfig{}, &be);
  std::vector<ParamView> views;
  for (auto& p : m->param_refs()) views.push_back({p.name, p.value, p.grad, p.numel, p.weight_decay});
  const int64_t B = 2, T = 32, N = B * T;
  PhiloxStream rng(4, 9);
  std::vector<int32_t> tok(N), tgt(N);
  for (int s = 0; s < 3; ++s) {
    for (int64_t i = 0; i < N; ++i) {
      tok[i] = static_cast<int32_t>(rng.next_below(cfg.vocab_size));
      tgt[i] = i % 5 == 4 ? -100 : static_cast<int32_t>(rng.next_below(cfg.vocab_size));
    }
    m->set_step(s, 3);
    m->zero_grad();
    r.losses.push_back(m->forward_backward(tok.data(), tgt.data(), B, T, model::LossOptions{1e-4}).loss);
    GradNorm gn = global_grad_norm(views, 1.0, 1.0f, be);
    EXPECT_TRUE(opt.step(views, 1e-3, gn.clip_scale).is_ok());
    recipe_after_optimizer_step(*m, s);
  }
  r.token_ce.resize(N);
  r.routes.resize(static_cast<size_t>(std::max<int64_t>(m->num_moe_layers(), 1) * N * cfg.num_experts_per_tok));
  model::RoutingIO io;
  io.record = r.routes.data();
  r.losses.push_back(m->forward_loss(tok.data(), tgt.data(), B, T, {}, io, r.token_ce.data()).loss);
  io.forced = r.routes.data();
  io.record = nullptr;
  r.losses.push_back(m->forward_loss(tok.data(), tgt.data(), B, T, {}, io).loss);
  r.logits.resize(static_cast<size_t>(N * cfg.vocab_size));
  m->forward_logits(r.logits.data(), tok.data(), B, T);
  r.values.resize(m->num_params());
  m->download_parameters(r.values.data());
  return r;
}

TEST(BackendGuard, OpsSeeOnlyBackendMemoryAndTheBitsOfTheCpuBackend) {
  set_num_threads(1);
  const char* recipes[] = {
      R"({"name": "bf16"})", R"({"name": "nvfp4-nvidia"})",
      R"({"name": "tetrajet-v2", "alignment": false, "sr": false, "outcontrol": {"rht": false}})",
      R"({"name": "tetrajet-v2", "outcontrol": {"rht": true, "outliers": {"enabled": true, "fraction": 0.1,
          "round_to": 16, "calibration_start": 0, "calibration_end": 0}},
          "oscireset": {"enabled": true, "threshold": 1.0, "window": 1, "period": 2, "start_step": 0}})"};
  for (const char* file : {"tiny-dense.json", "tiny-moe.json"}) {
    const model::ModelConfig cfg = load_config(file);
    for (const char* rj : recipes) {
      SCOPED_TRACE(std::string(file) + " " + rj);
      const model::RecipeConfig rc = model::parse_recipe_config(nlohmann::json::parse(rj)).value();
      GuardBackend guard;
      Outputs g = run(guard, cfg, rc);
      std::string seen;
      for (const std::string& v : guard.violations)
        if (seen.find(v) == std::string::npos) seen += v + " ";
      EXPECT_TRUE(guard.violations.empty()) << guard.violations.size() << " host pointers passed to: " << seen;
      // none of these recipes is fp32: the model asks for BF16 attention in every call
      EXPECT_FALSE(guard.attention_precisions.empty());
      for (const backend::AttentionPrecision p : guard.attention_precisions)
        EXPECT_EQ(p, backend::AttentionPrecision::kBf16);
      Outputs c = run(backend::cpu_backend(), cfg, rc);
      EXPECT_EQ(0, std::memcmp(g.losses.data(), c.losses.data(), g.losses.size() * sizeof(double)));
      EXPECT_EQ(0, std::memcmp(g.values.data(), c.values.data(), g.values.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(g.logits.data(), c.logits.data(), g.logits.size() * sizeof(float)));
      EXPECT_EQ(0, std::memcmp(g.token_ce.data(), c.token_ce.data(), g.token_ce.size() * sizeof(float)));
      EXPECT_EQ(g.routes, c.routes);
    }
  }
}

}  // namespace
}  // namespace nibble::train
