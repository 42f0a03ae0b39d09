// Exports of a training checkpoint for other tools: a Hugging Face folder (config.json,
// model.safetensors in F32 or BF16 with HF names, generation_config.json, tokenizer.model +
// tokenizer_config.json + special_tokens_map.json for transformers' slow LlamaTokenizer), and
// an NVFP4 folder in NVIDIA ModelOpt's layout (hf_quant_config.json; per quantized linear
// `weight` U8 (N, K/2) packed E2M1, `weight_scale` F8_E4M3 (N, K/16), `weight_scale_2` F32 scalar
// = amax/2688 (shared by the q/k/v and gate/up parts of one fused linear, as ModelOpt does),
// `input_scale` F32 scalar; every other tensor BF16). Both folders are built in a temporary
// folder and renamed into place, so a failure never leaves a partial export where a good one was.
// An export never goes into, over or around the checkpoint being read (its step folder and run
// folder, real paths), and replaces an existing path only when that is an earlier nibble export of
// the same kind (a folder holding only the files that export writes) or when `replace` is set.
// SIGINT/SIGTERM stop it before the rename (core/interrupt.h); the temporary folder is removed.
#pragma once

#include <map>
#include <string>

#include "core/dtype.h"
#include "core/status.h"
#include "train/checkpoint.h"

namespace nibble::train {

// dtype: kF32 or kBF16. replace: an existing out_dir is replaced whatever it holds (`--force`).
Status export_hf(const Checkpoint& ckpt, const std::string& out_dir, DType dtype, bool replace = false);

struct Nvfp4ExportOptions {
  // Per fused linear (LinearInfo name, e.g. "model.layers.0.self_attn.qkv_proj"): max |input|
  // seen in calibration; input_scale = amax / 2688. Linears not listed get input_scale = 1.0.
  std::map<std::string, float> input_amax;
  bool replace = false;  // an existing out_dir is replaced whatever it holds (`--force`)
};
Status export_nvfp4(const Checkpoint& ckpt, const std::string& out_dir, const Nvfp4ExportOptions& options = {});

// Whether `out_dir` may receive an export (hf, or nvfp4 when `nvfp4`) of `ckpt`; see above.
// kInvalidArgument naming the reason when not.
Status check_export_destination(const Checkpoint& ckpt, const std::string& out_dir, bool nvfp4, bool replace);

// The fused linear (LinearInfo name) an HF weight belongs to, or "" when it is not a block linear:
// "...self_attn.{q,k,v}_proj.weight" -> "...self_attn.qkv_proj", "...{gate,up}_proj.weight" ->
// "...gate_up_proj", "...{o,down}_proj.weight" -> the module name.
std::string fused_linear_of(const std::string& hf_weight_name);

}  // namespace nibble::train
