// One call that turns text into what training reads: a data folder holding the corpus copy
// (default: the KJV), `tokenizer.model`, `train.bin`, `val.bin` and `data.json` (options,
// fingerprint, counts). Built atomically (AtomicDir) and reused when data.json's fingerprint
// (FNV-1a 64 of the input text and the options) matches, like nanoGPT's prepare.py but cached.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "train/shards.h"
#include "train/tokenizer.h"

namespace nibble::train {

struct DatasetOptions {
  std::vector<std::string> text_files;  // empty: the default corpus (KJV from bible-kjv)
  int vocab_size = 4096;
  double val_fraction = 0.05;
  uint32_t tokenizer_seed = 1234;
  int64_t tokenizer_max_sentences = 200000;
};

struct Dataset {
  std::string dir;             // the data folder
  std::string tokenizer_path;  // <dir>/tokenizer.model
  std::string train_path;      // <dir>/train.bin
  std::string val_path;        // <dir>/val.bin
  ShardSummary summary;
  int32_t vocab_size = 0;
  uint64_t fingerprint = 0;
  bool reused = false;             // true: found complete and matching, nothing rebuilt
  double tokenizer_seconds = 0;    // time spent training the tokenizer (0 when reused)
  double shard_seconds = 0;        // time spent tokenizing into shards (0 when reused)
};

// Builds (or reuses) the data folder `dir`. A folder whose data.json has another fingerprint
// is rebuilt (replaced atomically).
Result<Dataset> prepare_dataset(const std::string& dir, const DatasetOptions& options);

// Opens an existing data folder (data.json + the three files) without building anything.
Result<Dataset> open_dataset(const std::string& dir);

}  // namespace nibble::train
