// Data folder preparation: corpus -> tokenizer (trained or loaded) -> train/val shards, or
// token shards -> train/val shards (copied, tail held out), cached by fingerprint.
#include "train/dataset.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>

#include "core/interrupt.h"
#include "io/output_guard.h"
#include "io/regular_file.h"
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

// FNV-1a 64 of the file's bytes, streamed in 1 MiB chunks (shards may be large).
Result<uint64_t> fnv1a_file(uint64_t h, const std::string& path) {
  auto file = io::open_regular_file(path, "data file");
  if (!file) return file.status();
  std::string buf(1 << 20, '\0');
  for (;;) {
    ssize_t n = ::read(file->fd(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error("data file '{}': read error: {}", path, std::strerror(errno));
    if (n == 0) break;
    h = fnv1a(h, std::string_view(buf.data(), static_cast<size_t>(n)));
  }
  return h;
}

// tokens: appends every token of the shards at `paths`, in order.
Status append_shard_tokens(std::vector<int32_t>* tokens, const std::vector<TokenShard>& shards) {
  for (const TokenShard& sh : shards) {
    const size_t at = tokens->size();
    tokens->resize(at + static_cast<size_t>(sh.size()));
    NIB_RETURN_IF_ERROR(sh.read(tokens->data() + at, 0, sh.size()));
  }
  return Status::ok();
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
      return data_loss("data folder {}: data.json format_version {} (this build reads {})", dir,
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

bool is_token_shard_file(const std::string& path) {
  auto file = io::open_regular_file(path);  // never blocks on a FIFO: not a shard
  if (!file) return false;
  char magic[sizeof(kShardMagic)] = {};
  if (::pread(file->fd(), magic, sizeof(magic), 0) != static_cast<ssize_t>(sizeof(magic))) return false;
  return std::equal(magic, magic + sizeof(magic), kShardMagic);
}

Result<Dataset> open_dataset(const std::string& dir) {
  const std::string meta = (fs::path(dir) / "data.json").string();
  auto text = io::read_regular_file(meta, "data folder file");
  if (!text && text.status().code() == StatusCode::kNotFound) return not_found("data folder {}: no data.json", dir);
  if (!text) return text.status();
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return data_loss("data folder {}: data.json is not a JSON object", dir);
  return dataset_from_json(dir, j);
}

// The data folder is rebuilt by replacing it whole: refuse one that holds what nibble did not
// write (anything but an empty folder or a data folder with its data.json).
static Status check_data_folder_is_ours(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (!fs::exists(st)) return Status::ok();
  if (!fs::is_directory(st)) return invalid_argument("data folder '{}' exists and is not a folder (data.dir)", dir);
  if (fs::is_empty(dir, ec)) return Status::ok();
  auto text = io::read_regular_file((fs::path(dir) / "data.json").string(), "data folder file");  // never blocks
  const nlohmann::json j = text ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
  if (!text || j.is_discarded() || !j.is_object() || !j.contains("fingerprint"))
    return invalid_argument("data folder '{}' holds files nibble did not write (no data.json): set data.dir to "
                            "another folder (it is replaced when rebuilt)",
                            dir);
  return Status::ok();
}

Result<Dataset> prepare_dataset(const std::string& dir, const DatasetOptions& o) {
  if (!(o.val_fraction >= 0 && o.val_fraction <= 0.5))
    return invalid_argument("val_fraction {} must be in [0, 0.5]", o.val_fraction);
  io::remove_stale_temporaries(dir);  // `DATA.tmp.<pid>` / `DATA.old.<pid>` of killed preparations
  NIB_RETURN_IF_ERROR(check_data_folder_is_ours(dir));
  // Inputs: text files or token shards, never both in one run.
  std::vector<std::string> shard_files, plain_files;
  for (const std::string& p : o.text_files) (is_token_shard_file(p) ? shard_files : plain_files).push_back(p);
  const bool from_shards = !shard_files.empty();
  if (from_shards && !plain_files.empty())
    return invalid_argument("data.files mixes NIBTOK token shards ('{}') and text files ('{}'): use one kind per run",
                            shard_files[0], plain_files[0]);
  if (from_shards && o.tokenizer_file.empty())
    return invalid_argument("'{}' is a NIBTOK token shard: token shards need data.tokenizer (the tokenizer that "
                            "produced them, so checkpoints, eval and generate can decode)", shard_files[0]);
  if (!o.val_shard_files.empty() && !from_shards)
    return invalid_argument("data.val_files is only for token shard input (data.files holds text)");
  for (const std::string& p : o.val_shard_files)
    if (!is_token_shard_file(p)) return data_loss("data.val_files: '{}' is not a NIBTOK token shard", p);

  // The loaded tokenizer (its bytes are copied into the folder as they are).
  std::string tokenizer_bytes;
  std::optional<Tokenizer> loaded;
  if (!o.tokenizer_file.empty()) {
    auto bytes = io::read_regular_file(o.tokenizer_file, "data.tokenizer");
    if (!bytes && bytes.status().code() == StatusCode::kNotFound)
      return not_found("data.tokenizer: cannot open '{}'", o.tokenizer_file);
    if (!bytes) return bytes.status();
    tokenizer_bytes = std::move(bytes).value();
    auto t = Tokenizer::from_serialized(tokenizer_bytes);
    if (!t) return data_loss("data.tokenizer: '{}' is not a sentencepiece model ({})", o.tokenizer_file,
                             t.status().message());
    if (t->vocab_size() > o.vocab_size)
      return data_loss("data.tokenizer: '{}' has {} pieces, more than the model's vocab_size {}",
                       o.tokenizer_file, t->vocab_size(), o.vocab_size);
    loaded.emplace(std::move(t).value());
  }

  // Gather the input text (the default corpus or the user's files) and fingerprint it.
  std::vector<std::string> texts;
  std::vector<std::string> names;
  if (from_shards) {
    names = shard_files;
  } else if (o.text_files.empty()) {
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
  if (loaded) {
    fp = fnv1a(fp, fmt::format("tokenizer={}:", tokenizer_bytes.size()));
    fp = fnv1a(fp, tokenizer_bytes);
  }
  for (const std::string& p : shard_files) {
    fp = fnv1a(fp, fmt::format("shard={}:", fs::file_size(p)));
    NIB_ASSIGN_OR_RETURN(fp, fnv1a_file(fp, p));
  }
  for (const std::string& p : o.val_shard_files) {
    fp = fnv1a(fp, fmt::format("val_shard={}:", fs::file_size(p)));
    NIB_ASSIGN_OR_RETURN(fp, fnv1a_file(fp, p));
  }

  auto existing = open_dataset(dir);
  if (existing.is_ok() && existing->fingerprint == fp) {
    existing->reused = true;
    return existing;
  }

  const std::string interrupted_what = "while preparing the data folder " + dir;
  if (interrupt_signal() != 0) return cancelled_status(interrupted_what);
  NIB_ASSIGN_OR_RETURN(AtomicDir out, AtomicDir::create(dir));
  const fs::path tmp = out.temp_path();
  auto t0 = std::chrono::steady_clock::now();
  if (loaded) {
    NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "tokenizer.model").string(), tokenizer_bytes));
  }
  ShardSummary sum;
  std::optional<Tokenizer> trained;
  auto t1 = t0;
  if (from_shards) {
    // Token shards: checked against the tokenizer, concatenated in order, tail held out (or val_files).
    const Tokenizer& tok = *loaded;
    // Opens the shards at `paths` (the config key `key` names them), each within the tokenizer's vocabulary.
    auto open_shards = [&](const std::vector<std::string>& paths, const char* key,
                           std::vector<TokenShard>* shards) -> Status {
      for (const std::string& p : paths) {
        NIB_ASSIGN_OR_RETURN(TokenShard sh, TokenShard::open(p));
        if (sh.vocab_size() > tok.vocab_size())
          return data_loss("{}: token shard '{}' has vocab_size {}, more than data.tokenizer's {}", key, p,
                           sh.vocab_size(), tok.vocab_size());
        shards->push_back(std::move(sh));
      }
      return Status::ok();
    };
    std::vector<TokenShard> train_shards, val_shards;
    NIB_RETURN_IF_ERROR(open_shards(shard_files, "data.files", &train_shards));
    NIB_RETURN_IF_ERROR(open_shards(o.val_shard_files, "data.val_files", &val_shards));
    std::vector<int32_t> tokens;  // (N) the input shards' tokens in order
    NIB_RETURN_IF_ERROR(append_shard_tokens(&tokens, train_shards));
    const int64_t n = static_cast<int64_t>(tokens.size());
    const int64_t n_val =
        val_shards.empty() ? static_cast<int64_t>(std::floor(o.val_fraction * static_cast<double>(n))) : 0;
    std::span<const int32_t> all(tokens);
    NIB_RETURN_IF_ERROR(write_token_shard((tmp / "train.bin").string(), all.first(static_cast<size_t>(n - n_val)),
                                          tok.vocab_size()));
    sum.train_tokens = n - n_val;
    if (val_shards.empty()) {
      NIB_RETURN_IF_ERROR(write_token_shard((tmp / "val.bin").string(), all.last(static_cast<size_t>(n_val)),
                                            tok.vocab_size()));
      sum.val_tokens = n_val;
    } else {
      tokens.clear();
      NIB_RETURN_IF_ERROR(append_shard_tokens(&tokens, val_shards));
      NIB_RETURN_IF_ERROR(write_token_shard((tmp / "val.bin").string(), tokens, tok.vocab_size()));
      sum.val_tokens = static_cast<int64_t>(tokens.size());
    }
    sum.files = static_cast<int64_t>(shard_files.size() + o.val_shard_files.size());
  } else {
    // The corpus is copied into the folder so the shards can always be traced to their text.
    std::vector<std::string> corpus_files;
    for (size_t i = 0; i < texts.size(); ++i) {
      std::string p = (tmp / fmt::format("corpus_{:03}.txt", i)).string();
      NIB_RETURN_IF_ERROR(write_file_atomic(p, texts[i]));
      corpus_files.push_back(p);
    }
    if (!loaded) {
      TokenizerTrainOptions to;
      to.vocab_size = o.vocab_size;
      to.seed = o.tokenizer_seed;
      to.max_sentences = o.tokenizer_max_sentences;
      to.vocab_size_name = o.vocab_size_name;
      NIB_ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::train(texts, to));
      NIB_RETURN_IF_ERROR(tok.save((tmp / "tokenizer.model").string()));
      trained.emplace(std::move(tok));
    }
    t1 = std::chrono::steady_clock::now();
    texts.clear();
    if (interrupt_signal() != 0) return cancelled_status(interrupted_what);  // `out` removes its folder
    NIB_ASSIGN_OR_RETURN(sum, build_token_shards((tmp / "train.bin").string(), (tmp / "val.bin").string(),
                                                 loaded ? *loaded : *trained, corpus_files,
                                                 SplitOptions{o.val_fraction}));
  }
  const Tokenizer& tok = loaded ? *loaded : *trained;
  auto t2 = std::chrono::steady_clock::now();
  // Special ids, then how the tokenizer came to be (keys are stored sorted either way).
  nlohmann::json tokenizer_json = {{"unk_id", tok.unk_id()}, {"bos_id", tok.bos_id()}, {"eos_id", tok.eos_id()},
                                   {"pad_id", tok.pad_id()}};
  if (loaded) {
    tokenizer_json.update({{"type", "sentencepiece (loaded)"}, {"file", o.tokenizer_file}});
  } else {
    tokenizer_json.update({{"type", "sentencepiece-bpe"}, {"seed", o.tokenizer_seed},
                           {"max_sentences", o.tokenizer_max_sentences}, {"byte_fallback", true}});
  }
  nlohmann::json j = {
      {"format_version", kDataFormatVersion},
      {"fingerprint", hex64(fp)},
      {"sources", names},
      {"vocab_size", tok.vocab_size()},
      {"val_fraction", o.val_fraction},
      {"input", from_shards ? "token-shards" : "text"},
      {"val_sources", o.val_shard_files},
      {"tokenizer", tokenizer_json},
      {"summary",
       {{"files", sum.files}, {"documents", sum.documents}, {"train_lines", sum.train_lines},
        {"val_lines", sum.val_lines}, {"train_tokens", sum.train_tokens}, {"val_tokens", sum.val_tokens},
        {"text_bytes", sum.text_bytes}}},
      {"shard_format", "NIBTOK v1 (docs/data.md)"},
  };
  NIB_RETURN_IF_ERROR(write_file_atomic((tmp / "data.json").string(), j.dump(2) + "\n"));
  if (interrupt_signal() != 0) return cancelled_status(interrupted_what);
  NIB_RETURN_IF_ERROR(out.commit());
  NIB_ASSIGN_OR_RETURN(Dataset d, open_dataset(dir));
  d.tokenizer_seconds = trained ? std::chrono::duration<double>(t1 - t0).count() : 0.0;
  d.shard_seconds = std::chrono::duration<double>(t2 - t1).count();
  return d;
}

}  // namespace nibble::train
