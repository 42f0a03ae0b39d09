// Token shard writing/reading and the corpus -> train/val shard builder; see shards.h.
#include "train/shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "io/output_guard.h"
#include "io/regular_file.h"
#include "train/atomic_dir.h"
#include "train/corpus.h"
#include "train/progress.h"
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

bool is_blank(std::string_view line) {
  for (char c : line)
    if (!std::isspace(static_cast<unsigned char>(c))) return false;
  return true;
}

// A token shard written as its tokens come: a placeholder header, the tokens appended in the
// shard's width, then the header with the final count, fsync and rename into place. The
// temporary `<path>.tmp.<pid>` is removed unless finish() succeeded.
class ShardAppender {
 public:
  static Result<std::unique_ptr<ShardAppender>> create(const std::string& path, int64_t vocab_size) {
    if (vocab_size < 1 || vocab_size > (int64_t{1} << 31) - 1)
      return invalid_argument("shard {}: vocab_size {} out of range", path, vocab_size);
    io::remove_stale_temporaries(path);
    std::unique_ptr<ShardAppender> a(new ShardAppender(path, vocab_size));
    a->fd_ = ::open(a->tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (a->fd_ < 0) return io_error("cannot create {}: {}", a->tmp_, std::strerror(errno));
    const std::string header(kShardHeaderBytes, '\0');
    NIB_RETURN_IF_ERROR(a->write_all(header.data(), header.size()));
    return a;
  }
  ~ShardAppender() {
    if (fd_ >= 0) ::close(fd_);
    if (!finished_) ::unlink(tmp_.c_str());
  }
  int64_t count() const { return count_; }

  // tokens: (n) ids in [0, vocab_size).
  Status append(std::span<const int32_t> tokens) {
    bytes_.resize(tokens.size() * static_cast<size_t>(width_));
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] < 0 || tokens[i] >= vocab_size_)
        return invalid_argument("shard {}: token {} at {} outside [0, {})", path_, tokens[i], count_ + i, vocab_size_);
      if (width_ == 2) {
        const uint16_t t = static_cast<uint16_t>(tokens[i]);
        std::memcpy(bytes_.data() + 2 * i, &t, 2);
      } else {
        std::memcpy(bytes_.data() + 4 * i, &tokens[i], 4);
      }
    }
    count_ += static_cast<int64_t>(tokens.size());
    return write_all(bytes_.data(), bytes_.size());
  }

  Status finish() {
    RawHeader h{};
    std::memcpy(h.magic, kShardMagic, 8);
    h.version = kShardVersion;
    h.dtype = static_cast<uint32_t>(width_);
    h.count = static_cast<uint64_t>(count_);
    h.vocab_size = static_cast<uint32_t>(vocab_size_);
    if (::pwrite(fd_, &h, sizeof(h), 0) != static_cast<ssize_t>(sizeof(h)))
      return io_error("write to {} failed: {}", tmp_, std::strerror(errno));
    const int rc = ::fsync(fd_), rc2 = ::close(fd_);
    fd_ = -1;
    if (rc != 0 || rc2 != 0) return io_error("cannot finish writing {}: {}", tmp_, std::strerror(errno));
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      return io_error("cannot rename {} to {}: {}", tmp_, path_, std::strerror(errno));
    finished_ = true;
    return Status::ok();
  }

 private:
  ShardAppender(std::string path, int64_t vocab_size)
      : path_(std::move(path)), tmp_(path_ + ".tmp." + std::to_string(::getpid())), vocab_size_(vocab_size),
        width_(vocab_size <= 65536 ? 2 : 4) {}
  Status write_all(const char* p, size_t left) {
    while (left > 0) {
      const ssize_t n = ::write(fd_, p, left);
      if (n < 0) {
        if (errno == EINTR) continue;
        return io_error("write to {} failed: {}", tmp_, std::strerror(errno));
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
    return Status::ok();
  }
  std::string path_, tmp_;
  int64_t vocab_size_;
  int width_;
  int fd_ = -1;
  int64_t count_ = 0;
  bool finished_ = false;
  std::string bytes_;
};

// The documents of one text file (split_documents' rule: blank lines separate documents, a
// trailing '\r' is dropped), read in 1 MiB chunks so a file is never held whole.
class DocumentReader {
 public:
  static Result<DocumentReader> open(const std::string& path) {
    auto file = io::open_regular_file(path, "text file");
    if (!file && file.status().code() == StatusCode::kNotFound) return not_found("text file not found: {}", path);
    if (!file) return file.status();
    DocumentReader r;
    r.path_ = path;
    r.size_ = static_cast<int64_t>(file->size());
    r.fd_ = ::dup(file->fd());
    if (r.fd_ < 0) return io_error("text file {}: {}", path, std::strerror(errno));
    return r;
  }
  DocumentReader(DocumentReader&& o) noexcept { *this = std::move(o); }
  DocumentReader& operator=(DocumentReader&& o) noexcept {
    std::swap(fd_, o.fd_);
    path_ = std::move(o.path_);
    chunk_ = std::move(o.chunk_);
    pos_ = o.pos_;
    size_ = o.size_;
    eof_ = o.eof_;
    return *this;
  }
  ~DocumentReader() {
    if (fd_ >= 0) ::close(fd_);
  }
  int64_t size() const { return size_; }

  // The next document's lines (without '\n'); an empty vector at the end of the file. `bytes`
  // counts the file bytes consumed.
  Status next(std::vector<std::string>* lines, int64_t* bytes) {
    lines->clear();
    std::string line;
    while (true) {
      bool have_line = false;
      NIB_RETURN_IF_ERROR(next_line(&line, &have_line, bytes));
      if (!have_line) return Status::ok();
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (is_blank(line)) {
        if (!lines->empty()) return Status::ok();
        continue;
      }
      lines->push_back(std::move(line));
    }
  }

 private:
  DocumentReader() = default;
  Status next_line(std::string* line, bool* have, int64_t* bytes) {
    line->clear();
    while (true) {
      if (pos_ < chunk_.size()) {
        const size_t nl = chunk_.find('\n', pos_);
        const size_t end = nl == std::string::npos ? chunk_.size() : nl;
        line->append(chunk_, pos_, end - pos_);
        *have = true;
        *bytes += static_cast<int64_t>(end - pos_) + (nl == std::string::npos ? 0 : 1);
        pos_ = end + (nl == std::string::npos ? 0 : 1);
        if (nl != std::string::npos) return Status::ok();
      }
      if (eof_) return Status::ok();
      chunk_.resize(size_t{1} << 20);
      ssize_t n;
      do n = ::read(fd_, chunk_.data(), chunk_.size());
      while (n < 0 && errno == EINTR);
      if (n < 0) return io_error("read of text file {} failed: {}", path_, std::strerror(errno));
      chunk_.resize(static_cast<size_t>(n));
      pos_ = 0;
      eof_ = n == 0;
    }
  }
  int fd_ = -1;
  std::string path_, chunk_;
  size_t pos_ = 0;
  int64_t size_ = 0;
  bool eof_ = false;
};

// Encodes one batch of documents (each split into its train part and its held-out tail) in
// parallel and appends the tokens in document order, so the output is independent of the
// thread count and of where batches are cut.
Status encode_batch(const std::vector<std::vector<std::string>>& docs, const std::vector<int64_t>& val_lines,
                    const Tokenizer& tokenizer, ShardAppender& train, ShardAppender* val) {
  const int64_t nd = static_cast<int64_t>(docs.size());
  std::vector<std::vector<int32_t>> parts(2 * docs.size());
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
      std::vector<int32_t>& dst = parts[2 * k + part];
      dst = std::move(ids).value();
      dst.push_back(eos);
    }
  }
  for (const Status& s : errors) NIB_RETURN_IF_ERROR(s);
  for (int64_t k = 0; k < nd; ++k) {
    NIB_RETURN_IF_ERROR(train.append(parts[2 * k]));
    if (val != nullptr) NIB_RETURN_IF_ERROR(val->append(parts[2 * k + 1]));
  }
  return Status::ok();
}

}  // namespace

Result<ShardSummary> build_token_shards(const std::string& train_path, const std::string& val_path,
                                        const Tokenizer& tokenizer, const std::vector<std::string>& text_files,
                                        const SplitOptions& options) {
  if (!(options.val_fraction >= 0.0 && options.val_fraction <= 0.5))
    return invalid_argument("val_fraction {} must be in [0, 0.5]", options.val_fraction);
  if (options.buffer_bytes < 1) return invalid_argument("buffer_bytes {} must be >= 1", options.buffer_bytes);
  if (text_files.empty()) return invalid_argument("no text files to tokenize");
  if (val_path.empty() && options.val_fraction != 0.0)
    return invalid_argument("no validation shard path: val_fraction must be 0 (it is {})", options.val_fraction);
  // Open every file first: a missing one fails before anything is encoded.
  std::vector<DocumentReader> readers;
  int64_t total_bytes = 0;
  for (const std::string& f : text_files) {
    NIB_ASSIGN_OR_RETURN(DocumentReader r, DocumentReader::open(f));
    total_bytes += r.size();
    readers.push_back(std::move(r));
  }
  NIB_ASSIGN_OR_RETURN(auto train, ShardAppender::create(train_path, tokenizer.vocab_size()));
  std::unique_ptr<ShardAppender> val;
  if (!val_path.empty()) {
    NIB_ASSIGN_OR_RETURN(val, ShardAppender::create(val_path, tokenizer.vocab_size()));
  }
  ByteProgress progress(total_bytes, options.progress ? stderr : nullptr);

  ShardSummary sum;
  std::vector<std::vector<std::string>> batch;
  std::vector<int64_t> batch_val;
  int64_t batch_bytes = 0, lines_seen = 0;
  auto flush = [&]() -> Status {
    if (batch.empty()) return Status::ok();
    NIB_RETURN_IF_ERROR(encode_batch(batch, batch_val, tokenizer, *train, val.get()));
    sum.peak_batch_bytes = std::max(sum.peak_batch_bytes, batch_bytes);
    ++sum.batches;
    batch.clear();
    batch_val.clear();
    batch_bytes = 0;
    progress.update(sum.text_bytes, train->count() + (val ? val->count() : 0));
    return Status::ok();
  };
  for (size_t f = 0; f < readers.size(); ++f) {
    int64_t docs_in_file = 0;
    std::vector<std::string> lines;
    while (true) {
      int64_t doc_bytes = 0;
      NIB_RETURN_IF_ERROR(readers[f].next(&lines, &doc_bytes));
      sum.text_bytes += doc_bytes;
      if (lines.empty()) break;
      // validation_lines_per_document, online: the quota depends on the lines seen so far only.
      const int64_t n = static_cast<int64_t>(lines.size());
      const int64_t target =
          static_cast<int64_t>(std::floor(options.val_fraction * static_cast<double>(lines_seen + n)));
      const int64_t v = std::clamp<int64_t>(target - sum.val_lines, 0, n);
      lines_seen += n;
      sum.val_lines += v;
      sum.train_lines += n - v;
      ++docs_in_file;
      for (const auto& l : lines) batch_bytes += static_cast<int64_t>(l.size()) + 1;
      batch.push_back(std::move(lines));
      batch_val.push_back(v);
      lines = {};
      if (batch_bytes >= options.buffer_bytes) NIB_RETURN_IF_ERROR(flush());
    }
    if (docs_in_file == 0) return data_loss("text file {} is empty", text_files[f]);
    sum.documents += docs_in_file;
    ++sum.files;
  }
  NIB_RETURN_IF_ERROR(flush());
  progress.finish();
  sum.train_tokens = train->count();
  sum.val_tokens = val ? val->count() : 0;
  if (sum.train_tokens == 0) return data_loss("no training tokens: the text files hold no non-blank lines");
  NIB_RETURN_IF_ERROR(train->finish());
  if (val) NIB_RETURN_IF_ERROR(val->finish());
  return sum;
}

}  // namespace nibble::train
