// SentencePiece BPE tokenizer training, saving, loading, encode/decode; see tokenizer.h.
#include "train/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <fmt/format.h>

#include <mutex>
#include <regex>

#include "io/regular_file.h"
#include "train/atomic_dir.h"

// SentencePiece's log threshold (0 INFO .. 3 FATAL), exported by libsentencepiece but declared
// only in its uninstalled common.h. Without it every training prints "Running command: ..." at
// INFO before the --minloglevel flag is parsed.
namespace sentencepiece::logging {
void SetMinLogLevel(int v);
}  // namespace sentencepiece::logging

namespace nibble::train {

namespace {

// Feeds the non-blank lines of the texts, in order, to the SentencePiece trainer.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<std::string>& texts) : texts_(texts) { advance(); }
  bool done() const override { return done_; }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    while (text_ < texts_.size()) {
      const std::string& t = texts_[text_];
      if (pos_ >= t.size()) {
        ++text_;
        pos_ = 0;
        continue;
      }
      size_t nl = t.find('\n', pos_);
      size_t end = nl == std::string::npos ? t.size() : nl;
      line_.assign(t, pos_, end - pos_);
      pos_ = end + 1;
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      if (line_.find_first_not_of(" \t\r\f\v") != std::string::npos) return;
    }
    done_ = true;
  }
  const std::vector<std::string>& texts_;
  size_t text_ = 0, pos_ = 0;
  std::string line_;
  bool done_ = false;
};

// SentencePiece's message without its "./src/file.cc(123) [condition]" prefix (its internals);
// `fallback` when nothing else is left (a failed protobuf parse says only that).
std::string sp_message(const sentencepiece::util::Status& s, const char* fallback = "failed") {
  static const std::regex prefix(R"(^\S*\.cc\(\d+\) \[[^\]]*\] ?)");
  std::string msg = std::regex_replace(std::string(s.message()), prefix, "");
  while (!msg.empty() && (msg.back() == ' ' || msg.back() == '\n')) msg.pop_back();
  return msg.empty() ? fallback : msg;
}

// A failed load/parse/encode: the model or the data is bad (bad input, not a bad argument).
Status from_sp(const sentencepiece::util::Status& s, std::string_view what) {
  if (s.ok()) return Status::ok();
  return data_loss("tokenizer: {}: {}", what, sp_message(s, "not a SentencePiece model (corrupt or truncated)"));
}

// A failed training, in nibble's terms: the two ways a corpus cannot give `vocab_size` pieces
// are named with options.vocab_size_name (the option or config key that set it).
Status from_sp_training(const sentencepiece::util::Status& s, const TokenizerTrainOptions& o) {
  if (s.ok()) return Status::ok();
  const std::string msg = sp_message(s);
  std::smatch m;
  static const std::regex too_high(R"(Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+))");
  static const std::regex too_many_chars(R"(Vocabulary size is smaller than required_chars\. (\d+) vs (\d+))");
  if (std::regex_search(msg, m, too_high))
    return data_loss("the training text is too small for a tokenizer of {} = {} pieces: it yields at most {}; give "
                     "more text or set {} to at most {}",
                     o.vocab_size_name, m[1].str(), m[2].str(), o.vocab_size_name, m[2].str());
  if (std::regex_search(msg, m, too_many_chars))
    return data_loss("the training text has too many distinct characters for a tokenizer of {} = {} pieces: with the "
                     "special and byte pieces they need {}; set {} to at least {} or use less varied text",
                     o.vocab_size_name, m[1].str(), m[2].str(), o.vocab_size_name, m[2].str());
  return data_loss("tokenizer training failed: {}", msg);
}

}  // namespace

Tokenizer::Tokenizer() : sp_(std::make_unique<sentencepiece::SentencePieceProcessor>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::train(const std::vector<std::string>& texts, const TokenizerTrainOptions& o) {
  if (o.vocab_size < 261 || o.vocab_size > (1 << 24))
    return invalid_argument("tokenizer: {} {} out of range [261, 2^24] (4 specials + 256 bytes + 1)",
                            o.vocab_size_name, o.vocab_size);
  if (o.num_threads < 1) return invalid_argument("tokenizer: num_threads must be >= 1");
  if (o.max_sentences <= 100)  // SentencePiece's own lower bound on input_sentence_size
    return invalid_argument("tokenizer: max_sentences must be > 100 (got {})", o.max_sentences);
  LineIterator probe(texts);
  if (probe.done()) return data_loss("tokenizer: no text to train on");

  std::string args = fmt::format(
      "--model_type=bpe --vocab_size={} --byte_fallback=true --character_coverage=1.0 "
      "--normalization_rule_name=identity --remove_extra_whitespaces=false --add_dummy_prefix=false "
      "--split_digits=true --allow_whitespace_only_pieces=true "
      "--unk_id=0 --bos_id=1 --eos_id=2 --pad_id=3 "
      "--num_threads={} --input_sentence_size={} --shuffle_input_sentence=true "
      "--max_sentence_length={} --hard_vocab_limit={} --minloglevel=3 --model_prefix=",
      o.vocab_size, o.num_threads, o.max_sentences, o.max_sentence_bytes, o.hard_vocab_limit ? "true" : "false");
  // SentencePiece's generator is process-global; serialise trainings that set it.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  sentencepiece::SetRandomGeneratorSeed(o.seed);
  // Errors come back as a Status (translated below); SentencePiece's own log lines are noise.
  sentencepiece::logging::SetMinLogLevel(3);
  LineIterator it(texts);
  std::string proto;
  NIB_RETURN_IF_ERROR(from_sp_training(sentencepiece::SentencePieceTrainer::Train(args, &it, &proto), o));
  return from_serialized(proto);
}

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  // Read here, not by sentencepiece: a FIFO or device must not block (io/regular_file.h).
  auto bytes = io::read_regular_file(path, "tokenizer");
  if (!bytes) return bytes.status();
  Tokenizer t;
  auto s = t.sp_->LoadFromSerializedProto(*bytes);
  if (!s.ok()) {
    return data_loss("cannot load tokenizer {}: {}", path,
                     sp_message(s, "not a SentencePiece model (corrupt or truncated)"));
  }
  return t;
}

Result<Tokenizer> Tokenizer::from_serialized(std::string_view model_proto) {
  Tokenizer t;
  NIB_RETURN_IF_ERROR(from_sp(t.sp_->LoadFromSerializedProto(model_proto), "cannot parse model"));
  return t;
}

std::string Tokenizer::serialized() const { return sp_->serialized_model_proto(); }

Status Tokenizer::save(const std::string& path) const { return write_file_atomic(path, serialized()); }

Result<std::vector<int32_t>> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  NIB_RETURN_IF_ERROR(from_sp(sp_->Encode(text, &ids), "encode failed"));
  return std::vector<int32_t>(ids.begin(), ids.end());
}

Result<std::string> Tokenizer::decode(std::span<const int32_t> ids) const {
  const int32_t n = vocab_size();
  std::vector<int> v(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= n) return invalid_argument("decode: token id {} outside [0, {})", ids[i], n);
    v[i] = ids[i];
  }
  std::string out;
  NIB_RETURN_IF_ERROR(from_sp(sp_->Decode(v, &out), "decode failed"));
  return out;
}

std::string Tokenizer::piece(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return sp_->IdToPiece(id);
}

int32_t Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }
int32_t Tokenizer::unk_id() const { return sp_->unk_id(); }
int32_t Tokenizer::bos_id() const { return sp_->bos_id(); }
int32_t Tokenizer::eos_id() const { return sp_->eos_id(); }
int32_t Tokenizer::pad_id() const { return sp_->pad_id(); }

}  // namespace nibble::train
