// One call that turns text into what training reads: a data folder holding the corpus copy
// (default: the KJV), `tokenizer.model`, `train.bin`, `val.bin` and `data.json` (options,
// fingerprint, counts). Built atomically (AtomicDir) and reused when data.json's fingerprint
// (FNV-1a 64 of the input text and the options) matches, like nanoGPT's prepare.py but cached.
// Two variants: a given sentencepiece `.model` is loaded (and copied) instead of training one, and
// NIBTOK token shards (shards.h, detected by their magic) are used as input without retokenizing.
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
  // Text files, or NIBTOK token shards (all of one kind; shards need tokenizer_file). Empty: the
  // default corpus (KJV from bible-kjv).
  std::vector<std::string> text_files;
  // "": train a tokenizer on the corpus; else a sentencepiece .model loaded as is (its bytes are
  // part of the fingerprint and copied to <dir>/tokenizer.model).
  std::string tokenizer_file;
  // Token shards only: validation shards. Empty: the last floor(val_fraction * N) of the N input
  // tokens (input shards concatenated in order) are held out as val.bin.
  std::vector<std::string> val_shard_files;
  int vocab_size = 4096;  // trained tokenizer's size; with tokenizer_file, the largest size accepted
  std::string vocab_size_name = "vocab_size";  // what errors call vocab_size (the config key)
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

// True when `path` is a readable file starting with the NIBTOK shard magic (kShardMagic).
bool is_token_shard_file(const std::string& path);

// Builds (or reuses) the data folder `dir`. A folder whose data.json has another fingerprint
// is rebuilt (replaced atomically).
Result<Dataset> prepare_dataset(const std::string& dir, const DatasetOptions& options);

// Opens an existing data folder (data.json + the three files) without building anything.
Result<Dataset> open_dataset(const std::string& dir);

}  // namespace nibble::train
