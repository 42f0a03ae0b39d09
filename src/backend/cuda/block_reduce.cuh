// Deterministic block reductions for the CUDA backend's kernels: a warp's xor-shuffle tree, then
// warp 0 combines the per-warp results from shared memory. The order depends only on blockDim
// (a fixed launch constant of each kernel), never on timing, so every reduction gives the same
// bits run to run (no atomics). The result is returned to every thread of the block.
// Requires blockDim.x a multiple of 32 and <= 1024; every thread of the block must call.
#pragma once

#include <cuda_runtime.h>

namespace nibble::cuda {

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// shared: 33 elements of scratch (one per warp + the broadcast slot); reused across calls only
// after the call returns (it ends with a barrier).
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < warps ? shared[lane] : identity;
    w = warp_reduce(w, op);
    if (lane == 0) shared[32] = w;
  }
  __syncthreads();
  const T r = shared[32];
  __syncthreads();
  return r;
}

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {  // NaN-propagating is not needed: callers compare like the CPU (x > m ? x : m)
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return b > a ? b : a; }
};

}  // namespace nibble::cuda
