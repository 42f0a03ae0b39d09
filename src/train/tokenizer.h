// The tokenizer: a SentencePiece BPE model (Kudo & Richardson 2018; the tokenizer library of
// Llama/Gemma) trained on the corpus, byte fallback on (any UTF-8 byte encodes, so
// decode(encode(s)) == s exactly), identity normalization, no dummy prefix. Training is
// deterministic (fixed seed, one thread, a seeded sample of at most max_sentences lines). Ids: unk 0, bos 1, eos 2, pad 3.
// Saved as the standard `tokenizer.model` protobuf that Python's sentencepiece loads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace nibble::train {

struct TokenizerTrainOptions {
  int vocab_size = 4096;            // total pieces incl. 4 specials and 256 byte pieces
  uint32_t seed = 1234;             // SentencePiece's random generator (sentence sampling)
  int num_threads = 1;              // 1 keeps training bit-reproducible
  int64_t max_sentences = 200000;   // input_sentence_size: a seeded uniform sample of this many lines
  int max_sentence_bytes = 16384;   // longer lines are skipped by the trainer
  bool hard_vocab_limit = true;     // false: a smaller vocab is accepted when the text is tiny
  std::string vocab_size_name = "vocab_size";  // what errors call vocab_size (e.g. a config key)
};

class Tokenizer {
 public:
  // Trains on the non-blank lines of `texts` (each a whole text, split at '\n').
  static Result<Tokenizer> train(const std::vector<std::string>& texts, const TokenizerTrainOptions& options);
  static Result<Tokenizer> load(const std::string& path);
  static Result<Tokenizer> from_serialized(std::string_view model_proto);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Writes the model protobuf (`tokenizer.model`) atomically.
  Status save(const std::string& path) const;
  std::string serialized() const;

  // out: (n) token ids of `text` (no bos/eos added).
  Result<std::vector<int32_t>> encode(std::string_view text) const;
  // The text of `ids`; ids outside [0, vocab_size) are an error.
  Result<std::string> decode(std::span<const int32_t> ids) const;
  std::string piece(int32_t id) const;

  int32_t vocab_size() const;
  int32_t unk_id() const;
  int32_t bos_id() const;
  int32_t eos_id() const;
  int32_t pad_id() const;

 private:
  Tokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
};

}  // namespace nibble::train
