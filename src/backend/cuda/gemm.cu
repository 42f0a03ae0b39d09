// cuBLASLt GEMMs of the CUDA backend (gemm.h). Row-major y (M,N) is the column-major (N,M)
// matrix cuBLAS sees, so every product runs as y^T = op(B) op(A) with m = N, n = M, k = K:
//   nt: y^T = b (K,N col-major)^T . a (K,M col-major)      transa = T, transb = N
//   nn: y^T = b (N,K col-major)   . a (K,M col-major)      transa = N, transb = N
//   tn: y^T = b (N,K col-major)   . a (M,K col-major)^T    transa = N, transb = T
// BF16 operands are converted (round to nearest even, exact by the caller's promise) into
// grow-only workspaces before the product. Mirrors llm.c's matmul_cublaslt.
#include "backend/cuda/gemm.h"

#include <cublasLt.h>
#include <fmt/format.h>

#include <algorithm>

#include "backend/backend.h"
#include "backend/cuda/cuda_check.h"
#include "core/bits.h"

namespace nibble::cuda {

namespace {

constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;  // cuBLAS's recommendation for Hopper

// dst: (n) bf16 bits <- src: (n) f32, round to nearest even (core/bits.h).
__global__ void f32_to_bf16_operand_kernel(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = f32_to_bf16_bits(src[i]);
}

// dst: (n) f32 <- src: (n) bf16 bits (exact).
__global__ void bf16_to_f32_operand_kernel(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
}

unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::min<int64_t>((n + threads - 1) / threads, 65535 * 8));
}

int alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (int al = 16; al > 1; al /= 2)
    if (a % al == 0) return al;
  return 1;
}

}  // namespace

const char* gemm_layout_op_name(GemmLayout layout) {
  switch (layout) {
    case GemmLayout::kNT: return "matmul_nt";
    case GemmLayout::kNN: return "matmul_nn";
    case GemmLayout::kTN: return "matmul_tn";
  }
  return "matmul";
}

struct GemmEngine::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLAS's A (our b), B (our a), C = D
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // false: cuBLASLt has no algorithm for this shape and alignment
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// Throws naming the op, its shapes and the device.
#define NIB_GEMM_CHECK_LT(expr)                                                                                     \
  do {                                                                                                              \
    cublasStatus_t st_ = (expr);                                                                                    \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                               \
      ::nibble::check_failed(#expr, __FILE__, __LINE__,                                                             \
                             fmt::format("{} (M={}, N={}, K={}, {}) on {}: cuBLASLt status {} ({})",                \
                                         gemm_layout_op_name(layout), M, N, K, bf16 ? "bf16 operands" : "fp32",     \
                                         device_name_, cublasLtGetStatusName(st_), cublasLtGetStatusString(st_)));   \
  } while (0)
#define NIB_GEMM_CHECK_CUDA(expr)                                                                                   \
  do {                                                                                                              \
    cudaError_t err_ = (expr);                                                                                      \
    if (err_ != cudaSuccess)                                                                                        \
      ::nibble::check_failed(#expr, __FILE__, __LINE__,                                                             \
                             fmt::format("{} (M={}, N={}, K={}, {}) on {}: CUDA error {} ({})",                     \
                                         gemm_layout_op_name(layout), M, N, K, bf16 ? "bf16 operands" : "fp32",     \
                                         device_name_, cudaGetErrorName(err_), cudaGetErrorString(err_)));           \
  } while (0)

GemmEngine::GemmEngine(backend::Backend& owner, cudaStream_t stream, std::string device_name)
    : owner_(owner), stream_(stream), device_name_(std::move(device_name)) {
  cublasLtHandle_t h = nullptr;
  cublasStatus_t st = cublasLtCreate(&h);
  NIB_CHECK_MSG(st == CUBLAS_STATUS_SUCCESS, "cublasLtCreate on {}: cuBLASLt status {} ({})", device_name_,
                cublasLtGetStatusName(st), cublasLtGetStatusString(st));
  handle_ = h;
}

GemmEngine::~GemmEngine() {
  plans_.clear();
  if (lt_workspace_) owner_.deallocate(lt_workspace_);
  if (a_bf16_) owner_.deallocate(a_bf16_);
  if (b_bf16_) owner_.deallocate(b_bf16_);
  if (a_f32_) owner_.deallocate(a_f32_);
  if (b_f32_) owner_.deallocate(b_f32_);
  if (consts_) owner_.deallocate(consts_);
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

void* GemmEngine::grow(void*& p, size_t& have, size_t bytes, const char* what) {
  if (p != nullptr && have >= bytes) return p;
  if (p != nullptr) owner_.deallocate(p);  // stream-ordered: earlier GEMMs finish first
  p = nullptr, have = 0;
  Result<void*> r = owner_.allocate(bytes, what);
  NIB_CHECK_MSG(r.is_ok(), "{}", r.status().message());
  p = r.value(), have = bytes;
  return p;
}

GemmEngine::Plan& GemmEngine::plan_for(const Key& key, GemmLayout layout, int64_t M, int64_t N, int64_t K,
                                       bool bf16) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return *it->second;
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t in_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  NIB_GEMM_CHECK_LT(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = layout == GemmLayout::kNT ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = layout == GemmLayout::kTN ? CUBLAS_OP_T : CUBLAS_OP_N;
  NIB_GEMM_CHECK_LT(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  NIB_GEMM_CHECK_LT(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (std::get<8>(key)) {  // alpha and beta read from device memory when the kernel runs
    const cublasLtPointerMode_t mode = CUBLASLT_POINTER_MODE_DEVICE;
    NIB_GEMM_CHECK_LT(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof mode));
  }
  // cuBLAS A = our b: stored (K,N) col-major for nt (ld K), (N,K) col-major for nn/tn (ld N).
  if (layout == GemmLayout::kNT)
    NIB_GEMM_CHECK_LT(cublasLtMatrixLayoutCreate(&plan->a, in_type, K, N, K));
  else
    NIB_GEMM_CHECK_LT(cublasLtMatrixLayoutCreate(&plan->a, in_type, N, K, N));
  // cuBLAS B = our a: stored (K,M) col-major for nt/nn (ld K), (M,K) col-major for tn (ld M).
  if (layout == GemmLayout::kTN)
    NIB_GEMM_CHECK_LT(cublasLtMatrixLayoutCreate(&plan->b, in_type, M, K, M));
  else
    NIB_GEMM_CHECK_LT(cublasLtMatrixLayoutCreate(&plan->b, in_type, K, M, K));
  NIB_GEMM_CHECK_LT(cublasLtMatrixLayoutCreate(&plan->c, CUDA_R_32F, N, M, N));

  cublasLtMatmulPreference_t pref = nullptr;
  NIB_GEMM_CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kLtWorkspaceBytes;
  const uint32_t align_y = static_cast<uint32_t>(std::get<5>(key)), align_a = static_cast<uint32_t>(std::get<6>(key)),
                 align_b = static_cast<uint32_t>(std::get<7>(key));
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
  if (st == CUBLAS_STATUS_SUCCESS)  // cuBLAS A is our b, cuBLAS B our a
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b, sizeof align_b);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a, sizeof align_a);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_y, sizeof align_y);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_y, sizeof align_y);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), plan->op, plan->a, plan->b, plan->c,
                                        plan->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) st = CUBLAS_STATUS_SUCCESS, found = 0;  // no algorithm: found says so
  NIB_GEMM_CHECK_LT(st);
  NIB_CHECK_MSG(found > 0 || bf16, "{} (M={}, N={}, K={}, fp32) on {}: cuBLASLt found no algorithm (alignments y {} a {} b {})",
                gemm_layout_op_name(layout), M, N, K, device_name_, align_y, align_a, align_b);
  plan->found = found > 0;
  if (plan->found) plan->algo = result.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void GemmEngine::run(GemmLayout layout, float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K,
                     bool accumulate, bool operands_bf16) {
  const bool bf16 = operands_bf16;
  NIB_CHECK_MSG(M >= 0 && N >= 0 && K >= 0, "{}: negative shape M={} N={} K={}", gemm_layout_op_name(layout), M, N, K);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: y = 0, or y unchanged when accumulating
    if (!accumulate) NIB_GEMM_CHECK_CUDA(cudaMemsetAsync(y, 0, size_t(M) * N * sizeof(float), stream_));
    return;
  }
  if (bf16) {
    // cuBLASLt may lack a BF16 algorithm for an odd leading dimension: the operands are exact BF16
    // values (the caller's promise), so the FP32 product below has the same products and FP32
    // accumulation. The BF16 plan of this shape is looked up with the workspaces' alignment (256).
    const Key key16{static_cast<int>(layout), M, N, K, true, alignment_of(y), 16, 16, false};
    if (!plan_for(key16, layout, M, N, K, true).found) {
      run(layout, y, a, b, M, N, K, accumulate, /*operands_bf16=*/false);
      return;
    }
  }
  const void* a_op = a;
  const void* b_op = b;
  if (bf16) {
    const int64_t na = M * K, nb = N * K;
    auto* a16 = static_cast<uint16_t*>(grow(a_bf16_, a_bf16_bytes_, size_t(na) * 2, "GEMM operand a in bf16"));
    auto* b16 = static_cast<uint16_t*>(grow(b_bf16_, b_bf16_bytes_, size_t(nb) * 2, "GEMM operand b in bf16"));
    const int threads = 256;
    f32_to_bf16_operand_kernel<<<grid_for(na, threads), threads, 0, stream_>>>(a16, a, na);
    NIB_GEMM_CHECK_CUDA(cudaGetLastError());
    f32_to_bf16_operand_kernel<<<grid_for(nb, threads), threads, 0, stream_>>>(b16, b, nb);
    NIB_GEMM_CHECK_CUDA(cudaGetLastError());
    a_op = a16, b_op = b16;
  }
  launch(layout, y, a_op, b_op, M, N, K, bf16, nullptr, accumulate);
}

void GemmEngine::launch(GemmLayout layout, float* y, const void* a, const void* b, int64_t M, int64_t N, int64_t K,
                        bool bf16, const float* alpha_dev, bool accumulate) {
  void* ws = grow(lt_workspace_, lt_workspace_bytes_, kLtWorkspaceBytes, "cuBLASLt workspace");
  const bool device_scalars = alpha_dev != nullptr;
  const Key key{static_cast<int>(layout), M, N, K, bf16, alignment_of(y), alignment_of(a), alignment_of(b),
                device_scalars};
  Plan& plan = plan_for(key, layout, M, N, K, bf16);
  const float alpha_host = 1.0f, beta_host = accumulate ? 1.0f : 0.0f;
  const void* alpha_p = &alpha_host;
  const void* beta_p = &beta_host;
  if (device_scalars) {
    if (consts_ == nullptr) {
      static const float kZeroOne[2] = {0.0f, 1.0f};  // static: the async copy reads it later
      grow(consts_, consts_bytes_, sizeof kZeroOne, "GEMM scalars");
      NIB_GEMM_CHECK_CUDA(cudaMemcpyAsync(consts_, kZeroOne, sizeof kZeroOne, cudaMemcpyHostToDevice, stream_));
    }
    alpha_p = alpha_dev;
    beta_p = static_cast<const float*>(consts_) + (accumulate ? 1 : 0);
    // With beta in device memory cuBLASLt cannot know at launch that it is 0, and 0 · C is NaN
    // where C holds a NaN or Inf left from earlier use: clear y first (one write of y).
    if (!accumulate) NIB_GEMM_CHECK_CUDA(cudaMemsetAsync(y, 0, size_t(M) * N * sizeof(float), stream_));
  }
  NIB_GEMM_CHECK_LT(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan.op, alpha_p, b, plan.a, a, plan.b,
                                   beta_p, y, plan.c, y, plan.c, &plan.algo, ws, kLtWorkspaceBytes, stream_));
}

void GemmEngine::run_bf16(GemmLayout layout, float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N,
                          int64_t K, const float* alpha, bool accumulate) {
  const bool bf16 = true;
  NIB_CHECK_MSG(M >= 0 && N >= 0 && K >= 0, "{}: negative shape M={} N={} K={}", gemm_layout_op_name(layout), M, N, K);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: y = 0, or y unchanged when accumulating
    if (!accumulate) NIB_GEMM_CHECK_CUDA(cudaMemsetAsync(y, 0, size_t(M) * N * sizeof(float), stream_));
    return;
  }
  const Key key{static_cast<int>(layout), M, N, K, true, alignment_of(y), alignment_of(a), alignment_of(b),
                alpha != nullptr};
  if (plan_for(key, layout, M, N, K, true).found) {
    launch(layout, y, a, b, M, N, K, true, alpha, accumulate);
    return;
  }
  // no BF16 algorithm (an odd leading dimension): the same exact values in FP32
  const int64_t na = M * K, nb = N * K;
  auto* a32 = static_cast<float*>(grow(a_f32_, a_f32_bytes_, size_t(na) * 4, "GEMM operand a widened to f32"));
  auto* b32 = static_cast<float*>(grow(b_f32_, b_f32_bytes_, size_t(nb) * 4, "GEMM operand b widened to f32"));
  const int threads = 256;
  bf16_to_f32_operand_kernel<<<grid_for(na, threads), threads, 0, stream_>>>(a32, a, na);
  NIB_GEMM_CHECK_CUDA(cudaGetLastError());
  bf16_to_f32_operand_kernel<<<grid_for(nb, threads), threads, 0, stream_>>>(b32, b, nb);
  NIB_GEMM_CHECK_CUDA(cudaGetLastError());
  launch(layout, y, a32, b32, M, N, K, false, alpha, accumulate);
}

}  // namespace nibble::cuda
