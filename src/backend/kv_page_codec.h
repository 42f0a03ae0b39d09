// Element codecs of the paged KV cache's pages (Backend::kv_cache_write / paged_attention), host
// and device: the CPU backend and the CUDA kernels call these same functions, so pages hold the
// same bytes on both. A slot (one position of one layer) is one record of kv_token_bytes bytes:
//   bf16 / f32: (Hkv, D) elements.
//   fp8:   [Hkv f32 scales][(Hkv, D) E4M3 codes], scale s = fl(amax * fl(1/448)) of that (token,
//          head) row (0 -> 1), code = e4m3_rne_sat(fl(x / s)), value = e4m3(code) * s.
//   nvfp4: [(Hkv, ceil(D/128)) f32 outer][(Hkv, D/16) E4M3 inner][(Hkv, D/2) packed E2M1], each
//          (token, head) row quantized by formats::nvfp4_2level_quantize_block128: the bits of the
//          trainer's two-level quantizer on the (tokens * Hkv, D) matrix (needs D % 16 == 0).
// Records are padded to 4 bytes so the FP32 scales stay aligned. Why per (token, head) scales:
// docs/architecture.md ("KV-cache page formats").
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/bits.h"
#include "core/host_device.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"
#include "formats/nvfp4.h"

namespace nibble::backend::kv {

// Byte offsets of the parts of one slot's record (scales, inner scales, codes) and its size.
struct TokenLayout {
  int64_t scales = 0, inner = 0, codes = 0, bytes = 0;
  int64_t outer_per_head = 0;  // nvfp4: ceil(D / 128) FP32 outer scales per head; fp8: 1
};

NIB_HOST_DEVICE int64_t round_up4(int64_t b) { return (b + 3) / 4 * 4; }

NIB_HOST_DEVICE TokenLayout token_layout(KvPageFormat f, int64_t Hkv, int64_t D) {
  const int64_t W = Hkv * D;
  TokenLayout L;
  switch (f) {
    case KvPageFormat::kF32: L.bytes = 4 * W; break;
    case KvPageFormat::kBf16: L.bytes = 2 * W; break;
    case KvPageFormat::kFp8:
      L.outer_per_head = 1;
      L.codes = 4 * Hkv;
      L.bytes = round_up4(L.codes + W);
      break;
    case KvPageFormat::kNvfp4:
      L.outer_per_head = (D + 127) / 128;
      L.inner = 4 * Hkv * L.outer_per_head;
      L.codes = L.inner + W / 16;
      L.bytes = round_up4(L.codes + W / 2);
      break;
  }
  return L;
}

// Quantizes (or rounds) the (token, head hk) row x (D) f32 into the slot record `rec`.
NIB_HOST_DEVICE void encode_head(uint8_t* rec, const TokenLayout& L, KvPageFormat f, int64_t D, int64_t hk,
                                 const float* x) {
  switch (f) {
    case KvPageFormat::kF32:
      for (int64_t d = 0; d < D; ++d) reinterpret_cast<float*>(rec)[hk * D + d] = x[d];
      break;
    case KvPageFormat::kBf16:
      for (int64_t d = 0; d < D; ++d) reinterpret_cast<uint16_t*>(rec)[hk * D + d] = f32_to_bf16_bits(x[d]);
      break;
    case KvPageFormat::kFp8: {
      float amax = 0.0f;
      for (int64_t d = 0; d < D; ++d) amax = formats::amax_update(amax, x[d]);
      float s = amax * formats::kRecip448;
      if (s == 0.0f) s = 1.0f;
      reinterpret_cast<float*>(rec + L.scales)[hk] = s;
      uint8_t* codes = rec + L.codes + hk * D;
      for (int64_t d = 0; d < D; ++d) codes[d] = static_cast<uint8_t>(formats::e4m3_rne_sat(x[d] / s));
      break;
    }
    case KvPageFormat::kNvfp4: {
      float* outer = reinterpret_cast<float*>(rec + L.scales) + hk * L.outer_per_head;
      uint8_t* inner = rec + L.inner + hk * (D / 16);
      uint8_t* codes = rec + L.codes + hk * (D / 2);
      for (int64_t o = 0; o < L.outer_per_head; ++o) {
        const int n = static_cast<int>(D - 128 * o < 128 ? D - 128 * o : 128);
        outer[o] = formats::nvfp4_2level_quantize_block128(codes + 64 * o, inner + 8 * o, x + 128 * o, n);
      }
      break;
    }
  }
}

// Element d of head hk of the slot record `rec`, as f32.
NIB_HOST_DEVICE float decode_element(const uint8_t* rec, const TokenLayout& L, KvPageFormat f, int64_t D, int64_t hk,
                                     int64_t d) {
  switch (f) {
    case KvPageFormat::kF32: return reinterpret_cast<const float*>(rec)[hk * D + d];
    case KvPageFormat::kBf16: return bf16_bits_to_f32(reinterpret_cast<const uint16_t*>(rec)[hk * D + d]);
    case KvPageFormat::kFp8:
      return formats::e4m3_decode(rec[L.codes + hk * D + d]) * reinterpret_cast<const float*>(rec + L.scales)[hk];
    case KvPageFormat::kNvfp4: {
      const float so = reinterpret_cast<const float*>(rec + L.scales)[hk * L.outer_per_head + d / 128];
      const float sp = formats::nvfp4_2level_block_scale(rec[L.inner + hk * (D / 16) + d / 16], so);
      return formats::nvfp4_2level_decode(formats::e2m1_unpack(rec + L.codes + hk * (D / 2), d), sp);
    }
  }
  return 0.0f;
}

}  // namespace nibble::backend::kv
