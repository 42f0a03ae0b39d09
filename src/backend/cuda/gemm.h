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

  // How many distinct (layout, shape, precision, alignment) plans are cached (tests).
  size_t cached_plans() const { return plans_.size(); }

 private:
  struct Plan;
  // layout, M, N, K, bf16, alignment of y, a, b in bytes (1..16)
  using Key = std::tuple<int, int64_t, int64_t, int64_t, bool, int, int, int>;
  Plan& plan_for(const Key& key, GemmLayout layout, int64_t M, int64_t N, int64_t K, bool bf16);
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
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace nibble::cuda
