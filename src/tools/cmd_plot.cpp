// `nibble plot --key K --out FILE.png METRICS.jsonl...`: one curve per metrics file (legend: the
// file name without `.metrics.jsonl` / `.jsonl`) of the numeric field K of its events against
// their "step", as a PNG drawn by train/plot.h (no matplotlib). --from-step/--to-step enlarge a
// window (the late-training part of the loss curves); the report tooling of the TetraJet-v2
// reproduction (scripts/repro/report.py) draws every figure with it.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "tools/command.h"
#include "train/atomic_dir.h"
#include "train/metrics.h"
#include "train/plot.h"

namespace nibble::tools {
namespace {

struct PlotArgs {
  std::vector<std::string> inputs;
  std::string key, out, title, y_label;
  double from_step = -INFINITY, to_step = INFINITY;
  int width = 900, height = 560;
};

std::string series_name(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  for (const std::string suffix : {".metrics.jsonl", ".jsonl"})
    if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      name.resize(name.size() - suffix.size());
      break;
    }
  return name;
}

int run_plot(const PlotArgs& a) {
  std::vector<train::PlotSeries> series;
  size_t points = 0;
  for (const std::string& path : a.inputs) {
    auto events = train::read_metrics(path);
    if (!events) return report_error("plot", events.status());
    train::PlotSeries s;
    s.name = series_name(path);
    for (const auto& e : *events) {
      if (!e.contains("step") || !e["step"].is_number() || !e.contains(a.key) || !e[a.key].is_number()) continue;
      if (e.contains("event") && e["event"] == "end") continue;  // repeats the last validation
      s.points.push_back({e["step"].get<double>(), e[a.key].get<double>()});
    }
    s.markers = s.points.size() <= 40;
    points += s.points.size();
    series.push_back(std::move(s));
  }
  if (points == 0)
    return report_error("plot", data_loss("no event in {} file(s) has a numeric '{}' and a step", a.inputs.size(), a.key));
  train::PlotOptions o;
  o.width = a.width;
  o.height = a.height;
  o.title = a.title;
  o.y_label = a.y_label.empty() ? a.key : a.y_label;
  o.x_min = a.from_step;
  o.x_max = a.to_step;
  auto image = train::render_series_plot(series, o);
  if (!image) return report_error("plot", image.status());
  auto png = train::encode_png(*image);
  if (!png) return report_error("plot", png.status());
  if (Status s = train::write_file_atomic(a.out, *png); !s.is_ok()) return report_error("plot", s);
  std::printf("plot: %s: %zu curve(s) of %s, %zu points\n", a.out.c_str(), series.size(), a.key.c_str(), points);
  return 0;
}

CommandRun setup_plot(CLI::App& app) {
  auto a = std::make_shared<PlotArgs>();
  app.add_option("inputs", a->inputs, "metrics.jsonl files, one curve each (at most 10)")->required();
  app.add_option("--key", a->key, "The event field to plot (val_loss, loss, recipe.oscireset.resets, ...)")->required();
  app.add_option("--out", a->out, "The PNG to write")->required();
  app.add_option("--from-step", a->from_step, "Leave out points before this step");
  app.add_option("--to-step", a->to_step, "Leave out points after this step");
  app.add_option("--title", a->title, "Title above the plot");
  app.add_option("--y-label", a->y_label, "Y axis label (default: the key)");
  app.add_option("--width", a->width, "Width in pixels")->capture_default_str();
  app.add_option("--height", a->height, "Height in pixels")->capture_default_str();
  return [a]() { return run_plot(*a); };
}

NIBBLE_REGISTER_COMMAND(plot_command, "plot", "Plot a metrics field of one or more runs as PNG", setup_plot);

}  // namespace
}  // namespace nibble::tools
