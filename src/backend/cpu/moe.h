// Mixture-of-experts routing on the CPU, as in transformers' Qwen3MoeSparseMoeBlock: router
// logits -> softmax -> top-k -> (optionally) renormalised top-k weights, dropless dispatch to
// per-expert row blocks and weighted combine, each with its backward. The rollout-routing-replay
// (R3) seam is `forced_idx`: a given top-k set per token, its gate weights the model's own
// formula over that set (p, or p / sum over the set with norm_topk_prob). Load-balancing statistics are accumulated here; the
// model turns them into the Switch/Qwen aux loss  E * sum_e f_e P_e.  Templated on float/double.
#pragma once

#include <cstdint>

namespace nibble::cpu {

// probs: (N,E) softmax(logits); lse: (N) logsumexp(logits); topk_idx: (N,k) i32 expert ids;
// topk_w: (N,k) gate weights; logits: (N,E); forced_idx: (N,k) i32 or nullptr.
// Without forcing: the k largest probs (descending, ties -> lower expert id), weights p or, when
// norm_topk_prob, p / sum of the k. With forcing: ids copied from forced_idx (each in [0,E),
// distinct per row), weights by the same rule over the forced set (p, or with norm_topk_prob
// p / sum over the set = softmax restricted to the set), so replaying the set the router would
// pick gives the same weights bit for bit whatever norm_topk_prob.
template <typename T>
void moe_router_forward(T* probs, T* lse, int32_t* topk_idx, T* topk_w, const T* logits, const int32_t* forced_idx,
                        int64_t N, int64_t E, int64_t k, bool norm_topk_prob);

// dlogits: (N,E) overwritten. dtopk_w: (N,k) dL/dtopk_w; probs, lse, topk_idx, topk_w from
// forward; renormalized = norm_topk_prob (forced or not). dprobs_extra: (E) or nullptr, added to
// dL/dprobs[n,e] for every row (the aux-loss gradient). z_scale: adds d/dlogits of
// z_scale * lse^2 (router z-loss).
template <typename T>
void moe_router_backward(T* dlogits, const T* dtopk_w, const T* probs, const T* lse, const int32_t* topk_idx,
                         const T* topk_w, const T* dprobs_extra, double z_scale, int64_t N, int64_t E, int64_t k,
                         bool renormalized);

// Dropless dispatch plan (a stable counting sort of the N*k assignments by expert):
// expert_offsets: (E+1) rows of expert e are [offsets[e], offsets[e+1]) of the sorted buffer;
// row_of_slot: (N*k) sorted row of assignment (n, j); token_of_row: (N*k) token of each row.
void moe_dispatch_plan(int64_t* expert_offsets, int32_t* row_of_slot, int32_t* token_of_row, const int32_t* topk_idx,
                       int64_t N, int64_t E, int64_t k);

// xe: (N*k, C) = x[token_of_row[r]]; x: (N,C)
template <typename T>
void moe_gather(T* xe, const T* x, const int32_t* token_of_row, int64_t rows, int64_t C);
// dx: (N,C) = sum_j dxe[row_of_slot[n*k+j]] (overwritten); dxe: (N*k, C)
template <typename T>
void moe_gather_backward(T* dx, const T* dxe, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C);
// out: (N,C) = sum_j topk_w[n,j] ye[row_of_slot[n*k+j]] (overwritten); ye: (N*k, C)
template <typename T>
void moe_combine(T* out, const T* ye, const T* topk_w, const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C);
// dye: (N*k, C) overwritten; dtopk_w: (N,k) overwritten; dout: (N,C); ye, topk_w as forward.
template <typename T>
void moe_combine_backward(T* dye, T* dtopk_w, const T* dout, const T* ye, const T* topk_w,
                          const int32_t* row_of_slot, int64_t N, int64_t k, int64_t C);

// count: (E) += number of rows routed to e; prob_sum: (E) += sum_n probs[n,e] (double sums).
template <typename T>
void moe_accumulate_load(double* count, double* prob_sum, const T* probs, const int32_t* topk_idx, int64_t N,
                         int64_t E, int64_t k);

}  // namespace nibble::cpu
