// Progress bar on stderr; see progress.h.
#include "train/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

namespace nibble::train {

ProgressBar::ProgressBar(int64_t total_steps, int64_t start_step, int64_t plain_every, std::FILE* out)
    : ProgressBar(total_steps, start_step, plain_every, out, ::isatty(::fileno(out)) != 0) {}

ProgressBar::ProgressBar(int64_t total_steps, int64_t start_step, int64_t plain_every, std::FILE* out, bool is_tty)
    : total_(total_steps),
      start_(start_step),
      plain_every_(plain_every < 1 ? 1 : plain_every),
      out_(out),
      tty_(is_tty),
      t0_(std::chrono::steady_clock::now()) {}

std::string ProgressBar::format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const int64_t t = static_cast<int64_t>(std::llround(s));
  if (t < 60) return fmt::format("{}s", t);
  if (t < 3600) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
}

std::string ProgressBar::format_perplexity(double ppl) {
  if (!std::isfinite(ppl)) return std::isnan(ppl) ? "nan" : "inf";
  return std::fabs(ppl) < 1e6 ? fmt::format("{:.3f}", ppl) : fmt::format("{:.4e}", ppl);
}

std::string ProgressBar::format(int64_t step, int64_t total, double loss, double tps, double eta, int bar_width) {
  const double frac = total > 0 ? std::clamp(static_cast<double>(step) / static_cast<double>(total), 0.0, 1.0) : 0.0;
  const int filled = static_cast<int>(std::floor(frac * bar_width));
  std::string bar = std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(bar_width - filled), '.');
  std::string rate = tps >= 1e6 ? fmt::format("{:.2f}M", tps / 1e6) : tps >= 1e3 ? fmt::format("{:.1f}k", tps / 1e3)
                                                                                : fmt::format("{:.0f}", tps);
  return fmt::format("step {}/{} [{}] {:5.1f}% loss {:.4f} | {} tok/s | eta {}", step, total, bar, 100.0 * frac, loss,
                     rate, eta < 0 ? std::string("?") : format_duration(eta));
}

void ProgressBar::update(int64_t step, double loss, double tps) {
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const int64_t done = step - start_;
  const double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(total_ - step) : -1.0;
  const std::string line = format(step, total_, loss, tps, eta);
  if (tty_) {
    std::fprintf(out_, "\r%s\x1b[K", line.c_str());  // \x1b[K clears what a longer line left
    drawn_ = true;
  } else if (step == start_ + 1 || step % plain_every_ == 0 || step == total_) {
    // Plain lines at the first step of this run, at multiples of the interval, and at the end.
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void ProgressBar::finish() {
  if (tty_ && drawn_) std::fprintf(out_, "\n");
  drawn_ = false;
  std::fflush(out_);
}

ByteProgress::ByteProgress(int64_t total_bytes, std::FILE* out)
    : ByteProgress(total_bytes, out, out != nullptr && ::isatty(::fileno(out)) != 0) {}

ByteProgress::ByteProgress(int64_t total_bytes, std::FILE* out, bool is_tty)
    : total_(total_bytes), out_(out), tty_(is_tty), t0_(std::chrono::steady_clock::now()) {}

std::string ByteProgress::format(int64_t done, int64_t total, int64_t tokens, double bps, double eta, int bar_width) {
  const double frac = total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0) : 1.0;
  const int filled = static_cast<int>(std::floor(frac * bar_width));
  const std::string bar =
      std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(bar_width - filled), '.');
  const double mib = 1024.0 * 1024.0;
  const std::string tok = tokens >= 1000000 ? fmt::format("{:.1f}M", static_cast<double>(tokens) / 1e6)
                                            : fmt::format("{}", tokens);
  return fmt::format("shards {:.1f}/{:.1f} MiB [{}] {:5.1f}% | {:.1f} MiB/s | {} tokens | eta {}",
                     static_cast<double>(done) / mib, static_cast<double>(total) / mib, bar, 100.0 * frac, bps / mib,
                     tok, eta < 0 ? std::string("?") : ProgressBar::format_duration(eta));
}

void ByteProgress::update(int64_t done, int64_t tokens) {
  if (out_ == nullptr) return;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  const double bps = elapsed > 0 ? static_cast<double>(done) / elapsed : 0.0;
  const double eta = done > 0 && bps > 0 ? static_cast<double>(total_ - done) / bps : -1.0;
  const std::string line = format(done, total_, tokens, bps, eta);
  const int decile = total_ > 0 ? static_cast<int>(10 * done / total_) : 10;
  if (tty_) {
    std::fprintf(out_, "\r%s\x1b[K", line.c_str());
    drawn_ = true;
  } else if (decile > last_decile_) {
    std::fprintf(out_, "%s\n", line.c_str());
    last_decile_ = decile;
  }
  std::fflush(out_);
}

void ByteProgress::finish() {
  if (out_ == nullptr) return;
  if (tty_ && drawn_) std::fprintf(out_, "\n");
  drawn_ = false;
  std::fflush(out_);
}

}  // namespace nibble::train
