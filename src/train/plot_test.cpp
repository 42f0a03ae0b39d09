// Tests of the loss plot: a valid PNG (signature, IHDR size, decodes with libpng's reader),
// both curves and the legend drawn in their colours, tick choice, and errors.
#include "train/plot.h"

#include <png.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace nibble::train {
namespace {

uint32_t be32(const std::string& s, size_t at) {
  return (uint32_t(uint8_t(s[at])) << 24) | (uint32_t(uint8_t(s[at + 1])) << 16) | (uint32_t(uint8_t(s[at + 2])) << 8) |
         uint32_t(uint8_t(s[at + 3]));
}

size_t count_color(const std::vector<uint8_t>& rgb, uint8_t r, uint8_t g, uint8_t b) {
  size_t n = 0;
  for (size_t i = 0; i + 2 < rgb.size(); i += 3) n += rgb[i] == r && rgb[i + 1] == g && rgb[i + 2] == b;
  return n;
}

TEST(Plot, WritesValidPng) {
  std::vector<PlotPoint> train, val;
  for (int s = 1; s <= 500; ++s) train.push_back({double(s), 8.0 * std::exp(-s / 120.0) + 2.5 + 0.05 * std::sin(s)});
  for (int s = 50; s <= 500; s += 50) val.push_back({double(s), 8.0 * std::exp(-s / 120.0) + 2.7});
  train.push_back({501, NAN});  // skipped
  std::string path = (std::filesystem::temp_directory_path() / "nibble_plot_test.png").string();
  ASSERT_TRUE(write_loss_plot(path, train, val).is_ok());
  std::ifstream f(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), {});
  ASSERT_GT(bytes.size(), 33u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(be32(bytes, 8), 13u);           // IHDR length
  EXPECT_EQ(bytes.substr(12, 4), "IHDR");
  EXPECT_EQ(be32(bytes, 16), 800u);         // width
  EXPECT_EQ(be32(bytes, 20), 500u);         // height
  EXPECT_EQ(uint8_t(bytes[24]), 8);         // bit depth
  EXPECT_EQ(uint8_t(bytes[25]), 2);         // colour type RGB

  // Decode with libpng (checks every chunk CRC and the zlib stream) and look at the pixels.
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  ASSERT_TRUE(png_image_begin_read_from_memory(&img, bytes.data(), bytes.size())) << img.message;
  img.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> rgb(PNG_IMAGE_SIZE(img));
  ASSERT_TRUE(png_image_finish_read(&img, nullptr, rgb.data(), 0, nullptr)) << img.message;
  EXPECT_EQ(img.width, 800u);
  EXPECT_GT(count_color(rgb, 31, 119, 180), 1000u);  // the train curve (2 px wide, ~700 px long)
  EXPECT_GT(count_color(rgb, 230, 97, 0), 300u);      // val markers 7x7 x 10 + line
  EXPECT_GT(count_color(rgb, 0, 0, 0), 2000u);        // axes, ticks, digits, legend text
  std::filesystem::remove(path);
}

// Several runs on one plot: every curve in its own palette colour, a window leaves the points
// outside it out (the image equals one drawn without them), more series than colours is an error.
TEST(Plot, SeriesPlotColoursAndWindow) {
  std::vector<PlotSeries> runs;
  for (int r = 0; r < 3; ++r) {
    PlotSeries s{"run-" + std::to_string(r), {}, false};
    for (int step = 0; step <= 200; step += 10) s.points.push_back({double(step), 5.0 - 0.01 * step + 0.2 * r});
    runs.push_back(s);
  }
  PlotOptions o;
  auto img = render_series_plot(runs, o);
  ASSERT_TRUE(img.is_ok()) << img.status().message();
  EXPECT_GT(count_color(img->rgb, 31, 119, 180), 200u);  // run-0: the train colour
  EXPECT_GT(count_color(img->rgb, 230, 97, 0), 200u);    // run-1: the validation colour
  EXPECT_GT(count_color(img->rgb, 44, 160, 44), 200u);   // run-2: green
  EXPECT_EQ(count_color(img->rgb, 214, 39, 40), 0u);     // no fourth series

  std::vector<PlotSeries> late = runs, cut = runs;
  for (auto& s : late) s.points.push_back({-50.0, 100.0});  // far outside the window
  for (auto& s : cut) s.points.erase(s.points.begin(), s.points.begin() + 15);  // steps < 150
  PlotOptions window;
  window.x_min = 150;
  auto a = render_series_plot(late, window), b = render_series_plot(cut, PlotOptions{});
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(a->rgb, b->rgb);
  auto full = render_series_plot(late, PlotOptions{});
  ASSERT_TRUE(full.is_ok());
  EXPECT_NE(full->rgb, a->rgb);

  std::vector<PlotSeries> eleven(11, runs[0]);
  EXPECT_FALSE(render_series_plot(eleven, o).is_ok());
  PlotOptions empty_window;
  empty_window.x_min = 1000;
  EXPECT_FALSE(render_series_plot(runs, empty_window).is_ok());  // no point inside
}

// The titles and keys the tools draw (metric names with '_', "last 35 percent," ...) must not
// fall back to the box glyph.
TEST(Plot, FontDrawsTheCharactersOfTitlesAndKeys) {
  for (char c : std::string("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .-+:_,()/%=<>|'"))
    EXPECT_TRUE(plot_glyph_known(c)) << "no glyph for '" << c << "'";
  EXPECT_FALSE(plot_glyph_known('#'));
}

TEST(Plot, NiceTicks) {
  auto t = nice_ticks(0.0, 1000.0, 6);  // raw 166.7 -> 200
  ASSERT_EQ(t.size(), 6u);
  EXPECT_DOUBLE_EQ(t[0], 0.0);
  EXPECT_DOUBLE_EQ(t[5], 1000.0);
  auto u = nice_ticks(2.37, 3.91, 6);  // raw 0.257 -> 0.2 (norm 2.57 < 3)
  ASSERT_FALSE(u.empty());
  EXPECT_NEAR(u[0], 2.4, 1e-12);
  EXPECT_NEAR(u[1] - u[0], 0.2, 1e-12);
  EXPECT_LE(u.back(), 3.91);
  EXPECT_TRUE(nice_ticks(1.0, 1.0).empty());
}

TEST(Plot, EdgeCasesAndErrors) {
  EXPECT_FALSE(render_loss_plot({}, {}).is_ok());
  EXPECT_FALSE(render_loss_plot({{1, NAN}}, {{2, INFINITY}}).is_ok());
  auto one = render_loss_plot({{10, 3.0}}, {});  // a single point still renders
  ASSERT_TRUE(one.is_ok());
  EXPECT_EQ(one->rgb.size(), 800u * 500u * 3u);
  EXPECT_FALSE(render_loss_plot({{1, 1}}, {}, 10, 10).is_ok());
  EXPECT_FALSE(write_loss_plot("/nonexistent_dir/x.png", {{1, 1}, {2, 0.5}}, {}).is_ok());
}

}  // namespace
}  // namespace nibble::train
