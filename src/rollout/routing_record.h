// R3 routing records (../shared/spec/03-rl-and-trace.md §4): each token's top-k expert ids per MoE
// layer, recorded at rollout and replayed by the trainer (model::RoutingIO::forced). Stored in a
// RecordStore (guidance_store.h) keyed by (sequence, position, MoE layer index, site 0); the ids
// are compact: uint8 when the model has <= 256 experts, else uint16.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/status.h"
#include "rollout/guidance_store.h"

namespace nibble::rollout {

// Record layout, host byte order: u8 id width (1 or 2 bytes), u8 0, u16 top_k, then top_k ids.
inline constexpr int64_t kRoutingHeaderBytes = 4;
int64_t routing_id_bytes(int64_t num_experts);  // 1 when num_experts <= 256, else 2
int64_t routing_record_bytes(int64_t num_experts, int64_t top_k);
// Routing bytes one token adds to the store: num_moe_layers records.
int64_t routing_bytes_per_token(int64_t num_experts, int64_t top_k, int64_t num_moe_layers);

// Rollout side: the record of one token's expert ids ids (top_k) i32, each in [0, num_experts).
Result<std::vector<uint8_t>> encode_routing(std::span<const int32_t> ids, int64_t num_experts);
// The ids of a record (validated: header, size, every id < num_experts). `what` names it in errors.
Result<std::vector<int32_t>> decode_routing(std::span<const uint8_t> payload, int64_t num_experts,
                                            const std::string& what);

// Appends what model::RoutingIO::record holds: topk (num_moe_layers, N, top_k) i32 expert ids; token
// row n is (row_sequence[n], row_position[n]); MoE layer m is stored as layer first_moe_layer + m.
Status append_routing(RecordStore& store, const int32_t* topk, int64_t num_moe_layers, int64_t N, int64_t top_k,
                      int64_t num_experts, const uint64_t* row_sequence, const uint32_t* row_position,
                      int64_t first_moe_layer = 0);

// Trainer side: forced (num_moe_layers, B*T, top_k) i32 <- the records of a (B, T) batch whose row b
// is sequence sequence[b] from position 0, what model::RoutingIO::forced takes. Positions at or past
// lengths[b] (lengths null: T) are padding and get experts 0..top_k-1 (any valid set: their loss
// is masked). Errors: a missing record within a length (not found), a record with another top_k.
Status gather_routing(int32_t* forced, RecordStore& store, const uint64_t* sequence, const int64_t* lengths, int64_t B,
                      int64_t T, int64_t num_moe_layers, int64_t top_k, int64_t num_experts);

}  // namespace nibble::rollout
