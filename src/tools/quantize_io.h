// Quantizing a whole safetensors checkpoint into one of the on-disk layouts of 01-formats.md §8
// (nibble's raw `T.codes/T.scales/T.global`, NVIDIA ModelOpt NVFP4, compressed-tensors
// nvfp4-pack-quantized), and the reverse direction `nibble inspect` needs: recognising those
// tensor groups in a file and dequantizing them. Used by cmd_quantize.cpp and cmd_inspect.cpp;
// the arithmetic is the formats CPU drivers (formats/quantize_cpu.h), called unchanged.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "formats/mx.h"
#include "io/safetensors.h"

namespace nibble::tools {

enum class QuantFormat : uint8_t { kNvfp4, kNvfp4TwoLevel, kMxfp4, kMxfp8 };
enum class QuantLayout : uint8_t { kRaw, kModelopt, kCompressedTensors };

// Key of the safetensors `__metadata__` entry (a JSON string) that records how a file was quantized.
inline constexpr const char* kFormatMetadataKey = "nibble.format";

struct QuantizeOptions {
  QuantFormat format = QuantFormat::kNvfp4;
  bool block_16x16 = false;                                    // nvfp4 only: TE 2-D weight tiles
  formats::MxScaleRule mx_rule = formats::MxScaleRule::kFloor;  // MX only
  bool stochastic = false;                                     // SR of elements (not mxfp8, not 16x16)
  uint64_t seed = 0;                                           // SR seed; stream = tensor index
  QuantLayout layout = QuantLayout::kRaw;
  std::string skip_regex;                                      // ECMAScript, regex_search on the name
  bool force = false;  // replace an existing OUT (or hf_quant_config.json) that nibble did not write
};

// Validates the flag combination of `nibble quantize` (strings as typed; empty optional = flag
// absent). kInvalidArgument (exit code 2) for any invalid value or combination.
Result<QuantizeOptions> make_quantize_options(const std::string& format, const std::optional<std::string>& block,
                                              const std::optional<std::string>& scale_rule,
                                              const std::string& rounding, const std::optional<uint64_t>& seed,
                                              const std::string& layout, const std::string& skip_regex);

std::string format_name(QuantFormat f);          // "nvfp4", "nvfp4-2level", "mxfp4", "mxfp8"
std::string layout_name(QuantLayout l);          // "raw", "modelopt", "compressed-tensors"
std::string scale_rule_name(formats::MxScaleRule r);  // "ocp", "rceil", "ceil"
int64_t format_block(QuantFormat f);             // 16, 128 (2-level row length), 32, 32

struct QuantizedReport {
  std::string name;
  Shape shape;
  DType dtype;
  uint64_t bytes_in = 0, bytes_out = 0;
};
struct CopiedReport {
  std::string name;
  std::string reason;
};
struct QuantizeReport {
  std::vector<QuantizedReport> quantized;
  std::vector<CopiedReport> copied;
  std::string hf_quant_config_path;  // written next to OUT for --layout modelopt, else empty
};

// The safetensors file or folder that `path` names for reading: a nibble run folder (it holds
// checkpoints/latest, as every other command accepts) stands for its latest checkpoint's
// model.safetensors; anything else is returned as given.
Result<std::string> resolve_input_path(const std::string& path);

// Opens a checkpoint for reading (resolve_input_path, then io::SafetensorsFile::open). A
// malformed file is an input error (exit code 1), not an invalid argument, so the reader's
// kInvalidArgument statuses are returned as kDataLoss.
Result<io::SafetensorsFile> open_input(const std::string& path);

// Reads `in` (a .safetensors file or sharded checkpoint), quantizes every eligible tensor and
// writes `out` atomically (plus hf_quant_config.json next to it for ModelOpt). Refused
// (kInvalidArgument): `out` (or that json) naming an input file by path or inode; an existing
// `out` that is not an earlier nibble quantize output (or a foreign hf_quant_config.json) unless
// options.force; an input that is already quantized. A SIGINT/SIGTERM stops it with no file left.
Result<QuantizeReport> quantize_checkpoint(const std::string& in, const std::string& out,
                                           const QuantizeOptions& options);

// ---- the inspect direction -------------------------------------------------------------------

// One quantized tensor as stored: its original name/shape and the member tensors holding it.
struct QuantGroup {
  std::string base;           // the original tensor's name
  QuantFormat format = QuantFormat::kNvfp4;
  QuantLayout layout = QuantLayout::kRaw;
  std::string block;          // "1x16", "16x16", "1x16+1x128" (2-level), "1x32"
  std::string scale_rule;     // MX: "ocp" | "rceil" | "ceil" when known ("" if not recorded)
  Shape shape;                // original [..., K]
  std::string codes, scales, global;  // member tensor names (global "" for MX)
};

// Groups of `file`, from its nibble.format metadata when present, else recognised by names,
// dtypes and shapes (raw, ModelOpt and compressed-tensors conventions).
Result<std::vector<QuantGroup>> find_quant_groups(const io::SafetensorsFile& file);

// y: the dequantized tensor, F32 CPU, group.shape.
Result<Tensor> dequantize_group(const io::SafetensorsFile& file, const QuantGroup& group);

}  // namespace nibble::tools
