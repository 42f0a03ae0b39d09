// The CUDA backend's GEMMs through cuBLASLt, with FP32 semantics (backend.h): row-major
// y (M,N) [+]= products of FP32 operands in the three layouts a linear layer needs (nt, nn, tn).
// operands_bf16 = false: FP32 inputs, CUBLAS_COMPUTE_32F (true FP32, never TF32).
// operands_bf16 = true: both operands converted to BF16 in a workspace (exact by the caller's
// promise) and multiplied on BF16 tensor cores with FP32 accumulation and FP32 output (where
// cuBLASLt has no BF16 algorithm for a shape, the FP32 product of the same exact values).
// Matmul descriptors and the heuristic's algorithm are cached per shape and alignment, so the
// steady state allocates nothing. Errors name the op, its shapes and the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace nibble::backend {
class Backend;
}

namespace nibble::cuda {

enum class GemmLayout : uint8_t {
  kNT,  // y: (M,N) = a: (M,K) . b: (N,K)^T
  kNN,  // y: (M,N) = a: (M,K) . b: (K,N)
  kTN,  // y: (M,N) = a: (K,M)^T . b: (K,N)
};
const char* gemm_layout_op_name(GemmLayout layout);  // "matmul_nt" ...

class GemmEngine {
 public:
  // owner: the backend whose allocate()/deallocate() hold the workspaces; all work on `stream`.
  GemmEngine(backend::Backend& owner, cudaStream_t stream, std::string device_name);
  ~GemmEngine();
  GemmEngine(const GemmEngine&) = delete;
  GemmEngine& operator=(const GemmEngine&) = delete;

  // y: (M,N) f32 row-major, a and b as the layout says (f32, row-major, contiguous).
  void run(GemmLayout layout, float* y, const float* a, const float* b, int64_t M, int64_t N, int64_t K,
           bool accumulate, bool operands_bf16);

  // y: (M,N) f32 row-major = alpha · Σ a·b [+ y] with a and b BF16 bits as the layout says
  // (backend.h matmul_bf16_*): BF16 tensor cores, FP32 accumulation. alpha: (1) f32 in device
  // memory (cuBLASLt pointer mode device: no host sync) or null for 1. Where cuBLASLt has no BF16
  // algorithm for a shape and alignment, the operands are widened (exactly) and multiplied in FP32.
  void run_bf16(GemmLayout layout, float* y, const uint16_t* a, const uint16_t* b, int64_t M, int64_t N, int64_t K,
                const float* alpha, bool accumulate);

  // How many distinct (layout, shape, precision, alignment) plans are cached (tests).
  size_t cached_plans() const { return plans_.size(); }

 private:
  struct Plan;
  // layout, M, N, K, bf16, alignment of y, a, b in bytes (1..16), alpha/beta in device memory
  using Key = std::tuple<int, int64_t, int64_t, int64_t, bool, int, int, int, bool>;
  Plan& plan_for(const Key& key, GemmLayout layout, int64_t M, int64_t N, int64_t K, bool bf16);
  // The product of prepared operands (f32 or bf16 as `bf16` says) with host or device scalars.
  void launch(GemmLayout layout, float* y, const void* a, const void* b, int64_t M, int64_t N, int64_t K, bool bf16,
              const float* alpha_dev, bool accumulate);
  void* grow(void*& p, size_t& have, size_t bytes, const char* what);

  backend::Backend& owner_;
  cudaStream_t stream_;
  std::string device_name_;
  void* handle_ = nullptr;  // cublasLtHandle_t
  void* lt_workspace_ = nullptr;
  size_t lt_workspace_bytes_ = 0;
  void* a_bf16_ = nullptr;  // (elements of operand a) bf16, grow-only
  size_t a_bf16_bytes_ = 0;
  void* b_bf16_ = nullptr;
  size_t b_bf16_bytes_ = 0;
  void* a_f32_ = nullptr;  // run_bf16's widened operands where no BF16 algorithm exists
  size_t a_f32_bytes_ = 0;
  void* b_f32_ = nullptr;
  size_t b_f32_bytes_ = 0;
  void* consts_ = nullptr;  // (2) f32 {0, 1} in device memory: beta for pointer mode device
  size_t consts_bytes_ = 0;
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace nibble::cuda
