// Tests of the data folder: built from user text, reused when unchanged, rebuilt when the text
// or options change, and the atomic folder writer it relies on; a loaded tokenizer (same folder
// as training it in place, rebuilt when the file changes) and token shard input (tail held out
// or val shards), with their errors.
#include "train/dataset.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "train/atomic_dir.h"
#include "train/loader.h"

namespace nibble::train {
namespace {

namespace fs = std::filesystem;

std::string temp_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("nibble_dataset_test_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

TEST(Dataset, BuildReuseRebuild) {
  const std::string root = temp_dir("root");
  fs::create_directories(root);
  const std::string txt = root + "/text.txt";
  {
    std::ofstream f(txt);
    for (int d = 0; d < 4; ++d) {
      for (int i = 0; i < 30; ++i) f << "chapter " << d << " verse " << i << " and the word was with the text\n";
      f << "\n";
    }
  }
  DatasetOptions o;
  o.text_files = {txt};
  o.vocab_size = 300;
  o.val_fraction = 0.1;
  const std::string dir = root + "/data";
  auto d = prepare_dataset(dir, o);
  ASSERT_TRUE(d.is_ok()) << d.status().message();
  EXPECT_FALSE(d->reused);
  EXPECT_EQ(d->vocab_size, 300);
  EXPECT_EQ(d->summary.documents, 4);
  EXPECT_EQ(d->summary.val_lines, 12);
  EXPECT_GT(d->summary.train_tokens, d->summary.val_tokens);
  EXPECT_TRUE(fs::exists(dir + "/corpus_000.txt"));
  auto tok = Tokenizer::load(d->tokenizer_path);
  ASSERT_TRUE(tok.is_ok());
  auto train = TokenShard::open(d->train_path);
  ASSERT_TRUE(train.is_ok());
  EXPECT_EQ(train->size(), d->summary.train_tokens);
  auto loader = TrainLoader::open({d->train_path}, 2, 16, 1);
  ASSERT_TRUE(loader.is_ok()) << loader.status().message();

  auto again = prepare_dataset(dir, o);
  ASSERT_TRUE(again.is_ok());
  EXPECT_TRUE(again->reused);
  EXPECT_EQ(again->fingerprint, d->fingerprint);

  o.val_fraction = 0.2;  // other options: rebuilt
  auto rebuilt = prepare_dataset(dir, o);
  ASSERT_TRUE(rebuilt.is_ok());
  EXPECT_FALSE(rebuilt->reused);
  EXPECT_NE(rebuilt->fingerprint, d->fingerprint);
  EXPECT_EQ(rebuilt->summary.val_lines, 24);
  for (const auto& e : fs::directory_iterator(root))  // no temporary folders left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();

  o.text_files = {root + "/missing.txt"};
  auto bad = prepare_dataset(dir, o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("missing.txt"), std::string::npos);
  EXPECT_TRUE(open_dataset(dir).is_ok());  // the failed rebuild left the old folder intact
  EXPECT_FALSE(open_dataset(root + "/nope").is_ok());
  fs::remove_all(root);
}

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// root/text.txt: 4 documents of 30 lines. Returns its bytes.
std::string write_text(const std::string& root) {
  fs::create_directories(root);
  std::ofstream f(root + "/text.txt");
  std::string t;
  for (int d = 0; d < 4; ++d) {
    for (int i = 0; i < 30; ++i) t += "chapter " + std::to_string(d) + " verse " + std::to_string(i) + " and so on\n";
    t += "\n";
  }
  f << t;
  return t;
}

TEST(Dataset, LoadedTokenizerGivesTheSameFolderAsTrainingInPlace) {
  const std::string root = temp_dir("loaded_tok");
  const std::string text = write_text(root);
  DatasetOptions o;
  o.text_files = {root + "/text.txt"};
  o.vocab_size = 300;
  o.val_fraction = 0.1;
  auto in_place = prepare_dataset(root + "/a", o);
  ASSERT_TRUE(in_place.is_ok()) << in_place.status().message();

  // The same tokenizer trained here (prepare_dataset's options) and loaded through tokenizer_file.
  TokenizerTrainOptions to;
  to.vocab_size = o.vocab_size;
  to.seed = o.tokenizer_seed;
  to.max_sentences = o.tokenizer_max_sentences;
  auto tok = Tokenizer::train({text}, to);
  ASSERT_TRUE(tok.is_ok()) << tok.status().message();
  ASSERT_TRUE(tok->save(root + "/tok.model").is_ok());
  o.tokenizer_file = root + "/tok.model";
  auto loaded = prepare_dataset(root + "/b", o);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
  EXPECT_EQ(loaded->tokenizer_seconds, 0.0);
  for (const char* f : {"tokenizer.model", "train.bin", "val.bin", "corpus_000.txt"})
    EXPECT_EQ(slurp(root + "/a/" + f), slurp(root + "/b/" + f)) << f;
  EXPECT_EQ(slurp(root + "/b/tokenizer.model"), slurp(root + "/tok.model"));
  EXPECT_TRUE(prepare_dataset(root + "/b", o)->reused);

  // Another tokenizer file under the same name: the folder is rebuilt with it.
  to.vocab_size = 290;
  auto smaller = Tokenizer::train({text}, to);
  ASSERT_TRUE(smaller.is_ok()) << smaller.status().message();
  ASSERT_TRUE(smaller->save(root + "/tok.model").is_ok());
  auto rebuilt = prepare_dataset(root + "/b", o);
  ASSERT_TRUE(rebuilt.is_ok()) << rebuilt.status().message();
  EXPECT_FALSE(rebuilt->reused);
  EXPECT_EQ(rebuilt->vocab_size, 290);
  EXPECT_EQ(slurp(root + "/b/tokenizer.model"), slurp(root + "/tok.model"));

  // A tokenizer larger than the limit, a missing one and a corrupt one: one-line errors.
  o.vocab_size = 289;
  auto big = prepare_dataset(root + "/c", o);
  ASSERT_FALSE(big.is_ok());
  EXPECT_NE(big.status().message().find("data.tokenizer"), std::string::npos) << big.status().message();
  EXPECT_NE(big.status().message().find("290"), std::string::npos) << big.status().message();
  o.vocab_size = 300;
  o.tokenizer_file = root + "/missing.model";
  auto missing = prepare_dataset(root + "/c", o);
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("missing.model"), std::string::npos);
  std::ofstream(root + "/corrupt.model") << "this is not a protobuf";
  o.tokenizer_file = root + "/corrupt.model";
  auto corrupt = prepare_dataset(root + "/c", o);
  ASSERT_FALSE(corrupt.is_ok());
  EXPECT_NE(corrupt.status().message().find("not a sentencepiece model"), std::string::npos)
      << corrupt.status().message();
  for (const auto* s : {&big, &missing, &corrupt})
    EXPECT_EQ(s->status().message().find('\n'), std::string::npos) << s->status().message();
  EXPECT_FALSE(fs::exists(root + "/c"));
  fs::remove_all(root);
}

TEST(Dataset, TokenShardInput) {
  const std::string root = temp_dir("shards");
  const std::string text = write_text(root);
  TokenizerTrainOptions to;
  to.vocab_size = 300;
  auto tok = Tokenizer::train({text}, to);
  ASSERT_TRUE(tok.is_ok());
  ASSERT_TRUE(tok->save(root + "/tok.model").is_ok());
  // Two input shards (ids 0..299 repeating, 100 and 57 tokens) and one validation shard.
  std::vector<int32_t> a(100), b(57), v(40);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int32_t>(i % 300);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int32_t>((7 * i) % 300);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int32_t>((3 * i + 1) % 300);
  ASSERT_TRUE(write_token_shard(root + "/a.bin", a, 300).is_ok());
  ASSERT_TRUE(write_token_shard(root + "/b.tok", b, 300).is_ok());  // detected by magic, not extension
  ASSERT_TRUE(write_token_shard(root + "/v.bin", v, 300).is_ok());
  EXPECT_TRUE(is_token_shard_file(root + "/b.tok"));
  EXPECT_FALSE(is_token_shard_file(root + "/text.txt"));
  EXPECT_FALSE(is_token_shard_file(root + "/missing.bin"));

  auto tokens_of = [](const std::string& path) {
    auto sh = TokenShard::open(path);
    EXPECT_TRUE(sh.is_ok()) << sh.status().message();
    std::vector<int32_t> t(static_cast<size_t>(sh->size()));
    EXPECT_TRUE(sh->read(t.data(), 0, sh->size()).is_ok());
    return t;
  };
  std::vector<int32_t> all = a;
  all.insert(all.end(), b.begin(), b.end());

  DatasetOptions o;
  o.text_files = {root + "/a.bin", root + "/b.tok"};
  o.tokenizer_file = root + "/tok.model";
  o.vocab_size = 300;
  o.val_fraction = 0.1;  // floor(0.1 * 157) = 15 tokens held out from the end
  auto d = prepare_dataset(root + "/d", o);
  ASSERT_TRUE(d.is_ok()) << d.status().message();
  EXPECT_EQ(d->summary.train_tokens, 142);
  EXPECT_EQ(d->summary.val_tokens, 15);
  EXPECT_EQ(tokens_of(d->train_path), std::vector<int32_t>(all.begin(), all.begin() + 142));
  EXPECT_EQ(tokens_of(d->val_path), std::vector<int32_t>(all.begin() + 142, all.end()));
  EXPECT_EQ(slurp(d->tokenizer_path), slurp(root + "/tok.model"));
  EXPECT_TRUE(prepare_dataset(root + "/d", o)->reused);

  o.val_shard_files = {root + "/v.bin"};  // validation shards given: all input tokens train
  auto dv = prepare_dataset(root + "/d", o);
  ASSERT_TRUE(dv.is_ok()) << dv.status().message();
  EXPECT_FALSE(dv->reused);
  EXPECT_EQ(tokens_of(dv->train_path), all);
  EXPECT_EQ(tokens_of(dv->val_path), v);

  // Errors, one line each: no tokenizer, mixed inputs, val shards with text, shard vocab too large.
  std::vector<std::pair<DatasetOptions, std::string>> cases;
  DatasetOptions e = o;
  e.tokenizer_file = "";
  cases.push_back({e, "need data.tokenizer"});
  e = o;
  e.text_files = {root + "/a.bin", root + "/text.txt"};
  cases.push_back({e, "mixes NIBTOK token shards"});
  e = o;
  e.text_files = {root + "/text.txt"};
  cases.push_back({e, "data.val_files is only for token shard input"});
  std::vector<int32_t> wide = {1, 2, 3, 400};
  ASSERT_TRUE(write_token_shard(root + "/wide.bin", wide, 512).is_ok());
  e = o;
  e.text_files = {root + "/wide.bin"};
  cases.push_back({e, "data.files: token shard '" + root + "/wide.bin' has vocab_size 512, more than data.tokenizer's 300"});
  e = o;
  e.val_shard_files = {root + "/wide.bin"};
  cases.push_back({e, "data.val_files: token shard '" + root + "/wide.bin' has vocab_size 512"});
  e = o;
  e.text_files = {root + "/a.bin", root + "/text.txt"};
  cases.push_back({e, "('" + root + "/a.bin') and text files ('" + root + "/text.txt')"});
  for (const auto& [opts, expect] : cases) {
    auto r = prepare_dataset(root + "/e", opts);
    ASSERT_FALSE(r.is_ok()) << expect;
    EXPECT_NE(r.status().message().find(expect), std::string::npos) << r.status().message();
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos) << r.status().message();
  }
  EXPECT_FALSE(fs::exists(root + "/e"));
  fs::remove_all(root);
}

TEST(AtomicDir, CommitReplacesAndAbandonRemoves) {
  const std::string dir = temp_dir("atomic");
  {
    auto a = AtomicDir::create(dir);
    ASSERT_TRUE(a.is_ok());
    ASSERT_TRUE(write_file_atomic(a->temp_path() + "/x.txt", "one").is_ok());
    EXPECT_FALSE(fs::exists(dir));  // not visible before commit
    ASSERT_TRUE(a->commit().is_ok());
  }
  EXPECT_TRUE(fs::exists(dir + "/x.txt"));
  std::string tmp;
  {
    auto b = AtomicDir::create(dir);
    ASSERT_TRUE(b.is_ok());
    tmp = b->temp_path();
    ASSERT_TRUE(write_file_atomic(tmp + "/y.txt", "two").is_ok());
  }  // abandoned: the old folder stays, the temporary goes
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(fs::exists(dir + "/x.txt"));
  {
    auto c = AtomicDir::create(dir);
    ASSERT_TRUE(c.is_ok());
    ASSERT_TRUE(write_file_atomic(c->temp_path() + "/z.txt", "three").is_ok());
    ASSERT_TRUE(c->commit().is_ok());
  }
  EXPECT_FALSE(fs::exists(dir + "/x.txt"));  // replaced as a whole
  EXPECT_TRUE(fs::exists(dir + "/z.txt"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace nibble::train
