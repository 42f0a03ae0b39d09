// Loss-curve plots as PNG (libpng): train loss and validation loss against the step, with axes,
// numbered ticks on "nice" 1-2-5 steps, grid lines and a legend, drawn into an RGB canvas with
// a built-in 5x7 bitmap font (digits, letters drawn lowercase, . - + : _ , ( ) / % = < > | ') scaled 2x;
// other characters are drawn as a box. Small and
// dependency-light on purpose (no matplotlib/gnuplot at run time), like llm.c's plain outputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/status.h"

namespace nibble::train {

struct PlotPoint {
  double step = 0;
  double value = 0;
};

// An 8-bit RGB image. rgb: (height, width, 3) u8 row-major.
struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;
};

// Any number of named curves (at most 10 colours) on one set of axes: the loss curves of several
// runs, a late-training window (x_min/x_max), a counter over time.
struct PlotSeries {
  std::string name;  // legend text (plot_glyph_known says which characters the font draws)
  std::vector<PlotPoint> points;
  bool markers = false;  // a square at every point
};
struct PlotOptions {
  int width = 800, height = 500;
  std::string x_label = "step", y_label = "loss", title;
  double x_min = -INFINITY, x_max = INFINITY;  // points outside are left out (the y range follows)
};
Result<RgbImage> render_series_plot(const std::vector<PlotSeries>& series, const PlotOptions& options);

// The train (blue line) and validation (orange, markers) loss plot. NaN/Inf points are skipped. Needs at least one finite point in total.
Result<RgbImage> render_loss_plot(const std::vector<PlotPoint>& train, const std::vector<PlotPoint>& val,
                                  int width = 800, int height = 500);
// The PNG file bytes of `image` (8-bit RGB, no interlace).
Result<std::string> encode_png(const RgbImage& image);
// render_loss_plot + encode_png, written to `path` atomically.
Status write_loss_plot(const std::string& path, const std::vector<PlotPoint>& train,
                       const std::vector<PlotPoint>& val);

// Tick positions on 1-2-5 x 10^k steps covering [lo, hi] with about `target` ticks.
std::vector<double> nice_ticks(double lo, double hi, int target = 6);

// Whether the bitmap font has a glyph for c (letters in either case); others are drawn as a box.
bool plot_glyph_known(char c);

}  // namespace nibble::train
