// Loss-curve PNG rendering with a tiny bitmap font; see plot.h.
#include "train/plot.h"

#include <png.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <csetjmp>
#include <map>

#include <fmt/format.h>

#include "train/atomic_dir.h"

namespace nibble::train {

namespace {

// 5x7 glyphs, 7 rows of 5 pixels ('1' = ink), top row first.
const std::map<char, std::array<const char*, 7>>& font() {
  static const std::map<char, std::array<const char*, 7>> f = {
      {'0', {"01110", "10001", "10011", "10101", "11001", "10001", "01110"}},
      {'1', {"00100", "01100", "00100", "00100", "00100", "00100", "01110"}},
      {'2', {"01110", "10001", "00001", "00010", "00100", "01000", "11111"}},
      {'3', {"11111", "00010", "00100", "00010", "00001", "10001", "01110"}},
      {'4', {"00010", "00110", "01010", "10010", "11111", "00010", "00010"}},
      {'5', {"11111", "10000", "11110", "00001", "00001", "10001", "01110"}},
      {'6', {"00110", "01000", "10000", "11110", "10001", "10001", "01110"}},
      {'7', {"11111", "00001", "00010", "00100", "01000", "01000", "01000"}},
      {'8', {"01110", "10001", "10001", "01110", "10001", "10001", "01110"}},
      {'9', {"01110", "10001", "10001", "01111", "00001", "00010", "01100"}},
      {'.', {"00000", "00000", "00000", "00000", "00000", "01100", "01100"}},
      {'-', {"00000", "00000", "00000", "11111", "00000", "00000", "00000"}},
      {'+', {"00000", "00100", "00100", "11111", "00100", "00100", "00000"}},
      {':', {"00000", "01100", "01100", "00000", "01100", "01100", "00000"}},
      {'_', {"00000", "00000", "00000", "00000", "00000", "00000", "11111"}},
      {',', {"00000", "00000", "00000", "00000", "01100", "00100", "01000"}},
      {'(', {"00010", "00100", "01000", "01000", "01000", "00100", "00010"}},
      {')', {"01000", "00100", "00010", "00010", "00010", "00100", "01000"}},
      {'/', {"00000", "00001", "00010", "00100", "01000", "10000", "00000"}},
      {'%', {"11000", "11001", "00010", "00100", "01000", "10011", "00011"}},
      {'=', {"00000", "00000", "11111", "00000", "11111", "00000", "00000"}},
      {'<', {"00010", "00100", "01000", "10000", "01000", "00100", "00010"}},
      {'>', {"01000", "00100", "00010", "00001", "00010", "00100", "01000"}},
      {'|', {"00100", "00100", "00100", "00100", "00100", "00100", "00100"}},
      {'\'', {"01100", "00100", "01000", "00000", "00000", "00000", "00000"}},
      {'a', {"00000", "00000", "01110", "00001", "01111", "10001", "01111"}},
      {'b', {"10000", "10000", "10110", "11001", "10001", "10001", "11110"}},
      {'c', {"00000", "00000", "01110", "10000", "10000", "10001", "01110"}},
      {'d', {"00001", "00001", "01101", "10011", "10001", "10001", "01111"}},
      {'e', {"00000", "00000", "01110", "10001", "11111", "10000", "01110"}},
      {'f', {"00110", "01001", "01000", "11100", "01000", "01000", "01000"}},
      {'g', {"00000", "01111", "10001", "10001", "01111", "00001", "01110"}},
      {'h', {"10000", "10000", "10110", "11001", "10001", "10001", "10001"}},
      {'i', {"00100", "00000", "01100", "00100", "00100", "00100", "01110"}},
      {'j', {"00010", "00000", "00110", "00010", "00010", "10010", "01100"}},
      {'k', {"10000", "10000", "10010", "10100", "11000", "10100", "10010"}},
      {'l', {"01100", "00100", "00100", "00100", "00100", "00100", "01110"}},
      {'m', {"00000", "00000", "11010", "10101", "10101", "10001", "10001"}},
      {'n', {"00000", "00000", "10110", "11001", "10001", "10001", "10001"}},
      {'o', {"00000", "00000", "01110", "10001", "10001", "10001", "01110"}},
      {'p', {"00000", "00000", "11110", "10001", "10001", "11110", "10000"}},
      {'q', {"00000", "00000", "01101", "10011", "01111", "00001", "00001"}},
      {'r', {"00000", "00000", "10110", "11001", "10000", "10000", "10000"}},
      {'s', {"00000", "00000", "01110", "10000", "01110", "00001", "11110"}},
      {'t', {"01000", "01000", "11100", "01000", "01000", "01001", "00110"}},
      {'u', {"00000", "00000", "10001", "10001", "10001", "10011", "01101"}},
      {'v', {"00000", "00000", "10001", "10001", "10001", "01010", "00100"}},
      {'w', {"00000", "00000", "10001", "10001", "10101", "10101", "01010"}},
      {'x', {"00000", "00000", "10001", "01010", "00100", "01010", "10001"}},
      {'y', {"00000", "00000", "10001", "10001", "01111", "00001", "01110"}},
      {'z', {"00000", "00000", "11111", "00010", "00100", "01000", "11111"}},
      {'?', {"11111", "10001", "10001", "10001", "10001", "10001", "11111"}},  // unknown glyph: a box
  };
  return f;
}

constexpr int kScale = 2;                  // font pixels per glyph pixel
constexpr int kGlyphW = 6 * kScale;        // 5 columns + 1 spacing
constexpr int kGlyphH = 7 * kScale;

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGrid{225, 225, 225};
constexpr Rgb kTrainColor{31, 119, 180}, kValColor{230, 97, 0};
// Series colours in order (train and validation first, as the loss plot has always drawn them),
// then matplotlib's tab10 rest.
constexpr std::array<Rgb, 10> kPalette{kTrainColor, kValColor, Rgb{44, 160, 44},  Rgb{214, 39, 40},
                                       Rgb{148, 103, 189}, Rgb{140, 86, 75},   Rgb{227, 119, 194},
                                       Rgb{127, 127, 127}, Rgb{188, 189, 34},  Rgb{23, 190, 207}};

class Canvas {
 public:
  Canvas(int w, int h) : img_{w, h, std::vector<uint8_t>(static_cast<size_t>(w) * h * 3, 255)} {}
  void set(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= img_.width || y >= img_.height) return;
    uint8_t* p = &img_.rgb[(static_cast<size_t>(y) * img_.width + x) * 3];
    p[0] = c.r;
    p[1] = c.g;
    p[2] = c.b;
  }
  void fill(int x0, int y0, int x1, int y1, Rgb c) {
    for (int y = y0; y <= y1; ++y)
      for (int x = x0; x <= x1; ++x) set(x, y, c);
  }
  // Bresenham line, `thick` x `thick` pen.
  void line(int x0, int y0, int x1, int y1, Rgb c, int thick = 1) {
    int dx = std::abs(x1 - x0), sx = x0 < x1 ? 1 : -1, dy = -std::abs(y1 - y0), sy = y0 < y1 ? 1 : -1;
    int err = dx + dy;
    for (;;) {
      fill(x0 - (thick - 1) / 2, y0 - (thick - 1) / 2, x0 + thick / 2, y0 + thick / 2, c);
      if (x0 == x1 && y0 == y1) break;
      int e2 = 2 * err;
      if (e2 >= dy) {
        err += dy;
        x0 += sx;
      }
      if (e2 <= dx) {
        err += dx;
        y0 += sy;
      }
    }
  }
  void text(int x, int y, const std::string& s, Rgb c) {  // (x, y): top-left
    for (char ch : s) {
      char k = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      if (k != ' ') {
        auto it = font().find(k);
        const auto& g = it != font().end() ? it->second : font().at('?');
        for (int r = 0; r < 7; ++r)
          for (int col = 0; col < 5; ++col)
            if (g[r][col] == '1') fill(x + col * kScale, y + r * kScale, x + col * kScale + kScale - 1,
                                       y + r * kScale + kScale - 1, c);
      }
      x += kGlyphW;
    }
  }
  RgbImage take() { return std::move(img_); }

 private:
  RgbImage img_;
};

int text_width(const std::string& s) { return static_cast<int>(s.size()) * kGlyphW - kScale; }

std::string tick_label(double v, double step) {
  int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)));
  if (std::fabs(v) < step * 1e-6) v = 0;  // print 0, not -0.000
  return fmt::format("{:.{}f}", v, decimals);
}

}  // namespace

bool plot_glyph_known(char c) {
  return c == ' ' || font().count(static_cast<char>(std::tolower(static_cast<unsigned char>(c)))) > 0;
}

std::vector<double> nice_ticks(double lo, double hi, int target) {
  std::vector<double> ticks;
  if (!(hi > lo) || target < 1) return ticks;
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double step = (norm < 1.5 ? 1.0 : norm < 3.0 ? 2.0 : norm < 7.0 ? 5.0 : 10.0) * mag;
  for (double k = std::ceil(lo / step - 1e-9); k * step <= hi + step * 1e-9; k += 1.0) ticks.push_back(k * step);
  return ticks;
}

Result<RgbImage> render_series_plot(const std::vector<PlotSeries>& series, const PlotOptions& o) {
  const int width = o.width, height = o.height;
  if (series.size() > kPalette.size())
    return invalid_argument("plot: {} series, at most {}", series.size(), kPalette.size());
  if (width < 200 || height < 150 || width > 8192 || height > 8192)
    return invalid_argument("plot size {}x{} outside [200, 8192] x [150, 8192]", width, height);
  double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
  auto in_window = [&](const PlotPoint& p) {
    return std::isfinite(p.step) && std::isfinite(p.value) && p.step >= o.x_min && p.step <= o.x_max;
  };
  for (const PlotSeries& se : series)
    for (const PlotPoint& p : se.points)
      if (in_window(p)) {
        xmin = std::min(xmin, p.step);
        xmax = std::max(xmax, p.step);
        ymin = std::min(ymin, p.value);
        ymax = std::max(ymax, p.value);
      }
  if (!std::isfinite(xmin)) return invalid_argument("plot: no finite points to draw");
  if (xmax == xmin) {
    xmin -= 1;
    xmax += 1;
  }
  if (ymax == ymin) {
    const double d = std::max(std::fabs(ymin) * 0.1, 0.5);
    ymin -= d;
    ymax += d;
  }
  const double pad = (ymax - ymin) * 0.05;
  ymin -= pad;
  ymax += pad;

  auto xt = nice_ticks(xmin, xmax, 6), yt = nice_ticks(ymin, ymax, 6);
  const double xstep = xt.size() > 1 ? xt[1] - xt[0] : 1.0, ystep = yt.size() > 1 ? yt[1] - yt[0] : 1.0;
  // Plot area in pixels: [left, right] x [top, bottom]; wide y tick labels (4000000) widen the left
  // margin, and a title gets its own row above the y label's.
  int widest_y_tick = 0;
  for (double t : yt) widest_y_tick = std::max(widest_y_tick, text_width(tick_label(t, ystep)));
  const int left = std::max(90, widest_y_tick + 9 + 8), right = width - 40;
  const int top = o.title.empty() ? 40 : 40 + kGlyphH + 6, bottom = height - 60;
  auto px = [&](double x) { return left + static_cast<int>(std::lround((x - xmin) / (xmax - xmin) * (right - left))); };
  auto py = [&](double y) { return bottom - static_cast<int>(std::lround((y - ymin) / (ymax - ymin) * (bottom - top))); };

  Canvas c(width, height);
  for (double t : yt) {
    const int y = py(t);
    c.line(left, y, right, y, kGrid);
    c.line(left - 5, y, left, y, kBlack);
    std::string s = tick_label(t, ystep);
    c.text(left - 9 - text_width(s), y - kGlyphH / 2, s, kBlack);
  }
  for (double t : xt) {
    const int x = px(t);
    c.line(x, top, x, bottom, kGrid);
    c.line(x, bottom, x, bottom + 5, kBlack);
    std::string s = tick_label(t, xstep);
    c.text(x - text_width(s) / 2, bottom + 10, s, kBlack);
  }
  c.line(left, top, left, bottom, kBlack);
  c.line(left, bottom, right, bottom, kBlack);
  c.text((left + right - text_width(o.x_label)) / 2, height - 30, o.x_label, kBlack);
  c.text(std::max(4, left - 9 - text_width(o.y_label)), top - 26, o.y_label, kBlack);
  if (!o.title.empty()) c.text((left + right - text_width(o.title)) / 2, 8, o.title, kBlack);

  auto draw_series = [&](const std::vector<PlotPoint>& pts, Rgb color, bool markers) {
    std::vector<PlotPoint> s;
    for (const PlotPoint& p : pts)
      if (in_window(p)) s.push_back(p);
    std::stable_sort(s.begin(), s.end(), [](const PlotPoint& a, const PlotPoint& b) { return a.step < b.step; });
    for (size_t i = 0; i + 1 < s.size(); ++i) c.line(px(s[i].step), py(s[i].value), px(s[i + 1].step), py(s[i + 1].value), color, 2);
    if (markers || s.size() == 1)
      for (const PlotPoint& p : s) c.fill(px(p.step) - 3, py(p.value) - 3, px(p.step) + 3, py(p.value) + 3, color);
  };
  for (size_t i = 0; i < series.size(); ++i) draw_series(series[i].points, kPalette[i], series[i].markers);

  // Legend, top right inside the plot area.
  int name_w = 0;
  for (const PlotSeries& se : series) name_w = std::max(name_w, text_width(se.name));
  const int lw = 40 + name_w + 16, lh = static_cast<int>(series.size()) * (kGlyphH + 8) + 8;
  const int lx = right - lw - 10, ly = top + 10;
  c.fill(lx, ly, lx + lw, ly + lh, kWhite);
  c.line(lx, ly, lx + lw, ly, kBlack);
  c.line(lx, ly + lh, lx + lw, ly + lh, kBlack);
  c.line(lx, ly, lx, ly + lh, kBlack);
  c.line(lx + lw, ly, lx + lw, ly + lh, kBlack);
  int row = ly + 8;
  for (size_t i = 0; i < series.size(); ++i) {
    c.line(lx + 8, row + kGlyphH / 2, lx + 32, row + kGlyphH / 2, kPalette[i], 3);
    c.text(lx + 40, row, series[i].name, kBlack);
    row += kGlyphH + 8;
  }
  return c.take();
}

Result<RgbImage> render_loss_plot(const std::vector<PlotPoint>& train, const std::vector<PlotPoint>& val, int width,
                                  int height) {
  PlotOptions o;
  o.width = width;
  o.height = height;
  return render_series_plot({{"train", train, false}, {"val", val, true}}, o);
}

namespace {
void png_append(png_structp png, png_bytep data, png_size_t n) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), n);
}
void png_flush_noop(png_structp) {}
}  // namespace

Result<std::string> encode_png(const RgbImage& image) {
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() != static_cast<size_t>(image.width) * image.height * 3)
    return invalid_argument("encode_png: image {}x{} with {} bytes", image.width, image.height, image.rgb.size());
  std::string out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  if (!png) return io_error("libpng: cannot create write struct");
  png_infop info = png_create_info_struct(png);
  if (!info) {
    png_destroy_write_struct(&png, nullptr);
    return io_error("libpng: cannot create info struct");
  }
  std::vector<png_bytep> rows(static_cast<size_t>(image.height));
  for (int y = 0; y < image.height; ++y)
    rows[y] = const_cast<png_bytep>(image.rgb.data() + static_cast<size_t>(y) * image.width * 3);
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return io_error("libpng: encoding failed");
  }
  png_set_write_fn(png, &out, png_append, png_flush_noop);
  png_set_IHDR(png, info, image.width, image.height, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

Status write_loss_plot(const std::string& path, const std::vector<PlotPoint>& train,
                       const std::vector<PlotPoint>& val) {
  NIB_ASSIGN_OR_RETURN(RgbImage image, render_loss_plot(train, val));
  NIB_ASSIGN_OR_RETURN(std::string png, encode_png(image));
  return write_file_atomic(path, png);
}

}  // namespace nibble::train
