// NIB_HOST_DEVICE: marks numeric code that both the CPU reference and CUDA kernels call.
// Without nvcc it is plain `inline`, so CPU-only builds and tests compile and test the very
// functions the kernels use (rule 2 of 04-architecture.md; CUTLASS's CUTLASS_HOST_DEVICE).
#pragma once

#if defined(__CUDACC__)
#define NIB_HOST_DEVICE __host__ __device__ __forceinline__
#define NIB_DEVICE __device__ __forceinline__
#else
#define NIB_HOST_DEVICE inline
#define NIB_DEVICE inline
#endif

#if defined(__CUDA_ARCH__)
#define NIB_ON_DEVICE 1
#else
#define NIB_ON_DEVICE 0
#endif
