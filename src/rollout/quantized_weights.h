// Block-linear weights received already quantized from a checkpoint (issue #15 §2): the file
// `nibble quantize --format nvfp4-2level` writes (raw layout, RTN; tools/quantize_io.h): per HF
// weight `W` the tensors `W.codes` (N, K/2) u8, `W.scales` (N, K/16) u8 E4M3 and `W.global`
// (N, K/128) f32. The model's fused linears (q|k|v, gate|up) are their HF members' rows stacked,
// which for this per-row format are the bits of quantizing the fused weight. The engine takes the
// result linear by linear through QuantizedLinears::set_quantized_weight (Engine::load_quantized_weights).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "model/transformer.h"

namespace nibble::rollout {

// Reads the quantized weights of `model`'s block linears from `path` (a safetensors file or
// sharded folder) one linear at a time: every member is checked first (nothing is handed over
// from a bad file), then fn(id, w) receives each linear's weight in linear_infos() order, w a
// QuantizedTensor of host pointers valid during the call only (one linear on the host at a
// time). Errors (one line): an unreadable file (kNotFound / kDataLoss); a file that is not a
// `nibble quantize` nvfp4-2level raw RTN output, a missing member, a wrong dtype or shape
// (kDataLoss); a block linear whose in-features are not a multiple of 128 (the tool copies
// those unquantized; kInvalidArgument); fn's error.
using QuantizedLinearSink = std::function<Status(int id, const backend::QuantizedTensor& w)>;
Status read_quantized_linears(const std::string& path, model::Model& model, const QuantizedLinearSink& fn);

}  // namespace nibble::rollout
