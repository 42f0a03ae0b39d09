// Token shards: the tokenized corpus as flat binary files, read by the loader (like llm.c's
// .bin token files and nanoGPT's train.bin/val.bin, with a checked header). Layout, all
// little-endian: a 32-byte header {magic "NIBTOK\0\0" (8 bytes), version u32 = 1, dtype u32 (2:
// u16 tokens, 4: u32 tokens), count u64 (tokens), vocab_size u32, reserved u32 = 0}, then `count`
// tokens. u16 is used when vocab_size <= 65536. Files are written atomically and mmap'ed to read.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"

namespace nibble::train {

class Tokenizer;

inline constexpr char kShardMagic[8] = {'N', 'I', 'B', 'T', 'O', 'K', '\0', '\0'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 32;

// tokens: (n) ids in [0, vocab_size). Writes `path` atomically (u16 if vocab_size <= 65536).
Status write_token_shard(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size);

// A read-only, mmap'ed token shard whose header and size were validated on open.
class TokenShard {
 public:
  static Result<TokenShard> open(const std::string& path);
  int64_t size() const { return count_; }
  int64_t vocab_size() const { return vocab_size_; }
  int bytes_per_token() const { return width_; }
  const std::string& path() const { return path_; }
  // dst: (n) int32 = tokens [start, start+n); an id >= vocab_size (a corrupt file) is an error.
  Status read(int32_t* dst, int64_t start, int64_t n) const;

 private:
  std::shared_ptr<const uint8_t> map_;  // the whole file
  std::string path_;
  int64_t count_ = 0, vocab_size_ = 0;
  int width_ = 2;
};

// ---- corpus -> train/val shards --------------------------------------------------------

struct SplitOptions {
  double val_fraction = 0.05;  // share of lines held out, in [0, 0.5]
  // Text held in memory at once: documents are read, encoded and appended to the shards in
  // batches of about this many bytes (a longer document is held whole), so memory stays about
  // 3 x max(buffer_bytes, longest document) whatever the corpus size.
  int64_t buffer_bytes = int64_t{64} << 20;
  bool progress = false;  // a progress line on stderr: bytes read of the total, MB/s, tokens, eta
};

// Deterministic held-out split of documents (lists of lines): document k sends its LAST
// v_k lines to validation, v_k = min(n_k, floor(f*C_k) - floor(f*C_{k-1})) with C_k the number
// of lines in documents 0..k, so the validation share is f of all lines (within one line) and
// spread over all documents. Returns v_k per document.
std::vector<int64_t> validation_lines_per_document(const std::vector<std::vector<std::string>>& docs,
                                                   double val_fraction);

struct ShardSummary {
  int64_t files = 0, documents = 0;
  int64_t train_lines = 0, val_lines = 0;
  int64_t train_tokens = 0, val_tokens = 0;
  int64_t text_bytes = 0;
  int64_t batches = 0;            // encode batches (about text_bytes / buffer_bytes)
  int64_t peak_batch_bytes = 0;   // the most text held at once (<= buffer_bytes + longest document)
};

// Reads `text_files` (an empty or missing file is an error), splits each into documents at blank
// lines, holds out the tail lines of each document (validation_lines_per_document), and writes
// the token streams: per document part, encode(lines joined by '\n', with a final '\n') then
// eos. Train parts go to `train_path`, validation parts to `val_path`, in file/document order.
// Streams: files are read in chunks and encoded in batches of options.buffer_bytes (in parallel
// within a batch), the tokens appended to both shards as they come; the shards are the same for
// any buffer size and thread count, and appear (atomically) only when complete. An empty
// `val_path` writes no validation shard (val_fraction must then be 0).
Result<ShardSummary> build_token_shards(const std::string& train_path, const std::string& val_path,
                                        const Tokenizer& tokenizer, const std::vector<std::string>& text_files,
                                        const SplitOptions& options);

}  // namespace nibble::train
