// The NVFP4 KV-cache step of the training forward, RTN (see kv_quantizer.h).
#include "model/kv_quantizer.h"

#include "core/check.h"

namespace nibble::model {

backend::QuantizedTensor nvfp4_kv_round_trip(backend::Backend& be, float* x, int64_t rows, int64_t D,
                                             backend::QuantizedBuffer& buf) {
  NIB_CHECK_MSG(D > 0 && D % 16 == 0, "nvfp4 KV cache: head dim {} is not a multiple of 16", D);
  backend::QuantizedTensor q = buf.view(be, backend::QuantFormat::kNvfp4TwoLevel, rows, D);
  be.quantize(q, x);
  be.dequantize(x, q);
  return q;
}

void Nvfp4KvQuantizer::quantize(backend::Backend& be, int64_t /*layer*/, float* k, float* v, int64_t N, int64_t Hkv,
                                int64_t D) {
  nvfp4_kv_round_trip(be, k, N * Hkv, D, buf_);
  nvfp4_kv_round_trip(be, v, N * Hkv, D, buf_);
}

}  // namespace nibble::model
