// Checkpoint quantization and the reverse (group recognition + dequantization) for the
// `quantize` and `inspect` commands; see quantize_io.h. Every code and scale byte comes from the
// formats CPU drivers (formats/quantize_cpu.h) called on the whole tensor viewed as
// [prod(leading dims), K], so a file written here is bit for bit what those drivers produce.
#include "tools/quantize_io.h"

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/interrupt.h"
#include "formats/e2m1.h"
#include "formats/e4m3.h"
#include "formats/quantize_cpu.h"
#include "io/atomic_file.h"
#include "io/output_guard.h"
#include "io/regular_file.h"
#include "train/checkpoint.h"

namespace nibble::tools {
namespace {

using nlohmann::json;
namespace fm = nibble::formats;
namespace fs = std::filesystem;

Shape with_last(const Shape& s, int64_t last) {
  Shape r = s;
  r.back() = last;
  return r;
}

std::string ends_strip(const std::string& s, const std::string& suffix) {
  if (s.size() <= suffix.size() || s.compare(s.size() - suffix.size(), suffix.size(), suffix) != 0) return "";
  return s.substr(0, s.size() - suffix.size());
}

// Member tensor names of a group stored under `base` in `layout` (01-formats.md §8; the
// suffixes apply to any base name, so `x.weight` -> `x.weight_scale`, `x.bias` -> `x.bias_scale`).
void member_names(QuantGroup& g) {
  switch (g.layout) {
    case QuantLayout::kRaw:
      g.codes = g.base + ".codes";
      g.scales = g.base + ".scales";
      g.global = g.format == QuantFormat::kMxfp4 || g.format == QuantFormat::kMxfp8 ? "" : g.base + ".global";
      break;
    case QuantLayout::kModelopt:
      g.codes = g.base;
      g.scales = g.base + "_scale";
      g.global = g.base + "_scale_2";
      break;
    case QuantLayout::kCompressedTensors:
      g.codes = g.base + "_packed";
      g.scales = g.base + "_scale";
      g.global = g.base + "_global_scale";
      break;
  }
}

std::string block_name(QuantFormat f, bool block_16x16) {
  switch (f) {
    case QuantFormat::kNvfp4: return block_16x16 ? "16x16" : "1x16";
    case QuantFormat::kNvfp4TwoLevel: return "1x16+1x128";
    default: return "1x32";
  }
}

std::optional<QuantFormat> parse_format(const std::string& s) {
  if (s == "nvfp4") return QuantFormat::kNvfp4;
  if (s == "nvfp4-2level") return QuantFormat::kNvfp4TwoLevel;
  if (s == "mxfp4") return QuantFormat::kMxfp4;
  if (s == "mxfp8") return QuantFormat::kMxfp8;
  return std::nullopt;
}
std::optional<QuantLayout> parse_layout(const std::string& s) {
  if (s == "raw") return QuantLayout::kRaw;
  if (s == "modelopt") return QuantLayout::kModelopt;
  if (s == "compressed-tensors") return QuantLayout::kCompressedTensors;
  return std::nullopt;
}

// One tensor quantized: its output tensors (named per layout) and the stored per-tensor scalar.
struct QuantizedTensor {
  std::vector<io::NamedTensor> outputs;
};

// x: (M, K) as stored, F32 | BF16 | F16. Returns the output tensors of group `g`.
Result<QuantizedTensor> quantize_tensor(const Tensor& x, const QuantGroup& g, const QuantizeOptions& o,
                                        uint64_t stream) {
  const Shape& shape = x.shape();
  const int64_t K = shape.back(), M = x.numel() / K;
  const fm::SrKey key{o.seed, stream};
  const fm::SrKey* sr = o.stochastic ? &key : nullptr;
  const bool bf16 = x.dtype() == DType::kBF16;
  // F16 (and BF16 where the driver takes only f32) converted to F32: exact.
  Tensor xf;
  auto f32_input = [&]() -> const float* {
    if (x.dtype() == DType::kF32) return x.data<float>();
    if (!xf.defined()) xf = x.to_f32();
    return xf.data<float>();
  };
  const auto* xb = bf16 ? static_cast<const uint16_t*>(x.raw()) : nullptr;
  const DType scale_dtype = o.layout == QuantLayout::kRaw ? DType::kU8 : DType::kF8E4M3;

  QuantizedTensor q;
  switch (o.format) {
    case QuantFormat::kNvfp4: {
      Tensor codes(DType::kU8, with_last(shape, K / 2)), scales(scale_dtype, with_last(shape, K / 16));
      uint8_t* c = codes.data<uint8_t>();
      uint8_t* s = scales.data<uint8_t>();
      float amax;
      if (o.block_16x16)
        amax = fm::nvfp4_te_quantize_2d_cpu(c, s, nullptr, nullptr, f32_input(), M, K);
      else if (bf16)
        amax = fm::nvfp4_te_quantize_cpu(c, s, xb, M, K, sr);
      else
        amax = fm::nvfp4_te_quantize_cpu(c, s, f32_input(), M, K, sr);
      q.outputs.push_back({g.codes, codes});
      q.outputs.push_back({g.scales, scales});
      if (o.layout == QuantLayout::kRaw) {
        Tensor gl(DType::kF32, Shape{});
        gl.data<float>()[0] = amax;
        q.outputs.push_back({g.global, gl});
      } else if (o.layout == QuantLayout::kModelopt) {
        Tensor gl(DType::kF32, Shape{});
        gl.data<float>()[0] = amax / 2688.0f;  // weight_scale_2: decode direction
        q.outputs.push_back({g.global, gl});
      } else {
        Tensor gl(DType::kF32, Shape{1});
        gl.data<float>()[0] = fm::nvfp4_te_global(amax).s_enc;  // weight_global_scale: the S_enc used
        q.outputs.push_back({g.global, gl});
      }
      break;
    }
    case QuantFormat::kNvfp4TwoLevel: {
      Tensor codes(DType::kU8, with_last(shape, K / 2)), inner(DType::kU8, with_last(shape, K / 16)),
          outer(DType::kF32, with_last(shape, K / 128));
      if (bf16)
        fm::nvfp4_2level_quantize_cpu(codes.data<uint8_t>(), inner.data<uint8_t>(), outer.data<float>(), xb, M, K, sr);
      else
        fm::nvfp4_2level_quantize_cpu(codes.data<uint8_t>(), inner.data<uint8_t>(), outer.data<float>(), f32_input(),
                                      M, K, sr);
      q.outputs = {{g.codes, codes}, {g.scales, inner}, {g.global, outer}};
      break;
    }
    case QuantFormat::kMxfp4: {
      Tensor codes(DType::kU8, with_last(shape, K / 2)), scales(DType::kU8, with_last(shape, K / 32));
      if (bf16)
        fm::mxfp4_quantize_cpu(codes.data<uint8_t>(), scales.data<uint8_t>(), xb, M, K, o.mx_rule, sr);
      else
        fm::mxfp4_quantize_cpu(codes.data<uint8_t>(), scales.data<uint8_t>(), f32_input(), M, K, o.mx_rule, sr);
      q.outputs = {{g.codes, codes}, {g.scales, scales}};
      break;
    }
    case QuantFormat::kMxfp8: {
      Tensor elems(DType::kF8E4M3, shape), scales(DType::kU8, with_last(shape, K / 32));
      if (bf16)
        fm::mxfp8_quantize_cpu(elems.data<uint8_t>(), scales.data<uint8_t>(), xb, M, K, o.mx_rule);
      else
        fm::mxfp8_quantize_cpu(elems.data<uint8_t>(), scales.data<uint8_t>(), f32_input(), M, K, o.mx_rule);
      q.outputs = {{g.codes, elems}, {g.scales, scales}};
      break;
    }
  }
  return q;
}

std::string module_of(const std::string& name) {
  std::string m = ends_strip(name, ".weight");
  return m.empty() ? name : m;
}

}  // namespace

std::string format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kNvfp4: return "nvfp4";
    case QuantFormat::kNvfp4TwoLevel: return "nvfp4-2level";
    case QuantFormat::kMxfp4: return "mxfp4";
    case QuantFormat::kMxfp8: return "mxfp8";
  }
  return "?";
}
std::string layout_name(QuantLayout l) {
  switch (l) {
    case QuantLayout::kRaw: return "raw";
    case QuantLayout::kModelopt: return "modelopt";
    case QuantLayout::kCompressedTensors: return "compressed-tensors";
  }
  return "?";
}
std::string scale_rule_name(formats::MxScaleRule r) {
  switch (r) {
    case formats::MxScaleRule::kFloor: return "ocp";
    case formats::MxScaleRule::kRceil: return "rceil";
    case formats::MxScaleRule::kTeCeil: return "ceil";
  }
  return "?";
}
int64_t format_block(QuantFormat f) {
  switch (f) {
    case QuantFormat::kNvfp4: return 16;
    case QuantFormat::kNvfp4TwoLevel: return 128;
    default: return 32;
  }
}

Result<QuantizeOptions> make_quantize_options(const std::string& format, const std::optional<std::string>& block,
                                              const std::optional<std::string>& scale_rule,
                                              const std::string& rounding, const std::optional<uint64_t>& seed,
                                              const std::string& layout, const std::string& skip_regex) {
  QuantizeOptions o;
  auto f = parse_format(format);
  if (!f) return invalid_argument("--format {}: expected nvfp4, nvfp4-2level, mxfp4 or mxfp8", format);
  o.format = *f;
  auto l = parse_layout(layout);
  if (!l) return invalid_argument("--layout {}: expected raw, modelopt or compressed-tensors", layout);
  o.layout = *l;
  const bool mx = o.format == QuantFormat::kMxfp4 || o.format == QuantFormat::kMxfp8;
  if (o.layout != QuantLayout::kRaw && o.format != QuantFormat::kNvfp4)
    return invalid_argument("--layout {} holds nvfp4 only (got --format {})", layout, format);
  if (block) {
    if (*block != "1x16" && *block != "16x16") return invalid_argument("--block {}: expected 1x16 or 16x16", *block);
    if (o.format != QuantFormat::kNvfp4) return invalid_argument("--block applies to --format nvfp4 only");
    o.block_16x16 = *block == "16x16";
  }
  if (scale_rule) {
    if (!mx) return invalid_argument("--scale-rule applies to mxfp4/mxfp8 only (nvfp4 scales are E4M3, RNE)");
    if (*scale_rule == "ocp") o.mx_rule = formats::MxScaleRule::kFloor;
    else if (*scale_rule == "rceil") o.mx_rule = formats::MxScaleRule::kRceil;
    else if (*scale_rule == "ceil") o.mx_rule = formats::MxScaleRule::kTeCeil;
    else return invalid_argument("--scale-rule {}: expected ocp, ceil or rceil", *scale_rule);
    if (o.format == QuantFormat::kMxfp8 && o.mx_rule == formats::MxScaleRule::kTeCeil)
      return invalid_argument("--scale-rule ceil is an mxfp4 rule; mxfp8 takes ocp or rceil (= ceil(log2(amax/448)))");
  } else {
    // Defaults: OCP floor for MXFP4 (the OCP MX spec), round-up for MXFP8 (01-formats.md §4).
    o.mx_rule = o.format == QuantFormat::kMxfp8 ? formats::MxScaleRule::kRceil : formats::MxScaleRule::kFloor;
  }
  if (rounding != "rtn" && rounding != "sr") return invalid_argument("--rounding {}: expected rtn or sr", rounding);
  o.stochastic = rounding == "sr";
  if (seed && !o.stochastic) return invalid_argument("--seed needs --rounding sr");
  if (o.stochastic && o.format == QuantFormat::kMxfp8)
    return invalid_argument("--rounding sr is not defined for mxfp8 (E4M3 elements round to nearest)");
  if (o.stochastic && o.block_16x16) return invalid_argument("--block 16x16 is round-to-nearest only (no --rounding sr)");
  o.seed = seed.value_or(0);
  if (!skip_regex.empty()) {
    try {
      std::regex re(skip_regex);
    } catch (const std::regex_error& e) {
      return invalid_argument("--skip '{}': invalid regular expression ({})", skip_regex, e.what());
    }
  }
  o.skip_regex = skip_regex;
  return o;
}

Result<std::string> resolve_input_path(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec) ||
      !std::filesystem::exists(std::filesystem::path(path) / "checkpoints" / "latest", ec))
    return path;
  NIB_ASSIGN_OR_RETURN(std::string step_dir, train::latest_checkpoint_dir(path));
  return (std::filesystem::path(step_dir) / "model.safetensors").string();
}

Result<io::SafetensorsFile> open_input(const std::string& given) {
  NIB_ASSIGN_OR_RETURN(std::string path, resolve_input_path(given));
  auto file = io::SafetensorsFile::open(path);
  if (!file && file.status().code() == StatusCode::kInvalidArgument)
    return Status(StatusCode::kDataLoss, file.status().message());
  return file;
}

namespace {

// True when `path` is a safetensors file that `nibble quantize` wrote (it has nibble.format).
bool is_nibble_quantized_file(const std::string& path) {
  auto f = io::SafetensorsFile::open(path);
  return f && f->metadata().count(kFormatMetadataKey) != 0;
}

// True when `path` is an hf_quant_config.json that nibble wrote (producer.name == "nibble").
bool is_nibble_hf_quant_config(const std::string& path) {
  auto text = io::read_regular_file(path);  // a FIFO or device is not ours, and never blocks
  if (!text) return false;
  const json j = json::parse(*text, nullptr, false);
  return j.is_object() && j.contains("producer") && j["producer"].is_object() &&
         j["producer"].value("name", "") == "nibble";
}

// What quantize_checkpoint may write: never one of the input files (same path or inode), an
// existing path only when nibble wrote it (or `force`).
Status check_quantize_outputs(const io::SafetensorsFile& file, const std::string& out, const std::string& hf_quant_path,
                              const QuantizeOptions& o) {
  for (const std::string& target : {out, hf_quant_path}) {
    if (target.empty()) continue;
    for (const std::string& f : file.files())
      if (io::same_file(f, target) || io::resolved_path(f) == io::resolved_path(target))
        return invalid_argument("output '{}' is the input file '{}': choose another OUT", target, f);
  }
  std::error_code ec;
  if (fs::exists(fs::symlink_status(out, ec))) {
    if (fs::is_directory(fs::status(out, ec)))
      return invalid_argument("output '{}' is a folder: OUT names the .safetensors file to write", out);
    if (!o.force && !is_nibble_quantized_file(out))
      return invalid_argument("output '{}' exists and is not an earlier nibble quantize output: choose a new path, or "
                              "pass --force to replace it",
                              out);
  }
  if (!hf_quant_path.empty() && fs::exists(fs::symlink_status(hf_quant_path, ec)) && !o.force &&
      !is_nibble_hf_quant_config(hf_quant_path))
    return invalid_argument("'{}' exists and was not written by nibble (--layout modelopt writes it next to OUT): "
                            "choose another folder for OUT, or pass --force to replace it",
                            hf_quant_path);
  return Status::ok();
}

// A quantized input (nibble.format metadata, or groups recognised by name) is refused: its codes
// are U8 and would be copied, its scales quantized again, giving a file no reader understands.
Status check_not_quantized(const io::SafetensorsFile& file, const std::string& in) {
  if (file.metadata().count(kFormatMetadataKey))
    return invalid_argument("'{}' is already quantized (it has '{}' metadata): quantize the original F32/BF16/F16 "
                            "checkpoint",
                            in, kFormatMetadataKey);
  auto groups = find_quant_groups(file);
  if (groups && !groups->empty())
    return invalid_argument("'{}' is already quantized ({} tensors in the {} layout, e.g. '{}'): quantize the original "
                            "F32/BF16/F16 checkpoint",
                            in, groups->size(), layout_name(groups->front().layout), groups->front().base);
  return Status::ok();
}

}  // namespace

Result<QuantizeReport> quantize_checkpoint(const std::string& in, const std::string& out,
                                           const QuantizeOptions& o) {
  NIB_ASSIGN_OR_RETURN(io::SafetensorsFile file, open_input(in));
  std::string hf_quant_path;
  if (o.layout == QuantLayout::kModelopt) {
    std::filesystem::path dir = std::filesystem::path(out).parent_path();
    hf_quant_path = (dir.empty() ? std::filesystem::path("hf_quant_config.json") : dir / "hf_quant_config.json").string();
  }
  NIB_RETURN_IF_ERROR(check_quantize_outputs(file, out, hf_quant_path, o));
  NIB_RETURN_IF_ERROR(check_not_quantized(file, in));
  std::optional<std::regex> skip;
  if (!o.skip_regex.empty()) skip.emplace(o.skip_regex);
  const int64_t block = format_block(o.format);

  QuantizeReport report;
  std::vector<io::NamedTensor> outputs;
  json tensors_meta = json::object();
  std::vector<std::string> excluded_modules;
  const std::vector<std::string> names = file.names();
  for (size_t index = 0; index < names.size(); ++index) {
    if (interrupt_signal() != 0) return cancelled_status(fmt::format("while quantizing: {} not written", out));
    const std::string& name = names[index];
    NIB_ASSIGN_OR_RETURN(Tensor x, file.get(name));
    std::string reason;
    const DType dt = x.dtype();
    if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16)
      reason = fmt::format("dtype {} (only F32/BF16/F16 are quantized)", dtype_name(dt));
    else if (x.rank() == 0)
      reason = "scalar";
    else if (x.numel() == 0)
      reason = "empty";
    else if (skip && std::regex_search(name, *skip))
      reason = fmt::format("matches --skip '{}'", o.skip_regex);
    else if (x.dim(-1) % block != 0)
      reason = fmt::format("last dimension {} is not a multiple of {}", x.dim(-1), block);
    if (!reason.empty()) {
      report.copied.push_back({name, reason});
      outputs.push_back({name, x});
      if (!ends_strip(name, ".weight").empty()) excluded_modules.push_back(module_of(name));
      continue;
    }
    QuantGroup g;
    g.base = name;
    g.format = o.format;
    g.layout = o.layout;
    member_names(g);
    NIB_ASSIGN_OR_RETURN(QuantizedTensor q, quantize_tensor(x, g, o, index));
    QuantizedReport r{name, x.shape(), dt, x.nbytes(), 0};
    for (auto& t : q.outputs) {
      r.bytes_out += t.tensor.nbytes();
      outputs.push_back(std::move(t));
    }
    report.quantized.push_back(r);
    tensors_meta[name] = {{"shape", x.shape()}, {"dtype", std::string(dtype_name(dt))}, {"sr_stream", index}};
  }
  std::set<std::string> seen;
  for (const auto& t : outputs)
    if (!seen.insert(t.name).second)
      return invalid_argument("output tensor name '{}' occurs twice (is the input already quantized?)", t.name);

  std::map<std::string, std::string> metadata = file.metadata();
  metadata.emplace("format", "pt");
  json info = {{"version", 1},
               {"format", format_name(o.format)},
               {"block", block_name(o.format, o.block_16x16)},
               {"layout", layout_name(o.layout)},
               {"rounding", o.stochastic ? "sr" : "rtn"},
               {"tensors", tensors_meta}};
  if (o.format == QuantFormat::kMxfp4 || o.format == QuantFormat::kMxfp8) info["scale_rule"] = scale_rule_name(o.mx_rule);
  if (o.stochastic) {
    info["seed"] = o.seed;
    info["sr_stream"] = "index of the tensor in the input's file order";
  }
  metadata[kFormatMetadataKey] = info.dump();
  json hf_quant;
  if (o.layout == QuantLayout::kModelopt) {
    hf_quant = {{"producer", {{"name", "nibble"}, {"version", "0.1.0"}}},
                {"quantization",
                 {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr}, {"group_size", 16},
                  {"exclude_modules", excluded_modules}}}};
    metadata["hf_quant_config"] = hf_quant.dump();
  } else if (o.layout == QuantLayout::kCompressedTensors) {
    json ct = {{"quant_method", "compressed-tensors"},
               {"format", "nvfp4-pack-quantized"},
               {"config_groups",
                {{"group_0",
                  {{"targets", {"Linear"}},
                   {"weights",
                    {{"num_bits", 4}, {"type", "float"}, {"strategy", "tensor_group"}, {"group_size", 16},
                     {"symmetric", true}, {"dynamic", false}}}}}}},
               {"ignore", excluded_modules}};
    metadata["quantization_config"] = ct.dump();
  }
  NIB_RETURN_IF_ERROR(io::write_safetensors(out, outputs, metadata, /*stop_on_interrupt=*/true));
  if (o.layout == QuantLayout::kModelopt) {
    std::string text = hf_quant.dump(2) + "\n";
    NIB_RETURN_IF_ERROR(io::write_file_atomic(hf_quant_path, text.data(), text.size()));
    report.hf_quant_config_path = hf_quant_path;
  }
  return report;
}

// ---- inspect ---------------------------------------------------------------------------------

Result<std::vector<QuantGroup>> find_quant_groups(const io::SafetensorsFile& file) {
  std::vector<QuantGroup> groups;
  auto meta = file.metadata().find(kFormatMetadataKey);
  if (meta != file.metadata().end()) {
    json info = json::parse(meta->second, nullptr, /*allow_exceptions=*/false);
    if (info.is_discarded() || !info.is_object())
      return data_loss("metadata '{}' is not a JSON object", kFormatMetadataKey);
    try {
      auto f = parse_format(info.at("format").get<std::string>());
      auto l = parse_layout(info.at("layout").get<std::string>());
      if (!f || !l) return data_loss("metadata '{}': unknown format or layout", kFormatMetadataKey);
      for (const auto& [base, t] : info.at("tensors").items()) {
        QuantGroup g;
        g.base = base;
        g.format = *f;
        g.layout = *l;
        g.block = info.at("block").get<std::string>();
        g.scale_rule = info.value("scale_rule", "");
        g.shape = t.at("shape").get<Shape>();
        member_names(g);
        for (const std::string& m : {g.codes, g.scales, g.global})
          if (!m.empty() && !file.contains(m))
            return data_loss("metadata '{}' names tensor '{}' but the file has no '{}'", kFormatMetadataKey, base, m);
        groups.push_back(std::move(g));
      }
    } catch (const json::exception& e) {
      return data_loss("metadata '{}': {}", kFormatMetadataKey, e.what());
    }
    return groups;
  }
  // No metadata: recognise the three layouts by their member names, dtypes and shapes.
  auto info_of = [&](const std::string& n) -> std::optional<io::TensorInfo> {
    if (!file.contains(n)) return std::nullopt;
    auto r = file.info(n);
    return r ? std::optional<io::TensorInfo>(*r) : std::nullopt;
  };
  for (const std::string& name : file.names()) {
    QuantGroup g;
    if (std::string b = ends_strip(name, ".codes"); !b.empty()) {
      auto codes = info_of(name), scales = info_of(b + ".scales");
      if (!scales || codes->shape.empty() || scales->shape.size() != codes->shape.size()) continue;
      const int64_t K = codes->dtype == DType::kF8E4M3 ? codes->shape.back() : 2 * codes->shape.back();
      const int64_t sl = scales->shape.back();
      g.base = b;
      g.layout = QuantLayout::kRaw;
      g.shape = with_last(codes->shape, K);
      if (codes->dtype == DType::kF8E4M3 && sl > 0 && K == 32 * sl) {
        g.format = QuantFormat::kMxfp8;
      } else if (codes->dtype == DType::kU8 && sl > 0 && K == 32 * sl) {
        g.format = QuantFormat::kMxfp4;
      } else if (codes->dtype == DType::kU8 && sl > 0 && K == 16 * sl) {
        auto gl = info_of(b + ".global");
        if (!gl) continue;
        g.format = gl->shape.empty() ? QuantFormat::kNvfp4 : QuantFormat::kNvfp4TwoLevel;
      } else {
        continue;
      }
    } else if (std::string b2 = ends_strip(name, "_packed"); !b2.empty()) {
      if (!info_of(b2 + "_scale") || !info_of(b2 + "_global_scale")) continue;
      g.base = b2;
      g.layout = QuantLayout::kCompressedTensors;
      g.format = QuantFormat::kNvfp4;
      g.shape = with_last(info_of(name)->shape, 2 * info_of(name)->shape.back());
    } else {
      auto codes = info_of(name), sc = info_of(name + "_scale"), s2 = info_of(name + "_scale_2");
      if (!sc || !s2 || codes->dtype != DType::kU8 || sc->dtype != DType::kF8E4M3 || codes->shape.empty()) continue;
      g.base = name;
      g.layout = QuantLayout::kModelopt;
      g.format = QuantFormat::kNvfp4;
      g.shape = with_last(codes->shape, 2 * codes->shape.back());
    }
    g.block = block_name(g.format, false);
    member_names(g);
    groups.push_back(std::move(g));
  }
  return groups;
}

Result<Tensor> dequantize_group(const io::SafetensorsFile& file, const QuantGroup& g) {
  if (g.shape.empty() || g.shape.back() <= 0) return data_loss("{}: recorded shape is not [..., K]", g.base);
  const int64_t K = g.shape.back(), M = shape_numel(g.shape) / K;
  const bool fp4 = g.format != QuantFormat::kMxfp8;
  const int64_t sblock = g.format == QuantFormat::kMxfp4 || g.format == QuantFormat::kMxfp8 ? 32 : 16;
  if (K % sblock != 0) return data_loss("{}: K = {} is not a multiple of {}", g.base, K, sblock);
  NIB_ASSIGN_OR_RETURN(Tensor codes, file.get(g.codes));
  NIB_ASSIGN_OR_RETURN(Tensor scales, file.get(g.scales));
  // Every member's size is checked before any pointer is read.
  auto expect = [&](const Tensor& t, const std::string& n, Shape s, std::initializer_list<DType> dts) -> Status {
    bool dt_ok = false;
    for (DType d : dts) dt_ok |= t.dtype() == d;
    if (!dt_ok || t.numel() != shape_numel(s))
      return data_loss("{}: member '{}' is {} {}, expected {} elements of shape {}", g.base, n, dtype_name(t.dtype()),
                       shape_str(t.shape()), shape_numel(s), shape_str(s));
    return Status::ok();
  };
  NIB_RETURN_IF_ERROR(expect(codes, g.codes, with_last(g.shape, fp4 ? K / 2 : K), {fp4 ? DType::kU8 : DType::kF8E4M3}));
  NIB_RETURN_IF_ERROR(expect(scales, g.scales, with_last(g.shape, K / sblock), {DType::kU8, DType::kF8E4M3}));
  Tensor y(DType::kF32, g.shape);
  float* yp = y.data<float>();
  const uint8_t* c = codes.data<uint8_t>();
  const uint8_t* s = scales.data<uint8_t>();
  switch (g.format) {
    case QuantFormat::kNvfp4: {
      NIB_ASSIGN_OR_RETURN(Tensor gl, file.get(g.global));
      NIB_RETURN_IF_ERROR(expect(gl, g.global, Shape{}, {DType::kF32}));
      const float v = gl.data<float>()[0];
      if (g.layout == QuantLayout::kRaw) {
        formats::nvfp4_te_dequantize_cpu(yp, c, s, v, M, K);
      } else {
        // What an inference engine computes: e2m1 * e4m3 scale * decode-direction global
        // (ModelOpt stores amax/2688; compressed-tensors stores 2688/amax, so divide).
        const bool divide = g.layout == QuantLayout::kCompressedTensors;
        for (int64_t i = 0; i < M * K; ++i) {
          float q = formats::e2m1_decode(formats::e2m1_unpack(c, i)) * formats::e4m3_decode(s[i / 16]);
          yp[i] = divide ? q / v : q * v;
        }
      }
      break;
    }
    case QuantFormat::kNvfp4TwoLevel: {
      NIB_ASSIGN_OR_RETURN(Tensor gl, file.get(g.global));
      NIB_RETURN_IF_ERROR(expect(gl, g.global, with_last(g.shape, (K + 127) / 128), {DType::kF32}));
      formats::nvfp4_2level_dequantize_cpu(yp, c, s, gl.data<float>(), M, K);
      break;
    }
    case QuantFormat::kMxfp4: formats::mxfp4_dequantize_cpu(yp, c, s, M, K); break;
    case QuantFormat::kMxfp8: formats::mxfp8_dequantize_cpu(yp, c, s, M, K); break;
  }
  return y;
}

}  // namespace nibble::tools
