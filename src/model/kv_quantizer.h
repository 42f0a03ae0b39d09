// The NVFP4 KV-cache step of the training forward (model::KvQuantizer, RTN): each (token, kv head)
// row of head_dim D of the rotated keys and of the values is quantized as the rollout engine's
// NVFP4 page codec stores it (backend/kv_page_codec.h: two-level NVFP4 of that row alone, 1x16
// E4M3 and 1x128 FP32 scales) and dequantized in place. The codec's bits are the backend's
// two-level quantizer's on the (N*Hkv, D) matrix, so this runs Backend::quantize / dequantize
// (kNvfp4TwoLevel) on that view: the same bits on every backend (the op-test suite's
// kv_quant_test.cpp checks them against kv_cache_write's pages). The RL trainer's guided variant
// (rl/fake_quant.h, TraceKvQuantizer) starts from these RTN codes.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "model/transformer.h"

namespace nibble::model {

// x (rows, D) f32 in be's memory <- the dequantized NVFP4 page codec of each row (D % 16 == 0);
// q: the two-level quantization of x (rows, D) as the codec writes it (q.codes, q.scales, q.outer
// in be's memory, viewed from `buf`). Returns q.
backend::QuantizedTensor nvfp4_kv_round_trip(backend::Backend& be, float* x, int64_t rows, int64_t D,
                                             backend::QuantizedBuffer& buf);

class Nvfp4KvQuantizer final : public KvQuantizer {
 public:
  void quantize(backend::Backend& be, int64_t layer, float* k, float* v, int64_t N, int64_t Hkv, int64_t D) override;

 private:
  backend::QuantizedBuffer buf_;
};

}  // namespace nibble::model
