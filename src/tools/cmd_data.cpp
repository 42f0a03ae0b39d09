// `nibble data`: the corpus tools of a large pretraining run (issue #14), for corpora too big for
// `nibble pretrain`'s in-memory data folder:
//   nibble data tokenizer --vocab N [--sample-lines L] [--seed S] --out tok.model TEXT...
//     trains the SentencePiece BPE tokenizer (tokenizer.h) on a seeded sample of L lines of TEXT
//     (sample_lines: reservoir sampling, files read line by line);
//   nibble data shards --tokenizer tok.model --out train.bin [--val-out val.bin --val-fraction F]
//                      [--buffer-mb M] [--no-progress] TEXT...
//     tokenizes TEXT into NIBTOK shards with the streaming build_token_shards (bounded memory,
//     progress bar on stderr). Both print one summary line; errors are one line (exit 2 / 1).
#include <cstdio>
#include <string>
#include <vector>

#include "tools/command.h"
#include "train/corpus.h"
#include "train/shards.h"
#include "train/tokenizer.h"

namespace nibble::tools {
namespace {

struct TokenizerArgs {
  std::vector<std::string> inputs;
  std::string out;
  int vocab = 16384;
  int64_t sample_lines = 300000;
  uint32_t seed = 1234;
};

struct ShardArgs {
  std::vector<std::string> inputs;
  std::string tokenizer, out, val_out;
  double val_fraction = 0.0;
  int64_t buffer_mb = 64;
  bool no_progress = false;
};

int run_tokenizer(const TokenizerArgs& a) {
  if (a.vocab < 261) return report_error("data tokenizer", invalid_argument("--vocab {} must be >= 261", a.vocab));
  if (a.sample_lines < 1)
    return report_error("data tokenizer", invalid_argument("--sample-lines {} must be >= 1", a.sample_lines));
  int64_t total = 0;
  auto sample = train::sample_lines(a.inputs, a.sample_lines, a.seed, &total);
  if (!sample) return report_error("data tokenizer", sample.status());
  std::string text;
  for (const std::string& l : *sample) {
    text += l;
    text += '\n';
  }
  const int64_t sample_bytes = static_cast<int64_t>(text.size());
  train::TokenizerTrainOptions o;
  o.vocab_size = a.vocab;
  o.seed = a.seed;
  o.max_sentences = a.sample_lines;
  o.vocab_size_name = "--vocab";
  auto tok = train::Tokenizer::train({std::move(text)}, o);
  if (!tok) return report_error("data tokenizer", tok.status());
  if (Status s = tok->save(a.out); !s.is_ok()) return report_error("data tokenizer", s);
  std::printf("data tokenizer: %s: %d pieces, trained on %zu of %lld lines (%.1f MB, seed %u)\n", a.out.c_str(),
              tok->vocab_size(), sample->size(), static_cast<long long>(total), sample_bytes / 1e6, a.seed);
  return 0;
}

int run_shards(const ShardArgs& a) {
  if (a.val_out.empty() && a.val_fraction != 0.0)
    return report_error("data shards", invalid_argument("--val-fraction needs --val-out"));
  if (a.buffer_mb < 1) return report_error("data shards", invalid_argument("--buffer-mb {} must be >= 1", a.buffer_mb));
  auto tok = train::Tokenizer::load(a.tokenizer);
  if (!tok) return report_error("data shards", tok.status());
  train::SplitOptions o;
  o.val_fraction = a.val_fraction;
  o.buffer_bytes = a.buffer_mb << 20;
  o.progress = !a.no_progress;
  auto sum = train::build_token_shards(a.out, a.val_out, *tok, a.inputs, o);
  if (!sum) return report_error("data shards", sum.status());
  std::printf("data shards: %s: %lld tokens", a.out.c_str(), static_cast<long long>(sum->train_tokens));
  if (!a.val_out.empty()) std::printf(", %s: %lld tokens", a.val_out.c_str(), static_cast<long long>(sum->val_tokens));
  std::printf(" from %lld documents, %.1f MB of text (%.2f bytes/token, %lld batches)\n",
              static_cast<long long>(sum->documents), sum->text_bytes / 1e6,
              static_cast<double>(sum->text_bytes) / static_cast<double>(sum->train_tokens + sum->val_tokens),
              static_cast<long long>(sum->batches));
  return 0;
}

CommandRun setup_data(CLI::App& app) {
  app.require_subcommand(1);
  auto tok_args = std::make_shared<TokenizerArgs>();
  CLI::App* tok = app.add_subcommand("tokenizer", "Train the BPE tokenizer on a seeded sample of text lines");
  tok->add_option("inputs", tok_args->inputs, "Text files (one paragraph per line, documents at blank lines)")
      ->required();
  tok->add_option("--out", tok_args->out, "The tokenizer.model to write")->required();
  tok->add_option("--vocab", tok_args->vocab, "Vocabulary size (4 specials + 256 bytes + merges)")->capture_default_str();
  tok->add_option("--sample-lines", tok_args->sample_lines, "Lines sampled to train on")->capture_default_str();
  tok->add_option("--seed", tok_args->seed, "Sampling and training seed")->capture_default_str();

  auto shard_args = std::make_shared<ShardArgs>();
  CLI::App* sh = app.add_subcommand("shards", "Tokenize text into NIBTOK shards, streaming, in bounded memory");
  sh->add_option("inputs", shard_args->inputs, "Text files")->required();
  sh->add_option("--tokenizer", shard_args->tokenizer, "tokenizer.model")->required();
  sh->add_option("--out", shard_args->out, "The (training) shard to write")->required();
  sh->add_option("--val-out", shard_args->val_out, "The validation shard (the tail lines of each document)");
  sh->add_option("--val-fraction", shard_args->val_fraction, "Share of lines held out into --val-out")
      ->capture_default_str();
  sh->add_option("--buffer-mb", shard_args->buffer_mb, "Text encoded per batch (memory ~3x)")->capture_default_str();
  sh->add_flag("--no-progress", shard_args->no_progress, "No progress bar");
  return [tok, sh, tok_args, shard_args]() {
    if (tok->parsed()) return run_tokenizer(*tok_args);
    if (sh->parsed()) return run_shards(*shard_args);
    return 2;
  };
}

NIBBLE_REGISTER_COMMAND(data_command, "data", "Corpus tools: train a tokenizer on a sample, build token shards",
                        setup_data);

}  // namespace
}  // namespace nibble::tools
