// RecordStore (writer thread, memory budget, spill file, reader) and the TRACE guidance records
// (extraction from quantized codes, the trainer's gathered batch, bytes per token). Spill file
// format, per record: u32 magic "NBRS", u32 CRC-32 of the payload, u64 sequence, u32 position,
// u16 layer, u16 site, u64 payload bytes, then the payload; a read checks all of them against the
// index, so a damaged or truncated file gives a data-loss Status, never a crash.
#include "rollout/guidance_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <set>

#include "core/check.h"
#include "backend/kv_page_codec.h"
#include "formats/quantize_cpu.h"

namespace nibble::rollout {
namespace {

constexpr uint32_t kSpillMagic = 0x5352424Eu;  // "NBRS" little-endian

// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320).
uint32_t crc32(const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

template <typename T>
void put(uint8_t* dst, T v) {
  std::memcpy(dst, &v, sizeof(T));
}
template <typename T>
T get(const uint8_t* src) {
  T v;
  std::memcpy(&v, src, sizeof(T));
  return v;
}

void encode_spill_header(uint8_t* h, const RecordKey& key, std::span<const uint8_t> payload) {
  put<uint32_t>(h + 0, kSpillMagic);
  put<uint32_t>(h + 4, crc32(payload.data(), payload.size()));
  put<uint64_t>(h + 8, key.sequence);
  put<uint32_t>(h + 16, key.position);
  put<uint16_t>(h + 20, key.layer);
  put<uint16_t>(h + 22, key.site);
  put<uint64_t>(h + 24, static_cast<uint64_t>(payload.size()));
}

// Writes all n bytes at offset (retrying short writes and EINTR); errno-based message on failure.
Status pwrite_all(int fd, const uint8_t* p, size_t n, int64_t offset, const std::string& what) {
  size_t done = 0;
  while (done < n) {
    ssize_t w = ::pwrite(fd, p + done, n - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return io_error("{}: writing {} bytes at offset {}: {}", what, n, offset, std::strerror(errno));
    if (w == 0) return io_error("{}: writing {} bytes at offset {}: no progress", what, n, offset);
    done += static_cast<size_t>(w);
  }
  return Status::ok();
}

// Reads up to n bytes at offset; returns the count read (short only at end of file).
Result<size_t> pread_all(int fd, uint8_t* p, size_t n, int64_t offset, const std::string& what) {
  size_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, p + done, n - done, static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return io_error("{}: reading {} bytes at offset {}: {}", what, n, offset, std::strerror(errno));
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

std::atomic<uint64_t> g_spill_counter{0};

// splitmix64 of the key's fields folded into one word: the index's hash
size_t hash_key(const RecordKey& key) {
  uint64_t h = key.sequence * 0x9E3779B97F4A7C15ull ^
               ((uint64_t{key.position} << 32) | (uint64_t{key.layer} << 16) | key.site);
  h ^= h >> 30, h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 27, h *= 0x94D049BB133111EBull;
  return static_cast<size_t>(h ^ (h >> 31));
}

}  // namespace

std::string record_key_name(const RecordKey& key) {
  return fmt::format("(sequence {}, position {}, layer {}, site {})", key.sequence, key.position, key.layer,
                     key.site);
}

// ---- RecordStore ----------------------------------------------------------------------------------

RecordStore::RecordStore(const RecordStoreOptions& options) : options_(options) {}

Result<std::unique_ptr<RecordStore>> RecordStore::open(const RecordStoreOptions& options) {
  if (options.memory_budget_bytes < 0)
    return invalid_argument("{}: memory budget {} bytes must be >= 0", options.name, options.memory_budget_bytes);
  if (options.queue_capacity < 1)
    return invalid_argument("{}: queue capacity {} must be >= 1", options.name, options.queue_capacity);
  std::unique_ptr<RecordStore> s(new RecordStore(options));
  if (!options.spill_dir.empty()) {
    if (::mkdir(options.spill_dir.c_str(), 0700) == 0) {
      s->created_spill_dir_ = true;
    } else if (errno != EEXIST) {
      return io_error("{}: cannot create spill directory {}: {}", options.name, options.spill_dir,
                      std::strerror(errno));
    }
    struct stat st {};
    if (::stat(options.spill_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return io_error("{}: spill directory {} is not a directory", options.name, options.spill_dir);
  }
  s->writer_ = std::thread([p = s.get()] { p->writer_loop(); });
  return s;
}

RecordStore::~RecordStore() { (void)close(); }

void RecordBatch::add(const RecordKey& key, std::span<const uint8_t> payload) {
  keys_.push_back(key);
  bytes_.insert(bytes_.end(), payload.begin(), payload.end());
  ends_.push_back(bytes_.size());
}

std::span<const uint8_t> RecordBatch::payload(size_t i) const {
  const size_t begin = i == 0 ? 0 : ends_[i - 1];
  return std::span<const uint8_t>(bytes_.data() + begin, ends_[i] - begin);
}

Status RecordStore::append(const RecordKey& key, std::vector<uint8_t>&& payload) {
  RecordBatch one;
  one.add(key, payload);
  return append_batch(std::move(one));
}

Status RecordStore::append_batch(RecordBatch&& b) {
  if (b.empty()) return Status::ok();
  std::unique_lock lk(queue_mu_);
  queue_not_full_.wait(lk, [&] {
    return closed_ || stopping_ || !writer_error_.is_ok() || queued_records_ < options_.queue_capacity;
  });
  if (closed_ || stopping_)
    return invalid_argument("{}: append {} after close", options_.name, record_key_name(b.key(0)));
  if (!writer_error_.is_ok()) return writer_error_;
  queued_records_ += static_cast<int64_t>(b.size());
  queue_.push_back(std::move(b));
  queue_not_empty_.notify_one();
  return Status::ok();
}

bool RecordStore::wait_drained() {
  std::unique_lock lk(queue_mu_);
  drained_.wait(lk, [&] { return queue_.empty() && !writer_busy_; });
  return !closed_;
}

Status RecordStore::flush() {
  std::unique_lock lk(queue_mu_);
  if (closed_) return invalid_argument("{}: flush after close", options_.name);
  drained_.wait(lk, [&] { return queue_.empty() && !writer_busy_; });
  return writer_error_;
}

void RecordStore::writer_loop() {
  std::deque<RecordBatch> items;  // what the queue held when the writer took it: indexed under one lock
  for (;;) {
    {
      std::unique_lock lk(queue_mu_);
      queue_not_empty_.wait(lk, [&] { return !queue_.empty() || stopping_; });
      if (queue_.empty()) return;  // stopping and drained
      items.swap(queue_);
      queued_records_ = 0;
      writer_busy_ = true;
      queue_not_full_.notify_all();
    }
    Status first_error;
    {
      std::lock_guard lk(index_mu_);
      for (const RecordBatch& b : items)
        for (size_t i = 0; i < b.size(); ++i) {
          Status st = insert(b.key(i), b.payload(i));
          if (!st.is_ok() && first_error.is_ok()) first_error = st;
        }
    }
    items.clear();
    {
      std::lock_guard lk(queue_mu_);
      if (!first_error.is_ok() && writer_error_.is_ok()) writer_error_ = first_error;
      writer_busy_ = false;
      if (queue_.empty()) drained_.notify_all();
      if (!first_error.is_ok()) queue_not_full_.notify_all();  // blocked producers see the error
    }
  }
}

RecordStore::Slot& RecordStore::probe(const RecordKey& key) {
  const size_t mask = slots_.size() - 1;
  size_t i = hash_key(key) & mask;
  while (slots_[i].size >= 0 && slots_[i].key != key) i = (i + 1) & mask;
  return slots_[i];
}

RecordStore::Slot* RecordStore::find_slot(const RecordKey& key) {
  if (slots_.empty()) return nullptr;
  Slot& s = probe(key);
  return s.size >= 0 ? &s : nullptr;
}

void RecordStore::grow_index() {
  std::vector<Slot> old(slots_.empty() ? size_t{1024} : 2 * slots_.size());
  old.swap(slots_);
  for (const Slot& s : old)
    if (s.size >= 0) probe(s.key) = s;  // keys are distinct: probe ends at an empty slot
}

const uint8_t* RecordStore::arena_copy(std::span<const uint8_t> payload) {
  constexpr size_t kArenaChunk = size_t{4} << 20;
  const size_t n = (payload.size() + 7) & ~size_t{7};  // 8-byte aligned records
  if (n > arena_left_) {
    const size_t chunk = std::max(kArenaChunk, n);
    arena_.push_back(std::make_unique_for_overwrite<uint8_t[]>(chunk));
    arena_next_ = arena_.back().get();
    arena_left_ = chunk;
  }
  uint8_t* at = arena_next_;
  if (!payload.empty()) std::memcpy(at, payload.data(), payload.size());
  arena_next_ += n;
  arena_left_ -= n;
  return at;
}

Status RecordStore::insert(const RecordKey& key, std::span<const uint8_t> payload) {
  if (10 * (records_ + 1) > 7 * static_cast<int64_t>(slots_.size())) grow_index();
  Slot& slot = probe(key);
  if (slot.size >= 0) return invalid_argument("{}: duplicate record {}", options_.name, record_key_name(key));
  const auto n = static_cast<int64_t>(payload.size());
  slot = Slot{key, arena_copy(payload), -1, n};
  ++records_;
  keys_of_sequence_[key.sequence].push_back(key);
  payload_bytes_ += n;
  memory_bytes_ += n;
  if (memory_bytes_ <= options_.memory_budget_bytes) return Status::ok();
  if (options_.spill_dir.empty())
    return invalid_argument("{}: {} bytes in memory exceed the budget of {} bytes and no spill directory is set",
                            options_.name, memory_bytes_, options_.memory_budget_bytes);
  return spill_memory_records();
}

Status RecordStore::open_spill_file() {
  for (int attempt = 0; attempt < 1000; ++attempt) {
    std::string path = fmt::format("{}/nibble-records-{}-{}.spill", options_.spill_dir, static_cast<long>(::getpid()),
                                   g_spill_counter.fetch_add(1));
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd >= 0) {
      spill_fd_ = fd;
      spill_path_ = path;
      spill_size_ = 0;
      return Status::ok();
    }
    if (errno != EEXIST) return io_error("{}: cannot create spill file {}: {}", options_.name, path, std::strerror(errno));
  }
  return io_error("{}: no free spill file name in {}", options_.name, options_.spill_dir);
}

Status RecordStore::spill_memory_records() {
  if (spill_fd_ < 0) NIB_RETURN_IF_ERROR(open_spill_file());
  const std::string what = fmt::format("{}: spill file {}", options_.name, spill_path_);
  // Records are written in key order in chunks of about 4 MiB; the index changes only when all
  // writes succeeded, so a failed spill leaves every record in memory and the file as it was.
  constexpr size_t kChunk = size_t{4} << 20;
  std::vector<Slot*> in_memory;
  for (Slot& e : slots_)
    if (e.size >= 0 && e.file_offset < 0) in_memory.push_back(&e);
  std::sort(in_memory.begin(), in_memory.end(), [](const Slot* a, const Slot* b) { return a->key < b->key; });
  std::vector<uint8_t> buf;
  std::vector<std::pair<Slot*, int64_t>> placed;
  int64_t offset = spill_size_;
  int64_t chunk_offset = offset;
  Status st;
  for (Slot* e : in_memory) {
    const std::span<const uint8_t> payload(e->data, static_cast<size_t>(e->size));
    const size_t at = buf.size();
    buf.resize(at + kSpillHeaderBytes + payload.size());
    encode_spill_header(buf.data() + at, e->key, payload);
    if (!payload.empty()) std::memcpy(buf.data() + at + kSpillHeaderBytes, payload.data(), payload.size());
    placed.emplace_back(e, offset);
    offset += kSpillHeaderBytes + e->size;
    if (buf.size() >= kChunk) {
      st = pwrite_all(spill_fd_, buf.data(), buf.size(), chunk_offset, what);
      if (!st.is_ok()) break;
      chunk_offset += static_cast<int64_t>(buf.size());
      buf.clear();
    }
  }
  if (st.is_ok() && !buf.empty()) st = pwrite_all(spill_fd_, buf.data(), buf.size(), chunk_offset, what);
  if (!st.is_ok()) {
    if (::ftruncate(spill_fd_, static_cast<off_t>(spill_size_)) != 0) {
      // The index never points past spill_size_, so a longer file is harmless.
    }
    return st;
  }
  for (auto& [e, off] : placed) {
    e->file_offset = off;
    e->data = nullptr;
    memory_bytes_ -= e->size;
    ++spilled_records_;
  }
  // every in-memory record is in the file now: the arena goes
  arena_.clear();
  arena_next_ = nullptr;
  arena_left_ = 0;
  spill_size_ = offset;
  return Status::ok();
}

Status RecordStore::read_spilled(const RecordKey& key, int64_t offset, int64_t size, std::vector<uint8_t>& out) {
  const std::string where = fmt::format("{}: spill file {}: record {} at offset {}", options_.name, spill_path_,
                                        record_key_name(key), offset);
  uint8_t h[kSpillHeaderBytes];
  NIB_ASSIGN_OR_RETURN(size_t got, pread_all(spill_fd_, h, sizeof h, offset, where));
  if (got != sizeof h) return data_loss("{}: truncated (header: {} of {} bytes)", where, got, sizeof h);
  if (get<uint32_t>(h) != kSpillMagic) return data_loss("{}: bad magic 0x{:08x}", where, get<uint32_t>(h));
  RecordKey k{get<uint64_t>(h + 8), get<uint32_t>(h + 16), get<uint16_t>(h + 20), get<uint16_t>(h + 22)};
  if (k != key) return data_loss("{}: header names {}", where, record_key_name(k));
  if (get<uint64_t>(h + 24) != static_cast<uint64_t>(size))
    return data_loss("{}: header says {} payload bytes, the index {}", where, get<uint64_t>(h + 24), size);
  out.resize(static_cast<size_t>(size));
  NIB_ASSIGN_OR_RETURN(got, pread_all(spill_fd_, out.data(), out.size(), offset + kSpillHeaderBytes, where));
  if (got != out.size()) return data_loss("{}: truncated (payload: {} of {} bytes)", where, got, out.size());
  const uint32_t crc = crc32(out.data(), out.size());
  if (crc != get<uint32_t>(h + 4))
    return data_loss("{}: payload CRC-32 0x{:08x}, header 0x{:08x}", where, crc, get<uint32_t>(h + 4));
  return Status::ok();
}

Result<std::vector<uint8_t>> RecordStore::read(const RecordKey& key) {
  if (!wait_drained()) return invalid_argument("{}: read {} after close", options_.name, record_key_name(key));
  int64_t offset = -1, size = 0;
  std::vector<uint8_t> out;
  {
    std::lock_guard lk(index_mu_);
    const Slot* e = find_slot(key);
    if (e == nullptr) return not_found("{}: no record {}", options_.name, record_key_name(key));
    if (e->file_offset < 0) return std::vector<uint8_t>(e->data, e->data + e->size);
    offset = e->file_offset;
    size = e->size;
  }
  // Spilled records never move and the file only grows, so the read needs no lock.
  NIB_RETURN_IF_ERROR(read_spilled(key, offset, size, out));
  return out;
}

Status RecordStore::read_each(std::span<const RecordKey> keys,
                              const std::function<Status(size_t i, std::span<const uint8_t> payload)>& fn,
                              std::vector<uint8_t>* found) {
  if (keys.empty()) return Status::ok();
  if (!wait_drained()) return invalid_argument("{}: read {} after close", options_.name, record_key_name(keys[0]));
  if (found != nullptr) found->assign(keys.size(), 0);
  std::vector<uint8_t> spilled;
  // the index lock is held throughout, so no spill moves a payload while fn reads it
  std::lock_guard lk(index_mu_);
  for (size_t i = 0; i < keys.size(); ++i) {
    const Slot* e = find_slot(keys[i]);
    if (e == nullptr) {
      if (found != nullptr) continue;
      return not_found("{}: no record {}", options_.name, record_key_name(keys[i]));
    }
    if (found != nullptr) (*found)[i] = 1;
    if (e->file_offset < 0) {
      NIB_RETURN_IF_ERROR(fn(i, std::span<const uint8_t>(e->data, static_cast<size_t>(e->size))));
    } else {
      NIB_RETURN_IF_ERROR(read_spilled(keys[i], e->file_offset, e->size, spilled));
      NIB_RETURN_IF_ERROR(fn(i, std::span<const uint8_t>(spilled)));
    }
  }
  return Status::ok();
}

bool RecordStore::contains(const RecordKey& key) {
  if (!wait_drained()) return false;
  std::lock_guard lk(index_mu_);
  return find_slot(key) != nullptr;
}

Status RecordStore::for_each_in_sequence(
    uint64_t sequence, const std::function<Status(const RecordKey&, std::span<const uint8_t>)>& fn) {
  if (!wait_drained()) return invalid_argument("{}: read of sequence {} after close", options_.name, sequence);
  std::vector<RecordKey> keys;
  {
    std::lock_guard lk(index_mu_);
    if (auto it = keys_of_sequence_.find(sequence); it != keys_of_sequence_.end()) keys = it->second;
  }
  std::sort(keys.begin(), keys.end());
  if (keys.empty()) return not_found("{}: no records of sequence {}", options_.name, sequence);
  return read_each(keys, [&](size_t i, std::span<const uint8_t> payload) { return fn(keys[i], payload); });
}

std::vector<uint64_t> RecordStore::sequences() {
  (void)wait_drained();
  std::vector<uint64_t> out;
  {
    std::lock_guard lk(index_mu_);
    for (const auto& [sequence, keys] : keys_of_sequence_) out.push_back(sequence);
  }
  std::sort(out.begin(), out.end());
  return out;
}

RecordStoreStats RecordStore::stats() {
  (void)wait_drained();
  std::lock_guard lk(index_mu_);
  RecordStoreStats s;
  s.records = records_;
  s.payload_bytes = payload_bytes_;
  s.memory_bytes = memory_bytes_;
  s.spilled_records = spilled_records_;
  s.spill_file_bytes = spill_size_;
  return s;
}

std::string RecordStore::spill_path() {
  std::lock_guard lk(index_mu_);
  return spill_path_;
}

Status RecordStore::close() {
  {
    std::lock_guard lk(queue_mu_);
    if (closed_) return Status::ok();
    stopping_ = true;
  }
  queue_not_empty_.notify_all();
  queue_not_full_.notify_all();
  if (writer_.joinable()) writer_.join();
  Status st;
  {
    std::lock_guard lk(index_mu_);
    if (spill_fd_ >= 0) {
      ::close(spill_fd_);
      spill_fd_ = -1;
      if (::unlink(spill_path_.c_str()) != 0 && errno != ENOENT)
        st = io_error("{}: cannot remove spill file {}: {}", options_.name, spill_path_, std::strerror(errno));
    }
    // Only a directory this store made, and only when empty (rmdir refuses otherwise).
    if (created_spill_dir_) {
      ::rmdir(options_.spill_dir.c_str());
      created_spill_dir_ = false;
    }
    std::vector<Slot>().swap(slots_);
    records_ = 0;
    keys_of_sequence_.clear();
    arena_.clear();
    arena_next_ = nullptr;
    arena_left_ = 0;
    memory_bytes_ = 0;
  }
  {
    std::lock_guard lk(queue_mu_);
    closed_ = true;
    if (st.is_ok() && !writer_error_.is_ok()) st = writer_error_;
  }
  drained_.notify_all();
  return st;
}

// ---- guidance records -----------------------------------------------------------------------------

const char* guidance_mode_name(GuidanceMode mode) { return mode == GuidanceMode::kTraceFull ? "trace-full" : "trace"; }

Result<GuidanceMode> parse_guidance_mode(std::string_view name) {
  if (name == "trace-full") return GuidanceMode::kTraceFull;
  if (name == "trace") return GuidanceMode::kTrace;
  return invalid_argument("guidance mode '{}': expected trace-full or trace", name);
}

namespace {
bool is_nvfp4(backend::QuantFormat f) {
  return f == backend::QuantFormat::kNvfp4Te || f == backend::QuantFormat::kNvfp4Te2d ||
         f == backend::QuantFormat::kNvfp4TwoLevel;
}
int64_t guide_bytes(int64_t cols, GuidanceMode mode) { return mode == GuidanceMode::kTraceFull ? cols / 2 : cols / 8; }
}  // namespace

int64_t guidance_outer_count(backend::QuantFormat format, int64_t cols) {
  return format == backend::QuantFormat::kNvfp4TwoLevel ? (cols + 127) / 128 : 1;
}

int64_t guidance_record_bytes(backend::QuantFormat format, int64_t cols, GuidanceMode mode) {
  return kGuidanceHeaderBytes + cols / 16 + 4 * guidance_outer_count(format, cols) + guide_bytes(cols, mode);
}

int64_t guidance_rows_record_bytes(int64_t rows, int64_t cols, GuidanceMode mode) {
  return kGuidanceRowsHeaderBytes +
         rows * (cols / 16 + 4 * guidance_outer_count(backend::QuantFormat::kNvfp4TwoLevel, cols) + guide_bytes(cols, mode));
}

Result<std::vector<uint8_t>> kv_guidance_record(const uint8_t* slot, int64_t Hkv, int64_t D, GuidanceMode mode) {
  if (D <= 0 || D % 16 != 0 || D > int64_t{0xFFFFFFFF})
    return invalid_argument("kv guidance: head dim {} must be a positive multiple of 16", D);
  if (Hkv <= 0 || Hkv > int64_t{0xFFFFFFFF}) return invalid_argument("kv guidance: {} kv heads", Hkv);
  const backend::kv::TokenLayout L = backend::kv::token_layout(backend::KvPageFormat::kNvfp4, Hkv, D);
  std::vector<uint8_t> rec(static_cast<size_t>(guidance_rows_record_bytes(Hkv, D, mode)));
  uint8_t* p = rec.data();
  p[0] = static_cast<uint8_t>(backend::QuantFormat::kNvfp4TwoLevel);
  p[1] = static_cast<uint8_t>(mode);
  put<uint16_t>(p + 2, kGuidanceRowsRecordVersion);
  put<uint32_t>(p + 4, static_cast<uint32_t>(D));
  put<uint32_t>(p + 8, static_cast<uint32_t>(Hkv));
  p += kGuidanceRowsHeaderBytes;
  // the codec's parts are (Hkv, ...) row-major like the record's; only their order differs
  std::memcpy(p, slot + L.inner, static_cast<size_t>(Hkv * (D / 16)));
  p += Hkv * (D / 16);
  std::memcpy(p, slot + L.scales, static_cast<size_t>(4 * Hkv * L.outer_per_head));
  p += 4 * Hkv * L.outer_per_head;
  if (mode == GuidanceMode::kTraceFull)
    std::memcpy(p, slot + L.codes, static_cast<size_t>(Hkv * (D / 2)));
  else
    formats::e2m1_mantissa_bits_cpu(p, slot + L.codes, Hkv, D);
  return rec;
}

Result<std::vector<uint8_t>> extract_guidance(const backend::QuantizedTensor& q, int64_t row, GuidanceMode mode) {
  if (!is_nvfp4(q.format))
    return invalid_argument("guidance: format {} has no E2M1 codes", backend::quant_format_name(q.format));
  if (q.cols <= 0 || q.cols % 16 != 0 || q.cols > int64_t{0xFFFFFFFF})
    return invalid_argument("guidance: cols={} must be a positive multiple of 16", q.cols);
  if (row < 0 || row >= q.rows) return invalid_argument("guidance: row {} outside [0, {})", row, q.rows);
  NIB_CHECK(q.codes != nullptr && q.scales != nullptr && q.outer != nullptr);
  const int64_t K = q.cols;
  std::vector<uint8_t> rec(static_cast<size_t>(guidance_record_bytes(q.format, K, mode)));
  uint8_t* p = rec.data();
  p[0] = static_cast<uint8_t>(q.format);
  p[1] = static_cast<uint8_t>(mode);
  put<uint16_t>(p + 2, kGuidanceRecordVersion);
  put<uint32_t>(p + 4, static_cast<uint32_t>(K));
  p += kGuidanceHeaderBytes;
  std::memcpy(p, q.scales + row * (K / 16), static_cast<size_t>(K / 16));
  p += K / 16;
  const int64_t n_outer = guidance_outer_count(q.format, K);
  const float* outer = q.format == backend::QuantFormat::kNvfp4TwoLevel ? q.outer + row * n_outer : q.outer;
  std::memcpy(p, outer, static_cast<size_t>(4 * n_outer));
  p += 4 * n_outer;
  const uint8_t* codes_row = q.codes + row * (K / 2);
  if (mode == GuidanceMode::kTraceFull)
    std::memcpy(p, codes_row, static_cast<size_t>(K / 2));
  else
    formats::e2m1_mantissa_bits_cpu(p, codes_row, 1, K);
  return rec;
}

Result<std::vector<uint8_t>> guidance_record_from_payload(backend::QuantFormat format, int64_t cols, GuidanceMode mode,
                                                          std::span<const uint8_t> payload) {
  if (!is_nvfp4(format))
    return invalid_argument("guidance: format {} has no E2M1 codes", backend::quant_format_name(format));
  if (cols <= 0 || cols % 16 != 0 || cols > int64_t{0xFFFFFFFF})
    return invalid_argument("guidance: cols={} must be a positive multiple of 16", cols);
  const int64_t bytes = guidance_record_bytes(format, cols, mode);
  if (static_cast<int64_t>(payload.size()) != bytes - kGuidanceHeaderBytes)
    return invalid_argument("guidance: a payload of {} bytes, a {} record of {} columns has {}", payload.size(),
                            backend::quant_format_name(format), cols, bytes - kGuidanceHeaderBytes);
  std::vector<uint8_t> rec(static_cast<size_t>(bytes));
  rec[0] = static_cast<uint8_t>(format);
  rec[1] = static_cast<uint8_t>(mode);
  put<uint16_t>(rec.data() + 2, kGuidanceRecordVersion);
  put<uint32_t>(rec.data() + 4, static_cast<uint32_t>(cols));
  std::memcpy(rec.data() + kGuidanceHeaderBytes, payload.data(), payload.size());
  return rec;
}

Status append_guidance(RecordStore& store, const backend::QuantizedTensor& q, const uint64_t* row_sequence,
                       const uint32_t* row_position, uint16_t layer, uint16_t site, GuidanceMode mode) {
  RecordBatch batch;
  for (int64_t r = 0; r < q.rows; ++r) {
    NIB_ASSIGN_OR_RETURN(std::vector<uint8_t> rec, extract_guidance(q, r, mode));
    batch.add(RecordKey{row_sequence[r], row_position[r], layer, site}, rec);
  }
  return store.append_batch(std::move(batch));
}

float GuidanceRecordView::outer_at(int64_t i) const { return get<float>(outer + 4 * i); }

uint32_t GuidanceRecordView::guide_at(int64_t i) const {
  return mode == GuidanceMode::kTraceFull ? formats::e2m1_unpack(guide, i) : (guide[i >> 3] >> (i & 7)) & 1u;
}

Result<GuidanceRecordView> parse_guidance_record(std::span<const uint8_t> payload, const std::string& what) {
  if (payload.size() < static_cast<size_t>(kGuidanceHeaderBytes))
    return data_loss("guidance record {}: {} bytes, shorter than its header", what, payload.size());
  const uint8_t* p = payload.data();
  GuidanceRecordView v;
  if (p[0] > static_cast<uint8_t>(backend::QuantFormat::kMxfp8) || !is_nvfp4(static_cast<backend::QuantFormat>(p[0])))
    return data_loss("guidance record {}: bad format byte {}", what, p[0]);
  if (p[1] > 1) return data_loss("guidance record {}: bad mode byte {}", what, p[1]);
  v.version = get<uint16_t>(p + 2);
  if (v.version != kGuidanceRecordVersion && v.version != kGuidanceRowsRecordVersion)
    return data_loss("guidance record {}: version {}, this build reads versions {} and {}", what, v.version,
                     kGuidanceRecordVersion, kGuidanceRowsRecordVersion);
  v.format = static_cast<backend::QuantFormat>(p[0]);
  v.mode = static_cast<GuidanceMode>(p[1]);
  v.cols = get<uint32_t>(p + 4);
  if (v.cols == 0 || v.cols % 16 != 0) return data_loss("guidance record {}: bad width {}", what, v.cols);
  int64_t header = kGuidanceHeaderBytes, want = 0;
  if (v.version == kGuidanceRowsRecordVersion) {
    if (payload.size() < static_cast<size_t>(kGuidanceRowsHeaderBytes))
      return data_loss("guidance record {}: {} bytes, shorter than its version 2 header", what, payload.size());
    if (v.format != backend::QuantFormat::kNvfp4TwoLevel)
      return data_loss("guidance record {}: version 2 of format {} (only nvfp4-2level has per-row records)", what,
                       backend::quant_format_name(v.format));
    v.rows = get<uint32_t>(p + 8);
    if (v.rows == 0) return data_loss("guidance record {}: version 2 with 0 rows", what);
    header = kGuidanceRowsHeaderBytes;
    want = guidance_rows_record_bytes(v.rows, v.cols, v.mode);
  } else {
    want = guidance_record_bytes(v.format, v.cols, v.mode);
  }
  if (static_cast<int64_t>(payload.size()) != want)
    return data_loss("guidance record {}: {} bytes, its header implies {}", what, payload.size(), want);
  v.scales = p + header;
  v.outer = v.scales + v.rows * (v.cols / 16);
  v.guide = v.outer + 4 * v.rows * guidance_outer_count(v.format, v.cols);
  return v;
}

Result<GuidanceBatch> gather_guidance(RecordStore& store, const uint64_t* row_sequence, const uint32_t* row_position,
                                      int64_t rows, uint16_t layer, uint16_t site, std::vector<uint8_t>* found) {
  GuidanceBatch g;
  g.rows = 0;
  std::vector<RecordKey> keys(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) keys[static_cast<size_t>(r)] = RecordKey{row_sequence[r], row_position[r], layer, site};
  int64_t filled = 0;  // batch records written so far
  auto take = [&](size_t r, std::span<const uint8_t> payload) -> Status {
    // the record's name only for an error (formatting it for every row cost more than the copies)
    const auto what = [&] { return fmt::format("{} in {}", record_key_name(keys[r]), store.name()); };
    Result<GuidanceRecordView> parsed = parse_guidance_record(payload, std::string());
    if (!parsed.is_ok()) parsed = parse_guidance_record(payload, what());  // the same error, named
    NIB_ASSIGN_OR_RETURN(GuidanceRecordView v, std::move(parsed));
    if (filled == 0) {
      g.format = v.format, g.mode = v.mode, g.cols = v.cols, g.rows_per_record = v.rows;
      // sized for every row; trimmed to the rows found at the end
      g.scales.resize(static_cast<size_t>(rows * v.rows * (g.cols / 16)));
      g.outer.resize(static_cast<size_t>(rows * v.rows * guidance_outer_count(g.format, g.cols)));
      g.guide.resize(static_cast<size_t>(rows * v.rows * guide_bytes(g.cols, g.mode)));
    } else if (v.format != g.format || v.mode != g.mode || v.cols != g.cols || v.rows != g.rows_per_record) {
      return invalid_argument("guidance record {}: {} {} {}x{} differs from the first row's {} {} {}x{}", what(),
                              backend::quant_format_name(v.format), guidance_mode_name(v.mode), v.rows, v.cols,
                              backend::quant_format_name(g.format), guidance_mode_name(g.mode), g.rows_per_record,
                              g.cols);
    }
    const int64_t R = g.rows_per_record, b = filled;
    const int64_t no = guidance_outer_count(g.format, g.cols), gb = guide_bytes(g.cols, g.mode);
    std::memcpy(g.scales.data() + b * R * (g.cols / 16), v.scales, static_cast<size_t>(R * (g.cols / 16)));
    std::memcpy(g.outer.data() + b * R * no, v.outer, static_cast<size_t>(4 * R * no));
    std::memcpy(g.guide.data() + b * R * gb, v.guide, static_cast<size_t>(R * gb));
    ++filled;
    return Status::ok();
  };
  NIB_RETURN_IF_ERROR(store.read_each(keys, take, found));
  g.rows = filled * g.rows_per_record;
  g.scales.resize(static_cast<size_t>(g.rows * (g.cols / 16)));
  g.outer.resize(static_cast<size_t>(g.rows * guidance_outer_count(g.format, g.cols)));
  g.guide.resize(static_cast<size_t>(g.rows * guide_bytes(g.cols, g.mode)));
  return g;
}

void guided_quantize_cpu(uint8_t* codes, const float* x, const GuidanceBatch& g) {
  const int64_t K = g.cols, gb = guide_bytes(K, g.mode);
  const formats::GuidanceKind kind = guidance_kind(g.mode);
  if (g.format == backend::QuantFormat::kNvfp4TwoLevel) {
    formats::nvfp4_2level_quantize_guided_cpu(codes, x, g.rows, K, g.scales.data(), g.outer.data(), g.guide.data(),
                                              kind);
    return;
  }
  // TE: one call per run of rows whose rollout tensors had the same amax.
  for (int64_t r0 = 0; r0 < g.rows;) {
    int64_t r1 = r0 + 1;
    while (r1 < g.rows && std::memcmp(&g.outer[r1], &g.outer[r0], sizeof(float)) == 0) ++r1;
    formats::nvfp4_te_quantize_guided_cpu(codes + r0 * (K / 2), x + r0 * K, r1 - r0, K, g.scales.data() + r0 * (K / 16),
                                          g.outer[r0], g.guide.data() + r0 * gb, kind);
    r0 = r1;
  }
}

// ---- sites and bytes per token ----------------------------------------------------------------------

uint16_t routed_expert_site(int64_t expert, int part) {
  NIB_CHECK_MSG(expert >= 0 && expert < kMaxGuidedExperts && (part == 0 || part == 1),
                "routed expert site: expert {} part {} (experts < {}, part 0 or 1)", expert, part, kMaxGuidedExperts);
  return static_cast<uint16_t>(kRoutedExpertSite0 + 2 * expert + part);
}

std::vector<TraceSiteWidth> trace_sites(const model::ModelConfig& config, int64_t layer, bool activations,
                                        bool kv_cache) {
  std::vector<TraceSiteWidth> s;
  if (activations) {
    s.push_back({kAttnInput, config.hidden_size});
    s.push_back({kAttnOutputInput, config.q_width()});
    if (config.is_moe_layer(layer)) {
      for (int64_t j = 0; j < config.num_experts_per_tok; ++j) {
        s.push_back({routed_expert_site(j, 0), config.hidden_size});
        s.push_back({routed_expert_site(j, 1), config.moe_intermediate_size});
      }
      if (config.shared_expert_intermediate_size > 0) {
        s.push_back({kMlpInput, config.hidden_size});
        s.push_back({kSharedExpertDownInput, config.shared_expert_intermediate_size});
      }
    } else {
      s.push_back({kMlpInput, config.hidden_size});
      s.push_back({kMlpDownInput, config.intermediate_size});
    }
  }
  if (kv_cache) {
    s.push_back({kKeyCache, config.head_dim, config.num_key_value_heads});
    s.push_back({kValueCache, config.head_dim, config.num_key_value_heads});
  }
  return s;
}

int64_t trace_site_record_bytes(backend::QuantFormat format, const TraceSiteWidth& site, GuidanceMode mode) {
  return site.rows > 0 ? guidance_rows_record_bytes(site.rows, site.cols, mode)
                       : guidance_record_bytes(format, site.cols, mode);
}

int64_t guidance_bytes_per_token(backend::QuantFormat format, const model::ModelConfig& config,
                                 std::span<const int64_t> layers, GuidanceMode mode, bool activations,
                                 bool kv_cache) {
  int64_t bytes = 0;
  for (int64_t layer : layers)
    for (const TraceSiteWidth& s : trace_sites(config, layer, activations, kv_cache))
      bytes += trace_site_record_bytes(format, s, mode);
  return bytes;
}

std::vector<int64_t> later_half_layers(int64_t num_layers) {
  std::vector<int64_t> out;
  for (int64_t l = num_layers / 2; l < num_layers; ++l) out.push_back(l);
  return out;
}

}  // namespace nibble::rollout
