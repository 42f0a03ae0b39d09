// Tests of `nibble data` (tokenizer on a line sample, streaming shards) and `nibble plot` through
// the binary: the happy paths (files written, summary lines, the shards readable and decoding
// back to the text) and their errors (one line, exit 2 for bad arguments, 1 for bad input).
#include <gtest/gtest.h>

#include "tools/cli_test_util.h"
#include "train/shards.h"
#include "train/tokenizer.h"

namespace nibble::tools::test {
namespace {

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

TEST(DataCli, TokenizerAndShardsRoundTrip) {
  ScratchDir d("data_cli");
  std::string text;
  for (int doc = 0; doc < 20; ++doc) {
    for (int l = 0; l < 5; ++l) text += "Paragraph " + std::to_string(l) + " of document " + std::to_string(doc) + " says hello.\n";
    text += "\n";
  }
  write_text(d / "t.txt", text);
  auto tok = run_nibble(d.path, "data tokenizer --vocab 300 --sample-lines 150 --out '" + (d / "tok.model") + "' '" +
                                    (d / "t.txt") + "'");
  ASSERT_EQ(tok.code, 0) << tok.err;
  EXPECT_NE(tok.out.find("300 pieces, trained on 100 of 100 lines"), std::string::npos) << tok.out;
  auto sh = run_nibble(d.path, "data shards --no-progress --buffer-mb 1 --tokenizer '" + (d / "tok.model") + "' --out '" +
                                   (d / "t.bin") + "' '" + (d / "t.txt") + "'");
  ASSERT_EQ(sh.code, 0) << sh.err;
  EXPECT_NE(sh.out.find("from 20 documents"), std::string::npos) << sh.out;
  auto shard = train::TokenShard::open(d / "t.bin");
  ASSERT_TRUE(shard.is_ok()) << shard.status().message();
  auto model = train::Tokenizer::load(d / "tok.model");
  ASSERT_TRUE(model.is_ok());
  std::vector<int32_t> ids(static_cast<size_t>(shard->size()));
  ASSERT_TRUE(shard->read(ids.data(), 0, shard->size()).is_ok());
  std::string back;
  std::vector<int32_t> part;
  for (int32_t t : ids) {
    if (t == model->eos_id()) {
      back += *model->decode(part) + "\n";
      part.clear();
    } else {
      part.push_back(t);
    }
  }
  EXPECT_EQ(back, text);  // every document, then a blank line where its eos was
  EXPECT_FALSE(fs::exists(d / "nope.bin"));

  // Errors: a held-out share without a validation shard (2), a missing text (1), a bad tokenizer (1).
  auto both = run_nibble(d.path, "data shards --val-fraction 0.1 --tokenizer '" + (d / "tok.model") + "' --out '" +
                                     (d / "x.bin") + "' '" + (d / "t.txt") + "'");
  EXPECT_EQ(both.code, 2);
  EXPECT_EQ(both.err_lines(), 1) << both.err;
  auto missing = run_nibble(d.path, "data shards --tokenizer '" + (d / "tok.model") + "' --out '" + (d / "x.bin") + "' '" +
                                        (d / "nope.txt") + "'");
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find("not found"), std::string::npos) << missing.err;
  EXPECT_FALSE(fs::exists(d / "x.bin"));
  auto badtok = run_nibble(d.path, "data shards --tokenizer '" + (d / "t.txt") + "' --out '" + (d / "x.bin") + "' '" +
                                       (d / "t.txt") + "'");
  EXPECT_EQ(badtok.code, 1) << badtok.err;
  auto small = run_nibble(d.path, "data tokenizer --vocab 100 --out '" + (d / "y.model") + "' '" + (d / "t.txt") + "'");
  EXPECT_EQ(small.code, 2) << small.err;
}

TEST(PlotCli, CurvesFromMetricsFiles) {
  ScratchDir d("plot_cli");
  write_text(d / "a.metrics.jsonl",
             "{\"event\":\"start\",\"step\":0}\n{\"step\":1,\"loss\":5.0}\n{\"step\":2,\"loss\":4.0,\"val_loss\":4.5}\n"
             "{\"event\":\"end\",\"step\":2,\"val_loss\":4.5}\n");
  write_text(d / "b.metrics.jsonl", "{\"step\":1,\"loss\":5.5}\n{\"step\":2,\"loss\":4.2,\"val_loss\":4.6}\n");
  auto ok = run_nibble(d.path, "plot --key loss --out '" + (d / "p.png") + "' '" + (d / "a.metrics.jsonl") + "' '" +
                                   (d / "b.metrics.jsonl") + "'");
  ASSERT_EQ(ok.code, 0) << ok.err;
  EXPECT_NE(ok.out.find("2 curve(s) of loss, 4 points"), std::string::npos) << ok.out;
  EXPECT_EQ(slurp(d / "p.png").substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  auto val = run_nibble(d.path, "plot --key val_loss --out '" + (d / "v.png") + "' '" + (d / "a.metrics.jsonl") + "'");
  ASSERT_EQ(val.code, 0) << val.err;
  EXPECT_NE(val.out.find("1 points"), std::string::npos) << val.out;  // the end event is not a point
  auto none = run_nibble(d.path, "plot --key grad_norm --out '" + (d / "n.png") + "' '" + (d / "a.metrics.jsonl") + "'");
  EXPECT_EQ(none.code, 1);
  EXPECT_EQ(none.err_lines(), 1) << none.err;
  EXPECT_FALSE(fs::exists(d / "n.png"));
  auto missing = run_nibble(d.path, "plot --key loss --out '" + (d / "m.png") + "' '" + (d / "nope.jsonl") + "'");
  EXPECT_EQ(missing.code, 1) << missing.err;
}

}  // namespace
}  // namespace nibble::tools::test
