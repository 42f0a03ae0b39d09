// Token shard writing/reading and the corpus -> train/val shard builder; see shards.h.
#include "train/shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "io/regular_file.h"
#include "train/atomic_dir.h"
#include "train/corpus.h"
#include "train/tokenizer.h"

namespace nibble::train {

static_assert(std::endian::native == std::endian::little, "shards are little-endian; this host is not");

namespace {

struct RawHeader {
  char magic[8];
  uint32_t version;
  uint32_t dtype;
  uint64_t count;
  uint32_t vocab_size;
  uint32_t reserved;
};
static_assert(sizeof(RawHeader) == kShardHeaderBytes);

}  // namespace

Status write_token_shard(const std::string& path, std::span<const int32_t> tokens, int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > (int64_t{1} << 31) - 1)
    return invalid_argument("shard {}: vocab_size {} out of range", path, vocab_size);
  const int width = vocab_size <= 65536 ? 2 : 4;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab_size)
      return invalid_argument("shard {}: token {} at {} outside [0, {})", path, tokens[i], i, vocab_size);
  std::string bytes(kShardHeaderBytes + tokens.size() * static_cast<size_t>(width), '\0');
  RawHeader h{};
  std::memcpy(h.magic, kShardMagic, 8);
  h.version = kShardVersion;
  h.dtype = static_cast<uint32_t>(width);
  h.count = tokens.size();
  h.vocab_size = static_cast<uint32_t>(vocab_size);
  std::memcpy(bytes.data(), &h, sizeof(h));
  char* out = bytes.data() + kShardHeaderBytes;
  if (width == 2) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      uint16_t t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(out + 2 * i, &t, 2);
    }
  } else {
    std::memcpy(out, tokens.data(), tokens.size() * 4);
  }
  return write_file_atomic(path, bytes);
}

Result<TokenShard> TokenShard::open(const std::string& path) {
  // Never blocks on a FIFO or device (io/regular_file.h).
  auto file = io::open_regular_file(path, "token shard");
  if (!file) {
    if (file.status().code() == StatusCode::kNotFound) return not_found("token shard {}: cannot open: no such file", path);
    return file.status();
  }
  const int fd = file->fd();
  const size_t size = static_cast<size_t>(file->size());
  if (size < kShardHeaderBytes) {
    return data_loss("token shard {}: truncated: {} bytes, shorter than the {}-byte header", path, size,
                     kShardHeaderBytes);
  }
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) return io_error("token shard {}: mmap failed: {}", path, std::strerror(errno));
  std::shared_ptr<const uint8_t> map(static_cast<const uint8_t*>(p),
                                     [size](const uint8_t* q) { ::munmap(const_cast<uint8_t*>(q), size); });
  RawHeader h;
  std::memcpy(&h, map.get(), sizeof(h));
  if (std::memcmp(h.magic, kShardMagic, 8) != 0)
    return data_loss("token shard {}: bad magic (not a nibble token shard: expected \"NIBTOK\")", path);
  if (h.version != kShardVersion)
    return data_loss("token shard {}: unsupported version {} (this build reads {})", path, h.version, kShardVersion);
  if (h.dtype != 2 && h.dtype != 4)
    return data_loss("token shard {}: bad dtype {} (expected 2 for u16 or 4 for u32)", path, h.dtype);
  if (h.vocab_size == 0 || (h.dtype == 2 && h.vocab_size > 65536))
    return data_loss("token shard {}: bad vocab_size {} for {}-byte tokens", path, h.vocab_size, h.dtype);
  if (h.count > (size - kShardHeaderBytes) / h.dtype || kShardHeaderBytes + h.count * h.dtype != size)
    return data_loss("token shard {}: size mismatch: header says {} tokens of {} bytes ({} bytes with header), file has "
                     "{} bytes (truncated or corrupt)",
                     path, h.count, h.dtype, kShardHeaderBytes + static_cast<double>(h.count) * h.dtype, size);
  TokenShard s;
  s.map_ = std::move(map);
  s.path_ = path;
  s.count_ = static_cast<int64_t>(h.count);
  s.vocab_size_ = h.vocab_size;
  s.width_ = static_cast<int>(h.dtype);
  return s;
}

Status TokenShard::read(int32_t* dst, int64_t start, int64_t n) const {
  NIB_CHECK_MSG(start >= 0 && n >= 0 && start + n <= count_, "read [{}, {}) of {} tokens", start, start + n, count_);
  const uint8_t* src = map_.get() + kShardHeaderBytes + static_cast<size_t>(start) * width_;
  bool bad = false;
  if (width_ == 2) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t t;
      std::memcpy(&t, src + 2 * i, 2);
      dst[i] = t;
      bad |= t >= vocab_size_;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t t;
      std::memcpy(&t, src + 4 * i, 4);
      dst[i] = static_cast<int32_t>(t);
      bad |= t >= static_cast<uint64_t>(vocab_size_);
    }
  }
  if (bad) {
    for (int64_t i = 0; i < n; ++i)
      if (dst[i] < 0 || dst[i] >= vocab_size_)
        return data_loss("token shard {}: token {} at position {} outside the vocabulary [0, {})", path_,
                         static_cast<uint32_t>(dst[i]), start + i, vocab_size_);
  }
  return Status::ok();
}

std::vector<int64_t> validation_lines_per_document(const std::vector<std::vector<std::string>>& docs,
                                                   double val_fraction) {
  std::vector<int64_t> v(docs.size(), 0);
  int64_t cumulative = 0, held = 0;
  for (size_t k = 0; k < docs.size(); ++k) {
    const int64_t n = static_cast<int64_t>(docs[k].size());
    cumulative += n;
    const int64_t target = static_cast<int64_t>(std::floor(val_fraction * static_cast<double>(cumulative)));
    const int64_t want = target - held;
    v[k] = want < 0 ? 0 : (want > n ? n : want);
    held += v[k];
  }
  return v;
}

namespace {

std::string join_lines(const std::vector<std::string>& lines, size_t begin, size_t end) {
  std::string s;
  for (size_t i = begin; i < end; ++i) {
    s += lines[i];
    s += '\n';
  }
  return s;
}

}  // namespace

Result<ShardSummary> build_token_shards(const std::string& train_path, const std::string& val_path,
                                        const Tokenizer& tokenizer, const std::vector<std::string>& text_files,
                                        const SplitOptions& options) {
  if (!(options.val_fraction >= 0.0 && options.val_fraction <= 0.5))
    return invalid_argument("val_fraction {} must be in [0, 0.5]", options.val_fraction);
  if (text_files.empty()) return invalid_argument("no text files to tokenize");
  ShardSummary sum;
  std::vector<std::vector<std::string>> docs;
  for (const std::string& f : text_files) {
    NIB_ASSIGN_OR_RETURN(std::string text, read_text_file(f));
    sum.text_bytes += static_cast<int64_t>(text.size());
    auto d = split_documents(text);
    for (auto& doc : d) docs.push_back(std::move(doc));
    ++sum.files;
  }
  sum.documents = static_cast<int64_t>(docs.size());
  const std::vector<int64_t> val_lines = validation_lines_per_document(docs, options.val_fraction);

  // Encode every document part in parallel (the processor is const and thread-safe), then
  // concatenate in document order so the shards do not depend on the thread count.
  const int64_t nd = static_cast<int64_t>(docs.size());
  std::vector<std::vector<int32_t>> train_parts(docs.size()), val_parts(docs.size());
  std::vector<Status> errors(docs.size());
  const int32_t eos = tokenizer.eos_id();
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t k = 0; k < nd; ++k) {
    const auto& lines = docs[k];
    const size_t split = lines.size() - static_cast<size_t>(val_lines[k]);
    for (int part = 0; part < 2; ++part) {
      size_t b = part == 0 ? 0 : split, e = part == 0 ? split : lines.size();
      if (b == e) continue;
      auto ids = tokenizer.encode(join_lines(lines, b, e));
      if (!ids.is_ok()) {
        errors[k] = ids.status();
        break;
      }
      std::vector<int32_t>& dst = part == 0 ? train_parts[k] : val_parts[k];
      dst = std::move(ids).value();
      dst.push_back(eos);
    }
  }
  for (const Status& s : errors) NIB_RETURN_IF_ERROR(s);
  std::vector<int32_t> train, val;
  for (int64_t k = 0; k < nd; ++k) {
    train.insert(train.end(), train_parts[k].begin(), train_parts[k].end());
    val.insert(val.end(), val_parts[k].begin(), val_parts[k].end());
    sum.val_lines += val_lines[k];
    sum.train_lines += static_cast<int64_t>(docs[k].size()) - val_lines[k];
  }
  sum.train_tokens = static_cast<int64_t>(train.size());
  sum.val_tokens = static_cast<int64_t>(val.size());
  if (train.empty()) return data_loss("no training tokens: the text files hold no non-blank lines");
  NIB_RETURN_IF_ERROR(write_token_shard(train_path, train, tokenizer.vocab_size()));
  NIB_RETURN_IF_ERROR(write_token_shard(val_path, val, tokenizer.vocab_size()));
  return sum;
}

}  // namespace nibble::train
