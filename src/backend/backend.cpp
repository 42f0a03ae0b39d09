// The device-neutral parts of the backend seam (backend.h): op and format names, require(),
// the byte counts of quantized operands and QuantizedBuffer views, and the composed defaults of
// the fused quantize + BF16 operand ops (the CPU reference). The registry and the CPU
// backend live in backend/cpu/cpu_backend.cpp (a layer above), so that linking the registry
// always links the CPU backend too.
#include "backend/backend.h"

#include "backend/kv_page_codec.h"

namespace nibble::backend {

const char* quant_format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kNvfp4Te: return "nvfp4-te";
    case QuantFormat::kNvfp4Te2d: return "nvfp4-te-2d";
    case QuantFormat::kNvfp4TwoLevel: return "nvfp4-2level";
    case QuantFormat::kMxfp8: return "mxfp8";
  }
  return "?";
}

const char* op_name(Op op) {
  static const char* const names[] = {"gemm",          "embedding",       "rmsnorm",
                                      "rope",          "swiglu",          "attention",
                                      "cross_entropy", "elementwise",     "moe_routing",
                                      "adamw",         "quantize_nvfp4_te", "quantize_nvfp4_2level",
                                      "quantize_mxfp8", "rht16",          "backward_operand_2level",
                                      "paged_kv_cache", "nvfp4_weight_gemm", "grouped_gemm",
                                      "trace_guided_rows", "greedy_rows"};
  static_assert(sizeof(names) / sizeof(names[0]) == static_cast<size_t>(Op::kCount));
  const auto i = static_cast<size_t>(op);
  return i < static_cast<size_t>(Op::kCount) ? names[i] : "?";
}

void Backend::require(Op op) const {
  NIB_CHECK_MSG(supports(op), "backend '{}' does not support op '{}'", name(), op_name(op));
}

const char* kv_page_format_name(KvPageFormat f) {
  switch (f) {
    case KvPageFormat::kBf16: return "bf16";
    case KvPageFormat::kF32: return "f32";
    case KvPageFormat::kFp8: return "fp8";
    case KvPageFormat::kNvfp4: return "nvfp4";
  }
  return "?";
}
int64_t kv_token_bytes(KvPageFormat f, int64_t Hkv, int64_t D) { return kv::token_layout(f, Hkv, D).bytes; }

// Backends without the paged KV-cache ops (supports(Op::kPagedKvCache) is false) fail by name.
void Backend::kv_cache_write(void*, void*, KvPageFormat, const float*, const float*, const int32_t*, int64_t,
                             int64_t, int64_t) {
  require(Op::kPagedKvCache);
  NIB_CHECK_MSG(false, "backend '{}' claims op 'paged_kv_cache' but does not override kv_cache_write", name());
}
void Backend::paged_attention(float*, const float*, const void*, const void*, KvPageFormat, const int32_t*, int64_t,
                              const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t, AttentionPrecision) {
  require(Op::kPagedKvCache);
  NIB_CHECK_MSG(false, "backend '{}' claims op 'paged_kv_cache' but does not override paged_attention", name());
}

void Backend::matmul_nt_nvfp4_weight(float*, const float*, const QuantizedTensor&, int64_t) {
  require(Op::kNvfp4WeightGemm);
  NIB_CHECK_MSG(false, "backend '{}' claims op 'nvfp4_weight_gemm' but does not override matmul_nt_nvfp4_weight",
                name());
}

void Backend::grouped_matmul_nt_nvfp4_weight(float*, const float*, const QuantizedTensor&, const int64_t*, int64_t,
                                             int64_t) {
  require(Op::kNvfp4WeightGemm);
  NIB_CHECK_MSG(false,
                "backend '{}' claims op 'nvfp4_weight_gemm' but does not override grouped_matmul_nt_nvfp4_weight",
                name());
}

void Backend::guided_overwrite_rows(QuantizedTensor&, int64_t*, const float*, const int32_t*, int64_t, const uint8_t*,
                                    const float*, const uint8_t*, formats::GuidanceKind) {
  require(Op::kTraceGuidedRows);
  NIB_CHECK_MSG(false, "backend '{}' claims op 'trace_guided_rows' but does not override guided_overwrite_rows",
                name());
}

void Backend::greedy_rows(int32_t*, double*, const float*, int64_t, int64_t) {
  require(Op::kGreedyRows);
  NIB_CHECK_MSG(false, "backend '{}' claims op 'greedy_rows' but does not override it", name());
}

void Backend::guidance_payload_rows(uint8_t*, const QuantizedTensor&, formats::GuidanceKind) {
  require(Op::kTraceGuidedRows);
  NIB_CHECK_MSG(false, "backend '{}' claims op 'trace_guided_rows' but does not override guidance_payload_rows",
                name());
}

// ---- fused quantize + BF16 operand: the composed reference ----------------------------------------

namespace {

// The parts a caller skipped, for the duration of one composed op: in backend memory (allocate())
// or, where the backend's memory is the host's, in plain host vectors.
struct SkippedParts {
  QuantizedBuffer in_backend;
  std::vector<uint8_t> codes, scales;
  std::vector<float> outer;
};

// The QuantizedTensor the unfused ops write: `out` itself, or `out` with its skipped parts (codes
// and scales; a 2-level outer) in `parts`; out.outer, where set, is kept (the TE amax).
QuantizedTensor with_all_parts(Backend& be, bool host, const QuantizedTensor& out, SkippedParts& parts,
                               const char* op) {
  NIB_CHECK_MSG((out.codes == nullptr) == (out.scales == nullptr), "{}: codes and scales are written or skipped together",
                op);
  const bool te = out.format == QuantFormat::kNvfp4Te || out.format == QuantFormat::kNvfp4Te2d;
  NIB_CHECK_MSG(!te || out.outer != nullptr, "{}: {} needs out.outer (the amax)", op, quant_format_name(out.format));
  const int64_t n_outer = QuantizedTensor::outer_count(out.format, out.rows, out.cols);
  QuantizedTensor q = out;
  if (out.codes != nullptr && (out.outer != nullptr || n_outer == 0)) return q;
  if (!host) {
    const QuantizedTensor v = parts.in_backend.view(be, out.format, out.rows, out.cols);
    if (q.codes == nullptr) q.codes = v.codes, q.scales = v.scales;
    if (q.outer == nullptr) q.outer = v.outer;
    return q;
  }
  if (q.codes == nullptr) {
    parts.codes.resize(static_cast<size_t>(QuantizedTensor::code_bytes(out.format, out.rows, out.cols)));
    parts.scales.resize(static_cast<size_t>(QuantizedTensor::scale_bytes(out.format, out.rows, out.cols)));
    q.codes = parts.codes.data(), q.scales = parts.scales.data();
  }
  if (q.outer == nullptr && n_outer > 0) {
    parts.outer.resize(static_cast<size_t>(n_outer));
    q.outer = parts.outer.data();
  }
  return q;
}

}  // namespace

void Backend::quantize_operand(QuantizedTensor& out, uint16_t* y, const float* x, const formats::SrKey* sr) {
  SkippedParts parts;
  QuantizedTensor q = with_all_parts(*this, host_memory_scratch(), out, parts, "quantize_operand");
  quantize(q, x, sr);
  dequantize_bf16(y, q);
}

void Backend::quantize_operand(QuantizedTensor& out, uint16_t* y, const uint16_t* x_bf16, const formats::SrKey* sr) {
  SkippedParts parts;
  QuantizedTensor q = with_all_parts(*this, host_memory_scratch(), out, parts, "quantize_operand");
  quantize(q, x_bf16, sr);
  dequantize_bf16(y, q);
}

void Backend::quantize_te_rht_transpose_operand(QuantizedTensor& out, uint16_t* y, uint16_t* y_t, const uint16_t* x,
                                                int64_t M, int64_t K, const formats::SrKey* sr) {
  SkippedParts parts;
  QuantizedTensor q = with_all_parts(*this, host_memory_scratch(), out, parts, "quantize_te_rht_transpose_operand");
  quantize_te_rht_transpose(q, y_t, x, M, K, sr);
  dequantize_bf16(y, q);
}

void Backend::backward_operand_two_level_bf16(QuantizedTensor& out, uint16_t* y, const QuantizedTensor& in,
                                              uint32_t sign_mask, const formats::SrKey& sr) {
  SkippedParts parts;
  QuantizedTensor q = with_all_parts(*this, host_memory_scratch(), out, parts, "backward_operand_two_level_bf16");
  backward_operand_two_level(q, in, sign_mask, sr);
  dequantize_bf16(y, q);
}

// ---- cross-entropy sums in backend memory: the host-returning ops and a copy --------------------

namespace {
void copy_sums_in(Backend& be, double* sums, const CrossEntropySums& s) {
  const double host[4] = {s.ce_sum, s.z_sum, static_cast<double>(s.n_valid), 0.0};
  be.copy_to_device(sums, host, sizeof(host));
}
}  // namespace

void Backend::cross_entropy_forward_sums(double* sums, float* lse, float* token_ce, const float* logits,
                                         const int32_t* targets, int64_t N, int64_t V) {
  copy_sums_in(*this, sums, cross_entropy_forward(lse, token_ce, logits, targets, N, V));
}

void Backend::cross_entropy_forward_backward_sums(double* sums, float* dlogits, float* lse, float* token_ce,
                                                  const float* logits, const int32_t* targets, int64_t N, int64_t V,
                                                  double ce_scale, double z_scale) {
  copy_sums_in(*this, sums,
               cross_entropy_forward_backward(dlogits, lse, token_ce, logits, targets, N, V, ce_scale, z_scale));
}

// ---- multi-tensor optimizer ops: the per-range reference ----------------------------------------
void Backend::sum_squares_chunks_multi(double* partials_host, const float* const* g, const int64_t* n, int64_t count,
                                       int64_t chunk, float grad_scale) {
  for (int64_t r = 0; r < count; ++r) {
    if (n[r] <= 0) continue;
    sum_squares_chunks(partials_host, g[r], n[r], chunk, grad_scale);
    partials_host += (n[r] + chunk - 1) / chunk;
  }
}
void Backend::adamw_update_multi(const AdamWRange* ranges, int64_t count, const AdamWStep& s) {
  AdamWStep one = s;
  for (int64_t r = 0; r < count; ++r) {
    if (ranges[r].n <= 0) continue;
    one.weight_decay = ranges[r].weight_decay ? s.weight_decay : 0.0;
    adamw_update(ranges[r].w, ranges[r].m, ranges[r].v, ranges[r].g, ranges[r].n, one);
  }
}

// Backends without the grouped GEMMs (supports(Op::kGroupedGemm) is false) fail by name.
namespace {
[[noreturn]] void missing_override(const Backend& be, const char* method) {
  be.require(Op::kGroupedGemm);
  NIB_CHECK_MSG(false, "backend '{}' claims op 'grouped_gemm' but does not override {}", be.name(), method);
  throw std::logic_error("unreachable");
}
}  // namespace
void Backend::grouped_matmul_bf16_nt(float*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, const float*, bool) {
  missing_override(*this, "grouped_matmul_bf16_nt");
}
void Backend::grouped_matmul_bf16_nn(float*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, const float*, bool) {
  missing_override(*this, "grouped_matmul_bf16_nn");
}
void Backend::grouped_matmul_bf16_tn(float*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                                     int64_t, int64_t, int64_t, const float*, bool) {
  missing_override(*this, "grouped_matmul_bf16_tn");
}
void Backend::grouped_matmul_bf16_nt_blocks(float*, const uint16_t*, const uint16_t*, const int64_t*, int64_t,
                                            int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, bool) {
  missing_override(*this, "grouped_matmul_bf16_nt_blocks");
}
void Backend::moe_dispatch_plan_device(int64_t*, int32_t*, int32_t*, const int32_t*, int64_t, int64_t, int64_t) {
  missing_override(*this, "moe_dispatch_plan_device");
}

int64_t QuantizedTensor::code_bytes(QuantFormat f, int64_t rows, int64_t cols) {
  return f == QuantFormat::kMxfp8 ? rows * cols : rows * cols / 2;
}

int64_t QuantizedTensor::scale_bytes(QuantFormat f, int64_t rows, int64_t cols) {
  return f == QuantFormat::kMxfp8 ? rows * cols / 32 : rows * cols / 16;
}

int64_t QuantizedTensor::outer_count(QuantFormat f, int64_t rows, int64_t cols) {
  switch (f) {
    case QuantFormat::kNvfp4TwoLevel: return rows * ((cols + 127) / 128);
    case QuantFormat::kNvfp4Te:
    case QuantFormat::kNvfp4Te2d: return 1;
    case QuantFormat::kMxfp8: return 0;
  }
  return 0;
}

QuantizedTensor QuantizedBuffer::view(Backend& be, QuantFormat format, int64_t rows, int64_t cols) {
  QuantizedTensor q;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  q.codes = codes.ensure(be, QuantizedTensor::code_bytes(format, rows, cols), "quantized codes");
  q.scales = scales.ensure(be, QuantizedTensor::scale_bytes(format, rows, cols), "quantized block scales");
  const int64_t n_outer = QuantizedTensor::outer_count(format, rows, cols);
  q.outer = n_outer > 0 ? outer.ensure(be, n_outer, "quantized outer scales") : nullptr;
  return q;
}

}  // namespace nibble::backend
