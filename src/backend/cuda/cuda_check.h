// NIB_CUDA_CHECK / NIB_CUBLAS_CHECK: every CUDA runtime and cuBLAS(Lt) call in nibble goes
// through one of these. A failure throws nibble::CheckError naming the call, the CUDA error
// string, file and line (04-architecture.md rule 9). NIB_CUDA_CHECK_LAUNCH() checks the last
// kernel launch. cuda_status() turns a cudaError_t into a Status for recoverable paths (init).
// Mirrors llm.c's cudaCheck and CUTLASS's CUDA_CHECK, with nibble's exception instead of exit.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/check.h"
#include "core/status.h"

namespace nibble::cuda {

[[noreturn]] inline void cuda_check_failed(cudaError_t err, const char* expr, const char* file, int line) {
  ::nibble::check_failed(expr, file, line,
                         fmt::format("CUDA error {} ({})", cudaGetErrorName(err), cudaGetErrorString(err)));
}

// A Status for a failed CUDA call (for code that must not throw, such as init()).
// The error is also taken off the thread's last-error slot (cudaGetLastError), so a recoverable
// failure (cudaSetDevice on a GPU that does not exist) is not reported again by the next kernel
// launch's check; sticky errors (a faulted context) stay and fail every later call anyway.
inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  (void)cudaGetLastError();
  return {StatusCode::kInternal, fmt::format("{}: CUDA error {} ({})", what, cudaGetErrorName(err), cudaGetErrorString(err))};
}

}  // namespace nibble::cuda

#define NIB_CUDA_CHECK(expr)                                                              \
  do {                                                                                    \
    cudaError_t nib_cuda_err_ = (expr);                                                   \
    if (nib_cuda_err_ != cudaSuccess)                                                     \
      ::nibble::cuda::cuda_check_failed(nib_cuda_err_, #expr, __FILE__, __LINE__);        \
  } while (0)

// After every kernel launch: catches bad launch configurations at once.
#define NIB_CUDA_CHECK_LAUNCH() NIB_CUDA_CHECK(cudaGetLastError())

// cuBLAS / cuBLASLt status codes (0 = success) without including their headers here.
#define NIB_CUBLAS_CHECK(expr)                                                                  \
  do {                                                                                          \
    int nib_cublas_st_ = static_cast<int>(expr);                                                \
    if (nib_cublas_st_ != 0)                                                                    \
      ::nibble::check_failed(#expr, __FILE__, __LINE__, fmt::format("cuBLAS status {}", nib_cublas_st_)); \
  } while (0)
