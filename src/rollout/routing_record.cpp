// R3 routing records: compact encoding of top-k expert ids, append from the (L_moe, N, k) array the
// model records, and the trainer's gather into the (L_moe, B*T, k) array the model replays.
#include "rollout/routing_record.h"

#include <cstring>

#include "core/check.h"

namespace nibble::rollout {

int64_t routing_id_bytes(int64_t num_experts) { return num_experts <= 256 ? 1 : 2; }

int64_t routing_record_bytes(int64_t num_experts, int64_t top_k) {
  return kRoutingHeaderBytes + top_k * routing_id_bytes(num_experts);
}

int64_t routing_bytes_per_token(int64_t num_experts, int64_t top_k, int64_t num_moe_layers) {
  return num_moe_layers * routing_record_bytes(num_experts, top_k);
}

Result<std::vector<uint8_t>> encode_routing(std::span<const int32_t> ids, int64_t num_experts) {
  if (num_experts < 1 || num_experts > 65536)
    return invalid_argument("routing record: {} experts (1..65536 supported)", num_experts);
  if (ids.empty() || ids.size() > 0xFFFF) return invalid_argument("routing record: top_k={} (1..65535)", ids.size());
  const int64_t w = routing_id_bytes(num_experts);
  std::vector<uint8_t> rec(static_cast<size_t>(routing_record_bytes(num_experts, static_cast<int64_t>(ids.size()))));
  rec[0] = static_cast<uint8_t>(w);
  rec[1] = 0;
  const auto k = static_cast<uint16_t>(ids.size());
  std::memcpy(rec.data() + 2, &k, 2);
  for (size_t j = 0; j < ids.size(); ++j) {
    if (ids[j] < 0 || ids[j] >= num_experts)
      return invalid_argument("routing record: expert id {} outside [0, {})", ids[j], num_experts);
    if (w == 1) {
      rec[kRoutingHeaderBytes + j] = static_cast<uint8_t>(ids[j]);
    } else {
      const auto id = static_cast<uint16_t>(ids[j]);
      std::memcpy(rec.data() + kRoutingHeaderBytes + 2 * j, &id, 2);
    }
  }
  return rec;
}

Result<std::vector<int32_t>> decode_routing(std::span<const uint8_t> payload, int64_t num_experts,
                                            const std::string& what) {
  if (payload.size() < static_cast<size_t>(kRoutingHeaderBytes))
    return data_loss("routing record {}: {} bytes, shorter than its header", what, payload.size());
  const int64_t w = payload[0];
  if (w != routing_id_bytes(num_experts))
    return data_loss("routing record {}: id width {} bytes, {} experts need {}", what, w, num_experts,
                     routing_id_bytes(num_experts));
  uint16_t k = 0;
  std::memcpy(&k, payload.data() + 2, 2);
  if (static_cast<int64_t>(payload.size()) != kRoutingHeaderBytes + k * w)
    return data_loss("routing record {}: {} bytes, its header implies {}", what, payload.size(),
                     kRoutingHeaderBytes + k * w);
  std::vector<int32_t> ids(k);
  for (int64_t j = 0; j < k; ++j) {
    uint16_t id = 0;
    if (w == 1)
      id = payload[static_cast<size_t>(kRoutingHeaderBytes + j)];
    else
      std::memcpy(&id, payload.data() + kRoutingHeaderBytes + 2 * j, 2);
    if (id >= num_experts) return data_loss("routing record {}: expert id {} outside [0, {})", what, id, num_experts);
    ids[static_cast<size_t>(j)] = id;
  }
  return ids;
}

Status append_routing(RecordStore& store, const int32_t* topk, int64_t num_moe_layers, int64_t N, int64_t top_k,
                      int64_t num_experts, const uint64_t* row_sequence, const uint32_t* row_position,
                      int64_t first_moe_layer) {
  if (first_moe_layer < 0 || first_moe_layer + num_moe_layers > 0x10000)
    return invalid_argument("routing record: MoE layers {}..{} do not fit the key", first_moe_layer,
                            first_moe_layer + num_moe_layers - 1);
  RecordBatch batch;
  for (int64_t m = 0; m < num_moe_layers; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const int32_t* ids = topk + (m * N + n) * top_k;
      NIB_ASSIGN_OR_RETURN(std::vector<uint8_t> rec,
                           encode_routing(std::span<const int32_t>(ids, static_cast<size_t>(top_k)), num_experts));
      batch.add(RecordKey{row_sequence[n], row_position[n], static_cast<uint16_t>(first_moe_layer + m), 0}, rec);
    }
  return store.append_batch(std::move(batch));
}

Status gather_routing(int32_t* forced, RecordStore& store, const uint64_t* sequence, const int64_t* lengths, int64_t B,
                      int64_t T, int64_t num_moe_layers, int64_t top_k, int64_t num_experts) {
  if (top_k > num_experts)
    return invalid_argument("routing replay: top_k={} exceeds {} experts", top_k, num_experts);
  // the recorded tokens' keys, read in one pass; padding tokens get experts 0..top_k-1
  std::vector<RecordKey> keys;
  std::vector<int32_t*> dsts;
  for (int64_t m = 0; m < num_moe_layers; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = lengths ? lengths[b] : T;
      for (int64_t t = 0; t < T; ++t) {
        int32_t* dst = forced + (m * B * T + b * T + t) * top_k;
        if (t >= len) {
          for (int64_t j = 0; j < top_k; ++j) dst[j] = static_cast<int32_t>(j);
          continue;
        }
        keys.push_back(RecordKey{sequence[b], static_cast<uint32_t>(t), static_cast<uint16_t>(m), 0});
        dsts.push_back(dst);
      }
    }
  return store.read_each(keys, [&](size_t i, std::span<const uint8_t> payload) -> Status {
    // the record's name only for an error
    const auto what = [&] { return fmt::format("{} in {}", record_key_name(keys[i]), store.name()); };
    Result<std::vector<int32_t>> decoded = decode_routing(payload, num_experts, std::string());
    if (!decoded.is_ok()) decoded = decode_routing(payload, num_experts, what());  // the same error, named
    NIB_ASSIGN_OR_RETURN(std::vector<int32_t> ids, std::move(decoded));
    if (static_cast<int64_t>(ids.size()) != top_k)
      return invalid_argument("routing record {}: top_k {} but the trainer expects {}", what(), ids.size(), top_k);
    std::memcpy(dsts[i], ids.data(), sizeof(int32_t) * static_cast<size_t>(top_k));
    return Status::ok();
  });
}

}  // namespace nibble::rollout
