// The CUDA backend (cuda_backend.h): memory, the stream, error reporting, and each op of
// backend.h as a call of its launcher (nn_ops, optimizer_ops, format_ops, quantize, attention,
// moe, gemm) on this backend's stream, checked at once with the op's name, shapes and device.
// Results the interface returns to the host (loss sums, norms, MoE offsets) travel through a
// small pinned buffer after one stream synchronisation. Ids out of range (tokens, targets) are
// flagged by the kernels and reported at the next synchronisation (copy_to_host, synchronize).
#include "backend/cuda/cuda_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/attention.h"
#include "backend/cuda/attention_bf16.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device.h"
#include "backend/cuda/flash_decoding.h"
#include "backend/cuda/format_ops.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/grouped_gemm_bf16.cuh"
#include "backend/cuda/moe.h"
#include "backend/cuda/sampling.h"
#include "backend/cuda/nn_ops.h"
#include "backend/cuda/optimizer_ops.h"
#include "backend/cuda/fp4_weight_mma.cuh"
#include "backend/cuda/paged_attention.h"
#include "backend/cuda/quantize.h"

namespace nibble::cuda {

using backend::QuantFormat;
using backend::QuantizedTensor;

struct CudaBackend::HostResults {
  double values[8];
  uint32_t flags;
};

// A failed CUDA call inside op `op`: throws naming the op, the shapes (formatted only on failure)
// and the device.
#define NIB_OP_CUDA(expr, op, ...)                                                                           \
  do {                                                                                                       \
    cudaError_t nib_e_ = (expr);                                                                             \
    if (nib_e_ != cudaSuccess)                                                                               \
      op_failed(op, fmt::format(__VA_ARGS__),                                                                \
                fmt::format("CUDA error {} ({})", cudaGetErrorName(nib_e_), cudaGetErrorString(nib_e_)), #expr, \
                __FILE__, __LINE__);                                                                         \
  } while (0)
// A launcher of quantize.h: a bad shape comes back as a Status, a failed CUDA call inside it as
// a CheckError; both are reported with the op's context.
#define NIB_OP_STATUS(expr, op, ...)                                                                      \
  do {                                                                                                    \
    const ::nibble::Status nib_s_ = [&]() -> ::nibble::Status {                                           \
      try {                                                                                               \
        return (expr);                                                                                    \
      } catch (const CheckError& nib_err_) {                                                              \
        op_failed(op, fmt::format(__VA_ARGS__), nib_err_.what(), #expr, __FILE__, __LINE__);              \
      }                                                                                                   \
    }();                                                                                                  \
    if (!nib_s_.is_ok()) op_failed(op, fmt::format(__VA_ARGS__), nib_s_.message(), #expr, __FILE__, __LINE__); \
  } while (0)
// A precondition of op `op` on its arguments.
#define NIB_OP_REQUIRE(cond, op, ...)                                                                   \
  do {                                                                                                  \
    if (!(cond)) op_failed(op, fmt::format(__VA_ARGS__), "precondition failed", #cond, __FILE__, __LINE__); \
  } while (0)
// Runs a launcher of another file that throws CheckError itself; adds the op's context.
#define NIB_OP_CALL(call, op, ...)                                                              \
  do {                                                                                          \
    try {                                                                                       \
      call;                                                                                     \
    } catch (const CheckError& nib_err_) {                                                      \
      op_failed(op, fmt::format(__VA_ARGS__), nib_err_.what(), #call, __FILE__, __LINE__);      \
    }                                                                                           \
    NIB_OP_CUDA(cudaGetLastError(), op, __VA_ARGS__);                                          \
  } while (0)

namespace {

Result<std::unique_ptr<backend::Backend>> cuda_factory(int device_index) { return CudaBackend::create(device_index); }

double gib(size_t bytes) { return static_cast<double>(bytes) / double(1 << 30); }

}  // namespace

void register_cuda_backend() {
  static std::once_flag once;
  std::call_once(once, [] { backend::register_backend("cuda", &cuda_factory); });
}

Result<std::unique_ptr<backend::Backend>> CudaBackend::create(int device_index) {
  Status s = init(device_index);
  if (!s.is_ok()) return s;
  try {
    return std::unique_ptr<backend::Backend>(new CudaBackend(device_index));
  } catch (const CheckError& e) {
    return Status{StatusCode::kInternal, e.what()};
  }
}

CudaBackend::CudaBackend(int device_index) : device_(device_index) {
  NIB_CUDA_CHECK(cudaSetDevice(device_));
  cudaDeviceProp prop{};
  NIB_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  name_ = fmt::format("cuda:{} ({})", device_, prop.name);
  NIB_OP_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "create backend", "device {}", device_);
  NIB_OP_CUDA(cudaDeviceGetDefaultMemPool(&pool_, device_), "create backend", "device {}", device_);
  // Keep freed blocks in the pool (grow-only buffers come and go at shape changes only).
  uint64_t keep = std::numeric_limits<uint64_t>::max();
  NIB_OP_CUDA(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep), "create backend", "device {}",
              device_);
  NIB_OP_CUDA(cudaMalloc(&small_dev_, 8 * sizeof(double)), "create backend", "device {}", device_);
  NIB_OP_CUDA(cudaMalloc(&flags_dev_, sizeof(uint32_t)), "create backend", "device {}", device_);
  // On this backend's stream: a plain cudaMemset runs on the legacy stream, unordered with ours.
  NIB_OP_CUDA(cudaMemsetAsync(flags_dev_, 0, sizeof(uint32_t), stream_), "create backend", "device {}", device_);
  void* pinned = nullptr;
  NIB_OP_CUDA(cudaMallocHost(&pinned, sizeof(HostResults)), "create backend", "device {}", device_);
  host_ = static_cast<HostResults*>(pinned);
  gemm_ = std::make_unique<GemmEngine>(*this, stream_, name_);
}

CudaBackend::~CudaBackend() {
  // Destructors never throw: errors here (e.g. a context already torn down) are dropped.
  (void)cudaSetDevice(device_);
  gemm_.reset();
  if (scratch_) (void)cudaFreeAsync(scratch_, stream_);
  if (stream_) (void)cudaStreamSynchronize(stream_);
  if (small_dev_) (void)cudaFree(small_dev_);
  if (flags_dev_) (void)cudaFree(flags_dev_);
  if (host_) (void)cudaFreeHost(host_);
  if (stream_) (void)cudaStreamDestroy(stream_);
  (void)cudaGetLastError();
}

bool CudaBackend::supports(backend::Op op) const { return op != backend::Op::kCount; }

void CudaBackend::activate() const {
  int current = -1;
  if (cudaGetDevice(&current) != cudaSuccess || current != device_)
    NIB_OP_CUDA(cudaSetDevice(device_), "select device", "device {}", device_);
}

void CudaBackend::op_failed(const char* op, const std::string& shapes, const std::string& error, const char* expr,
                            const char* file, int line) const {
  check_failed(expr, file, line, fmt::format("{} ({}) on {}: {}", op, shapes, name_, error));
}

// ---- memory ------------------------------------------------------------------------------------
size_t CudaBackend::gemm_plan_count() const { return gemm_->cached_plans(); }

Result<void*> CudaBackend::allocate(size_t bytes, const std::string& what) {
  activate();
  if (capturing_)
    return Status{StatusCode::kInternal,
                  fmt::format("allocating {} ({} bytes) on {} while capturing a graph: run the same shapes eagerly "
                              "first so every buffer has its size",
                              what, bytes, name_)};
  ++allocation_count_;
  void* p = nullptr;
  cudaError_t e = cudaMallocAsync(&p, std::max<size_t>(bytes, 1), stream_);
  if (e == cudaErrorMemoryAllocation) {
    // Blocks cached in the pool are free to the allocator but not to another process: hand
    // them back and try once more before giving up.
    (void)cudaGetLastError();
    (void)cudaStreamSynchronize(stream_);
    (void)cudaMemPoolTrimTo(pool_, 0);
    e = cudaMallocAsync(&p, std::max<size_t>(bytes, 1), stream_);
  }
  if (e == cudaSuccess) return p;
  (void)cudaGetLastError();
  size_t free_b = 0, total_b = 0;
  (void)cudaMemGetInfo(&free_b, &total_b);
  (void)cudaGetLastError();
  const std::string cause = e == cudaErrorMemoryAllocation
                                ? "out of GPU memory"
                                : fmt::format("CUDA error {} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
  return Status{StatusCode::kInternal,
                fmt::format("{} on {} allocating {}: {} bytes ({:.3f} GiB) requested, {:.3f} GiB free of {:.3f} GiB; "
                            "lower batch_size or seq_len in the run config (raise grad_accum to keep the tokens per step), "
                            "or choose a smaller model",
                            cause, name_, what, bytes, gib(bytes), gib(free_b), gib(total_b))};
}

backend::Backend::MemoryStats CudaBackend::memory_stats() {
  activate();
  uint64_t used = 0, high = 0;  // cuuint64_t
  NIB_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemCurrent, &used));
  NIB_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &high));
  return {static_cast<int64_t>(used), static_cast<int64_t>(high)};
}

void CudaBackend::reset_peak_memory() {
  activate();
  uint64_t zero = 0;  // resets the high watermark to the current use
  NIB_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero));
}

void CudaBackend::deallocate(void* p) {
  if (p == nullptr) return;
  (void)cudaSetDevice(device_);
  ++deallocation_count_;  // a graph captured before may point into p: memory_epoch() moves on
  if (capturing_) {  // a free inside a capture would become a node of the graph: freed after it
    deferred_frees_.push_back(p);
    return;
  }
  cudaError_t e = cudaFreeAsync(p, stream_);
  if (e != cudaSuccess) (void)cudaGetLastError();  // called from destructors: never throw
}

void* CudaBackend::scratch(size_t bytes, const char* op) {
  if (scratch_ != nullptr && scratch_bytes_ >= bytes) return scratch_;
  if (scratch_ != nullptr) deallocate(scratch_);
  scratch_ = nullptr, scratch_bytes_ = 0;
  const size_t want = std::max<size_t>(bytes, size_t{1} << 20);
  Result<void*> r = allocate(want, fmt::format("the scratch workspace of {}", op));
  NIB_CHECK_MSG(r.is_ok(), "{}", r.status().message());
  scratch_ = r.value(), scratch_bytes_ = want;
  return scratch_;
}

void CudaBackend::copy_to_device(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return;
  activate();
  refuse_while_capturing("copy_to_device");
  NIB_OP_CUDA(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "copy_to_device", "{} bytes",
              bytes);
}

void CudaBackend::refuse_while_capturing(const char* op) const {
  if (capturing_)
    op_failed(op, "during a graph capture",
              "a captured graph cannot move data between host and device or synchronise (do it before or after "
              "the captured region)",
              "capturing_", __FILE__, __LINE__);
}

void CudaBackend::sync_and_check_flags(const char* op) {
  refuse_while_capturing(op);
  NIB_OP_CUDA(cudaMemcpyAsync(&host_->flags, flags_dev_, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream_), op,
              "error flags");
  NIB_OP_CUDA(cudaStreamSynchronize(stream_), op, "synchronising the stream (an earlier kernel may have failed)");
  const uint32_t flags = host_->flags;
  if (flags != 0) {
    NIB_OP_CUDA(cudaMemsetAsync(flags_dev_, 0, sizeof(uint32_t), stream_), op, "error flags");
    std::string what;
    if (flags & kErrorTokenId) what += "embedding_forward/backward met a token id outside [0, V); ";
    if (flags & kErrorTargetId) what += "cross_entropy met a target id >= V; ";
    op_failed(op, "reported at this synchronisation", what + "check the tokenizer's vocabulary against the model's vocab_size (data.vocab_size)",
              "error flags", __FILE__, __LINE__);
  }
}

void CudaBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  activate();
  refuse_while_capturing("copy_to_host");
  if (bytes > 0)
    NIB_OP_CUDA(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "copy_to_host", "{} bytes",
                bytes);
  sync_and_check_flags("copy_to_host");
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  activate();
  NIB_OP_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "copy", "{} bytes", bytes);
}

void CudaBackend::fill_zero(void* dst, size_t bytes) {
  if (bytes == 0) return;
  activate();
  NIB_OP_CUDA(cudaMemsetAsync(dst, 0, bytes, stream_), "fill_zero", "{} bytes", bytes);
}

void CudaBackend::synchronize() {
  activate();
  sync_and_check_flags("synchronize");
}

// ---- GEMMs -------------------------------------------------------------------------------------
void CudaBackend::matmul_nt(float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K, bool accumulate,
                            bool operands_bf16) {
  activate();
  gemm_->run(GemmLayout::kNT, y, x, w, M, N, K, accumulate, operands_bf16);
}
void CudaBackend::matmul_nn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                            bool operands_bf16) {
  activate();
  gemm_->run(GemmLayout::kNN, y, a, b, M, N, K, accumulate, operands_bf16);
}
void CudaBackend::matmul_tn(float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K, bool accumulate,
                            bool operands_bf16) {
  activate();
  gemm_->run(GemmLayout::kTN, y, a, b, M, N, K, accumulate, operands_bf16);
}

// ---- per-token layers --------------------------------------------------------------------------
void CudaBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, int64_t N, int64_t V,
                                    int64_t C) {
  activate();
  NIB_OP_CUDA(cuda::embedding_forward(out, tokens, wte, N, V, C, flags_dev_, stream_), "embedding_forward",
              "N={} V={} C={}", N, V, C);
}

void CudaBackend::embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t N, int64_t V,
                                     int64_t C) {
  activate();
  NIB_OP_REQUIRE(N < (int64_t{1} << 31) && V < (int64_t{1} << 30), "embedding_backward", "N={} V={} C={}", N, V, C);
  void* ws = scratch(embedding_backward_workspace_bytes(N), "embedding_backward");
  NIB_OP_CUDA(cuda::embedding_backward(dwte, dout, tokens, N, V, C, ws, flags_dev_, stream_), "embedding_backward",
              "N={} V={} C={}", N, V, C);
}

void CudaBackend::rmsnorm_forward(float* out, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                                  double eps) {
  activate();
  NIB_OP_CUDA(cuda::rmsnorm_forward(out, rstd, x, w, R, C, eps, stream_), "rmsnorm_forward", "R={} C={}", R, C);
}

void CudaBackend::rmsnorm_backward(float* dx, float* dw, const float* dout, const float* x, const float* w,
                                   const float* rstd, int64_t R, int64_t C) {
  activate();
  NIB_OP_REQUIRE(R < int64_t{65535} * 64, "rmsnorm_backward", "R={} C={}", R, C);
  void* ws = scratch(rmsnorm_backward_workspace_bytes(R, C), "rmsnorm_backward");
  NIB_OP_CUDA(cuda::rmsnorm_backward(dx, dw, dout, x, w, rstd, R, C, ws, stream_), "rmsnorm_backward", "R={} C={}", R,
              C);
}

void CudaBackend::rope_forward(float* out, const float* x, const float* cos, const float* sin,
                               const int32_t* positions, int64_t B, int64_t Tn, int64_t H, int64_t D) {
  activate();
  NIB_OP_REQUIRE(D % 2 == 0, "rope_forward", "B={} T={} H={} D={}", B, Tn, H, D);
  NIB_OP_CUDA(rope_apply(out, x, cos, sin, positions, B, Tn, H, D, 1.0f, stream_), "rope_forward",
              "B={} T={} H={} D={}", B, Tn, H, D);
}

void CudaBackend::rope_backward(float* dx, const float* dout, const float* cos, const float* sin,
                                const int32_t* positions, int64_t B, int64_t Tn, int64_t H, int64_t D) {
  activate();
  NIB_OP_REQUIRE(D % 2 == 0, "rope_backward", "B={} T={} H={} D={}", B, Tn, H, D);
  NIB_OP_CUDA(rope_apply(dx, dout, cos, sin, positions, B, Tn, H, D, -1.0f, stream_), "rope_backward",
              "B={} T={} H={} D={}", B, Tn, H, D);
}

void CudaBackend::swiglu_forward(float* out, const float* gu, int64_t N, int64_t I) {
  activate();
  NIB_OP_CUDA(cuda::swiglu_forward(out, gu, N, I, stream_), "swiglu_forward", "N={} I={}", N, I);
}

void CudaBackend::swiglu_backward(float* dgu, const float* dout, const float* gu, int64_t N, int64_t I) {
  activate();
  NIB_OP_CUDA(cuda::swiglu_backward(dgu, dout, gu, N, I, stream_), "swiglu_backward", "N={} I={}", N, I);
}

void CudaBackend::attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, int64_t B,
                                    int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                                    backend::AttentionPrecision precision) {
  activate();
  NIB_OP_REQUIRE(Hkv > 0 && H % Hkv == 0 && D <= 256, "attention_forward", "B={} T={} H={} Hkv={} D={}", B, Tn, H,
                 Hkv, D);
  if (precision == backend::AttentionPrecision::kBf16) {
    NIB_OP_REQUIRE(D <= cuda::kAttentionBf16MaxHeadDim, "attention_forward", "bf16: D={} (at most {})", D,
                   cuda::kAttentionBf16MaxHeadDim);
    void* ws = scratch(cuda::attention_bf16_workspace_bytes(B, Tn, H, Hkv, D, false), "attention_forward");
    NIB_OP_CALL(cuda::attention_forward_bf16(out, lse, q, k, v, B, Tn, H, Hkv, D, ws, stream_), "attention_forward",
                "bf16 B={} T={} H={} Hkv={} D={}", B, Tn, H, Hkv, D);
    return;
  }
  NIB_OP_CALL(cuda::attention_forward(out, lse, q, k, v, B, Tn, H, Hkv, D, stream_), "attention_forward",
              "B={} T={} H={} Hkv={} D={}", B, Tn, H, Hkv, D);
}

void CudaBackend::attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* out,
                                     const float* lse, const float* q, const float* k, const float* v, int64_t B,
                                     int64_t Tn, int64_t H, int64_t Hkv, int64_t D,
                                     backend::AttentionPrecision precision) {
  activate();
  NIB_OP_REQUIRE(Hkv > 0 && H % Hkv == 0 && D <= 256, "attention_backward", "B={} T={} H={} Hkv={} D={}", B, Tn, H,
                 Hkv, D);
  if (precision == backend::AttentionPrecision::kBf16) {
    NIB_OP_REQUIRE(D <= cuda::kAttentionBf16MaxHeadDim, "attention_backward", "bf16: D={} (at most {})", D,
                   cuda::kAttentionBf16MaxHeadDim);
    void* ws = scratch(cuda::attention_bf16_workspace_bytes(B, Tn, H, Hkv, D, true), "attention_backward");
    NIB_OP_CALL(cuda::attention_backward_bf16(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D, ws, stream_),
                "attention_backward", "bf16 B={} T={} H={} Hkv={} D={}", B, Tn, H, Hkv, D);
    return;
  }
  const size_t ws_bytes = cuda::attention_backward_workspace_bytes(B, Tn, H, Hkv, D);
  void* ws = ws_bytes > 0 ? scratch(ws_bytes, "attention_backward") : nullptr;
  NIB_OP_CALL(cuda::attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, Tn, H, Hkv, D, ws, stream_),
              "attention_backward", "B={} T={} H={} Hkv={} D={}", B, Tn, H, Hkv, D);
}

backend::CrossEntropySums CudaBackend::cross_entropy_forward(float* lse, float* token_ce, const float* logits,
                                                             const int32_t* targets, int64_t N, int64_t V) {
  activate();
  NIB_OP_CUDA(cuda::cross_entropy_forward(small_dev_, lse, token_ce, logits, targets, N, V, flags_dev_, stream_),
              "cross_entropy_forward", "N={} V={}", N, V);
  NIB_OP_CUDA(cudaMemcpyAsync(host_->values, small_dev_, 3 * sizeof(double), cudaMemcpyDeviceToHost, stream_),
              "cross_entropy_forward", "N={} V={}", N, V);
  sync_and_check_flags("cross_entropy_forward");
  return {host_->values[0], host_->values[1], static_cast<int64_t>(host_->values[2])};
}

// The kernels write the (4) sums where they are asked to; the error flags wait for the next sync.
void CudaBackend::cross_entropy_forward_sums(double* sums, float* lse, float* token_ce, const float* logits,
                                             const int32_t* targets, int64_t N, int64_t V) {
  activate();
  NIB_OP_CUDA(cuda::cross_entropy_forward(sums, lse, token_ce, logits, targets, N, V, flags_dev_, stream_),
              "cross_entropy_forward_sums", "N={} V={}", N, V);
}

void CudaBackend::cross_entropy_forward_backward_sums(double* sums, float* dlogits, float* lse, float* token_ce,
                                                      const float* logits, const int32_t* targets, int64_t N,
                                                      int64_t V, double ce_scale, double z_scale) {
  activate();
  NIB_OP_REQUIRE(token_ce != nullptr, "cross_entropy_forward_backward_sums", "N={} V={}", N, V);
  NIB_OP_CUDA(cuda::cross_entropy_forward_backward(sums, dlogits, lse, token_ce, logits, targets, N, V, ce_scale,
                                                   z_scale, flags_dev_, stream_),
              "cross_entropy_forward_backward_sums", "N={} V={}", N, V);
}

backend::CrossEntropySums CudaBackend::cross_entropy_forward_backward(float* dlogits, float* lse, float* token_ce,
                                                                      const float* logits, const int32_t* targets,
                                                                      int64_t N, int64_t V, double ce_scale,
                                                                      double z_scale) {
  activate();
  NIB_OP_REQUIRE(token_ce != nullptr, "cross_entropy_forward_backward", "N={} V={}", N, V);
  NIB_OP_CUDA(cuda::cross_entropy_forward_backward(small_dev_, dlogits, lse, token_ce, logits, targets, N, V, ce_scale,
                                                   z_scale, flags_dev_, stream_),
              "cross_entropy_forward_backward", "N={} V={}", N, V);
  NIB_OP_CUDA(cudaMemcpyAsync(host_->values, small_dev_, 3 * sizeof(double), cudaMemcpyDeviceToHost, stream_),
              "cross_entropy_forward_backward", "N={} V={}", N, V);
  sync_and_check_flags("cross_entropy_forward_backward");
  return {host_->values[0], host_->values[1], static_cast<int64_t>(host_->values[2])};
}

// ---- small utilities ---------------------------------------------------------------------------
void CudaBackend::add_inplace(float* y, const float* x, int64_t n) {
  activate();
  NIB_OP_CUDA(cuda::add_inplace(y, x, n, stream_), "add_inplace", "n={}", n);
}

void CudaBackend::add(float* y, const float* a, const float* b, int64_t n) {
  activate();
  NIB_OP_CUDA(cuda::add(y, a, b, n, stream_), "add", "n={}", n);
}

void CudaBackend::copy_2d(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int64_t rows, int64_t cols) {
  activate();
  NIB_OP_REQUIRE(dst_ld >= cols && src_ld >= cols, "copy_2d", "rows={} cols={} dst_ld={} src_ld={}", rows, cols, dst_ld,
                 src_ld);
  NIB_OP_CUDA(cuda::copy_2d(dst, dst_ld, src, src_ld, rows, cols, stream_), "copy_2d",
              "rows={} cols={} dst_ld={} src_ld={}", rows, cols, dst_ld, src_ld);
}

// ---- MoE ---------------------------------------------------------------------------------------
void CudaBackend::moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                                     const int32_t* forced_idx, int64_t N, int64_t E, int64_t k, bool norm_topk_prob) {
  activate();
  NIB_OP_CALL(cuda::moe_router_forward(probs, lse, topk_idx, topk_w, logits, forced_idx, N, E, k, norm_topk_prob,
                                       stream_),
              "moe_router_forward", "N={} E={} k={}", N, E, k);
}

void CudaBackend::moe_router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                                      const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra,
                                      double z_scale, int64_t N, int64_t E, int64_t k, bool renormalized) {
  activate();
  NIB_OP_CALL(cuda::moe_router_backward(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, dprobs_extra, z_scale, N, E, k,
                                        renormalized, stream_),
              "moe_router_backward", "N={} E={} k={}", N, E, k);
}

void CudaBackend::moe_dispatch_plan(int64_t* expert_offsets_host, int32_t* row_of_slot, int32_t* token_of_row,
                                    const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  activate();
  auto* offsets = static_cast<int64_t*>(scratch(static_cast<size_t>(E + 1) * sizeof(int64_t), "moe_dispatch_plan"));
  NIB_OP_CALL(cuda::moe_dispatch_plan(offsets, row_of_slot, token_of_row, topk_idx, N, E, k, stream_),
              "moe_dispatch_plan", "N={} E={} k={}", N, E, k);
  NIB_OP_CUDA(cudaMemcpyAsync(expert_offsets_host, offsets, static_cast<size_t>(E + 1) * sizeof(int64_t),
                              cudaMemcpyDeviceToHost, stream_),
              "moe_dispatch_plan", "N={} E={} k={}", N, E, k);
  sync_and_check_flags("moe_dispatch_plan");
  // The kernels route no assignment whose expert id is outside [0, E) (moe.h): fewer than N*k
  // rows planned means such ids were met (the CPU throws for them too).
  if (expert_offsets_host[E] != N * k)
    op_failed("moe_dispatch_plan", fmt::format("N={} E={} k={}", N, E, k),
              fmt::format("{} of {} top-k expert ids are outside [0, {})", N * k - expert_offsets_host[E], N * k, E),
              "expert_offsets[E] == N * k", __FILE__, __LINE__);
}

// The plan without the host round trip (no synchronisation): the offsets stay in device memory
// for the grouped GEMMs. Out-of-range ids are not checked here (backend.h).
void CudaBackend::moe_dispatch_plan_device(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row,
                                           const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  activate();
  NIB_OP_CALL(cuda::moe_dispatch_plan(expert_offsets, row_of_slot, token_of_row, topk_idx, N, E, k, stream_),
              "moe_dispatch_plan_device", "N={} E={} k={}", N, E, k);
}

void CudaBackend::moe_gather(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t C) {
  activate();
  NIB_OP_CALL(cuda::moe_gather(xe, x, token_of_row, rows, C, stream_), "moe_gather", "rows={} C={}", rows, C);
}

void CudaBackend::moe_gather_backward(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N, int64_t k,
                                      int64_t C) {
  activate();
  NIB_OP_CALL(cuda::moe_gather_backward(dx, dxe, row_of_slot, N, k, C, stream_), "moe_gather_backward",
              "N={} k={} C={}", N, k, C);
}

void CudaBackend::moe_combine(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot, int64_t N,
                              int64_t k, int64_t C) {
  activate();
  NIB_OP_CALL(cuda::moe_combine(out, ye, topk_w, row_of_slot, N, k, C, stream_), "moe_combine", "N={} k={} C={}", N, k,
              C);
}

void CudaBackend::moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye,
                                       const float* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                                       int64_t C) {
  activate();
  NIB_OP_CALL(cuda::moe_combine_backward(dye, dtopk_w, dout, ye, topk_w, row_of_slot, N, k, C, stream_),
              "moe_combine_backward", "N={} k={} C={}", N, k, C);
}

double CudaBackend::moe_accumulate_load(double* count_host, double* prob_sum_host, const float* probs,
                                        const float* lse, const int32_t* topk_idx, int64_t N, int64_t E, int64_t k) {
  activate();
  const size_t n = static_cast<size_t>(2 * E + 1);
  auto* sums = static_cast<double*>(scratch(n * sizeof(double), "moe_accumulate_load"));
  NIB_OP_CUDA(cudaMemsetAsync(sums, 0, n * sizeof(double), stream_), "moe_accumulate_load", "N={} E={} k={}", N, E, k);
  NIB_OP_CALL(cuda::moe_accumulate_load(sums, sums + E, sums + 2 * E, probs, lse, topk_idx, N, E, k, stream_),
              "moe_accumulate_load", "N={} E={} k={}", N, E, k);
  if (moe_load_host_.size() < n) moe_load_host_.resize(n);
  std::vector<double>& host = moe_load_host_;
  NIB_OP_CUDA(cudaMemcpyAsync(host.data(), sums, n * sizeof(double), cudaMemcpyDeviceToHost, stream_),
              "moe_accumulate_load", "N={} E={} k={}", N, E, k);
  sync_and_check_flags("moe_accumulate_load");
  for (int64_t e = 0; e < E; ++e) {
    count_host[e] += host[static_cast<size_t>(e)];
    prob_sum_host[e] += host[static_cast<size_t>(E + e)];
  }
  return host[static_cast<size_t>(2 * E)];
}

// ---- optimizer ---------------------------------------------------------------------------------
double CudaBackend::sum_squares(const float* g, int64_t n, float grad_scale) {
  activate();
  void* ws = scratch(sum_squares_workspace_bytes(n), "sum_squares");
  NIB_OP_CUDA(cuda::sum_squares(small_dev_, g, n, grad_scale, ws, stream_), "sum_squares", "n={}", n);
  NIB_OP_CUDA(cudaMemcpyAsync(host_->values, small_dev_, sizeof(double), cudaMemcpyDeviceToHost, stream_),
              "sum_squares", "n={}", n);
  sync_and_check_flags("sum_squares");
  return host_->values[0];
}

void CudaBackend::sum_squares_chunks(double* partials_host, const float* g, int64_t n, int64_t chunk,
                                     float grad_scale) {
  activate();
  NIB_CHECK_MSG(chunk > 0, "sum_squares_chunks: chunk {} must be positive", chunk);
  if (n <= 0) return;
  const int64_t count = (n + chunk - 1) / chunk;
  auto* partials = static_cast<double*>(scratch(static_cast<size_t>(count) * sizeof(double), "sum_squares_chunks"));
  NIB_OP_CUDA(cuda::sum_squares_chunks(partials, g, n, chunk, grad_scale, stream_), "sum_squares_chunks",
              "n={} chunk={}", n, chunk);
  NIB_OP_CUDA(cudaMemcpyAsync(partials_host, partials, static_cast<size_t>(count) * sizeof(double),
                              cudaMemcpyDeviceToHost, stream_),
              "sum_squares_chunks", "n={} chunk={}", n, chunk);
  sync_and_check_flags("sum_squares_chunks");
}

void CudaBackend::sum_squares_chunks_multi(double* partials_host, const float* const* g, const int64_t* n,
                                           int64_t count, int64_t chunk, float grad_scale) {
  activate();
  NIB_CHECK_MSG(chunk > 0, "sum_squares_chunks_multi: chunk {} must be positive", chunk);
  // descriptors of the non-empty ranges, then one launch, one copy back, one synchronisation
  sum_ranges_.clear();
  int64_t total = 0;
  for (int64_t r = 0; r < count; ++r) {
    if (n[r] <= 0) continue;
    sum_ranges_.push_back(cuda::SumSquaresRange{g[r], n[r], total});
    total += (n[r] + chunk - 1) / chunk;
  }
  if (total == 0) return;
  const size_t desc_bytes = (sum_ranges_.size() * sizeof(cuda::SumSquaresRange) + 15) / 16 * 16;
  auto* base = static_cast<uint8_t*>(scratch(desc_bytes + static_cast<size_t>(total) * sizeof(double),
                                             "sum_squares_chunks_multi"));
  auto* ranges = reinterpret_cast<cuda::SumSquaresRange*>(base);
  auto* partials = reinterpret_cast<double*>(base + desc_bytes);
  NIB_OP_CUDA(cudaMemcpyAsync(ranges, sum_ranges_.data(), sum_ranges_.size() * sizeof(cuda::SumSquaresRange),
                              cudaMemcpyHostToDevice, stream_),
              "sum_squares_chunks_multi", "{} ranges", sum_ranges_.size());
  NIB_OP_CUDA(cuda::sum_squares_chunks_multi(partials, ranges, static_cast<int>(sum_ranges_.size()), total, chunk,
                                             grad_scale, stream_),
              "sum_squares_chunks_multi", "{} ranges, {} pieces", sum_ranges_.size(), total);
  NIB_OP_CUDA(cudaMemcpyAsync(partials_host, partials, static_cast<size_t>(total) * sizeof(double),
                              cudaMemcpyDeviceToHost, stream_),
              "sum_squares_chunks_multi", "{} pieces", total);
  sync_and_check_flags("sum_squares_chunks_multi");
}

namespace {
// The AdamW scalars exactly as train/optimizer.cpp computes them (Python doubles, then f32).
AdamWScalars adamw_scalars(const backend::AdamWStep& s) {
  AdamWScalars a;
  a.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  a.weight_decay = s.weight_decay != 0.0;
  a.one_minus_b1 = static_cast<float>(1.0 - s.beta1);
  a.b2 = static_cast<float>(s.beta2);
  a.one_minus_b2 = static_cast<float>(1.0 - s.beta2);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  a.step_size = static_cast<float>(s.lr / bc1);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.eps = static_cast<float>(s.eps);
  a.grad_scale = s.grad_scale;
  return a;
}
}  // namespace

void CudaBackend::adamw_update(float* w, float* m, float* v, const float* g, int64_t n, const backend::AdamWStep& s) {
  activate();
  NIB_OP_CUDA(cuda::adamw_update(w, m, v, g, n, adamw_scalars(s), stream_), "adamw_update", "n={} step={}", n, s.step);
}

void CudaBackend::adamw_update_multi(const backend::AdamWRange* ranges, int64_t count, const backend::AdamWStep& s) {
  activate();
  refuse_while_capturing("adamw_update_multi");
  adamw_ranges_.clear();
  int64_t blocks = 0;
  for (int64_t r = 0; r < count; ++r) {
    const backend::AdamWRange& x = ranges[r];
    if (x.n <= 0) continue;
    adamw_ranges_.push_back(cuda::AdamWMultiRange{x.w, x.m, x.v, x.g, x.n, blocks, x.weight_decay ? 1 : 0});
    blocks += (x.n + cuda::kAdamWMultiTile - 1) / cuda::kAdamWMultiTile;
  }
  if (blocks == 0) return;
  const size_t bytes = adamw_ranges_.size() * sizeof(cuda::AdamWMultiRange);
  auto* dev = static_cast<cuda::AdamWMultiRange*>(scratch(bytes, "adamw_update_multi"));
  NIB_OP_CUDA(cudaMemcpyAsync(dev, adamw_ranges_.data(), bytes, cudaMemcpyHostToDevice, stream_), "adamw_update_multi",
              "{} ranges", adamw_ranges_.size());
  NIB_OP_CUDA(cuda::adamw_update_multi(dev, static_cast<int>(adamw_ranges_.size()), blocks, adamw_scalars(s), stream_),
              "adamw_update_multi", "{} ranges, step={}", adamw_ranges_.size(), s.step);
}

void CudaBackend::scale(float* x, int64_t n, float s) {
  activate();
  NIB_OP_CUDA(cuda::scale(x, n, s, stream_), "scale", "n={}", n);
}

// ---- format ops --------------------------------------------------------------------------------
void CudaBackend::round_to_bf16(float* dst, const float* src, int64_t n) {
  activate();
  NIB_OP_CUDA(cuda::round_to_bf16(dst, src, n, stream_), "round_to_bf16", "n={}", n);
}

void CudaBackend::to_bf16_bits(uint16_t* dst, const float* src, int64_t n) {
  activate();
  NIB_OP_CUDA(cuda::to_bf16_bits(dst, src, n, stream_), "to_bf16_bits", "n={}", n);
}

void CudaBackend::from_bf16_bits(float* dst, const uint16_t* src, int64_t n) {
  activate();
  NIB_OP_CUDA(cuda::from_bf16_bits(dst, src, n, stream_), "from_bf16_bits", "n={}", n);
}

void CudaBackend::gather_columns_bf16(float* dst, const float* src, int64_t rows, int64_t rows_p, int64_t src_cols,
                                      const int64_t* idx, int64_t n_idx, int64_t cols_p) {
  activate();
  NIB_OP_REQUIRE(rows <= rows_p && n_idx <= cols_p && (idx != nullptr || n_idx <= src_cols), "gather_columns_bf16",
                 "rows={} rows_p={} src_cols={} n_idx={} cols_p={}", rows, rows_p, src_cols, n_idx, cols_p);
  NIB_OP_CUDA(cuda::gather_columns_bf16(dst, src, rows, rows_p, src_cols, idx, n_idx, cols_p, stream_),
              "gather_columns_bf16", "rows={} rows_p={} src_cols={} n_idx={} cols_p={}", rows, rows_p, src_cols, n_idx,
              cols_p);
}

void CudaBackend::scatter_add_columns(float* dw, const float* t, int64_t N, int64_t K, const int64_t* idx,
                                      int64_t n_idx, int64_t ld) {
  activate();
  NIB_OP_REQUIRE(n_idx <= ld && n_idx <= K, "scatter_add_columns", "N={} K={} n_idx={} ld={}", N, K, n_idx, ld);
  NIB_OP_CUDA(cuda::scatter_columns(dw, t, N, K, idx, n_idx, ld, true, stream_), "scatter_add_columns",
              "N={} K={} n_idx={} ld={}", N, K, n_idx, ld);
}

void CudaBackend::scatter_columns(float* dst, const float* t, int64_t N, int64_t K, const int64_t* idx, int64_t n_idx,
                                  int64_t ld) {
  activate();
  NIB_OP_REQUIRE(n_idx <= ld && n_idx <= K, "scatter_columns", "N={} K={} n_idx={} ld={}", N, K, n_idx, ld);
  NIB_OP_CUDA(cuda::scatter_columns(dst, t, N, K, idx, n_idx, ld, false, stream_), "scatter_columns",
              "N={} K={} n_idx={} ld={}", N, K, n_idx, ld);
}

void CudaBackend::transpose(float* dst, const float* src, int64_t rows, int64_t cols) {
  activate();
  NIB_OP_STATUS(cuda::transpose<float>(dst, src, rows, cols, stream_), "transpose (f32)", "rows={} cols={}", rows, cols);
  NIB_OP_CUDA(cudaGetLastError(), "transpose (f32)", "rows={} cols={}", rows, cols);
}

void CudaBackend::transpose(uint16_t* dst, const uint16_t* src, int64_t rows, int64_t cols) {
  activate();
  NIB_OP_STATUS(cuda::transpose<uint16_t>(dst, src, rows, cols, stream_), "transpose (u16)", "rows={} cols={}", rows,
                cols);
  NIB_OP_CUDA(cudaGetLastError(), "transpose (u16)", "rows={} cols={}", rows, cols);
}

void CudaBackend::rht16_rows(float* y, const float* x, int64_t rows, int64_t cols, uint32_t sign_mask) {
  activate();
  NIB_OP_STATUS(rht16_rows_f32(y, x, rows, cols, sign_mask, stream_), "rht16_rows", "rows={} cols={}", rows, cols);
  NIB_OP_CUDA(cudaGetLastError(), "rht16_rows", "rows={} cols={}", rows, cols);
}

void CudaBackend::column_sumsq_accumulate(double* sums, const float* x, int64_t M, int64_t K) {
  activate();
  NIB_OP_CUDA(cuda::column_sumsq_accumulate(sums, x, M, K, stream_), "column_sumsq_accumulate", "M={} K={}", M, K);
}

template <typename In>
void CudaBackend::quantize_impl(QuantizedTensor& out, const In* x, const formats::SrKey* sr, uint16_t* operand) {
  activate();
  const char* op = operand != nullptr ? (std::is_same_v<In, float> ? "quantize_operand (f32)" : "quantize_operand (bf16)")
                                      : (std::is_same_v<In, float> ? "quantize (f32)" : "quantize (bf16)");
  const int64_t M = out.rows, K = out.cols;
  const char* fmt_name = backend::quant_format_name(out.format);
  // quantize_operand may skip the codes and scales (together); quantize writes them.
  NIB_OP_REQUIRE((out.codes != nullptr && out.scales != nullptr) ||
                     (operand != nullptr && out.codes == nullptr && out.scales == nullptr),
                 op, "{} {}x{}", fmt_name, M, K);
  switch (out.format) {
    case QuantFormat::kNvfp4Te:
      NIB_OP_REQUIRE(out.outer != nullptr, op, "{} {}x{} (amax buffer)", fmt_name, M, K);
      NIB_OP_STATUS(quantize_nvfp4_te<In>(out.codes, out.scales, out.outer, x, M, K, sr, AmaxMode::kCompute,
                                          ScaleLayout::kLinear, stream_, operand),
                    op, "{} {}x{}", fmt_name, M, K);
      break;
    case QuantFormat::kNvfp4Te2d:
      NIB_OP_REQUIRE(out.outer != nullptr, op, "{} {}x{} (amax buffer)", fmt_name, M, K);
      NIB_OP_REQUIRE(sr == nullptr, op, "{} {}x{}: 2-D tile scaling is round-to-nearest only", fmt_name, M, K);
      NIB_OP_STATUS(quantize_nvfp4_te_2d<In>(out.codes, out.scales, nullptr, nullptr, out.outer, x, M, K,
                                             AmaxMode::kCompute, ScaleLayout::kLinear, stream_, operand),
                    op, "{} {}x{}", fmt_name, M, K);
      break;
    case QuantFormat::kNvfp4TwoLevel:
      NIB_OP_REQUIRE(out.outer != nullptr || operand != nullptr, op, "{} {}x{} (outer scales)", fmt_name, M, K);
      NIB_OP_STATUS(quantize_nvfp4_2level<In>(out.codes, out.scales, out.outer, x, M, K, sr, ScaleLayout::kLinear,
                                              stream_, operand),
                    op, "{} {}x{}", fmt_name, M, K);
      break;
    case QuantFormat::kMxfp8:
      NIB_OP_REQUIRE(sr == nullptr, op, "{} {}x{}: MXFP8 is round-to-nearest only", fmt_name, M, K);
      NIB_OP_STATUS(quantize_mxfp8<In>(out.codes, out.scales, x, M, K, MxScaleRule::kRceil, ScaleLayout::kLinear,
                                       stream_, operand),
                    op, "{} {}x{}", fmt_name, M, K);
      break;
  }
  NIB_OP_CUDA(cudaGetLastError(), op, "{} {}x{}", fmt_name, M, K);
}

void CudaBackend::matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                 const float* alpha, bool accumulate) {
  activate();
  gemm_->run_bf16(GemmLayout::kNT, y, a, b, M, N, K, alpha, accumulate);
}
void CudaBackend::matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                 const float* alpha, bool accumulate) {
  activate();
  gemm_->run_bf16(GemmLayout::kNN, y, a, b, M, N, K, alpha, accumulate);
}
void CudaBackend::matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                                 const float* alpha, bool accumulate) {
  activate();
  gemm_->run_bf16(GemmLayout::kTN, y, a, b, M, N, K, alpha, accumulate);
}
// Grouped BF16 GEMMs: one launch of the kernel in grouped_gemm_bf16.cuh (tile scheduler over
// (group, m-tile, n-tile) reading the device offsets; empty groups launch no work).
void CudaBackend::grouped_rows_bf16(bool nn, float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                    int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                    const float* alpha, bool accumulate) {
  activate();
  const char* op = nn ? "grouped_matmul_bf16_nn" : "grouped_matmul_bf16_nt";
  NIB_OP_REQUIRE(G >= 0 && extent >= 0 && N >= 0 && K >= 0 && (G <= 1 || b_stride >= N * K), op,
                 "G={} extent={} N={} K={} b_stride={}", G, extent, N, K, b_stride);
  NIB_OP_CUDA(grouped_gemm::launch(nn ? grouped_gemm::Layout::kNN : grouped_gemm::Layout::kNT, y, a, b, offsets, G,
                                   extent, 0, N, K, b_stride, alpha, accumulate, stream_),
              op, "G={} extent={} N={} K={}", G, extent, N, K);
}
void CudaBackend::grouped_matmul_bf16_nt(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                         int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                         const float* alpha, bool accumulate) {
  grouped_rows_bf16(false, y, a, b, offsets, G, extent, N, K, b_stride, alpha, accumulate);
}
void CudaBackend::grouped_matmul_bf16_nn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                         int64_t G, int64_t extent, int64_t N, int64_t K, int64_t b_stride,
                                         const float* alpha, bool accumulate) {
  grouped_rows_bf16(true, y, a, b, offsets, G, extent, N, K, b_stride, alpha, accumulate);
}
void CudaBackend::grouped_matmul_bf16_tn(float* y, const uint16_t* a, const uint16_t* b, const int64_t* offsets,
                                         int64_t G, int64_t extent, int64_t M, int64_t N, int64_t y_stride,
                                         const float* alpha, bool accumulate) {
  activate();
  NIB_OP_REQUIRE(G >= 0 && extent >= 0 && M >= 0 && N >= 0 && (G <= 1 || y_stride >= M * N), "grouped_matmul_bf16_tn",
                 "G={} extent={} M={} N={} y_stride={}", G, extent, M, N, y_stride);
  NIB_OP_CUDA(grouped_gemm::launch(grouped_gemm::Layout::kTN, y, a, b, offsets, G, extent, M, N, 0, y_stride, alpha,
                                   accumulate, stream_),
              "grouped_matmul_bf16_tn", "G={} extent={} M={} N={}", G, extent, M, N);
}
void CudaBackend::grouped_matmul_bf16_nt_blocks(float* y, const uint16_t* a, const uint16_t* b,
                                                const int64_t* offsets, int64_t G, int64_t extent, int64_t M,
                                                int64_t N, int64_t a_rows, int64_t b_rows, int64_t y_stride,
                                                const float* alpha, bool accumulate) {
  activate();
  NIB_OP_REQUIRE(G >= 0 && extent >= 0 && M >= 0 && N >= 0 && a_rows >= M && b_rows >= N &&
                     (G <= 1 || y_stride >= M * N),
                 "grouped_matmul_bf16_nt_blocks", "G={} extent={} M={} N={} a_rows={} b_rows={} y_stride={}", G, extent,
                 M, N, a_rows, b_rows, y_stride);
  NIB_OP_CUDA(grouped_gemm::launch_blocks(y, a, b, offsets, G, extent, M, N, a_rows, b_rows, y_stride, alpha,
                                          accumulate, stream_),
              "grouped_matmul_bf16_nt_blocks", "G={} extent={} M={} N={}", G, extent, M, N);
}

void CudaBackend::nvfp4_te_alpha(float* alpha, const float* amax_a, const float* amax_b) {
  activate();
  NIB_OP_CUDA(cuda::nvfp4_te_alpha(alpha, amax_a, amax_b, stream_), "nvfp4_te_alpha", "{}", "(1)");
}

void CudaBackend::quantize(QuantizedTensor& out, const float* x, const formats::SrKey* sr) {
  quantize_impl(out, x, sr, nullptr);
}

void CudaBackend::quantize(QuantizedTensor& out, const uint16_t* x_bf16, const formats::SrKey* sr) {
  quantize_impl(out, x_bf16, sr, nullptr);
}

void CudaBackend::quantize_operand(QuantizedTensor& out, uint16_t* y, const float* x, const formats::SrKey* sr) {
  NIB_OP_REQUIRE(y != nullptr, "quantize_operand (f32)", "{} {}x{}", backend::quant_format_name(out.format), out.rows,
                 out.cols);
  quantize_impl(out, x, sr, y);
}

void CudaBackend::quantize_operand(QuantizedTensor& out, uint16_t* y, const uint16_t* x_bf16,
                                   const formats::SrKey* sr) {
  NIB_OP_REQUIRE(y != nullptr, "quantize_operand (bf16)", "{} {}x{}", backend::quant_format_name(out.format), out.rows,
                 out.cols);
  quantize_impl(out, x_bf16, sr, y);
}

// The BF16 GEMM operand (backend.h): TE formats without the per-tensor factor (amax null), the
// others the FP32 value rounded by the kernels' BF16 output path.
void CudaBackend::dequantize_bf16(uint16_t* y, const QuantizedTensor& q) {
  activate();
  const int64_t M = q.rows, K = q.cols;
  const char* fmt_name = backend::quant_format_name(q.format);
  switch (q.format) {
    case QuantFormat::kNvfp4Te:
    case QuantFormat::kNvfp4Te2d:
      NIB_OP_STATUS(dequantize_nvfp4_te<uint16_t>(y, q.codes, q.scales, nullptr, M, K, stream_), "dequantize_bf16",
                    "{} {}x{}", fmt_name, M, K);
      break;
    case QuantFormat::kNvfp4TwoLevel:
      NIB_OP_STATUS(dequantize_nvfp4_2level<uint16_t>(y, q.codes, q.scales, q.outer, M, K, stream_),
                    "dequantize_bf16", "{} {}x{}", fmt_name, M, K);
      break;
    case QuantFormat::kMxfp8:
      NIB_OP_STATUS(dequantize_mxfp8<uint16_t>(y, q.codes, q.scales, M, K, stream_), "dequantize_bf16", "{} {}x{}",
                    fmt_name, M, K);
      break;
  }
  NIB_OP_CUDA(cudaGetLastError(), "dequantize_bf16", "{} {}x{}", fmt_name, M, K);
}

void CudaBackend::dequantize(float* y, const QuantizedTensor& q) {
  activate();
  const int64_t M = q.rows, K = q.cols;
  const char* fmt_name = backend::quant_format_name(q.format);
  switch (q.format) {
    case QuantFormat::kNvfp4Te:
    case QuantFormat::kNvfp4Te2d:
      NIB_OP_STATUS(dequantize_nvfp4_te<float>(y, q.codes, q.scales, q.outer, M, K, stream_), "dequantize", "{} {}x{}",
                    fmt_name, M, K);
      break;
    case QuantFormat::kNvfp4TwoLevel:
      NIB_OP_STATUS(dequantize_nvfp4_2level<float>(y, q.codes, q.scales, q.outer, M, K, stream_), "dequantize",
                    "{} {}x{}", fmt_name, M, K);
      break;
    case QuantFormat::kMxfp8:
      NIB_OP_STATUS(dequantize_mxfp8<float>(y, q.codes, q.scales, M, K, stream_), "dequantize", "{} {}x{}", fmt_name, M,
                    K);
      break;
  }
  NIB_OP_CUDA(cudaGetLastError(), "dequantize", "{} {}x{}", fmt_name, M, K);
}

void CudaBackend::te_rht_transpose_impl(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M, int64_t K,
                                        const formats::SrKey* sr, uint16_t* operand, const char* op) {
  activate();
  NIB_OP_REQUIRE(out.format == QuantFormat::kNvfp4Te && out.rows == K && out.cols == M && M % 16 == 0 &&
                     out.outer != nullptr,
                 op, "x {}x{} -> {} {}x{}", M, K, backend::quant_format_name(out.format), out.rows, out.cols);
  NIB_OP_STATUS(quantize_nvfp4_te_rht_t(out.codes, out.scales, out.outer, y_t, x, M, K, sr, stream_, operand), op,
                "x {}x{}", M, K);
  NIB_OP_CUDA(cudaGetLastError(), op, "x {}x{}", M, K);
}

void CudaBackend::quantize_te_rht_transpose(QuantizedTensor& out, uint16_t* y_t, const uint16_t* x, int64_t M,
                                            int64_t K, const formats::SrKey* sr) {
  NIB_OP_REQUIRE(out.codes != nullptr && out.scales != nullptr, "quantize_te_rht_transpose", "x {}x{}", M, K);
  te_rht_transpose_impl(out, y_t, x, M, K, sr, nullptr, "quantize_te_rht_transpose");
}

void CudaBackend::quantize_te_rht_transpose_operand(QuantizedTensor& out, uint16_t* y, uint16_t* y_t,
                                                    const uint16_t* x, int64_t M, int64_t K,
                                                    const formats::SrKey* sr) {
  NIB_OP_REQUIRE(y != nullptr, "quantize_te_rht_transpose_operand", "x {}x{}", M, K);
  te_rht_transpose_impl(out, y_t, x, M, K, sr, y, "quantize_te_rht_transpose_operand");
}

void CudaBackend::backward_operand_impl(QuantizedTensor& out, const QuantizedTensor& in, uint32_t sign_mask,
                                        const formats::SrKey& sr, uint16_t* operand, const char* op) {
  activate();
  const int64_t M = in.rows, K = in.cols;
  NIB_OP_REQUIRE(in.format == QuantFormat::kNvfp4TwoLevel && out.format == QuantFormat::kNvfp4TwoLevel &&
                     out.rows == K && out.cols == M && M % 128 == 0,
                 op, "in {} {}x{} -> out {} {}x{}", backend::quant_format_name(in.format), M, K,
                 backend::quant_format_name(out.format), out.rows, out.cols);
  NIB_OP_STATUS(nvfp4_2level_transpose_rht_requantize(out.codes, out.scales, out.outer, in.codes, in.scales, in.outer,
                                                      M, K, sign_mask, &sr, stream_, operand),
                op, "in {}x{}", M, K);
  NIB_OP_CUDA(cudaGetLastError(), op, "in {}x{}", M, K);
}

void CudaBackend::backward_operand_two_level(QuantizedTensor& out, const QuantizedTensor& in, uint32_t sign_mask,
                                             const formats::SrKey& sr) {
  NIB_OP_REQUIRE(out.codes != nullptr && out.scales != nullptr && out.outer != nullptr, "backward_operand_two_level",
                 "in {}x{}", in.rows, in.cols);
  backward_operand_impl(out, in, sign_mask, sr, nullptr, "backward_operand_two_level");
}

void CudaBackend::backward_operand_two_level_bf16(QuantizedTensor& out, uint16_t* y, const QuantizedTensor& in,
                                                  uint32_t sign_mask, const formats::SrKey& sr) {
  NIB_OP_REQUIRE(y != nullptr, "backward_operand_two_level_bf16", "in {}x{}", in.rows, in.cols);
  backward_operand_impl(out, in, sign_mask, sr, y, "backward_operand_two_level_bf16");
}

// ---- packed-NVFP4 weight GEMM ----------------------------------------------------------------------
void CudaBackend::matmul_nt_nvfp4_weight(float* y, const float* x, const backend::QuantizedTensor& w, int64_t M) {
  activate();
  NIB_OP_REQUIRE(w.format == backend::QuantFormat::kNvfp4TwoLevel && w.cols % 32 == 0 && M >= 0 &&
                     M <= INT32_MAX && w.rows <= INT32_MAX && w.cols <= INT32_MAX,
                 "matmul_nt_nvfp4_weight", "{} ({}, {}) M={}", backend::quant_format_name(w.format), w.rows, w.cols,
                 M);
  // the GEMV for M <= 8 and BF16 tensor cores beyond (backend/cuda/fp4_weight_mma.cuh), whose K
  // splits take S (M, N) f32 partial sums from the scratch; NIBBLE_NVFP4_WEIGHT_GEMM=gemv (read once
  // per process) keeps the GEMV for every M (3.6-5x slower at M 16-64 on the H200, docs/benchmarks.md)
  static const bool mma = [] {
    const char* v = std::getenv("NIBBLE_NVFP4_WEIGHT_GEMM");
    return v == nullptr || std::strcmp(v, "gemv") != 0;
  }();
  const int m = static_cast<int>(M), n = static_cast<int>(w.rows), k = static_cast<int>(w.cols);
  if (!mma) {
    NIB_OP_CUDA(nibble_fp4_gemv::nvfp4_gemv(y, x, w.codes, w.scales, w.outer, m, n, k, stream_),
                "matmul_nt_nvfp4_weight", "({}, {}) M={}", w.rows, w.cols, M);
    return;
  }
  const size_t ws_bytes = nibble_fp4_gemv::nvfp4_weight_gemm_workspace_bytes(m, n, k);
  void* ws = ws_bytes > 0 ? scratch(ws_bytes, "matmul_nt_nvfp4_weight") : nullptr;
  NIB_OP_CUDA(nibble_fp4_gemv::nvfp4_weight_gemm(y, x, w.codes, w.scales, w.outer, m, n, k, ws, ws_bytes, stream_),
              "matmul_nt_nvfp4_weight", "({}, {}) M={}", w.rows, w.cols, M);
}

void CudaBackend::grouped_matmul_nt_nvfp4_weight(float* y, const float* x, const backend::QuantizedTensor& w,
                                                 const int64_t* offsets, int64_t G, int64_t rows) {
  activate();
  NIB_OP_REQUIRE(w.format == backend::QuantFormat::kNvfp4TwoLevel && w.cols % 32 == 0 && G >= 0 && rows >= 0 &&
                     rows <= INT32_MAX && G <= INT32_MAX && w.rows <= INT32_MAX && w.cols <= INT32_MAX &&
                     (G == 0 || offsets != nullptr) && (rows + 7) / 8 + G <= 65535,
                 "grouped_matmul_nt_nvfp4_weight", "{} ({}, {}) G={} rows={}", backend::quant_format_name(w.format),
                 w.rows, w.cols, G, rows);
  NIB_OP_CUDA(nibble_fp4_gemv::nvfp4_grouped_gemv(y, x, w.codes, w.scales, w.outer, offsets, static_cast<int>(G),
                                                  static_cast<int>(rows), static_cast<int>(w.rows),
                                                  static_cast<int>(w.cols), stream_),
              "grouped_matmul_nt_nvfp4_weight", "({}, {}) G={} rows={}", w.rows, w.cols, G, rows);
}

// ---- greedy decoding -------------------------------------------------------------------------------
void CudaBackend::greedy_rows(int32_t* token, double* stats, const float* logits, int64_t rows, int64_t V) {
  activate();
  NIB_OP_REQUIRE(rows >= 0 && rows <= INT32_MAX && V > 0, "greedy_rows", "rows={} V={}", rows, V);
  NIB_OP_CUDA(cuda::greedy_rows(token, stats, logits, rows, V, stream_), "greedy_rows", "rows={} V={}", rows, V);
}

// ---- TRACE guided rows -----------------------------------------------------------------------------
void CudaBackend::guided_overwrite_rows(backend::QuantizedTensor& q, int64_t* stats, const float* x,
                                        const int32_t* rows, int64_t R, const uint8_t* scales, const float* outer,
                                        const uint8_t* guide, formats::GuidanceKind kind) {
  activate();
  NIB_OP_REQUIRE(q.format == backend::QuantFormat::kNvfp4TwoLevel && q.cols > 0 && q.cols % 16 == 0 && R >= 0 &&
                     R <= q.rows,
                 "guided_overwrite_rows", "{} ({}, {}) R={}", backend::quant_format_name(q.format), q.rows, q.cols, R);
  NIB_OP_STATUS(cuda::nvfp4_2level_guided_rows(q.codes, q.scales, q.outer, stats, x, rows, R, q.cols, scales, outer,
                                               guide, kind, stream_),
                "guided_overwrite_rows", "({}, {}) R={}", q.rows, q.cols, R);
}

void CudaBackend::guidance_payload_rows(uint8_t* out, const backend::QuantizedTensor& q, formats::GuidanceKind kind) {
  activate();
  NIB_OP_REQUIRE(q.format == backend::QuantFormat::kNvfp4TwoLevel && q.cols > 0 && q.cols % 16 == 0,
                 "guidance_payload_rows", "{} ({}, {})", backend::quant_format_name(q.format), q.rows, q.cols);
  NIB_OP_STATUS(cuda::guidance_payload_rows(out, q.codes, q.scales, q.outer, q.rows, q.cols, kind, stream_),
                "guidance_payload_rows", "({}, {})", q.rows, q.cols);
}

// ---- paged KV cache ------------------------------------------------------------------------------
void CudaBackend::kv_cache_write(void* k_pages, void* v_pages, backend::KvPageFormat format, const float* k,
                                 const float* v, const int32_t* slots, int64_t N, int64_t Hkv, int64_t D) {
  activate();
  NIB_OP_REQUIRE(N >= 0 && Hkv > 0 && D > 0 && (format != backend::KvPageFormat::kNvfp4 || D % 16 == 0),
                 "kv_cache_write", "N={} Hkv={} D={} {}", N, Hkv, D, backend::kv_page_format_name(format));
  NIB_OP_CUDA(cuda::kv_cache_write(k_pages, v_pages, format, k, v, slots, N, Hkv, D, stream_), "kv_cache_write",
              "N={} Hkv={} D={} {}", N, Hkv, D, backend::kv_page_format_name(format));
}

void CudaBackend::paged_attention(float* out, const float* q, const void* k_pages, const void* v_pages,
                                  backend::KvPageFormat format, const int32_t* block_table, int64_t max_blocks,
                                  const int32_t* context_len, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                                  int64_t page_size, backend::AttentionPrecision precision) {
  activate();
  NIB_OP_REQUIRE(Hkv > 0 && H % Hkv == 0 && D > 0 && page_size > 0 && max_blocks > 0 &&
                     (format != backend::KvPageFormat::kNvfp4 || D % 16 == 0),
                 "paged_attention", "N={} H={} Hkv={} D={} page={} blocks={}", N, H, Hkv, D, page_size, max_blocks);
  const bool bf16 = precision == backend::AttentionPrecision::kBf16;
  if (!cuda::paged_attention_one_block_selected() &&
      cuda::flash_decoding_supports(format, q, k_pages, v_pages, H, Hkv, D)) {
    // flash decoding; a batch whose workspace would pass 256 MiB (long prefills) runs in row groups
    const size_t per_row = cuda::flash_decoding_workspace_bytes_per_row(H, max_blocks * page_size, D);
    const size_t want = std::max(per_row, std::min(per_row * static_cast<size_t>(N), size_t{256} << 20));
    void* ws = scratch(want, "paged_attention");
    NIB_OP_CUDA(cuda::flash_decoding(out, q, k_pages, v_pages, format, block_table, max_blocks, context_len, N, H, Hkv,
                                     D, page_size, bf16, ws, want, stream_),
                "paged_attention", "flash decoding N={} H={} Hkv={} D={} page={} blocks={} {}", N, H, Hkv, D,
                page_size, max_blocks, backend::kv_page_format_name(format));
    return;
  }
  NIB_OP_REQUIRE(max_blocks * page_size <= cuda::paged_attention_max_context(D), "paged_attention",
                 "N={} H={} Hkv={} D={} page={} blocks={} (longest context of the one-block kernel {})", N, H, Hkv, D,
                 page_size, max_blocks, cuda::paged_attention_max_context(D));
  NIB_OP_CUDA(cuda::paged_attention(out, q, k_pages, v_pages, format, block_table, max_blocks, context_len, N, H, Hkv,
                                    D, page_size, bf16, stream_),
              "paged_attention", "N={} H={} Hkv={} D={} page={} blocks={} {}", N, H, Hkv, D, page_size, max_blocks,
              backend::kv_page_format_name(format));
}

// ---- graph capture -----------------------------------------------------------------------------
namespace {
class CudaGraph final : public backend::CapturedGraph {
 public:
  CudaGraph(cudaGraph_t graph, cudaGraphExec_t exec, cudaStream_t stream, int device)
      : graph_(graph), exec_(exec), stream_(stream), device_(device) {}
  ~CudaGraph() override {
    (void)cudaSetDevice(device_);
    if (exec_) (void)cudaGraphExecDestroy(exec_);
    if (graph_) (void)cudaGraphDestroy(graph_);
    (void)cudaGetLastError();
  }
  void replay() override {
    (void)cudaSetDevice(device_);
    const cudaError_t e = cudaGraphLaunch(exec_, stream_);
    NIB_CHECK_MSG(e == cudaSuccess, "graph replay on device {}: CUDA error {} ({})", device_, cudaGetErrorName(e),
                  cudaGetErrorString(e));
  }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
  int device_;
};
}  // namespace

void CudaBackend::begin_capture() {
  activate();
  NIB_CHECK_MSG(!capturing_, "begin_capture on {}: a capture is already under way", name_);
  // Thread-local mode: only this thread's calls that a graph cannot hold fail (the sampler's
  // threads touch no CUDA).
  NIB_OP_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin_capture", "stream capture");
  capturing_ = true;
}

void CudaBackend::free_deferred() {
  for (void* p : deferred_frees_)
    if (cudaFreeAsync(p, stream_) != cudaSuccess) (void)cudaGetLastError();
  deferred_frees_.clear();
}

std::unique_ptr<backend::CapturedGraph> CudaBackend::end_capture() {
  activate();
  NIB_CHECK_MSG(capturing_, "end_capture on {}: no capture under way", name_);
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
  free_deferred();
  NIB_OP_CUDA(ended, "end_capture", "stream capture (an op inside it failed)");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  if (e != cudaSuccess) {
    (void)cudaGraphDestroy(graph);
    NIB_OP_CUDA(e, "end_capture", "instantiating the captured graph");
  }
  return std::make_unique<CudaGraph>(graph, exec, stream_, device_);
}

void CudaBackend::abort_capture() {
  if (!capturing_) return;
  capturing_ = false;
  (void)cudaSetDevice(device_);
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph != nullptr) (void)cudaGraphDestroy(graph);
  (void)cudaGetLastError();  // an invalidated capture reports its error here: dropped with it
  free_deferred();
}

}  // namespace nibble::cuda
