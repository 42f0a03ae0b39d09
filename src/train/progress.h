// A one-line progress report for long work on stderr: "step 120/1000 [###....] 12.0% loss
// 3.412 | 18.3k tok/s | eta 4m12s". On a terminal the line is redrawn in place with '\r'; when
// stderr is a file or pipe (CI, nohup) a plain line is printed instead at the run's first step,
// at every multiple of `plain_every` and at the last step, so logs stay readable. Mirrors tqdm's
// behaviour without its dependency.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace nibble::train {

class ProgressBar {
 public:
  // total_steps: the final step; start_step: where this (possibly resumed) run starts.
  ProgressBar(int64_t total_steps, int64_t start_step = 0, int64_t plain_every = 50, std::FILE* out = stderr);
  ProgressBar(int64_t total_steps, int64_t start_step, int64_t plain_every, std::FILE* out, bool is_tty);

  // Reports that `step` steps are done (1-based count), with the latest loss and throughput.
  void update(int64_t step, double loss, double tokens_per_second);
  // Ends the in-place line (newline on a terminal).
  void finish();

  // The text of one report (no '\r' or '\n'); eta_seconds < 0 prints "eta ?".
  static std::string format(int64_t step, int64_t total, double loss, double tokens_per_second, double eta_seconds,
                            int bar_width = 20);
  // "59s", "4m12s", "2h03m".
  static std::string format_duration(double seconds);
  // A perplexity for people: "42.185" below 1e6, "1.2346e+124" from there on, "inf"/"nan".
  static std::string format_perplexity(double ppl);

 private:
  int64_t total_, start_, plain_every_;
  std::FILE* out_;
  bool tty_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point t0_;
};

// Progress of work measured in bytes (the shard builder reading a corpus): "shards 512.0/2048.0
// MiB [#####...] 25.0% | 12.3 MiB/s | 134.2M tokens | eta 2m05s". Redrawn with '\r' on a
// terminal; otherwise a plain line at each further 10% and at the end. `out` null: silent.
class ByteProgress {
 public:
  ByteProgress(int64_t total_bytes, std::FILE* out);
  ByteProgress(int64_t total_bytes, std::FILE* out, bool is_tty);
  void update(int64_t bytes_done, int64_t tokens);
  void finish();
  static std::string format(int64_t bytes_done, int64_t total_bytes, int64_t tokens, double bytes_per_second,
                            double eta_seconds, int bar_width = 20);

 private:
  int64_t total_;
  std::FILE* out_;
  bool tty_;
  bool drawn_ = false;
  int last_decile_ = -1;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace nibble::train
