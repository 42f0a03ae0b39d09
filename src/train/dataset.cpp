// Data folder preparation: corpus -> tokenizer -> train/val shards, cached by fingerprint.
#include "train/dataset.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "train/atomic_dir.h"
#include "train/corpus.h"

namespace nibble::train {
namespace fs = std::filesystem;

namespace {

constexpr int kDataFormatVersion = 1;

uint64_t fnv1a(uint64_t h, std::string_view s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

Result<Dataset> dataset_from_json(const std::string& dir, const nlohmann::json& j) {
  Dataset d;
  d.dir = dir;
  d.tokenizer_path = (fs::path(dir) / "tokenizer.model").string();
  d.train_path = (fs::path(dir) / "train.bin").string();
  d.val_path = (fs::path(dir) / "val.bin").string();
  try {
    if (j.at("format_version").get<int>() != kDataFormatVersion)
      return invalid_argument("data folder {}: data.json format_version {} (this build reads {})", dir,
                              j.at("format_version").get<int>(), kDataFormatVersion);
    d.fingerprint = std::stoull(j.at("fingerprint").get<std::string>(), nullptr, 16);
    d.vocab_size = j.at("vocab_size").get<int32_t>();
    const auto& s = j.at("summary");
    d.summary.files = s.at("files").get<int64_t>();
    d.summary.documents = s.at("documents").get<int64_t>();
    d.summary.train_lines = s.at("train_lines").get<int64_t>();
    d.summary.val_lines = s.at("val_lines").get<int64_t>();
    d.summary.train_tokens = s.at("train_tokens").get<int64_t>();
    d.summary.val_tokens = s.at("val_tokens").get<int64_t>();
    d.summary.text_bytes = s.at("text_bytes").get<int64_t>();
  } catch (const std::exception& e) {
    return data_loss("data folder {}: bad data.json: {}", dir, e.what());
  }
  for (const std::string& p : {d.tokenizer_path, d.train_path, d.val_path})
    if (!fs::is_regular_file(p)) return not_found("data folder {}: missing {}", dir, p);
  return d;
}

}  // namespace

Result<Dataset> open_dataset(const std::string& dir) {
  const std::string meta = (fs::path(dir) / "data.json").string();
  std::ifstream f(meta);
  if (!f) return not_found("data folder {}: no data.json", dir);
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) return data_loss("data folder {}: data.json is not a JSON object", dir);
  return dataset_from_json(dir, j);
}

Result<Dataset> prepare_dataset(const std::string& dir, const DatasetOptions& o) {
  if (!(o.val_fraction >= 0 && o.val_fraction <= 0.5))
    return invalid_argument("val_fraction {} must be in [0, 0.5]", o.val_fraction);
  // Gather the input text (the default corpus or the user's files) and fingerprint it.
  std::vector<std::string> texts;
  std::vector<std::string> names;
  if (o.text_files.empty()) {
    NIB_ASSIGN_OR_RETURN(std::string kjv, default_corpus_text());
    texts.push_back(std::move(kjv));
    names.push_back("default:kjv");
  } else {
    for (const std::string& p : o.text_files) {
      NIB_ASSIGN_OR_RETURN(std::string t, read_text_file(p));
      texts.push_back(std::move(t));
      names.push_back(p);
    }
  }
  uint64_t fp = 0xcbf29ce484222325ull;
  fp = fnv1a(fp, fmt::format("v{} vocab={} val={} seed={} maxs={};", kDataFormatVersion, o.vocab_size,
                             o.val_fraction, o.tokenizer_seed, o.tokenizer_max_sentences));
  for (const std::string& t : texts) {
    fp = fnv1a(fp, std::to_string(t.size()) + ":");
    fp = fnv1a(fp, t);
  }

  auto existing = open_dataset(dir);
  if (existing.is_ok() && existing->fingerprint == fp) {
    existing->reused = true;
    return existing;
  }

  NIB_ASSIGN_OR_RETURN(AtomicDir out, AtomicDir::create(dir));
  const fs::path tmp = out.temp_path();
  // The corpus is copied into the folder so the shards can always be traced to their text.
  std::vector<std::string> corpus_files;
  for (size_t i = 0; i < texts.size(); ++i) {
    std::string p = (tmp / fmt::format("corpus_{:03}.txt", i)).string();
    NIB_RETURN_IF_ERROR(write_file_atomic(p, texts[i]));
    corpus_files.push_back(p);
  }
  TokenizerTrainOptions to;
  to.vocab_size = o.vocab_size;
  to.seed = o.tokenizer_seed;
  to.max_sentences = o.tokenizer_max_sentences;
  auto t0 = std::chrono::steady_clock::now();
  NIB_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::train(texts, to));
  auto t1 = std::chrono::steady_clock::now();
  NIB_RETURN_IF_ERROR(tok.save((tmp / "tokenizer.model").string()));
  texts.clear();
  NIB_ASSIGN_OR_RETURN(ShardSummary sum, build_token_shards((tmp / "train.bin").string(), (tmp / "val.bin").string(),
                                                            tok, corpus_files, SplitOptions{o.val_fraction}));
  auto t2 = std::chrono::steady_clock::now();
  nlohmann::json j = {
      {"format_version", kDataFormatVersion},
      {"fingerprint", hex64(fp)},
      {"sources", names},
      {"vocab_size", tok.vocab_size()},
      {"val_fraction", o.val_fraction},
      {"tokenizer", {{"type", "sentencepiece-bpe"}, {"seed", o.tokenizer_seed}, {"max_sentences", o.tokenizer_max_sentences},
                     {"byte_fallback", true}, {"unk_id", tok.unk_id()}, {"bos_id", tok.bos_id()},
                     {"eos_id", tok.eos_id()}, {"pad_id", tok.pad_id()}}},
      {"summary",
       {{"files", sum.files}, {"documents", sum.documents}, {"train_lines", sum.train_lines},
        {"val_lines", sum.val_lines}, {"train_tokens", sum.train_tokens}, {"val_tokens", sum.val_tokens},
        {"text_bytes", sum.text_bytes}}},
      {"shard_format", "NIBTOK v1 (docs/data.md)"},
  };
  NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "data.json").string(), j.dump(2) + "\n"));
  NIB_RETURN_IF_ERROR(out.commit());
  NIB_ASSIGN_OR_RETURN(Dataset d, open_dataset(dir));
  d.tokenizer_seconds = std::chrono::duration<double>(t1 - t0).count();
  d.shard_seconds = std::chrono::duration<double>(t2 - t1).count();
  return d;
}

}  // namespace nibble::train
