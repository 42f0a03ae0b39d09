// Tests of the SentencePiece tokenizer wrapper: training on a small text, exact round trips
// (byte fallback makes any UTF-8 encodable), save/load, determinism, and errors.
#include "train/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace nibble::train {
namespace {

std::string small_text() {
  std::string t;
  const char* lines[] = {
      "In the beginning God created the heaven and the earth.",
      "And the earth was without form, and void; and darkness was upon the face of the deep.",
      "And God said, Let there be light: and there was light.",
      "And God saw the light, that it was good: and God divided the light from the darkness.",
      "And God called the light Day, and the darkness he called Night.",
      "And the evening and the morning were the first day.",
  };
  for (int rep = 0; rep < 4; ++rep)
    for (const char* l : lines) t += std::string(l) + "\n";
  return t;
}

TokenizerTrainOptions small_options() {
  TokenizerTrainOptions o;
  o.vocab_size = 320;
  return o;
}

TEST(Tokenizer, TrainsAndRoundTripsText) {
  auto tok = Tokenizer::train({small_text()}, small_options());
  ASSERT_TRUE(tok.is_ok()) << tok.status().message();
  EXPECT_EQ(tok->vocab_size(), 320);
  EXPECT_EQ(tok->unk_id(), 0);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  EXPECT_EQ(tok->pad_id(), 3);
  // Seen text, text with unseen characters (byte fallback), leading/double spaces, newlines.
  for (std::string s : {std::string("And God said, Let there be light."), std::string("  two  spaces\nand\ttabs\n"),
                        std::string("Zebra 123 \xc3\xa9t\xc3\xa9 \xe2\x82\xac!"), std::string("")}) {
    auto ids = tok->encode(s);
    ASSERT_TRUE(ids.is_ok());
    for (int32_t id : *ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, 320);
      EXPECT_NE(id, tok->unk_id()) << "byte fallback should never produce unk";
    }
    auto back = tok->decode(*ids);
    ASSERT_TRUE(back.is_ok());
    EXPECT_EQ(*back, s);
  }
  // Merges were learned: common words take fewer tokens than bytes.
  auto ids = tok->encode("And God said");
  ASSERT_TRUE(ids.is_ok());
  EXPECT_LT(ids->size(), std::string("And God said").size());
}

TEST(Tokenizer, DeterministicAndSaveLoad) {
  auto a = Tokenizer::train({small_text()}, small_options());
  auto b = Tokenizer::train({small_text()}, small_options());
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  EXPECT_EQ(a->serialized(), b->serialized());

  // With fewer sentences allowed than lines, SentencePiece samples lines with its seeded
  // generator: still identical across trainings.
  std::string many;
  for (int rep = 0; rep < 13; ++rep) many += small_text();  // 312 lines
  TokenizerTrainOptions sampled = small_options();
  sampled.max_sentences = 150;
  auto s1 = Tokenizer::train({many}, sampled);
  auto s2 = Tokenizer::train({many}, sampled);
  ASSERT_TRUE(s1.is_ok() && s2.is_ok()) << s1.status().message();
  EXPECT_EQ(s1->serialized(), s2->serialized());

  std::string path = (std::filesystem::temp_directory_path() / "nibble_tokenizer_test.model").string();
  ASSERT_TRUE(a->save(path).is_ok());
  auto c = Tokenizer::load(path);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->serialized(), a->serialized());
  EXPECT_EQ(*c->encode("the light"), *a->encode("the light"));
  std::filesystem::remove(path);
}

TEST(Tokenizer, Errors) {
  EXPECT_FALSE(Tokenizer::train({""}, small_options()).is_ok());
  TokenizerTrainOptions few = small_options();
  few.max_sentences = 100;
  EXPECT_FALSE(Tokenizer::train({small_text()}, few).is_ok());
  TokenizerTrainOptions tiny = small_options();
  tiny.vocab_size = 10;
  EXPECT_FALSE(Tokenizer::train({small_text()}, tiny).is_ok());
  TokenizerTrainOptions huge = small_options();
  huge.vocab_size = 5000;  // more pieces than a 24-line text can make
  EXPECT_FALSE(Tokenizer::train({small_text()}, huge).is_ok());
  auto missing = Tokenizer::load("/nonexistent/tokenizer.model");
  EXPECT_FALSE(missing.is_ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/tokenizer.model"), std::string::npos);
  EXPECT_FALSE(Tokenizer::from_serialized("not a protobuf").is_ok());
  auto tok = Tokenizer::train({small_text()}, small_options());
  ASSERT_TRUE(tok.is_ok());
  std::vector<int32_t> bad = {5, 320};
  EXPECT_FALSE(tok->decode(bad).is_ok());
}

}  // namespace
}  // namespace nibble::train
