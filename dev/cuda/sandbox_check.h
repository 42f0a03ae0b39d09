// The sandboxes' (dev/cuda/*.cu, spec 06 principle 7) error checks: CK(cuda call) and
// CKB(cuBLAS / cuBLASLt call) print the failed call with its file and line and exit(2), so a
// sandbox run ends at the first failure with the reason. Sandboxes only: the backend reports
// errors through src/backend/cuda/cuda_check.h.
#pragma once

#include <cstdio>
#include <cstdlib>

#define CK(expr)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)
#define CKB(expr)                                                                                 \
  do {                                                                                            \
    cublasStatus_t s_ = (expr);                                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                            \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #expr, (int)s_); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)
