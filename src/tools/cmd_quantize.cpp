// `nibble quantize IN OUT --format ...`: quantizes every eligible tensor of a safetensors
// checkpoint (any HF-style file or sharded folder) into NVFP4 / NVFP4 2-level / MXFP4 / MXFP8 in
// nibble's raw layout or the ModelOpt / compressed-tensors NVFP4 layouts (01-formats.md §8), and
// prints what was quantized and what was copied (and why). The work is quantize_io.h's.
#include <cstdio>

#include <fmt/format.h>

#include "core/interrupt.h"
#include "tools/command.h"
#include "tools/option_check.h"
#include "tools/quantize_io.h"

namespace nibble::tools {
namespace {

std::string human_bytes(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.2f} MiB", b / double(1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", b / double(1ull << 10));
  return fmt::format("{} B", b);
}

struct QuantizeArgs {
  std::string in, out, format, rounding = "rtn", layout = "raw", skip, block, scale_rule;
  uint64_t seed = 0;
  bool force = false;
  CLI::Option *block_opt = nullptr, *rule_opt = nullptr, *seed_opt = nullptr;
};

int run_quantize(const QuantizeArgs& a) {
  auto opt = [](CLI::Option* o, const std::string& v) {
    return o->count() > 0 ? std::optional<std::string>(v) : std::nullopt;
  };
  auto options = make_quantize_options(a.format, opt(a.block_opt, a.block), opt(a.rule_opt, a.scale_rule), a.rounding,
                                       a.seed_opt->count() > 0 ? std::optional<uint64_t>(a.seed) : std::nullopt,
                                       a.layout, a.skip);
  if (!options) return report_error("quantize", options.status());
  options->force = a.force;
  install_interrupt_handlers();
  auto report = quantize_checkpoint(a.in, a.out, *options);
  if (!report) return report_error("quantize", report.status());

  const QuantizeOptions& o = *options;
  std::string fmt_label = format_name(o.format);
  if (o.format == QuantFormat::kNvfp4) fmt_label += o.block_16x16 ? " 16x16" : " 1x16";
  if (o.format == QuantFormat::kMxfp4 || o.format == QuantFormat::kMxfp8) fmt_label += " " + scale_rule_name(o.mx_rule);
  if (o.stochastic) fmt_label += fmt::format(" sr(seed {})", o.seed);
  size_t w = 6;
  for (const auto& q : report->quantized) w = std::max(w, q.name.size());
  std::printf("%-*s  %-20s  %-26s  %12s    %12s\n", static_cast<int>(w), "tensor", "shape", "format", "bytes in",
              "bytes out");
  uint64_t total_in = 0, total_out = 0;
  for (const auto& q : report->quantized) {
    std::string shape = shape_str(q.shape) + " " + std::string(dtype_name(q.dtype));
    std::printf("%-*s  %-20s  %-26s  %12s -> %12s\n", static_cast<int>(w), q.name.c_str(), shape.c_str(),
                fmt_label.c_str(), human_bytes(q.bytes_in).c_str(), human_bytes(q.bytes_out).c_str());
    total_in += q.bytes_in;
    total_out += q.bytes_out;
  }
  for (const auto& c : report->copied) std::printf("copied %s: %s\n", c.name.c_str(), c.reason.c_str());
  std::printf("quantized %zu tensors (%s -> %s), copied %zu; layout %s; wrote %s\n", report->quantized.size(),
              human_bytes(total_in).c_str(), human_bytes(total_out).c_str(), report->copied.size(),
              layout_name(o.layout).c_str(), a.out.c_str());
  if (!report->hf_quant_config_path.empty()) std::printf("wrote %s\n", report->hf_quant_config_path.c_str());
  return 0;
}

CommandRun setup_quantize(CLI::App& app) {
  auto a = std::make_shared<QuantizeArgs>();
  app.add_option("IN", a->in, "Input .safetensors file (or sharded checkpoint folder / index .json)")->required();
  app.add_option("OUT", a->out, "Output .safetensors file (written atomically; never an input file)")->required();
  app.add_option("--format", a->format, "nvfp4 | nvfp4-2level | mxfp4 | mxfp8")->required();
  a->block_opt = app.add_option("--block", a->block, "nvfp4 scale block: 1x16 (default) | 16x16 (TE 2-D weight tiles)");
  a->rule_opt = app.add_option("--scale-rule", a->scale_rule,
                               "MX scale exponent rule: ocp (default mxfp4) | ceil (mxfp4 only) | rceil (default mxfp8)");
  app.add_option("--rounding", a->rounding, "rtn (default) | sr (stochastic; not mxfp8, not 16x16)");
  a->seed_opt = app.add_option("--seed", a->seed, "SR seed (needs --rounding sr; default 0); stream = tensor index")
                    ->check(Unsigned64());
  app.add_option("--layout", a->layout, "raw (default) | modelopt | compressed-tensors (the last two: nvfp4 only)");
  app.add_option("--skip", a->skip, "Copy tensors whose name matches this regular expression (ECMAScript, search)");
  app.add_flag("--force", a->force, "Replace an existing OUT (or hf_quant_config.json) that nibble did not write");
  return [a] { return run_quantize(*a); };
}

}  // namespace

NIBBLE_REGISTER_COMMAND(quantize_command, "quantize", "Quantize a safetensors checkpoint to NVFP4/MXFP4/MXFP8",
                        setup_quantize);

}  // namespace nibble::tools
