// Batches for training and evaluation from token shards (shards.h), like llm.c's dataloader
// but shuffled, seeded and resumable. The token stream of each shard is cut into windows of
// T+1 tokens starting at multiples of T (window j: tokens [jT, jT+T], so consecutive windows
// share one token and every token is a target once); windows never cross shards. Each epoch
// visits every window once in a Fisher-Yates order drawn from PhiloxStream(seed, kLoaderStream
// + epoch). State = (epoch, position in the epoch's order): saving it and restoring it later
// yields exactly the batches the uninterrupted run would have drawn.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "train/shards.h"

namespace nibble::train {

// Philox stream tag of the loader ("LOAD" << 32); stream = tag + epoch, so other users of the
// run seed (initialisation, dropout, SR) never draw the same numbers.
inline constexpr uint64_t kLoaderStream = uint64_t{0x4C4F4144} << 32;

struct Batch {
  int64_t batch = 0;             // B (rows actually filled)
  int64_t seq_len = 0;           // T
  std::vector<int32_t> tokens;   // (B,T) int32: window[0..T-1]
  std::vector<int32_t> targets;  // (B,T) int32: window[1..T]
};

// Ready-made rows instead of windows cut from shards (`nibble sft`: one tokenized task example
// per row, padded, prompt positions without a target): tokens and targets (count, seq_len) int32,
// targets < 0 ignored by the loss. Shared, read-only: a train and a validation loader may hold it.
struct Rows {
  int64_t count = 0, seq_len = 0;
  std::vector<int32_t> tokens, targets;
};

struct LoaderState {
  uint64_t epoch = 0;
  int64_t position = 0;  // windows of this epoch already drawn
};

class TrainLoader {
 public:
  // Needs at least one window (T+1 tokens in some shard). batch >= 1, seq_len >= 1.
  static Result<TrainLoader> open(const std::vector<std::string>& shard_paths, int64_t batch, int64_t seq_len,
                                  uint64_t seed);
  // The same shuffling, state and resume over ready-made rows (each row is one "window").
  static Result<TrainLoader> from_rows(std::shared_ptr<const Rows> rows, int64_t batch, uint64_t seed);

  // out: the next B windows as tokens (B,T) and targets (B,T); crosses epoch ends seamlessly.
  // With a row range [row_begin, row_end) (data parallelism: one rank's share of the global
  // batch), the state advances by all B windows as before but only rows row_begin..row_end-1 are
  // read: out is (row_end-row_begin, T), the rows the whole batch has at those places.
  Status next(Batch* out);
  Status next(Batch* out, int64_t row_begin, int64_t row_end);

  LoaderState state() const { return state_; }
  Status restore(const LoaderState& state);
  // {"epoch", "position", "seed", "seq_len", "windows"}; restoring checks that seed, seq_len and
  // the number of windows match this loader (same data, same config), else an error.
  nlohmann::json state_json() const;
  Status restore_json(const nlohmann::json& j);

  int64_t windows_per_epoch() const { return shard_window_begin_.back(); }
  int64_t batch() const { return batch_; }
  int64_t seq_len() const { return seq_len_; }
  uint64_t seed() const { return seed_; }

 private:
  void make_order(uint64_t epoch);
  std::vector<TokenShard> shards_;
  std::shared_ptr<const Rows> rows_;          // from_rows: the rows (then shards_ is empty)
  std::vector<int64_t> shard_window_begin_;  // (shards+1): first global window of each shard
  std::vector<int64_t> order_;               // this epoch's permutation of windows (8 B/window)
  int64_t batch_ = 0, seq_len_ = 0;
  uint64_t seed_ = 0;
  LoaderState state_;
  uint64_t order_epoch_ = ~uint64_t{0};
};

// Fixed-order evaluation batches: windows in shard order, B per batch (fewer only when the whole
// set has fewer than B windows), at most max_batches batches (0: all); a final partial batch is
// dropped so every evaluation sees the same token count.
class ValLoader {
 public:
  static Result<ValLoader> open(const std::vector<std::string>& shard_paths, int64_t batch, int64_t seq_len,
                                int64_t max_batches);
  // Ready-made rows in order, B per batch, with the same rules as open().
  static Result<ValLoader> from_rows(std::shared_ptr<const Rows> rows, int64_t batch, int64_t max_batches);
  int64_t num_batches() const { return num_batches_; }
  // out: batch i (0 <= i < num_batches()).
  Status get(int64_t i, Batch* out) const;

 private:
  void set_batches(int64_t batch, int64_t max_batches);
  std::vector<TokenShard> shards_;
  std::shared_ptr<const Rows> rows_;
  std::vector<int64_t> shard_window_begin_;
  int64_t batch_ = 0, seq_len_ = 0, num_batches_ = 0;
};

}  // namespace nibble::train
