// Seeded, resumable training batches and fixed-order validation batches; see loader.h.
#include "train/loader.h"

#include <algorithm>

#include "core/check.h"
#include "core/philox.h"

namespace nibble::train {

namespace {

// Opens the shards; window_begin gets (shards+1) prefix sums of each shard's window count.
Status open_windows(const std::vector<std::string>& paths, int64_t seq_len, std::vector<TokenShard>* shards,
                    std::vector<int64_t>* window_begin) {
  if (paths.empty()) return invalid_argument("no token shards given");
  if (seq_len < 1) return invalid_argument("seq_len must be >= 1 (got {})", seq_len);
  window_begin->assign(1, 0);
  for (const std::string& p : paths) {
    NIB_ASSIGN_OR_RETURN(TokenShard s, TokenShard::open(p));
    if (!shards->empty() && s.vocab_size() != shards->front().vocab_size())
      return data_loss("token shard {} has vocab_size {}, {} has {}", p, s.vocab_size(),
                       shards->front().path(), shards->front().vocab_size());
    const int64_t windows = s.size() >= seq_len + 1 ? (s.size() - 1) / seq_len : 0;
    window_begin->push_back(window_begin->back() + windows);
    shards->push_back(std::move(s));
  }
  if (window_begin->back() == 0)
    return data_loss("token shards hold no window of seq_len+1 = {} tokens (shard {} has {} tokens)",
                     seq_len + 1, paths.front(), shards->front().size());
  return Status::ok();
}

// Global window w -> its shard and first token. row: (T+1) int32 scratch; tokens/targets: (T)
// int32 each.
Status fill_row(const std::vector<TokenShard>& shards, const std::vector<int64_t>& window_begin, int64_t w,
                int64_t seq_len, int32_t* row, int32_t* tokens, int32_t* targets) {
  const size_t shard = static_cast<size_t>(std::upper_bound(window_begin.begin(), window_begin.end(), w) -
                                           window_begin.begin()) - 1;
  const int64_t start = (w - window_begin[shard]) * seq_len;
  NIB_RETURN_IF_ERROR(shards[shard].read(row, start, seq_len + 1));
  for (int64_t t = 0; t < seq_len; ++t) {
    tokens[t] = row[t];
    targets[t] = row[t + 1];
  }
  return Status::ok();
}

// Checks ready-made rows; window_begin gets {0, count} (all rows form one "shard").
Status check_rows(const std::shared_ptr<const Rows>& rows, std::vector<int64_t>* window_begin) {
  if (rows == nullptr || rows->count < 1) return data_loss("no rows to train on");
  if (rows->seq_len < 1) return invalid_argument("seq_len must be >= 1 (got {})", rows->seq_len);
  const size_t n = static_cast<size_t>(rows->count * rows->seq_len);
  NIB_CHECK_MSG(rows->tokens.size() == n && rows->targets.size() == n, "rows: {} tokens, {} targets for {}x{}",
                rows->tokens.size(), rows->targets.size(), rows->count, rows->seq_len);
  *window_begin = {0, rows->count};
  return Status::ok();
}

// Row w of `rows` into tokens/targets: (T) int32 each.
void copy_row(const Rows& rows, int64_t w, int32_t* tokens, int32_t* targets) {
  const size_t o = static_cast<size_t>(w * rows.seq_len);
  std::copy_n(rows.tokens.data() + o, rows.seq_len, tokens);
  std::copy_n(rows.targets.data() + o, rows.seq_len, targets);
}

// Shapes out as B windows of T tokens (tokens, targets: (B,T) int32) and returns the (T+1) int32
// row scratch that fill_row reads each window into.
std::vector<int32_t> start_batch(Batch* out, int64_t batch, int64_t seq_len) {
  out->batch = batch;
  out->seq_len = seq_len;
  out->tokens.resize(static_cast<size_t>(batch * seq_len));
  out->targets.resize(static_cast<size_t>(batch * seq_len));
  return std::vector<int32_t>(static_cast<size_t>(seq_len + 1));
}

}  // namespace

Result<TrainLoader> TrainLoader::open(const std::vector<std::string>& shard_paths, int64_t batch, int64_t seq_len,
                                      uint64_t seed) {
  if (batch < 1) return invalid_argument("batch size must be >= 1 (got {})", batch);
  TrainLoader l;
  NIB_RETURN_IF_ERROR(open_windows(shard_paths, seq_len, &l.shards_, &l.shard_window_begin_));
  l.batch_ = batch;
  l.seq_len_ = seq_len;
  l.seed_ = seed;
  return l;
}

Result<TrainLoader> TrainLoader::from_rows(std::shared_ptr<const Rows> rows, int64_t batch, uint64_t seed) {
  if (batch < 1) return invalid_argument("batch size must be >= 1 (got {})", batch);
  TrainLoader l;
  NIB_RETURN_IF_ERROR(check_rows(rows, &l.shard_window_begin_));
  l.seq_len_ = rows->seq_len;
  l.rows_ = std::move(rows);
  l.batch_ = batch;
  l.seed_ = seed;
  return l;
}

void TrainLoader::make_order(uint64_t epoch) {
  if (order_epoch_ == epoch) return;
  const int64_t n = windows_per_epoch();
  order_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) order_[i] = i;
  PhiloxStream rng(seed_, kLoaderStream + epoch);
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates: swap i with a uniform j in [0, i]
    int64_t j = static_cast<int64_t>(rng.next_below(static_cast<uint64_t>(i) + 1));
    std::swap(order_[i], order_[j]);
  }
  order_epoch_ = epoch;
}

Status TrainLoader::next(Batch* out) { return next(out, 0, batch_); }

Status TrainLoader::next(Batch* out, int64_t row_begin, int64_t row_end) {
  if (row_begin < 0 || row_end > batch_ || row_begin >= row_end)
    return invalid_argument("loader: rows [{}, {}) outside the batch of {}", row_begin, row_end, batch_);
  std::vector<int32_t> row = start_batch(out, row_end - row_begin, seq_len_);
  for (int64_t b = 0; b < batch_; ++b) {
    if (state_.position >= windows_per_epoch()) {
      ++state_.epoch;
      state_.position = 0;
    }
    make_order(state_.epoch);
    const int64_t w = order_[static_cast<size_t>(state_.position)];
    if (b >= row_begin && b < row_end) {
      const int64_t o = (b - row_begin) * seq_len_;
      if (rows_ != nullptr) copy_row(*rows_, w, out->tokens.data() + o, out->targets.data() + o);
      else NIB_RETURN_IF_ERROR(fill_row(shards_, shard_window_begin_, w, seq_len_, row.data(), out->tokens.data() + o,
                                   out->targets.data() + o));
    }
    ++state_.position;
  }
  return Status::ok();
}

Status TrainLoader::restore(const LoaderState& s) {
  if (s.position < 0 || s.position > windows_per_epoch())
    return invalid_argument("loader state: position {} outside [0, {}]", s.position, windows_per_epoch());
  state_ = s;
  return Status::ok();
}

nlohmann::json TrainLoader::state_json() const {
  return {{"epoch", state_.epoch},   {"position", state_.position},      {"seed", seed_},
          {"seq_len", seq_len_},     {"windows", windows_per_epoch()}};
}

Status TrainLoader::restore_json(const nlohmann::json& j) {
  try {
    if (!j.is_object()) return invalid_argument("loader state: expected a JSON object");
    const uint64_t seed = j.at("seed").get<uint64_t>();
    const int64_t seq_len = j.at("seq_len").get<int64_t>();
    const int64_t windows = j.at("windows").get<int64_t>();
    if (seed != seed_ || seq_len != seq_len_ || windows != windows_per_epoch())
      return invalid_argument(
          "loader state was saved for seed {} seq_len {} with {} windows; this run has seed {} seq_len {} with {} "
          "windows (different data or config)",
          seed, seq_len, windows, seed_, seq_len_, windows_per_epoch());
    LoaderState s;
    s.epoch = j.at("epoch").get<uint64_t>();
    s.position = j.at("position").get<int64_t>();
    return restore(s);
  } catch (const nlohmann::json::exception& e) {
    return invalid_argument("loader state: {}", e.what());
  }
}

Result<ValLoader> ValLoader::open(const std::vector<std::string>& shard_paths, int64_t batch, int64_t seq_len,
                                  int64_t max_batches) {
  if (batch < 1) return invalid_argument("batch size must be >= 1 (got {})", batch);
  if (max_batches < 0) return invalid_argument("max_batches must be >= 0 (got {})", max_batches);
  ValLoader v;
  NIB_RETURN_IF_ERROR(open_windows(shard_paths, seq_len, &v.shards_, &v.shard_window_begin_));
  v.seq_len_ = seq_len;
  v.set_batches(batch, max_batches);
  return v;
}

Result<ValLoader> ValLoader::from_rows(std::shared_ptr<const Rows> rows, int64_t batch, int64_t max_batches) {
  if (batch < 1) return invalid_argument("batch size must be >= 1 (got {})", batch);
  if (max_batches < 0) return invalid_argument("max_batches must be >= 0 (got {})", max_batches);
  ValLoader v;
  NIB_RETURN_IF_ERROR(check_rows(rows, &v.shard_window_begin_));
  v.seq_len_ = rows->seq_len;
  v.rows_ = std::move(rows);
  v.set_batches(batch, max_batches);
  return v;
}

void ValLoader::set_batches(int64_t batch, int64_t max_batches) {
  const int64_t windows = shard_window_begin_.back();
  batch_ = windows < batch ? windows : batch;
  num_batches_ = windows / batch_;
  if (max_batches > 0 && num_batches_ > max_batches) num_batches_ = max_batches;
}

Status ValLoader::get(int64_t i, Batch* out) const {
  NIB_CHECK_MSG(i >= 0 && i < num_batches_, "validation batch {} of {}", i, num_batches_);
  std::vector<int32_t> row = start_batch(out, batch_, seq_len_);
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t w = i * batch_ + b;
    if (rows_ != nullptr) {
      copy_row(*rows_, w, out->tokens.data() + b * seq_len_, out->targets.data() + b * seq_len_);
      continue;
    }
    NIB_RETURN_IF_ERROR(fill_row(shards_, shard_window_begin_, w, seq_len_, row.data(),
                                 out->tokens.data() + b * seq_len_, out->targets.data() + b * seq_len_));
  }
  return Status::ok();
}

}  // namespace nibble::train
