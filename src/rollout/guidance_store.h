// TRACE guidance records and the store that holds them (../shared/spec/03-rl-and-trace.md §2.2,
// §2.4; 01-formats.md §7). RecordStore is the host-side store of rollout records keyed by
// (sequence, token position, layer, site), shared by guidance and R3 routing (routing_record.h):
// producers hand filled host buffers to append() (a move); a background writer thread moves them
// into an in-memory index through a bounded queue (a full queue blocks the producer: back-pressure,
// never loss); past a memory budget the writer spills to one file it creates exclusively in the
// spill directory; close() removes what the store created and nothing else. The trainer reads
// records by key or streams a sequence in key order, in memory or spilled.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "formats/guided.h"
#include "model/config.h"

namespace nibble::rollout {

// ---- the store ----------------------------------------------------------------------------------

// Ordered by (sequence, position, layer, site): a sequence's records are one contiguous range.
struct RecordKey {
  uint64_t sequence = 0;
  uint32_t position = 0;
  uint16_t layer = 0;
  uint16_t site = 0;
  auto operator<=>(const RecordKey&) const = default;
};
// "(sequence 3, position 17, layer 5, site 1)": how errors name a key.
std::string record_key_name(const RecordKey& key);

// Records queued together (RecordStore::append_batch): keys and payloads packed end to end, so a
// step's hundreds of thousands of records are three heap blocks, not one each.
class RecordBatch {
 public:
  void add(const RecordKey& key, std::span<const uint8_t> payload);
  size_t size() const { return keys_.size(); }
  bool empty() const { return keys_.empty(); }
  const RecordKey& key(size_t i) const { return keys_[i]; }
  std::span<const uint8_t> payload(size_t i) const;

 private:
  std::vector<RecordKey> keys_;
  std::vector<size_t> ends_;  // payload i is bytes_[ends_[i-1] (0 for i = 0), ends_[i])
  std::vector<uint8_t> bytes_;
};

struct RecordStoreOptions {
  std::string name = "record store";  // names the store in errors ("guidance store", "routing store")
  int64_t memory_budget_bytes = int64_t{1} << 30;  // payload bytes kept in host memory before spilling
  std::string spill_dir;  // where the spill file goes (created if missing); empty: never spill, and an
                          // append past the budget fails with a Status
  int64_t queue_capacity = 1024;  // records waiting for the writer before append() blocks
};

struct RecordStoreStats {
  int64_t records = 0;           // records stored (memory + spilled)
  int64_t payload_bytes = 0;     // their payload bytes (what bytes-per-token figures count)
  int64_t memory_bytes = 0;      // payload bytes held in host memory
  int64_t spilled_records = 0;   // records in the spill file
  int64_t spill_file_bytes = 0;  // size of the spill file: spilled payload + kSpillHeaderBytes each
};

class RecordStore {
 public:
  // Written before each spilled payload: magic, CRC-32 of the payload, key, payload length.
  static constexpr int64_t kSpillHeaderBytes = 32;

  // Starts the writer thread. Errors: a spill directory that cannot be created.
  static Result<std::unique_ptr<RecordStore>> open(const RecordStoreOptions& options);
  ~RecordStore();  // close(), ignoring its status
  RecordStore(const RecordStore&) = delete;
  RecordStore& operator=(const RecordStore&) = delete;

  // Queues a record (the payload is moved, not copied); blocks while the queue is full. Fails with
  // the writer's first error (spill write failed, duplicate key, over budget without a spill
  // directory) or when the store is closed.
  Status append(const RecordKey& key, std::vector<uint8_t>&& payload);
  // Queues all of `records` at once (one lock and one wake-up of the writer for the batch, which is
  // what a recorder appending thousands of rows a step needs); blocks while the queue is full, then
  // queues the whole batch (the queue may exceed its capacity by one batch). Errors as append().
  Status append_batch(RecordBatch&& records);
  // Waits until every queued record is stored; returns the writer's first error, if any.
  Status flush();

  // The payload of one record (waits for queued records first). Errors: no such key (not found), a
  // damaged or truncated spill record (data loss), a failed read (I/O).
  Result<std::vector<uint8_t>> read(const RecordKey& key);
  // Reads many records in one pass (one wait for queued records, one lock of the index):
  // fn(i, payload of keys[i]) for each i in order; the payload span is valid during the call only.
  // A missing key fails (not found, naming it) unless `found` is given: then found[i] (resized to
  // keys.size()) says whether keys[i] was stored, and missing keys are skipped. Stops at fn's
  // first error, and on a damaged spilled record (data loss).
  Status read_each(std::span<const RecordKey> keys,
                   const std::function<Status(size_t i, std::span<const uint8_t> payload)>& fn,
                   std::vector<uint8_t>* found = nullptr);
  // Whether a record `key` is stored (waits for queued records first); false once closed.
  bool contains(const RecordKey& key);
  // Calls fn for each record of `sequence` in key order (positions, then layers, then sites), one
  // record in memory at a time; stops at fn's first error and returns it. No records: not found.
  Status for_each_in_sequence(uint64_t sequence,
                              const std::function<Status(const RecordKey&, std::span<const uint8_t>)>& fn);
  // The sequence ids that have records, ascending.
  std::vector<uint64_t> sequences();

  RecordStoreStats stats();
  const std::string& name() const { return options_.name; }
  std::string spill_path();  // empty until the first spill

  // Drains the queue, stops the writer, removes the spill file and (only when the store created it
  // and it is then empty) the spill directory. Idempotent; afterwards every call but stats() fails.
  Status close();

 private:
  explicit RecordStore(const RecordStoreOptions& options);
  // One slot of the index: open addressing with linear probing over a power-of-two table kept at
  // most 70% full, the key and where its payload is inline (one cache line per probe).
  struct Slot {
    RecordKey key;
    const uint8_t* data = nullptr;  // the payload in the arena while in memory
    int64_t file_offset = -1;       // of the record's header in the spill file; -1: in memory
    int64_t size = -1;              // payload bytes; -1: an empty slot
  };
  void writer_loop();
  Status insert(const RecordKey& key, std::span<const uint8_t> payload);  // writer thread, index_mu_ held
  Status spill_memory_records();                                         // writer thread, index_mu_ held
  Status open_spill_file();                                              // writer thread, index_mu_ held
  Status read_spilled(const RecordKey& key, int64_t offset, int64_t size, std::vector<uint8_t>& out);
  Slot& probe(const RecordKey& key);      // index_mu_ held, slots_ not empty: key's slot, or the empty one it would take
  Slot* find_slot(const RecordKey& key);  // index_mu_ held; nullptr: no such record
  void grow_index();                      // index_mu_ held
  const uint8_t* arena_copy(std::span<const uint8_t> payload);  // index_mu_ held
  bool wait_drained();  // false once closed

  RecordStoreOptions options_;
  // queue_mu_: the queue, its flags and writer_error_. index_mu_: the index, the spill file, counters.
  std::mutex queue_mu_, index_mu_;
  std::condition_variable queue_not_full_, queue_not_empty_, drained_;
  std::deque<RecordBatch> queue_;
  int64_t queued_records_ = 0;
  bool stopping_ = false, closed_ = false, writer_busy_ = false;
  Status writer_error_;
  // A hash index (a gather reads hundreds of thousands of keys a step: one probe each, not a tree
  // walk); the key order that sequences() and for_each_in_sequence() promise comes from sorting a
  // sequence's keys when asked. In-memory payloads live in an arena of 4 MiB chunks (no heap block
  // per record), freed when a spill has moved every in-memory record to the file.
  std::vector<Slot> slots_;
  int64_t records_ = 0;
  std::unordered_map<uint64_t, std::vector<RecordKey>> keys_of_sequence_;
  std::vector<std::unique_ptr<uint8_t[]>> arena_;
  uint8_t* arena_next_ = nullptr;
  size_t arena_left_ = 0;
  int64_t payload_bytes_ = 0, memory_bytes_ = 0, spilled_records_ = 0;
  int spill_fd_ = -1;
  int64_t spill_size_ = 0;
  std::string spill_path_;
  bool created_spill_dir_ = false;
  std::thread writer_;
};

// ---- guidance records ---------------------------------------------------------------------------

// "trace-full": every element's 4-bit E2M1 code; "trace": only its mantissa bit (code bit 0).
enum class GuidanceMode : uint8_t { kTraceFull = 0, kTrace = 1 };
const char* guidance_mode_name(GuidanceMode mode);
Result<GuidanceMode> parse_guidance_mode(std::string_view name);
inline formats::GuidanceKind guidance_kind(GuidanceMode mode) {
  return mode == GuidanceMode::kTraceFull ? formats::GuidanceKind::kFull : formats::GuidanceKind::kMantissaBit;
}

// Record of one token row (cols values) at one site, host byte order (version 1):
//   header  8 bytes: u8 QuantFormat, u8 GuidanceMode, u16 version (kGuidanceRecordVersion), u32 cols
//   scales  cols/16 bytes E4M3 block scales
//   outer   n_outer f32: TE (kNvfp4Te, kNvfp4Te2d) 1 (the tensor amax); 2-level ceil(cols/128)
//   guide   cols/2 bytes packed E2M1 codes (trace-full) or cols/8 bytes mantissa bits (trace;
//           bit j of byte i = element 8i+j, as formats::e2m1_mantissa_bits_cpu writes them)
// Version 2 (kGuidanceRowsRecordVersion) holds `rows` rows of cols values that were quantized one
// by one, each with its own scales: the KV-cache sites, one row per kv head (the NVFP4 page
// codec, backend/kv_page_codec.h, quantizes each (token, kv head) row of head_dim alone):
//   header  12 bytes: u8 QuantFormat (kNvfp4TwoLevel only), u8 GuidanceMode, u16 version 2,
//           u32 cols, u32 rows
//   scales  (rows, cols/16) E4M3; outer (rows, ceil(cols/128)) f32; guide (rows, cols/2) codes or
//           (rows, cols/8) mantissa bits: row-major, so element (r, c) is element r*cols + c.
inline constexpr int64_t kGuidanceHeaderBytes = 8;
inline constexpr int64_t kGuidanceRowsHeaderBytes = 12;
// Version 1: routed experts are sites (routed_expert_site, keyed by expert id). Version 0 (no
// routed-expert sites; 16 + j was reserved for the token's j-th expert) is refused when read.
inline constexpr uint16_t kGuidanceRecordVersion = 1;
inline constexpr uint16_t kGuidanceRowsRecordVersion = 2;
int64_t guidance_outer_count(backend::QuantFormat format, int64_t cols);
int64_t guidance_record_bytes(backend::QuantFormat format, int64_t cols, GuidanceMode mode);
// Bytes of a version-2 record of (rows, cols).
int64_t guidance_rows_record_bytes(int64_t rows, int64_t cols, GuidanceMode mode);

// Rollout side: the record of row `row` of q (host memory; an NVFP4 format, cols % 16 == 0).
Result<std::vector<uint8_t>> extract_guidance(const backend::QuantizedTensor& q, int64_t row, GuidanceMode mode);
// The same record from its payload (scales | outer | guide, as Backend::guidance_payload_rows
// writes a row of a kNvfp4TwoLevel tensor of `cols`): the header prepended. Errors: a payload of
// the wrong size, a non-NVFP4 format.
Result<std::vector<uint8_t>> guidance_record_from_payload(backend::QuantFormat format, int64_t cols, GuidanceMode mode,
                                                          std::span<const uint8_t> payload);
// Appends the record of every row of q; row r is token (row_sequence[r], row_position[r]).
// row_sequence, row_position: (q.rows) host arrays.
Status append_guidance(RecordStore& store, const backend::QuantizedTensor& q, const uint64_t* row_sequence,
                       const uint32_t* row_position, uint16_t layer, uint16_t site, GuidanceMode mode);

// KV-cache sites (version 2): the record of one token's K or V as an NVFP4 page slot holds it.
// slot: one slot record of backend::kv::token_layout(kNvfp4, Hkv, D) (host memory); the record
// has Hkv rows of D values (D % 16 == 0): the codec's outer, inner scales and codes, unchanged.
Result<std::vector<uint8_t>> kv_guidance_record(const uint8_t* slot, int64_t Hkv, int64_t D, GuidanceMode mode);

// A record's parts, pointing into its payload (valid while the payload lives).
struct GuidanceRecordView {
  backend::QuantFormat format = backend::QuantFormat::kNvfp4TwoLevel;
  GuidanceMode mode = GuidanceMode::kTrace;
  uint16_t version = kGuidanceRecordVersion;
  int64_t rows = 1;                 // version 1: 1
  int64_t cols = 0;
  const uint8_t* scales = nullptr;  // (rows, cols/16) e4m3
  const uint8_t* outer = nullptr;   // (rows, n_outer) f32, unaligned: read with outer_at
  const uint8_t* guide = nullptr;   // (rows, cols/2) codes or (rows, cols/8) mantissa bits
  float outer_at(int64_t i) const;
  // The guide value of element i (of rows*cols, row-major) as formats/guided.h takes it: the 4-bit
  // code or the mantissa bit.
  uint32_t guide_at(int64_t i) const;
};
// Checks the header against the payload size. Errors (data loss) name `what` (e.g. the key).
Result<GuidanceRecordView> parse_guidance_record(std::span<const uint8_t> payload, const std::string& what);

// Trainer side: the records of rows (row_sequence[r], row_position[r]) at (layer, site), gathered
// into the arrays formats::nvfp4_*_quantize_guided_cpu and backend/cuda's guided quantizers take.
// A version-2 record of R rows gives R consecutive batch rows: token row r's rows are
// r*R .. r*R + R - 1 (rows = tokens * R).
struct GuidanceBatch {
  backend::QuantFormat format = backend::QuantFormat::kNvfp4TwoLevel;
  GuidanceMode mode = GuidanceMode::kTrace;
  int64_t rows = 0, cols = 0;
  int64_t rows_per_record = 1;
  std::vector<uint8_t> scales;  // (rows, cols/16) e4m3
  std::vector<float> outer;     // TE: (rows) the amax of each row's rollout tensor; 2-level (rows, ceil(cols/128))
  std::vector<uint8_t> guide;   // (rows, cols/2) packed codes or (rows, cols/8) mantissa bits
};
// rows: token rows, read in one pass over the store (RecordStore::read_each). Errors: a missing
// record (not found, naming the key) unless `found` is given: then found[r] says whether row r had
// a record, and the batch holds the found rows' records in row order (a routed expert's rows that
// the rollout sent elsewhere have none); records of different widths/formats/modes/row counts.
Result<GuidanceBatch> gather_guidance(RecordStore& store, const uint64_t* row_sequence, const uint32_t* row_position,
                                      int64_t rows, uint16_t layer, uint16_t site,
                                      std::vector<uint8_t>* found = nullptr);
// codes (g.rows, g.cols/2) <- guided rounding of x (g.rows, g.cols) f32 under the rollout's scales
// (TE rows are grouped by equal amax, since the TE quantizer takes one amax per call).
void guided_quantize_cpu(uint8_t* codes, const float* x, const GuidanceBatch& g);

// ---- sites and bytes per token ------------------------------------------------------------------

// Site ids of a transformer block (the key's `site`; record version 1, kGuidanceRecordVersion):
// activations entering quantized linears, and the KV-cache writes. A MoE layer's routed expert e
// has two sites, routed_expert_site(e, 0) (its gate/up input, hidden_size) and
// routed_expert_site(e, 1) (its down_proj input, moe_intermediate_size), each recorded for every
// token routed to e: a token has top_k records of each, one per expert of its set, keyed by the
// expert's id (not its rank in the top-k list), so a trainer that routes a token elsewhere finds
// no record for that expert.
enum TraceSite : uint16_t {
  kAttnInput = 0,         // q/k/v projections' input (hidden_size)
  kAttnOutputInput = 1,   // o_proj input (q_width)
  kMlpInput = 2,          // gate/up input of a dense MLP or of the shared expert (hidden_size)
  kMlpDownInput = 3,      // dense down_proj input (intermediate_size)
  kKeyCache = 4,          // K written to an NVFP4 KV cache (version 2: Hkv rows of head_dim)
  kValueCache = 5,        // V written to an NVFP4 KV cache (version 2: Hkv rows of head_dim)
  kSharedExpertDownInput = 6,  // shared expert down_proj input (shared_expert_intermediate_size)
  kRoutedExpertSite0 = 16,     // + 2e + part: routed expert e's gate/up (part 0) / down (part 1) input
};
// The most experts a MoE layer may have for its sites to fit the key's u16.
inline constexpr int64_t kMaxGuidedExperts = (0xFFFF - kRoutedExpertSite0 + 1) / 2;
// The site of routed expert `expert`'s gate/up (part 0) or down_proj (part 1) input
// (expert in [0, kMaxGuidedExperts), checked).
uint16_t routed_expert_site(int64_t expert, int part);
struct TraceSiteWidth {
  uint16_t site = 0;
  int64_t cols = 0;
  int64_t rows = 0;  // 0: a version-1 record of one row; > 0: version 2 of `rows` rows (KV: Hkv rows of head_dim)
};
// The bytes of a site's record (version 2 records are two-level whatever `format` says: the
// NVFP4 page codec's).
int64_t trace_site_record_bytes(backend::QuantFormat format, const TraceSiteWidth& site, GuidanceMode mode);
// The records one token adds at `layer` (activation sites and/or KV-cache sites, the latter per
// kv head: rows = num_key_value_heads, cols = head_dim) and their widths.
// A MoE layer lists its routed experts' sites as those of experts 0..top_k-1, standing for the
// token's own top_k experts (the widths, and so the bytes, are the same for every expert).
std::vector<TraceSiteWidth> trace_sites(const model::ModelConfig& config, int64_t layer, bool activations,
                                        bool kv_cache);
// Guidance bytes one token adds to the store: sum over `layers` of the sites' record bytes.
int64_t guidance_bytes_per_token(backend::QuantFormat format, const model::ModelConfig& config,
                                 std::span<const int64_t> layers, GuidanceMode mode, bool activations,
                                 bool kv_cache);
// The later half of the layers (the paper's default layer set: the last 20 of 40).
std::vector<int64_t> later_half_layers(int64_t num_layers);

}  // namespace nibble::rollout
