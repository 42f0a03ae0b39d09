// Paged KV cache: page allocation, refcounts, copy-on-write, batch tables (see kv_cache.h).
#include "rollout/kv_cache.h"

#include <algorithm>
#include <map>

#include "core/check.h"

namespace nibble::rollout {

Result<std::unique_ptr<PagedKvCache>> PagedKvCache::create(backend::Backend& be, const KvCacheConfig& c) {
  if (c.num_layers <= 0 || c.num_heads <= 0 || c.num_kv_heads <= 0 || c.head_dim <= 0 || c.num_heads % c.num_kv_heads)
    return invalid_argument("kv cache: bad model shape (layers {}, heads {}, kv heads {}, head dim {})", c.num_layers,
                            c.num_heads, c.num_kv_heads, c.head_dim);
  if (c.format == backend::KvPageFormat::kNvfp4 && c.head_dim % 16 != 0)
    return invalid_argument("kv cache: nvfp4 pages need a head dim that is a multiple of 16 (got {})", c.head_dim);
  if (c.page_size <= 0 || c.num_pages <= 0)
    return invalid_argument("kv cache: page size ({}) and page count ({}) must be positive", c.page_size, c.num_pages);
  if (c.graph_rows < 0 || (c.graph_rows > 0 && c.max_context <= 0))
    return invalid_argument("kv cache: graph rows ({}) need a positive max context (got {})", c.graph_rows,
                            c.max_context);
  if (!be.supports(backend::Op::kPagedKvCache))
    return unimplemented("backend '{}' has no paged KV-cache ops (kv_cache_write, paged_attention) yet: run the "
                         "rollout engine with --device cpu (issue #15 tracks the CUDA kernels)",
                         be.name());
  std::unique_ptr<PagedKvCache> kv(new PagedKvCache(be, c));
  try {
    kv->k_.ensure(be, c.num_layers * kv->layer_bytes(), "KV cache keys");
    kv->v_.ensure(be, c.num_layers * kv->layer_bytes(), "KV cache values");
    if (c.graph_rows > 0) {
      kv->graph_slots_.ensure(be, c.graph_rows, "KV cache slots (graph steps)");
      kv->graph_ctx_.ensure(be, c.graph_rows, "KV cache context lengths (graph steps)");
      kv->graph_table_.ensure(be, c.graph_rows * kv->graph_blocks(), "KV cache block tables (graph steps)");
    }
  } catch (const backend::AllocationError& e) {
    return invalid_argument("{} (lower --kv-pages)", e.what());
  }
  kv->refcount_.assign(static_cast<size_t>(c.num_pages), 0);
  for (int64_t p = c.num_pages - 1; p >= 0; --p) kv->free_.push_back(static_cast<int32_t>(p));
  return kv;
}

int64_t PagedKvCache::graph_stride(int64_t blocks) const {
  int64_t p = 1;
  while (p < blocks) p *= 2;
  return std::min(p, graph_blocks());
}

int64_t PagedKvCache::graph_blocks() const {
  return (config_.max_context + config_.page_size - 1) / config_.page_size;
}

int64_t PagedKvCache::layer_bytes() const {
  return allocated_pages() * config_.page_size *
         backend::kv_token_bytes(config_.format, config_.num_kv_heads, config_.head_dim);
}
int64_t PagedKvCache::bytes() const { return 2 * config_.num_layers * layer_bytes(); }  // the scratch page too
uint8_t* PagedKvCache::k_layer(int64_t l) const { return k_.data() + l * layer_bytes(); }
uint8_t* PagedKvCache::v_layer(int64_t l) const { return v_.data() + l * layer_bytes(); }

PagedKvCache::Sequence& PagedKvCache::seq(SeqId id) {
  NIB_CHECK_MSG(id >= 0 && id < static_cast<SeqId>(seqs_.size()) && seqs_[id].live, "kv cache: no sequence {}", id);
  return seqs_[id];
}
const PagedKvCache::Sequence& PagedKvCache::seq(SeqId id) const {
  NIB_CHECK_MSG(id >= 0 && id < static_cast<SeqId>(seqs_.size()) && seqs_[id].live, "kv cache: no sequence {}", id);
  return seqs_[id];
}

PagedKvCache::SeqId PagedKvCache::add_sequence() {
  seqs_.push_back(Sequence{{}, 0, true});
  ++live_;
  return static_cast<SeqId>(seqs_.size() - 1);
}

PagedKvCache::SeqId PagedKvCache::fork(SeqId parent) {
  Sequence child = seq(parent);
  for (int32_t p : child.pages) ++refcount_[p];
  seqs_.push_back(std::move(child));
  ++live_;
  return static_cast<SeqId>(seqs_.size() - 1);
}

void PagedKvCache::release(SeqId id) {
  Sequence& s = seq(id);
  for (int32_t p : s.pages) drop_page(p);
  s.pages.clear();
  s.live = false;
  --live_;
}

int64_t PagedKvCache::length(SeqId id) const { return seq(id).length; }
const std::vector<int32_t>& PagedKvCache::pages_of(SeqId id) const { return seq(id).pages; }

int32_t PagedKvCache::take_page() {
  NIB_CHECK(!free_.empty());
  int32_t p = free_.back();
  free_.pop_back();
  refcount_[p] = 1;
  return p;
}

void PagedKvCache::drop_page(int32_t p) {
  NIB_CHECK(refcount_[p] > 0);
  if (--refcount_[p] == 0) free_.push_back(p);
}

void PagedKvCache::copy_page(int32_t dst, int32_t src) {
  const int64_t page_bytes = layer_bytes() / allocated_pages();
  for (int64_t l = 0; l < config_.num_layers; ++l) {
    be_->copy(k_layer(l) + dst * page_bytes, k_layer(l) + src * page_bytes, static_cast<size_t>(page_bytes));
    be_->copy(v_layer(l) + dst * page_bytes, v_layer(l) + src * page_bytes, static_cast<size_t>(page_bytes));
  }
}

int64_t PagedKvCache::pages_needed(SeqId id, int64_t n) const {
  const Sequence& s = seq(id);
  const int64_t ps = config_.page_size;
  const int64_t have = static_cast<int64_t>(s.pages.size());
  const int64_t want = (s.length + n + ps - 1) / ps;
  int64_t need = std::max<int64_t>(0, want - have);
  // a partly filled last page held by another sequence too is copied before it is written
  if (n > 0 && s.length % ps != 0 && refcount_[s.pages.back()] > 1) ++need;
  return need;
}

Status PagedKvCache::grow(SeqId id, int64_t n) {
  const int64_t need = pages_needed(id, n);
  if (need > free_pages())
    return invalid_argument("kv cache: {} more positions need {} free pages, {} are free", n, need, free_pages());
  Sequence& s = seq(id);
  const int64_t ps = config_.page_size;
  if (n > 0 && s.length % ps != 0 && refcount_[s.pages.back()] > 1) {  // copy-on-write
    const int32_t old = s.pages.back();
    const int32_t fresh = take_page();
    copy_page(fresh, old);
    drop_page(old);
    s.pages.back() = fresh;
  }
  while (static_cast<int64_t>(s.pages.size()) * ps < s.length + n) s.pages.push_back(take_page());
  return Status::ok();
}

Status PagedKvCache::fill_batch(const std::vector<SeqId>& row_seq, const std::vector<int32_t>& row_pos, int64_t rows,
                                bool graph_layout) {
  NIB_CHECK(row_seq.size() == row_pos.size());
  const int64_t N = static_cast<int64_t>(row_seq.size());
  if (N == 0) return invalid_argument("kv cache: empty batch");
  const int64_t ps = config_.page_size;
  std::map<SeqId, int64_t> next;  // next expected position per sequence in this batch
  int64_t max_blocks = 1;
  for (int64_t i = 0; i < N; ++i) {
    const Sequence& s = seq(row_seq[i]);
    auto it = next.try_emplace(row_seq[i], s.length).first;
    if (row_pos[i] != it->second)
      return invalid_argument("kv cache: row {} writes position {} of sequence {}, expected {}", i, row_pos[i],
                              row_seq[i], it->second);
    if (row_pos[i] >= static_cast<int64_t>(s.pages.size()) * ps)
      return invalid_argument("kv cache: position {} of sequence {} has no page (grow first)", row_pos[i], row_seq[i]);
    if (refcount_[s.pages[row_pos[i] / ps]] > 1)
      return invalid_argument("kv cache: position {} of sequence {} is in a shared page (grow first)", row_pos[i],
                              row_seq[i]);
    ++it->second;
    max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(s.pages.size()));
  }
  const int64_t stride = graph_layout ? graph_stride(max_blocks) : max_blocks;
  if (max_blocks > stride)
    return invalid_argument("kv cache: a sequence holds {} pages, the padded layout has room for {}", max_blocks,
                            stride);
  slots_h_.resize(static_cast<size_t>(rows));
  ctx_h_.resize(static_cast<size_t>(rows));
  table_h_.assign(static_cast<size_t>(rows * stride), 0);
  for (int64_t i = 0; i < N; ++i) {
    const Sequence& s = seq(row_seq[i]);
    slots_h_[i] = static_cast<int32_t>(s.pages[row_pos[i] / ps] * ps + row_pos[i] % ps);
    ctx_h_[i] = row_pos[i] + 1;
    std::copy(s.pages.begin(), s.pages.end(), table_h_.begin() + i * stride);
  }
  for (int64_t i = N; i < rows; ++i) {  // padding rows: position 0 of the scratch page, alone
    slots_h_[i] = static_cast<int32_t>(scratch_page() * ps);
    ctx_h_[i] = 1;
    std::fill(table_h_.begin() + i * stride, table_h_.begin() + (i + 1) * stride, scratch_page());
  }
  batch_growth_.assign(next.begin(), next.end());
  batch_rows_ = rows;
  max_blocks_ = stride;
  return Status::ok();
}

Status PagedKvCache::begin_batch(const std::vector<SeqId>& row_seq, const std::vector<int32_t>& row_pos) {
  const int64_t N = static_cast<int64_t>(row_seq.size());
  NIB_RETURN_IF_ERROR(fill_batch(row_seq, row_pos, N, /*graph_layout=*/false));
  backend::Buffer<int32_t>* bufs[3] = {&slots_, &ctx_, &table_};
  const int64_t want[3] = {N, N, N * max_blocks_};
  const char* what[3] = {"KV cache slots", "KV cache context lengths", "KV cache block tables"};
  const std::vector<int32_t>* host[3] = {&slots_h_, &ctx_h_, &table_h_};
  backend::Backend& be = *be_;
  for (int i = 0; i < 3; ++i) {
    // grown to powers of two: a buffer freed frees the engine's CUDA graphs (memory_epoch), so
    // the tables, which grow with the batch's longest sequence, are regrown only now and then
    int64_t n = bufs[i]->size();
    if (n < want[i]) {
      n = 1;
      while (n < want[i]) n *= 2;
    }
    be.copy_to_device(bufs[i]->ensure(be, n, what[i]), host[i]->data(), host[i]->size() * sizeof(int32_t));
  }
  cur_slots_ = slots_.data(), cur_ctx_ = ctx_.data(), cur_table_ = table_.data();
  return Status::ok();
}

Status PagedKvCache::begin_padded_batch(const std::vector<SeqId>& row_seq, const std::vector<int32_t>& row_pos,
                                        int64_t padded_rows) {
  if (config_.graph_rows <= 0) return invalid_argument("kv cache: created without the padded layout (graph rows 0)");
  if (padded_rows < static_cast<int64_t>(row_seq.size()) || padded_rows > config_.graph_rows)
    return invalid_argument("kv cache: {} padded rows for {} rows (at most {})", padded_rows, row_seq.size(),
                            config_.graph_rows);
  NIB_RETURN_IF_ERROR(fill_batch(row_seq, row_pos, padded_rows, /*graph_layout=*/true));
  backend::Backend& be = *be_;
  be.copy_to_device(graph_slots_.data(), slots_h_.data(), slots_h_.size() * sizeof(int32_t));
  be.copy_to_device(graph_ctx_.data(), ctx_h_.data(), ctx_h_.size() * sizeof(int32_t));
  be.copy_to_device(graph_table_.data(), table_h_.data(), table_h_.size() * sizeof(int32_t));
  cur_slots_ = graph_slots_.data(), cur_ctx_ = graph_ctx_.data(), cur_table_ = graph_table_.data();
  return Status::ok();
}

void PagedKvCache::finish_batch() {
  for (const auto& [id, len] : batch_growth_) seq(id).length = len;
  batch_growth_.clear();
  batch_rows_ = 0;
}

void PagedKvCache::append_and_attend(backend::Backend& be, int64_t layer, float* out, const float* q, const float* k,
                                     const float* v, int64_t N) {
  NIB_CHECK_MSG(&be == be_, "kv cache: called with another backend than its own");
  NIB_CHECK_MSG(N == batch_rows_, "kv cache: {} rows given, the batch has {} (begin_batch first)", N, batch_rows_);
  NIB_CHECK(layer >= 0 && layer < config_.num_layers);
  const int64_t Hkv = config_.num_kv_heads, D = config_.head_dim;
  be.kv_cache_write(k_layer(layer), v_layer(layer), config_.format, k, v, cur_slots_, N, Hkv, D);
  if (observer_ != nullptr) observer_->on_kv_written(*this, layer);
  be.paged_attention(out, q, k_layer(layer), v_layer(layer), config_.format, cur_table_, max_blocks_, cur_ctx_, N,
                     config_.num_heads, Hkv, D, config_.page_size, config_.attention);
}

void PagedKvCache::read_batch_slots(int64_t layer, bool values, std::vector<uint8_t>& out) const {
  NIB_CHECK_MSG(batch_rows_ > 0, "kv cache: read_batch_slots outside a batch");
  NIB_CHECK(layer >= 0 && layer < config_.num_layers);
  const int64_t tb = token_bytes(), N = batch_rows_;
  out.resize(static_cast<size_t>(N * tb));
  const uint8_t* base = values ? v_layer(layer) : k_layer(layer);
  // one copy per run of rows in consecutive slots (a prompt chunk's rows fill a page in order)
  for (int64_t i = 0; i < N;) {
    int64_t j = i + 1;
    while (j < N && slots_h_[j] == slots_h_[j - 1] + 1) ++j;
    be_->copy_to_host(out.data() + i * tb, base + slots_h_[i] * tb, static_cast<size_t>((j - i) * tb));
    i = j;
  }
}

std::vector<uint8_t> PagedKvCache::page_bytes(int64_t layer, int32_t page, bool values) const {
  const int64_t page_bytes = layer_bytes() / allocated_pages();
  std::vector<uint8_t> out(static_cast<size_t>(page_bytes));
  be_->copy_to_host(out.data(), (values ? v_layer(layer) : k_layer(layer)) + page * page_bytes,
                    static_cast<size_t>(page_bytes));
  return out;
}

}  // namespace nibble::rollout
