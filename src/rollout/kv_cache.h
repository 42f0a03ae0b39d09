// The rollout engine's paged KV cache (../shared/spec/06-backends.md §8): keys and values of
// every layer live in fixed-size pages of page_size positions (BF16 by default, F32 as the exact
// reference, FP8 or NVFP4 with their scales: backend/kv_page_codec.h) in the backend's memory;
// each sequence has a page table; pages are refcounted so the G samples of a group share their
// prompt's pages (fork), a shared page that a sample writes into is copied first (copy-on-write),
// and a page is freed when no sequence holds it. As model::KvCacheAttention it serves forward_decode:
// each layer's new keys/values go through Backend::kv_cache_write (quantized there) and the
// queries read the pages through Backend::paged_attention (Op::kPagedKvCache). The engine's
// CUDA-graph steps use a padded layout in fixed buffers (begin_padded_batch).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/status.h"
#include "model/transformer.h"

namespace nibble::rollout {

struct KvCacheConfig {
  int64_t num_layers = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int64_t page_size = 16;  // positions per page
  int64_t num_pages = 0;   // pages per layer (the same page ids in every layer)
  backend::KvPageFormat format = backend::KvPageFormat::kBf16;
  // the model's attention precision (Model::attention_precision): decode attends as training does
  backend::AttentionPrecision attention = backend::AttentionPrecision::kFp32;
  // The padded layout of the engine's CUDA-graph steps (rollout/decode_graph.h); 0: none.
  // graph_rows > 0: the most rows of such a batch; one scratch page past num_pages takes the
  // padding rows' keys and values (no sequence ever holds it), and the slots, context lengths and
  // block tables of such a batch live in fixed buffers of (graph_rows) and (graph_rows,
  // graph_blocks) entries, graph_blocks = ceil(max_context / page_size), allocated at create.
  int64_t graph_rows = 0;
  int64_t max_context = 0;  // positions a sequence can hold (needed with graph_rows)
};

class PagedKvCache;

// Told after each layer's keys and values of a batch went into their slots (before the queries
// attend): the TRACE recorder of the KV-cache sites (recorders.h) reads them back there.
class KvWriteObserver {
 public:
  virtual ~KvWriteObserver() = default;
  virtual void on_kv_written(const PagedKvCache& cache, int64_t layer) = 0;
};

class PagedKvCache final : public model::KvCacheAttention {
 public:
  using SeqId = int64_t;
  // Allocates the pages on `be` (which must outlive the cache). Errors: bad sizes, a backend
  // without Op::kPagedKvCache (named), out of memory.
  static Result<std::unique_ptr<PagedKvCache>> create(backend::Backend& be, const KvCacheConfig& config);

  const KvCacheConfig& config() const { return config_; }
  int64_t num_pages() const { return config_.num_pages; }
  int64_t free_pages() const { return static_cast<int64_t>(free_.size()); }
  int64_t live_sequences() const { return live_; }
  // Bytes of K and V pages over all layers.
  int64_t bytes() const;
  // Bytes of the current batch's slots, block tables and context lengths in backend memory.
  int64_t table_bytes() const {
    return static_cast<int64_t>(sizeof(int32_t)) * (slots_.size() + table_.size() + ctx_.size() +
                                                    graph_slots_.size() + graph_table_.size() + graph_ctx_.size());
  }

  // A new empty sequence.
  SeqId add_sequence();
  // A new sequence holding the same positions as `parent` by sharing its pages (refcounts + 1).
  SeqId fork(SeqId parent);
  // Drops the sequence; its pages return to the free list when no other sequence holds them.
  void release(SeqId seq);
  int64_t length(SeqId seq) const;  // positions written
  // Pages grow(seq, n) would take from the free list (new pages + a copy of a shared last page).
  int64_t pages_needed(SeqId seq, int64_t n) const;
  // Makes room for n more positions of seq (allocating pages, copying a shared partly filled last
  // page first). Error (nothing changed) when the free pages do not suffice.
  Status grow(SeqId seq, int64_t n);

  // The rows of the next forward_decode: row i writes position row_pos[i] of sequence row_seq[i].
  // The rows of one sequence must be its next positions length .. length + k - 1 in order, with
  // room made by grow(). Uploads the slots, block tables and context lengths; finish_batch()
  // then advances the lengths.
  Status begin_batch(const std::vector<SeqId>& row_seq, const std::vector<int32_t>& row_pos);
  // The same rows in the layout of a graph step of `padded_rows` rows (>= the rows given, <=
  // config().graph_rows): the metadata goes to the fixed buffers (the same pointers every step),
  // the block tables with stride graph_stride(the rows' most pages) (table_stride(): a graph is
  // captured per stride, so a step passes the attention what a graph of that stride holds), and
  // each padding row writes slot 0 of the scratch page with context length 1 (its table row: the
  // scratch page). The paged attention's results do not depend on the stride (a row reads its
  // context_len positions), so the real rows' results are those of begin_batch.
  // append_and_attend then runs padded_rows rows.
  Status begin_padded_batch(const std::vector<SeqId>& row_seq, const std::vector<int32_t>& row_pos,
                            int64_t padded_rows);
  void finish_batch();
  // Block-table stride of the graph layout for rows of at most `blocks` pages: the next power of
  // two, at most graph_blocks() = ceil(max_context / page_size) (few strides, few graphs; a short
  // context's attention does not launch for the whole context).
  int64_t graph_stride(int64_t blocks) const;
  int64_t graph_blocks() const;
  // The scratch page's id (num_pages()).
  int32_t scratch_page() const { return static_cast<int32_t>(config_.num_pages); }
  // Host copies of the current batch's metadata as uploaded: slots (rows), context lengths
  // (rows), block tables (rows, table_stride()).
  const std::vector<int32_t>& batch_slots() const { return slots_h_; }
  const std::vector<int32_t>& batch_context_lengths() const { return ctx_h_; }
  const std::vector<int32_t>& batch_block_tables() const { return table_h_; }
  int64_t table_stride() const { return max_blocks_; }

  // model::KvCacheAttention: writes layer `layer`'s rows then attends over the pages.
  void append_and_attend(backend::Backend& be, int64_t layer, float* out, const float* q, const float* k,
                         const float* v, int64_t N) override;

  // Observer of every layer's writes (null: none, the default; the caller keeps it alive).
  void set_write_observer(KvWriteObserver* observer) { observer_ = observer; }
  // out (N, kv_token_bytes) <- host copy of the slot records of the current batch's N rows in
  // layer `layer` (keys, or values), row i the batch's row i. Between begin_batch and finish_batch.
  void read_batch_slots(int64_t layer, bool values, std::vector<uint8_t>& out) const;
  int64_t token_bytes() const {
    return backend::kv_token_bytes(config_.format, config_.num_kv_heads, config_.head_dim);
  }

  // host copy of one page of one layer (tests): (page_size, Hkv, D) elements as bytes.
  std::vector<uint8_t> page_bytes(int64_t layer, int32_t page, bool values) const;
  // The page ids of a sequence (tests, recorders).
  const std::vector<int32_t>& pages_of(SeqId seq) const;

 private:
  struct Sequence {
    std::vector<int32_t> pages;
    int64_t length = 0;
    bool live = false;
  };
  PagedKvCache(backend::Backend& be, const KvCacheConfig& config) : be_(&be), config_(config) {}
  Sequence& seq(SeqId id);
  const Sequence& seq(SeqId id) const;
  int32_t take_page();
  void drop_page(int32_t page);
  void copy_page(int32_t dst, int32_t src);
  int64_t layer_bytes() const;
  int64_t allocated_pages() const { return config_.num_pages + (config_.graph_rows > 0 ? 1 : 0); }
  // begin_batch / begin_padded_batch: checks the rows and fills the host metadata with `rows` >=
  // row_seq.size() rows of the stride `stride_of(the rows' most pages)`.
  Status fill_batch(const std::vector<SeqId>& row_seq, const std::vector<int32_t>& row_pos, int64_t rows,
                    bool graph_layout);
  uint8_t* k_layer(int64_t layer) const;
  uint8_t* v_layer(int64_t layer) const;

  backend::Backend* be_;
  KvCacheConfig config_;
  backend::Buffer<uint8_t> k_, v_;        // (L, num_pages, page_size) slots of kv_token_bytes each
  std::vector<int32_t> refcount_;          // (num_pages)
  std::vector<int32_t> free_;              // free page ids (a stack: lowest id on top first)
  std::vector<Sequence> seqs_;
  int64_t live_ = 0;
  // the current batch (host copies, then backend memory)
  std::vector<int32_t> slots_h_, table_h_, ctx_h_;
  std::vector<std::pair<SeqId, int64_t>> batch_growth_;  // (seq, new length) applied by finish_batch
  backend::Buffer<int32_t> slots_, table_, ctx_;
  backend::Buffer<int32_t> graph_slots_, graph_table_, graph_ctx_;  // the padded layout (fixed)
  const int32_t* cur_slots_ = nullptr;  // the current batch's: slots_ ... or graph_slots_ ...
  const int32_t* cur_table_ = nullptr;
  const int32_t* cur_ctx_ = nullptr;
  int64_t batch_rows_ = 0, max_blocks_ = 0;
  KvWriteObserver* observer_ = nullptr;
};

}  // namespace nibble::rollout
