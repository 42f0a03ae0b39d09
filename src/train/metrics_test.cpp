// Tests of the JSON-lines metrics file and the progress bar text.
#include "train/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "train/progress.h"

namespace nibble::train {
namespace {

std::string temp_file(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("nibble_metrics_test_" + std::to_string(::getpid()) + name)).string();
}

TEST(Metrics, LinesParseAsJson) {
  std::string path = temp_file("m.jsonl");
  {
    auto w = MetricsWriter::open(path, true);
    ASSERT_TRUE(w.is_ok()) << w.status().message();
    ASSERT_TRUE(w->write({{"step", 1}, {"train_loss", 5.25}, {"lr", 1e-4}}).is_ok());
    ASSERT_TRUE(w->write({{"step", 2}, {"train_loss", NAN}, {"note", "nan becomes null"}}).is_ok());
    ASSERT_TRUE(w->write({{"step", 2}, {"val_loss", 4.5}}).is_ok());
    EXPECT_FALSE(w->write(nlohmann::json::array({1, 2})).is_ok());
  }
  {  // append keeps earlier lines
    auto w = MetricsWriter::open(path);
    ASSERT_TRUE(w.is_ok());
    ASSERT_TRUE(w->write({{"step", 3}, {"train_loss", 4.0}}).is_ok());
  }
  std::ifstream f(path);
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << line;
    EXPECT_TRUE(j.is_object());
    ++n;
  }
  EXPECT_EQ(n, 4);
  auto events = read_metrics(path);
  ASSERT_TRUE(events.is_ok());
  ASSERT_EQ(events->size(), 4u);
  EXPECT_EQ((*events)[0]["train_loss"].get<double>(), 5.25);
  EXPECT_TRUE((*events)[1]["train_loss"].is_null());

  // Resume at step 2: events of step 3 go.
  ASSERT_TRUE(drop_metrics_after_step(path, 2).is_ok());
  events = read_metrics(path);
  ASSERT_TRUE(events.is_ok());
  EXPECT_EQ(events->size(), 3u);

  // A partial last line (crash mid-write) is skipped; a broken middle line is an error.
  { std::ofstream(path, std::ios::app) << "{\"step\": 4, \"train_l"; }
  events = read_metrics(path);
  ASSERT_TRUE(events.is_ok());
  EXPECT_EQ(events->size(), 3u);
  { std::ofstream(path, std::ios::app) << "\n{\"step\": 5}\n"; }
  auto broken = read_metrics(path);
  ASSERT_FALSE(broken.is_ok());
  EXPECT_NE(broken.status().message().find("line 4"), std::string::npos) << broken.status().message();
  std::filesystem::remove(path);
  EXPECT_FALSE(read_metrics(path).is_ok());
  EXPECT_TRUE(drop_metrics_after_step(path, 1).is_ok());  // nothing to drop
}

// The steps at which a non-terminal ProgressBar(total, start, every) prints a line when updated
// at every step from start + 1 to total.
std::vector<int64_t> plain_line_steps(int64_t total, int64_t start, int64_t every) {
  std::FILE* f = std::tmpfile();
  EXPECT_NE(f, nullptr);
  ProgressBar bar(total, start, every, f, false);
  for (int64_t s = start + 1; s <= total; ++s) bar.update(s, 2.0, 100.0);
  bar.finish();
  std::rewind(f);
  char buf[8192];
  const size_t n = std::fread(buf, 1, sizeof(buf), f);
  std::fclose(f);
  std::string out(buf, n);
  EXPECT_EQ(out.find('\r'), std::string::npos);
  std::vector<int64_t> steps;
  for (size_t at = out.find("step "); at != std::string::npos; at = out.find("step ", at + 1))
    steps.push_back(std::stoll(out.substr(at + 5)));
  return steps;
}

TEST(Progress, PerplexityIsReadableWhenHuge) {
  EXPECT_EQ(ProgressBar::format_perplexity(42.18512), "42.185");
  EXPECT_EQ(ProgressBar::format_perplexity(999999.0), "999999.000");
  EXPECT_EQ(ProgressBar::format_perplexity(std::exp(287.0)), "4.3905e+124");  // not 125 digits
  EXPECT_EQ(ProgressBar::format_perplexity(INFINITY), "inf");
}

TEST(Progress, FormatAndPlainLines) {
  EXPECT_EQ(ProgressBar::format(50, 200, 3.14159, 18300, 252, 10),
            "step 50/200 [##........]  25.0% loss 3.1416 | 18.3k tok/s | eta 4m12s");
  EXPECT_EQ(ProgressBar::format_duration(59), "59s");
  EXPECT_EQ(ProgressBar::format_duration(7380), "2h03m");
  EXPECT_EQ(ProgressBar::format_duration(-1), "?");
  EXPECT_NE(ProgressBar::format(1, 10, 1.0, 2.5e6, -1).find("2.50M tok/s | eta ?"), std::string::npos);

  // Not a terminal: a plain line at the run's first step, at multiples of the interval, and at
  // the last step (the old rule, "interval steps after the last line", printed 1, 3, 5, 6 for
  // log_interval 2 and 6 steps).
  EXPECT_EQ(plain_line_steps(10, 0, 3), (std::vector<int64_t>{1, 3, 6, 9, 10}));
  EXPECT_EQ(plain_line_steps(6, 0, 2), (std::vector<int64_t>{1, 2, 4, 6}));
  EXPECT_EQ(plain_line_steps(10, 4, 4), (std::vector<int64_t>{5, 8, 10}));  // resumed at step 4
  EXPECT_EQ(plain_line_steps(3, 0, 1), (std::vector<int64_t>{1, 2, 3}));

  // A terminal: redrawn in place.
  std::FILE* f = std::tmpfile();
  char buf[4096];
  size_t n = 0;
  std::string out;
  ProgressBar tty(3, 0, 1, f, true);
  for (int s = 1; s <= 3; ++s) tty.update(s, 1.0, 10.0);
  tty.finish();
  std::rewind(f);
  n = std::fread(buf, 1, sizeof(buf), f);
  out.assign(buf, n);
  std::fclose(f);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\r'), 3);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
}

}  // namespace
}  // namespace nibble::train
