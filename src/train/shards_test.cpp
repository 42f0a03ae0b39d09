// Tests of token shards (round trip, u16/u32, corrupt/truncated/wrong-magic files), the
// deterministic train/val split, the shard builder and the default KJV corpus.
#include "train/shards.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include <fmt/format.h>

#include "train/corpus.h"
#include "train/progress.h"
#include "train/tokenizer.h"

namespace nibble::train {
namespace {

namespace fs = std::filesystem;

std::string temp_path(const std::string& name) {
  std::string file = "nibble_shards_test_";
  file += std::to_string(::getpid());
  file += '_';
  file += name;
  return (fs::temp_directory_path() / file).string();
}

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

TEST(Shards, RoundTripU16AndU32) {
  for (int64_t vocab : {int64_t{300}, int64_t{65536}, int64_t{100000}}) {
    std::vector<int32_t> tokens;
    for (int i = 0; i < 1000; ++i) tokens.push_back(static_cast<int32_t>((i * 7919) % vocab));
    tokens.push_back(static_cast<int32_t>(vocab - 1));
    std::string path = temp_path("rt.bin");
    ASSERT_TRUE(write_token_shard(path, tokens, vocab).is_ok());
    const int width = vocab <= 65536 ? 2 : 4;
    EXPECT_EQ(fs::file_size(path), kShardHeaderBytes + tokens.size() * width);
    std::string bytes = read_all(path);
    EXPECT_EQ(bytes.substr(0, 8), std::string("NIBTOK\0\0", 8));
    auto shard = TokenShard::open(path);
    ASSERT_TRUE(shard.is_ok()) << shard.status().message();
    EXPECT_EQ(shard->size(), static_cast<int64_t>(tokens.size()));
    EXPECT_EQ(shard->vocab_size(), vocab);
    EXPECT_EQ(shard->bytes_per_token(), width);
    std::vector<int32_t> back(tokens.size());
    ASSERT_TRUE(shard->read(back.data(), 0, static_cast<int64_t>(back.size())).is_ok());
    EXPECT_EQ(back, tokens);
    std::vector<int32_t> mid(5);
    ASSERT_TRUE(shard->read(mid.data(), 100, 5).is_ok());
    EXPECT_EQ(mid, std::vector<int32_t>(tokens.begin() + 100, tokens.begin() + 105));
    fs::remove(path);
  }
  std::string empty = temp_path("empty.bin");
  ASSERT_TRUE(write_token_shard(empty, {}, 10).is_ok());
  auto e = TokenShard::open(empty);
  ASSERT_TRUE(e.is_ok());
  EXPECT_EQ(e->size(), 0);
  fs::remove(empty);
}

TEST(Shards, WriterRejectsOutOfVocabTokens) {
  std::vector<int32_t> tokens = {1, 2, 10};
  std::string path = temp_path("bad.bin");
  EXPECT_FALSE(write_token_shard(path, tokens, 10).is_ok());
  EXPECT_FALSE(fs::exists(path));
  tokens[2] = -1;
  EXPECT_FALSE(write_token_shard(path, tokens, 10).is_ok());
}

void expect_open_error(const std::string& path, const std::string& needle) {
  auto s = TokenShard::open(path);
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.status().message().find(needle), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find(path), std::string::npos) << s.status().message();
}

TEST(Shards, CorruptFilesGiveClearErrors) {
  std::vector<int32_t> tokens(64);
  for (int i = 0; i < 64; ++i) tokens[i] = i;
  std::string good = temp_path("good.bin");
  ASSERT_TRUE(write_token_shard(good, tokens, 100).is_ok());
  const std::string bytes = read_all(good);
  std::string path = temp_path("corrupt.bin");

  expect_open_error(temp_path("does_not_exist.bin"), "cannot open");
  write_all(path, bytes.substr(0, 10));
  expect_open_error(path, "shorter than the 32-byte header");
  write_all(path, bytes.substr(0, bytes.size() - 1));
  expect_open_error(path, "size mismatch");
  std::string longer = bytes;
  longer.append(2, 'x');
  write_all(path, longer);
  expect_open_error(path, "size mismatch");
  std::string m = bytes;
  m[0] = 'X';
  write_all(path, m);
  expect_open_error(path, "bad magic");
  m = bytes;
  m[8] = 7;  // version
  write_all(path, m);
  expect_open_error(path, "unsupported version 7");
  m = bytes;
  m[12] = 3;  // dtype
  write_all(path, m);
  expect_open_error(path, "bad dtype 3");
  // A token beyond the vocabulary is found when read.
  m = bytes;
  m[kShardHeaderBytes + 2 * 5] = static_cast<char>(200);
  write_all(path, m);
  auto s = TokenShard::open(path);
  ASSERT_TRUE(s.is_ok());
  std::vector<int32_t> out(64);
  Status st = s->read(out.data(), 0, 64);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("position 5"), std::string::npos) << st.message();
  fs::remove(good);
  fs::remove(path);
}

TEST(Split, ValidationShareIsFractionOfLinesAndTails) {
  std::vector<std::vector<std::string>> docs;
  int64_t total = 0;
  for (int k = 0; k < 37; ++k) {
    docs.emplace_back();
    for (int i = 0; i < 1 + (k * 13) % 50; ++i) docs.back().push_back(fmt::format("d{}l{}", k, i));
    total += static_cast<int64_t>(docs.back().size());
  }
  for (double f : {0.0, 0.05, 0.1, 0.5}) {
    auto v = validation_lines_per_document(docs, f);
    int64_t held = 0;
    for (size_t k = 0; k < docs.size(); ++k) {
      EXPECT_GE(v[k], 0);
      EXPECT_LE(v[k], static_cast<int64_t>(docs[k].size()));
      held += v[k];
    }
    // floor(f * total) exactly: the per-document quotas telescope.
    EXPECT_EQ(held, static_cast<int64_t>(std::floor(f * static_cast<double>(total))));
    EXPECT_EQ(v, validation_lines_per_document(docs, f));  // deterministic
  }
}

TEST(Split, SplitDocumentsAtBlankLines) {
  auto d = split_documents("a\nb\n\n  \nc\r\n\nd");
  ASSERT_EQ(d.size(), 3u);
  EXPECT_EQ(d[0], (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(d[1], (std::vector<std::string>{"c"}));
  EXPECT_EQ(d[2], (std::vector<std::string>{"d"}));
  EXPECT_TRUE(split_documents("\n\n").empty());
}

TEST(Shards, BuildTrainValShardsDisjoint) {
  // 3 documents of distinct numbered lines; every line is unique, so train/val disjointness
  // can be checked on the decoded text.
  std::string text;
  std::vector<std::string> all_lines;
  for (int d = 0; d < 3; ++d) {
    for (int i = 0; i < 40; ++i) {
      std::string l = "document " + std::to_string(d) + " says line " + std::to_string(i) + " of the text.";
      text += l + "\n";
      all_lines.push_back(l);
    }
    text += "\n";
  }
  std::string txt = temp_path("corpus.txt");
  write_all(txt, text);
  TokenizerTrainOptions o;
  o.vocab_size = 300;
  auto tok = Tokenizer::train({text}, o);
  ASSERT_TRUE(tok.is_ok()) << tok.status().message();
  std::string train = temp_path("train.bin"), val = temp_path("val.bin");
  auto sum = build_token_shards(train, val, *tok, {txt}, SplitOptions{0.1});
  ASSERT_TRUE(sum.is_ok()) << sum.status().message();
  EXPECT_EQ(sum->documents, 3);
  EXPECT_EQ(sum->val_lines, 12);  // floor(0.1 * 120)
  EXPECT_EQ(sum->train_lines, 108);

  auto decode_shard = [&](const std::string& p, int64_t* eos_count) {
    auto s = TokenShard::open(p);
    EXPECT_TRUE(s.is_ok());
    std::vector<int32_t> ids(static_cast<size_t>(s->size()));
    EXPECT_TRUE(s->read(ids.data(), 0, s->size()).is_ok());
    *eos_count = std::count(ids.begin(), ids.end(), tok->eos_id());
    std::vector<int32_t> no_eos;
    for (int32_t t : ids)
      if (t != tok->eos_id()) no_eos.push_back(t);
    return *tok->decode(no_eos);
  };
  int64_t train_eos = 0, val_eos = 0;
  std::string train_text = decode_shard(train, &train_eos), val_text = decode_shard(val, &val_eos);
  EXPECT_EQ(train_eos, 3);  // one eos per document part
  EXPECT_EQ(val_eos, 3);    // 0.1*40 = 4 lines held out of each document
  std::set<std::string> train_lines, val_lines;
  const auto train_docs = split_documents(train_text), val_docs = split_documents(val_text);
  ASSERT_EQ(train_docs.size(), 1u);  // eos removed: the parts run together without blank lines
  ASSERT_EQ(val_docs.size(), 1u);
  for (const auto& l : train_docs[0]) train_lines.insert(l);
  for (const auto& l : val_docs[0]) val_lines.insert(l);
  EXPECT_EQ(train_lines.size(), 108u);
  EXPECT_EQ(val_lines.size(), 12u);
  for (const auto& l : val_lines) EXPECT_EQ(train_lines.count(l), 0u) << l;
  for (const auto& l : all_lines) EXPECT_EQ(train_lines.count(l) + val_lines.count(l), 1u) << l;
  EXPECT_EQ(val_lines.count("document 1 says line 39 of the text."), 1u);  // the tail is held out
  EXPECT_EQ(val_lines.count("document 1 says line 35 of the text."), 0u);

  // Missing and empty inputs are clear errors.
  auto missing = build_token_shards(train, val, *tok, {temp_path("nope.txt")}, SplitOptions{});
  ASSERT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("not found"), std::string::npos);
  std::string blank = temp_path("blank.txt");
  write_all(blank, "\n \n");
  auto empty = build_token_shards(train, val, *tok, {blank}, SplitOptions{});
  ASSERT_FALSE(empty.is_ok());
  EXPECT_NE(empty.status().message().find("empty"), std::string::npos);
  EXPECT_FALSE(build_token_shards(train, val, *tok, {txt}, SplitOptions{0.9}).is_ok());
  for (const auto& p : {txt, train, val, blank}) fs::remove(p);
}

// The builder streams: a corpus many times larger than the buffer is read and encoded in many
// batches, none holding more than the buffer plus one document, and the shards are byte for byte
// those of one batch (the whole corpus in memory). A document longer than the buffer is kept whole.
TEST(Shards, StreamingBuildIsBoundedAndIndependentOfTheBuffer) {
  std::string text;
  size_t longest = 0;
  for (int d = 0; d < 120; ++d) {
    std::string doc;
    const int lines = d == 7 ? 400 : 3 + d % 11;  // document 7 is longer than the small buffer
    for (int l = 0; l < lines; ++l) doc += fmt::format("doc {} line {} reads {} words of text.\n", d, l, (d * 31 + l) % 97);
    longest = std::max(longest, doc.size());
    text += doc + (d % 5 == 0 ? "\r\n \n" : "\n");  // blank separators with stray whitespace
  }
  std::string txt = temp_path("stream.txt"), txt2 = temp_path("stream2.txt");
  write_all(txt, text);
  const std::string text2 = "a second file with one document\nof two lines\n";
  write_all(txt2, text2);
  TokenizerTrainOptions o;
  o.vocab_size = 300;
  auto tok = Tokenizer::train({text}, o);
  ASSERT_TRUE(tok.is_ok()) << tok.status().message();
  const std::string tr1 = temp_path("s_tr1.bin"), va1 = temp_path("s_va1.bin");
  const std::string tr2 = temp_path("s_tr2.bin"), va2 = temp_path("s_va2.bin");
  SplitOptions whole{0.05};  // default 64 MiB buffer: one batch
  auto one = build_token_shards(tr1, va1, *tok, {txt, txt2}, whole);
  ASSERT_TRUE(one.is_ok()) << one.status().message();
  EXPECT_EQ(one->batches, 1);
  SplitOptions small{0.05};
  small.buffer_bytes = 1024;
  ASSERT_GT(static_cast<int64_t>(text.size()), 10 * small.buffer_bytes);  // the input is much larger
  ASSERT_GT(static_cast<int64_t>(longest), small.buffer_bytes);
  auto many = build_token_shards(tr2, va2, *tok, {txt, txt2}, small);
  ASSERT_TRUE(many.is_ok()) << many.status().message();
  EXPECT_GT(many->batches, 10);
  EXPECT_LE(many->peak_batch_bytes, small.buffer_bytes + static_cast<int64_t>(longest));
  EXPECT_GE(many->peak_batch_bytes, static_cast<int64_t>(longest));  // the long document, whole
  EXPECT_EQ(read_all(tr1), read_all(tr2));
  EXPECT_EQ(read_all(va1), read_all(va2));
  EXPECT_EQ(many->documents, 121);
  EXPECT_EQ(many->text_bytes, static_cast<int64_t>(text.size() + text2.size()));
  EXPECT_EQ(many->val_lines, one->val_lines);
  EXPECT_GT(many->val_tokens, 0);
  // The split is the in-memory rule's (validation_lines_per_document).
  std::vector<std::vector<std::string>> docs = split_documents(text);
  docs.push_back({"a second file with one document", "of two lines"});
  int64_t expect_val = 0;
  for (int64_t v : validation_lines_per_document(docs, 0.05)) expect_val += v;
  EXPECT_EQ(many->val_lines, expect_val);
  // No temporaries are left next to the shards.
  for (const auto& e : fs::directory_iterator(fs::temp_directory_path()))
    EXPECT_EQ(e.path().string().find(tr2 + ".tmp"), std::string::npos) << e.path();
  for (const auto& p : {txt, txt2, tr1, va1, tr2, va2}) fs::remove(p);
}

TEST(Progress, ByteProgressFormatAndPlainLines) {
  EXPECT_EQ(ByteProgress::format(512 << 20, int64_t{2048} << 20, 134200000, 12.5 * (1 << 20), 125, 10),
            "shards 512.0/2048.0 MiB [##........]  25.0% | 12.5 MiB/s | 134.2M tokens | eta 2m05s");
  std::FILE* f = std::tmpfile();
  ByteProgress plain(100, f, false);
  for (int b = 1; b <= 100; ++b) plain.update(b, b);  // a line per further 10%
  plain.finish();
  std::rewind(f);
  char buf[8192];
  const std::string out(buf, std::fread(buf, 1, sizeof(buf), f));
  std::fclose(f);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 11);  // 0%, 10%, ..., 100%
  EXPECT_EQ(out.find('\r'), std::string::npos);
}

TEST(Corpus, SampleLinesIsSeededUniformAndInOrder) {
  std::string a = temp_path("sample_a.txt"), b = temp_path("sample_b.txt");
  std::string ta, tb;
  for (int i = 0; i < 600; ++i) ta += fmt::format("line {}\n", i) + (i % 7 == 0 ? " \n" : "");
  for (int i = 600; i < 1000; ++i) tb += fmt::format("line {}\r\n", i);
  write_all(a, ta);
  write_all(b, tb);
  int64_t total = 0;
  auto s1 = sample_lines({a, b}, 100, 7, &total);
  ASSERT_TRUE(s1.is_ok()) << s1.status().message();
  EXPECT_EQ(total, 1000);  // blank lines are not counted
  ASSERT_EQ(s1->size(), 100u);
  int previous = -1, from_b = 0;
  for (const std::string& l : *s1) {
    ASSERT_EQ(l.rfind("line ", 0), 0u) << l;
    const int n = std::stoi(l.substr(5));
    EXPECT_GT(n, previous);  // reading order, no repeats
    EXPECT_EQ(l, fmt::format("line {}", n));  // '\r' dropped
    previous = n;
    from_b += n >= 600;
  }
  EXPECT_GT(from_b, 20);  // uniform: ~40 of 100 from the second file (not just the first lines)
  EXPECT_LT(from_b, 60);
  EXPECT_EQ(*sample_lines({a, b}, 100, 7), *s1);  // deterministic
  EXPECT_NE(*sample_lines({a, b}, 100, 8), *s1);  // the seed matters
  auto all = sample_lines({a, b}, 5000, 7);
  ASSERT_TRUE(all.is_ok());
  EXPECT_EQ(all->size(), 1000u);
  EXPECT_FALSE(sample_lines({temp_path("missing.txt")}, 10, 1).is_ok());
  EXPECT_FALSE(sample_lines({a}, 0, 1).is_ok());
  for (const auto& p : {a, b}) fs::remove(p);
}

TEST(Corpus, DefaultCorpusIsTheKjv) {
  if (!fs::exists(kBibleProgram) || !fs::exists(kBibleData)) {
    auto r = default_corpus_text();
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("install bible-kjv"), std::string::npos);
    GTEST_SKIP() << "bible-kjv not installed (scripts/setup.sh installs it)";
  }
  auto text = default_corpus_text();
  ASSERT_TRUE(text.is_ok()) << text.status().message();
  EXPECT_EQ(text->rfind("In the beginning God created the heaven and the earth.\n", 0), 0u);
  const std::string last = "The grace of our Lord Jesus Christ be with you all. Amen.\n";
  EXPECT_EQ(text->substr(text->size() - last.size()), last);
  auto docs = split_documents(*text);
  EXPECT_EQ(docs.size(), 66u);  // books
  size_t verses = 0;
  for (const auto& d : docs) verses += d.size();
  EXPECT_EQ(verses, 31102u);
  std::string path = temp_path("kjv.txt");
  ASSERT_TRUE(write_default_corpus(path).is_ok());
  auto again = read_text_file(path);
  ASSERT_TRUE(again.is_ok());
  EXPECT_EQ(*again, *text);
  fs::remove(path);
}

}  // namespace
}  // namespace nibble::train
