// Run metrics as JSON lines (`metrics.jsonl`): one JSON object per event ({"step": 10,
// "train_loss": 3.2, ...}), appended and flushed per line so a crash loses at most the line
// being written and `tail -f`/pandas.read_json(lines=True) can follow a live run. Mirrors the
// JSONL loggers of OLMo/torchtitan rather than TensorBoard's binary event files.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace nibble::train {

class MetricsWriter {
 public:
  // Opens `path` for appending (creating it); truncate = true starts it empty.
  static Result<MetricsWriter> open(const std::string& path, bool truncate = false);
  // Writes `event` (a JSON object) as one line and flushes. NaN/Inf numbers become null.
  Status write(const nlohmann::json& event);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::shared_ptr<FILE> file_;
};

// Every line of a metrics file parsed; a line that is not a JSON object is an error naming its
// line number, except a final partial line (a crash mid-write), which is skipped. With
// `damaged` given, damaged lines are skipped instead and counted there (NUL bytes, which two
// writers of one file leave, are removed from a line before it is parsed).
Result<std::vector<nlohmann::json>> read_metrics(const std::string& path, int64_t* damaged = nullptr);

// For resuming from a checkpoint at `step`: rewrites `path` (atomically) without the events
// whose "step" is greater than `step` (a crashed run logged them after its last checkpoint).
// A missing file is fine (nothing to drop); damaged lines never block a resume: they are
// dropped with a warning and the good lines kept.
Status drop_metrics_after_step(const std::string& path, int64_t step);

}  // namespace nibble::train
