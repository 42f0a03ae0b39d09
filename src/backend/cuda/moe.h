// CUDA MoE routing ops, the CUDA side of Backend::moe_* (backend.h) with the semantics of
// backend/cpu/moe.h (transformers' Qwen3MoeSparseMoeBlock: softmax router, top-k with ties to
// the lower expert id, optional renormalisation, R3 forced sets, dropless stable dispatch).
// Deterministic: fixed orders, no float atomics. Pointers are device memory unless named _host.
// probs, top-k ids and weights equal the CPU's bit for bit (backend/glibc_expf.h), as do the plan,
// gather, gather_backward, combine and dye; lse, dlogits, dtopk_w and the load sums are within the
// tolerances of backend/ops_test/moe_test.cpp. E <= 4096 (router rows live in shared memory).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace nibble::cuda {

// probs (N,E), lse (N), topk_idx (N,k) i32, topk_w (N,k); logits (N,E); forced_idx (N,k) or null.
// With forced_idx the call synchronises `stream` once and throws the CPU's CheckError for the
// first token whose forced set has an id outside [0,E) or a repeated id.
void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_w, const float* logits,
                        const int32_t* forced_idx, int64_t N, int64_t E, int64_t k, bool norm_topk_prob,
                        cudaStream_t stream);
// dlogits (N,E) overwritten; dprobs_extra (E) or null.
void moe_router_backward(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                         const int32_t* topk_idx, const float* topk_w, const float* dprobs_extra, double z_scale,
                         int64_t N, int64_t E, int64_t k, bool renormalized, cudaStream_t stream);
// Stable counting sort of the N*k assignments by expert (same order as the CPU's):
// expert_offsets (E+1) i64 device, row_of_slot (N*k), token_of_row (N*k). No workspace:
// token_of_row holds per-chunk counts until the last kernel fills it. Ids outside [0,E) are not
// routed (row -1) and not counted, so expert_offsets[E] < N*k says the plan is invalid: the caller
// checks it after copying the offsets to the host (the CPU throws there instead).
void moe_dispatch_plan(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row, const int32_t* topk_idx,
                       int64_t N, int64_t E, int64_t k, cudaStream_t stream);
void moe_gather(float* xe, const float* x, const int32_t* token_of_row, int64_t rows, int64_t C, cudaStream_t stream);
void moe_gather_backward(float* dx, const float* dxe, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C,
                         cudaStream_t stream);
void moe_combine(float* out, const float* ye, const float* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k,
                 int64_t C, cudaStream_t stream);
void moe_combine_backward(float* dye, float* dtopk_w, const float* dout, const float* ye, const float* topk_w,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C, cudaStream_t stream);
// Per-expert sums in double on the device: count (E) += rows routed to e, prob_sum (E) +=
// sum_n probs[n,e]; lse2 (1) += sum_n lse[n]^2. Fixed-order reductions.
void moe_accumulate_load(double* count, double* prob_sum, double* lse2, const float* probs, const float* lse,
                         const int32_t* topk_idx, int64_t N, int64_t E, int64_t k, cudaStream_t stream);

}  // namespace nibble::cuda
