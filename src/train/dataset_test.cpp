// Tests of the data folder: built from user text, reused when unchanged, rebuilt when the text
// or options change, and the atomic folder writer it relies on.
#include "train/dataset.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

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
