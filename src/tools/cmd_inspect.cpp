// `nibble inspect FILE [--against SRC]`: lists a safetensors file's tensors and metadata,
// recognises the quantized tensor groups `nibble quantize` writes (raw, ModelOpt,
// compressed-tensors; quantize_io.h), and with --against dequantizes each group and prints its
// error against the source tensor: RMSE, relative RMSE ||x_hat - x|| / ||x||, max |error|,
// SNR in dB (10 log10 of ||x||^2 / ||x_hat - x||^2), the fraction of exact zeros in x_hat and
// the count of positions where either side is NaN/Inf (left out of the other statistics).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>

#include <fmt/format.h>

#include "tools/command.h"
#include "tools/quantize_io.h"

namespace nibble::tools {
namespace {

struct InspectArgs {
  std::string file, against;
};

struct ErrorStats {
  double rmse = 0, rel_rmse = 0, max_abs = 0, snr_db = 0, zeros = 0;
  int64_t nonfinite = 0;  // positions where x_hat or x is NaN/Inf: left out of the other statistics
};

// x_hat, x: n f32 values. Sums in double so the statistics do not depend on n's size. A NaN or
// Inf on either side is counted in `nonfinite` and left out of the sums (it would turn them into
// NaN, which the comparisons below would read as a perfect result); with no finite pair left the
// statistics are NaN.
ErrorStats error_stats(const float* x_hat, const float* x, int64_t n) {
  double se = 0, sx = 0, mx = 0;
  int64_t zeros = 0, nonfinite = 0;
  for (int64_t i = 0; i < n; ++i) {
    zeros += x_hat[i] == 0.0f;
    if (!std::isfinite(x_hat[i]) || !std::isfinite(x[i])) {
      ++nonfinite;
      continue;
    }
    double e = static_cast<double>(x_hat[i]) - static_cast<double>(x[i]);
    se += e * e;
    sx += static_cast<double>(x[i]) * x[i];
    mx = std::max(mx, std::fabs(e));
  }
  ErrorStats s;
  const int64_t finite = n - nonfinite;
  s.nonfinite = nonfinite;
  s.zeros = n > 0 ? static_cast<double>(zeros) / n : 0;
  if (nonfinite > 0 && finite == 0) {
    s.rmse = s.rel_rmse = s.max_abs = s.snr_db = NAN;
    return s;
  }
  s.rmse = finite > 0 ? std::sqrt(se / finite) : 0;
  s.rel_rmse = sx > 0 ? std::sqrt(se / sx) : (se > 0 ? INFINITY : 0);
  s.max_abs = mx;
  s.snr_db = se > 0 ? 10.0 * std::log10(sx / se) : INFINITY;
  return s;
}

std::string truncated(const std::string& s, size_t n) { return s.size() <= n ? s : s.substr(0, n) + "..."; }

int run_inspect(const InspectArgs& a) {
  auto file = open_input(a.file);
  if (!file) return report_error("inspect", file.status());
  auto groups = find_quant_groups(*file);
  if (!groups) return report_error("inspect", groups.status());

  auto resolved = resolve_input_path(a.file);
  if (resolved && *resolved != a.file) {
    std::printf("%s (latest checkpoint: %s)\n", a.file.c_str(), resolved->c_str());
  } else {
    std::printf("%s\n", a.file.c_str());
  }
  if (!file->metadata().empty()) {
    std::printf("metadata:\n");
    for (const auto& [k, v] : file->metadata()) std::printf("  %s = %s\n", k.c_str(), truncated(v, 200).c_str());
  }
  const auto names = file->names();
  size_t w = 6;
  for (const auto& n : names) w = std::max(w, n.size());
  uint64_t total = 0;
  std::printf("tensors (%zu):\n  %-*s  %-8s  %-20s  %12s\n", names.size(), static_cast<int>(w), "name", "dtype",
              "shape", "bytes");
  for (const auto& n : names) {
    auto info = file->info(n);
    if (!info) return report_error("inspect", info.status());
    uint64_t bytes = info->data_end - info->data_begin;
    total += bytes;
    std::printf("  %-*s  %-8s  %-20s  %12llu\n", static_cast<int>(w), n.c_str(),
                std::string(dtype_name(info->dtype)).c_str(), shape_str(info->shape).c_str(),
                static_cast<unsigned long long>(bytes));
  }
  std::printf("total %llu bytes of tensor data\n", static_cast<unsigned long long>(total));

  if (!groups->empty()) {
    std::printf("quantized groups (%zu):\n", groups->size());
    for (const auto& g : *groups) {
      std::string members = g.codes + ", " + g.scales + (g.global.empty() ? "" : ", " + g.global);
      std::printf("  %s: %s %s%s, layout %s, shape %s [%s]\n", g.base.c_str(), format_name(g.format).c_str(),
                  g.block.c_str(), g.scale_rule.empty() ? "" : (" " + g.scale_rule).c_str(),
                  layout_name(g.layout).c_str(), shape_str(g.shape).c_str(), members.c_str());
    }
  }
  if (a.against.empty()) return 0;

  auto src = open_input(a.against);
  if (!src) return report_error("inspect", src.status());
  std::printf("error against %s:\n  %-*s  %-14s  %11s  %9s  %11s  %8s  %7s  %9s\n", a.against.c_str(),
              static_cast<int>(w), "tensor", "format", "rmse", "rel_rmse", "max_abs", "snr_db", "zeros", "nonfinite");
  std::set<std::string> members;
  for (const auto& g : *groups) {
    members.insert({g.codes, g.scales, g.global});
    if (!src->contains(g.base)) {
      std::printf("  %-*s  not in %s\n", static_cast<int>(w), g.base.c_str(), a.against.c_str());
      continue;
    }
    auto xt = src->get(g.base);
    if (!xt) return report_error("inspect", xt.status());
    if (xt->shape() != g.shape || !dtype_is_floating(xt->dtype())) {
      return report_error("inspect", data_loss("{}: source is {} {}, quantized shape is {}", g.base,
                                               dtype_name(xt->dtype()), shape_str(xt->shape()), shape_str(g.shape)));
    }
    auto y = dequantize_group(*file, g);
    if (!y) return report_error("inspect", y.status());
    Tensor x = xt->to_f32();
    ErrorStats s = error_stats(y->data<float>(), x.data<float>(), x.numel());
    // A non-finite value is never an exact match: the row says how many there are and that the
    // statistics leave them out.
    std::string note;
    if (s.nonfinite > 0)
      note = fmt::format("  NOT EXACT: {} of {} values are NaN/Inf (source or dequantized); statistics over the rest",
                         s.nonfinite, x.numel());
    std::printf("  %-*s  %-14s  %11.4e  %9.5f  %11.4e  %8.2f  %7.4f  %9lld%s\n", static_cast<int>(w), g.base.c_str(),
                format_name(g.format).c_str(), s.rmse, s.rel_rmse, s.max_abs, s.snr_db, s.zeros,
                static_cast<long long>(s.nonfinite), note.c_str());
  }
  // Tensors stored unquantized: say whether they equal the source byte for byte.
  for (const auto& n : names) {
    if (members.count(n) || !src->contains(n)) continue;
    auto a_t = file->get(n);
    auto b_t = src->get(n);
    if (!a_t || !b_t) continue;
    bool same = a_t->dtype() == b_t->dtype() && a_t->shape() == b_t->shape() &&
                std::memcmp(a_t->raw(), b_t->raw(), a_t->nbytes()) == 0;
    std::printf("  %-*s  %-14s  %s\n", static_cast<int>(w), n.c_str(), "copied", same ? "identical" : "DIFFERS");
  }
  return 0;
}

CommandRun setup_inspect(CLI::App& app) {
  auto a = std::make_shared<InspectArgs>();
  app.add_option("FILE", a->file,
                 "A .safetensors file, a sharded checkpoint folder / index .json, or a nibble run folder (its latest "
                 "checkpoint's model)")
      ->required();
  app.add_option("--against", a->against, "Source checkpoint: dequantize each quantized group and print its error");
  return [a] { return run_inspect(*a); };
}

}  // namespace

NIBBLE_REGISTER_COMMAND(inspect_command, "inspect", "List a safetensors file; error of quantized tensors vs a source",
                        setup_inspect);

}  // namespace nibble::tools
