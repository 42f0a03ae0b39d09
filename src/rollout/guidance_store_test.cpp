// Tests of the record store and the TRACE guidance records (guidance_store.h): round trips of both
// modes on TE and 2-level NVFP4 (odd multiples of 16 included), mantissa-only reconstruction equal
// to the full code's choice whenever the trainer's neighbours bracket the rollout's code, spill
// round trip under a tiny budget, concurrent producers against a tiny queue, damaged spill files,
// a failing spill write, spill-directory cleanup, errors by key, bytes per token measured, and
// routed experts' sites (distinct ids; per-expert records through a spilling store; versioning),
// and the KV-cache sites' version-2 records (one row per kv head, from NVFP4 page slots).
#include "rollout/guidance_store.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "core/check.h"
#include "backend/kv_page_codec.h"
#include "core/philox.h"
#include "formats/quantize_cpu.h"

namespace nibble::rollout {
namespace {

namespace fs = std::filesystem;
using backend::QuantFormat;
using backend::QuantizedTensor;

// A quantized (rows, cols) tensor with its own host storage, made by the CPU backend's quantizer
// (the very function the rollout and the trainer share).
struct HostQuant {
  std::vector<float> x;
  std::vector<uint8_t> codes, scales;
  std::vector<float> outer;
  QuantizedTensor q;
};
HostQuant quantize(QuantFormat f, int64_t rows, int64_t cols, uint64_t seed) {
  HostQuant h;
  PhiloxStream rng(seed, 3);
  h.x.resize(static_cast<size_t>(rows * cols));
  // Per-row magnitudes spread over 2^-3..2^3 so blocks get different scales.
  for (int64_t r = 0; r < rows; ++r) {
    const double row_scale = std::ldexp(1.0, static_cast<int>(r % 7) - 3);
    for (int64_t c = 0; c < cols; ++c) h.x[r * cols + c] = static_cast<float>(row_scale * rng.next_normal());
  }
  h.codes.resize(static_cast<size_t>(QuantizedTensor::code_bytes(f, rows, cols)));
  h.scales.resize(static_cast<size_t>(QuantizedTensor::scale_bytes(f, rows, cols)));
  h.outer.resize(static_cast<size_t>(QuantizedTensor::outer_count(f, rows, cols)));
  h.q.format = f;
  h.q.rows = rows;
  h.q.cols = cols;
  h.q.codes = h.codes.data();
  h.q.scales = h.scales.data();
  h.q.outer = h.outer.data();
  backend::cpu_backend().quantize(h.q, h.x.data());
  return h;
}

class GuidanceStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("nibble_guidance_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  RecordStoreOptions options(int64_t budget, int64_t queue = 1024) const {
    RecordStoreOptions o;
    o.name = "guidance store";
    o.memory_budget_bytes = budget;
    o.spill_dir = (dir_ / "spill").string();
    o.queue_capacity = queue;
    return o;
  }
  std::unique_ptr<RecordStore> open(const RecordStoreOptions& o) {
    auto s = RecordStore::open(o);
    EXPECT_TRUE(s.is_ok()) << s.status().message();
    return std::move(s).value();
  }
  fs::path dir_;
};

std::vector<uint8_t> bytes_of(uint64_t seed, size_t n) {
  std::vector<uint8_t> v(n);
  PhiloxStream rng(seed, 9);
  for (auto& b : v) b = static_cast<uint8_t>(rng.next_below(256));
  return v;
}

// ---- guidance records ---------------------------------------------------------------------------

// Appends every row of a rollout tensor, gathers them back as the trainer does, and checks the
// scales, outer factors and guidance against the tensor; then the trainer's guided rounding of the
// same inputs under that guidance reproduces the rollout's codes bit for bit (both modes).
TEST_F(GuidanceStoreTest, RoundTripBothModesTeAnd2LevelOddWidths) {
  for (QuantFormat f : {QuantFormat::kNvfp4Te, QuantFormat::kNvfp4TwoLevel})
    for (int64_t cols : {16, 48, 208, 400})
      for (GuidanceMode mode : {GuidanceMode::kTraceFull, GuidanceMode::kTrace}) {
        SCOPED_TRACE(fmt::format("{} cols={} {}", backend::quant_format_name(f), cols, guidance_mode_name(mode)));
        const int64_t rows = 9;
        HostQuant h = quantize(f, rows, cols, 100 + static_cast<uint64_t>(cols));
        auto store = open(options(int64_t{1} << 20));
        std::vector<uint64_t> seq(rows);
        std::vector<uint32_t> pos(rows);
        for (int64_t r = 0; r < rows; ++r) seq[r] = static_cast<uint64_t>(r % 3), pos[r] = static_cast<uint32_t>(r / 3);
        ASSERT_TRUE(append_guidance(*store, h.q, seq.data(), pos.data(), 7, kMlpInput, mode).is_ok());
        ASSERT_TRUE(store->flush().is_ok());
        EXPECT_EQ(store->stats().payload_bytes, rows * guidance_record_bytes(f, cols, mode));

        auto g = gather_guidance(*store, seq.data(), pos.data(), rows, 7, kMlpInput);
        ASSERT_TRUE(g.is_ok()) << g.status().message();
        EXPECT_EQ(g->format, f);
        EXPECT_EQ(g->mode, mode);
        EXPECT_EQ(g->cols, cols);
        EXPECT_EQ(g->scales, h.scales);
        const int64_t no = guidance_outer_count(f, cols);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < no; ++j)
            EXPECT_EQ(g->outer[r * no + j], f == QuantFormat::kNvfp4TwoLevel ? h.outer[r * no + j] : h.outer[0]);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const uint32_t code = formats::e2m1_unpack(h.codes.data() + r * cols / 2, c);
            const uint32_t got = mode == GuidanceMode::kTraceFull
                                     ? formats::e2m1_unpack(g->guide.data() + r * cols / 2, c)
                                     : (g->guide[r * cols / 8 + c / 8] >> (c % 8)) & 1u;
            ASSERT_EQ(got, mode == GuidanceMode::kTraceFull ? code : (code & 1u)) << "row " << r << " col " << c;
          }
        std::vector<uint8_t> codes(h.codes.size(), 0xAB);
        guided_quantize_cpu(codes.data(), h.x.data(), *g);
        EXPECT_EQ(codes, h.codes);
        EXPECT_TRUE(store->close().is_ok());
      }
}

// ---- KV-cache sites (version 2) -------------------------------------------------------------------

// The NVFP4 page slots of `tokens` tokens of (Hkv, D) values x: (tokens, Hkv*D), as
// Backend::kv_cache_write's codec writes them (kv_page_codec.h).
std::vector<uint8_t> nvfp4_slots(const std::vector<float>& x, int64_t tokens, int64_t Hkv, int64_t D) {
  const backend::kv::TokenLayout L = backend::kv::token_layout(backend::KvPageFormat::kNvfp4, Hkv, D);
  std::vector<uint8_t> slots(static_cast<size_t>(tokens * L.bytes));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < Hkv; ++h)
      backend::kv::encode_head(slots.data() + t * L.bytes, L, backend::KvPageFormat::kNvfp4, D, h,
                               x.data() + (t * Hkv + h) * D);
  return slots;
}

// A token's K (or V) slot becomes one record of Hkv rows; gathered for several tokens they are
// the (tokens*Hkv, D) batch of the codec's scales, and guided rounding of the same values
// reproduces the slot's codes (trace-full) / their mantissa bits (trace) bit for bit; D = 144
// has a short second 128-block (two outer scales per head).
TEST_F(GuidanceStoreTest, KvRecordsHoldTheCodecSlotPerHead) {
  for (int64_t D : {16, 64, 144})
    for (GuidanceMode mode : {GuidanceMode::kTraceFull, GuidanceMode::kTrace}) {
      SCOPED_TRACE(fmt::format("D={} {}", D, guidance_mode_name(mode)));
      const int64_t tokens = 5, Hkv = 3;
      HostQuant h = quantize(QuantFormat::kNvfp4TwoLevel, tokens * Hkv, D, 700 + static_cast<uint64_t>(D));
      const std::vector<uint8_t> slots = nvfp4_slots(h.x, tokens, Hkv, D);
      const int64_t tb = backend::kv_token_bytes(backend::KvPageFormat::kNvfp4, Hkv, D);
      auto store = open(options(int64_t{1} << 20));
      std::vector<uint64_t> seq(tokens, 4);
      std::vector<uint32_t> pos(tokens);
      for (int64_t t = 0; t < tokens; ++t) {
        pos[t] = static_cast<uint32_t>(t);
        auto rec = kv_guidance_record(slots.data() + t * tb, Hkv, D, mode);
        ASSERT_TRUE(rec.is_ok()) << rec.status().message();
        EXPECT_EQ(static_cast<int64_t>(rec->size()), guidance_rows_record_bytes(Hkv, D, mode));
        auto v = parse_guidance_record(*rec, "kv");
        ASSERT_TRUE(v.is_ok()) << v.status().message();
        EXPECT_EQ(v->version, kGuidanceRowsRecordVersion);
        EXPECT_EQ(v->rows, Hkv);
        EXPECT_EQ(v->cols, D);
        ASSERT_TRUE(store->append(RecordKey{4, pos[t], 2, kKeyCache}, std::move(rec).value()).is_ok());
      }
      auto g = gather_guidance(*store, seq.data(), pos.data(), tokens, 2, kKeyCache);
      ASSERT_TRUE(g.is_ok()) << g.status().message();
      EXPECT_EQ(g->rows, tokens * Hkv);
      EXPECT_EQ(g->rows_per_record, Hkv);
      // the codec's bits are the two-level quantizer's on the (tokens*Hkv, D) matrix
      EXPECT_EQ(g->scales, h.scales);
      EXPECT_EQ(g->outer, h.outer);
      std::vector<uint8_t> codes(h.codes.size(), 0xAB);
      guided_quantize_cpu(codes.data(), h.x.data(), *g);
      EXPECT_EQ(codes, h.codes);
      EXPECT_TRUE(store->close().is_ok());
    }
}

// Version-2 records: a damaged header is data loss naming the record; other formats than
// two-level, zero rows, a size that disagrees, an unknown version are refused; a gather that
// mixes one-row and per-head records (or different head counts) is an error naming the key.
TEST_F(GuidanceStoreTest, KvRecordErrors) {
  const int64_t Hkv = 2, D = 32;
  HostQuant h = quantize(QuantFormat::kNvfp4TwoLevel, Hkv, D, 5);
  const std::vector<uint8_t> slot = nvfp4_slots(h.x, 1, Hkv, D);
  EXPECT_FALSE(kv_guidance_record(slot.data(), Hkv, 24, GuidanceMode::kTrace).is_ok());  // D % 16
  auto rec = kv_guidance_record(slot.data(), Hkv, D, GuidanceMode::kTrace);
  ASSERT_TRUE(rec.is_ok());
  auto expect_loss = [](const std::vector<uint8_t>& r, const char* what) {
    auto v = parse_guidance_record(r, "kv 7");
    ASSERT_FALSE(v.is_ok()) << what;
    EXPECT_EQ(v.status().code(), StatusCode::kDataLoss) << what;
    EXPECT_NE(v.status().message().find("kv 7"), std::string::npos) << v.status().message();
  };
  std::vector<uint8_t> te = *rec;
  te[0] = static_cast<uint8_t>(QuantFormat::kNvfp4Te);
  expect_loss(te, "te");
  std::vector<uint8_t> zero = *rec;
  zero[8] = zero[9] = zero[10] = zero[11] = 0;
  expect_loss(zero, "0 rows");
  std::vector<uint8_t> more = *rec;
  more[8] = 3;  // 3 rows in a record sized for 2
  expect_loss(more, "rows");
  std::vector<uint8_t> v3 = *rec;
  v3[2] = 3;
  expect_loss(v3, "version 3");
  auto v = parse_guidance_record(v3, "kv 7");
  EXPECT_NE(v.status().message().find("version 3"), std::string::npos) << v.status().message();
  std::vector<uint8_t> cut(rec->begin(), rec->begin() + 10);
  expect_loss(cut, "short header");

  auto store = open(options(int64_t{1} << 20));
  auto one = extract_guidance(h.q, 0, GuidanceMode::kTrace);  // a one-row record of width D
  ASSERT_TRUE(one.is_ok());
  ASSERT_TRUE(store->append(RecordKey{1, 0, 0, kKeyCache}, std::move(rec).value()).is_ok());
  ASSERT_TRUE(store->append(RecordKey{1, 1, 0, kKeyCache}, std::move(one).value()).is_ok());
  const std::vector<uint64_t> seq = {1, 1};
  const std::vector<uint32_t> pos = {0, 1};
  auto g = gather_guidance(*store, seq.data(), pos.data(), 2, 0, kKeyCache);
  ASSERT_FALSE(g.is_ok());
  EXPECT_NE(g.status().message().find("position 1"), std::string::npos) << g.status().message();
  // a damaged record: the error names its key and store too
  ASSERT_TRUE(store->append(RecordKey{1, 2, 0, kKeyCache}, std::vector<uint8_t>(cut)).is_ok());
  const std::vector<uint32_t> pos2 = {2};
  auto damaged = gather_guidance(*store, seq.data(), pos2.data(), 1, 0, kKeyCache);
  ASSERT_FALSE(damaged.is_ok());
  EXPECT_NE(damaged.status().message().find("position 2"), std::string::npos) << damaged.status().message();
  EXPECT_NE(damaged.status().message().find("bytes, shorter than its"), std::string::npos) << damaged.status().message();
  EXPECT_TRUE(store->close().is_ok());
}

// A trainer batch can hold TE rows from different rollout tensors (decode steps with their own
// amax): each row keeps its tensor's amax, and guided rounding reproduces both tensors' codes.
TEST_F(GuidanceStoreTest, TeRowsFromDifferentRolloutTensorsKeepTheirAmax) {
  const int64_t cols = 64;
  HostQuant a = quantize(QuantFormat::kNvfp4Te, 2, cols, 1), b = quantize(QuantFormat::kNvfp4Te, 3, cols, 2);
  for (float& v : b.x) v *= 3.0f;  // a different amax for b
  backend::cpu_backend().quantize(b.q, b.x.data());
  ASSERT_NE(a.outer[0], b.outer[0]);
  auto store = open(options(1 << 20));
  const uint64_t sa[2] = {1, 2}, sb[3] = {1, 2, 3};
  const uint32_t pa[2] = {0, 0}, pb[3] = {1, 1, 0};
  ASSERT_TRUE(append_guidance(*store, a.q, sa, pa, 0, kKeyCache, GuidanceMode::kTrace).is_ok());
  ASSERT_TRUE(append_guidance(*store, b.q, sb, pb, 0, kKeyCache, GuidanceMode::kTrace).is_ok());
  // Trainer rows: (1,0) a0, (1,1) b0, (2,0) a1, (2,1) b1, (3,0) b2.
  const uint64_t ts[5] = {1, 1, 2, 2, 3};
  const uint32_t tp[5] = {0, 1, 0, 1, 0};
  auto g = gather_guidance(*store, ts, tp, 5, 0, kKeyCache);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  EXPECT_EQ(g->outer, (std::vector<float>{a.outer[0], b.outer[0], a.outer[0], b.outer[0], b.outer[0]}));
  const float* src_rows[5] = {&a.x[0], &b.x[0], &a.x[cols], &b.x[cols], &b.x[2 * cols]};
  const uint8_t* want_rows[5] = {&a.codes[0], &b.codes[0], &a.codes[cols / 2], &b.codes[cols / 2], &b.codes[cols]};
  std::vector<float> x(5 * cols);
  for (int r = 0; r < 5; ++r) std::copy(src_rows[r], src_rows[r] + cols, x.begin() + r * cols);
  std::vector<uint8_t> codes(5 * cols / 2);
  guided_quantize_cpu(codes.data(), x.data(), *g);
  for (int r = 0; r < 5; ++r)
    EXPECT_TRUE(std::equal(want_rows[r], want_rows[r] + cols / 2, codes.begin() + r * cols / 2)) << "row " << r;
  // A missing trainer row is not found, naming the key and the store.
  const uint32_t bad[5] = {0, 1, 0, 1, 1};
  auto miss = gather_guidance(*store, ts, bad, 5, 0, kKeyCache);
  ASSERT_FALSE(miss.is_ok());
  EXPECT_EQ(miss.status().message(), "guidance store: no record (sequence 3, position 1, layer 0, site 4)");
}

// The trainer's inputs differ slightly from the rollout's (relative noise up to 2^-4, enough to
// cross rounding thresholds often). Wherever the two E2M1 neighbours of the trainer's scaled value
// bracket the rollout's code (same sign or a zero magnitude), mantissa-only guidance picks exactly
// what full guidance picks, and that is the rollout's magnitude (03-rl-and-trace §2.4).
TEST_F(GuidanceStoreTest, MantissaOnlyEqualsFullWheneverNeighboursBracket) {
  for (QuantFormat f : {QuantFormat::kNvfp4Te, QuantFormat::kNvfp4TwoLevel}) {
    SCOPED_TRACE(backend::quant_format_name(f));
    const int64_t rows = 16, cols = 272;
    HostQuant roll = quantize(f, rows, cols, 7);
    std::vector<float> xt = roll.x;
    PhiloxStream rng(8, 1);
    for (float& v : xt) v = static_cast<float>(v * (1.0 + std::ldexp(rng.next_uniform() - 0.5, -3)));

    auto store = open(options(int64_t{1} << 20));
    std::vector<uint64_t> seq(rows, 5);
    std::vector<uint32_t> pos(rows);
    for (int64_t r = 0; r < rows; ++r) pos[r] = static_cast<uint32_t>(r);
    ASSERT_TRUE(append_guidance(*store, roll.q, seq.data(), pos.data(), 0, kAttnInput, GuidanceMode::kTraceFull).is_ok());
    ASSERT_TRUE(append_guidance(*store, roll.q, seq.data(), pos.data(), 1, kAttnInput, GuidanceMode::kTrace).is_ok());
    auto full = gather_guidance(*store, seq.data(), pos.data(), rows, 0, kAttnInput);
    auto mbit = gather_guidance(*store, seq.data(), pos.data(), rows, 1, kAttnInput);
    ASSERT_TRUE(full.is_ok() && mbit.is_ok());
    std::vector<uint8_t> c_full(roll.codes.size()), c_mbit(roll.codes.size());
    guided_quantize_cpu(c_full.data(), xt.data(), *full);
    guided_quantize_cpu(c_mbit.data(), xt.data(), *mbit);

    // The trainer's own RTN codes under the rollout's scales, and the neighbours, element by element.
    int64_t bracketed = 0, rtn_differs = 0, guided_fixed = 0;
    const formats::Nvfp4TeGlobal tg = formats::nvfp4_te_global(roll.outer[0]);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const float x = xt[r * cols + c];
        float z = 0;
        uint32_t rtn = 0;
        if (f == QuantFormat::kNvfp4Te) {
          const float enc = formats::nvfp4_te_block_enc(roll.scales[r * cols / 16 + c / 16], tg);
          z = x * enc;
          rtn = formats::nvfp4_te_encode_rtn(x, enc);
        } else {
          const float sp = formats::nvfp4_2level_block_scale(roll.scales[r * cols / 16 + c / 16],
                                                             roll.outer[r * ((cols + 127) / 128) + c / 128]);
          const float a = formats::nvfp4_2level_scaled_magnitude(x, sp);
          z = std::signbit(x) ? -a : a;
          rtn = formats::e2m1_rne_index(a) | (static_cast<uint32_t>(std::signbit(x)) << 3);
        }
        uint32_t down = 0, up = 0;
        formats::e2m1_neighbour_indices(std::fabs(z), down, up);
        const uint32_t roll_code = formats::e2m1_unpack(roll.codes.data() + r * cols / 2, c);
        const uint32_t roll_mag = roll_code & 7u;
        const bool same_sign = ((roll_code >> 3) & 1u) == ((rtn >> 3) & 1u) || roll_mag == 0;
        if (!same_sign || (roll_mag != down && roll_mag != up)) continue;
        ++bracketed;
        const uint32_t gf = formats::e2m1_unpack(c_full.data() + r * cols / 2, c);
        const uint32_t gm = formats::e2m1_unpack(c_mbit.data() + r * cols / 2, c);
        ASSERT_EQ(gm, gf) << "row " << r << " col " << c << " z=" << z;
        ASSERT_EQ(gm & 7u, roll_mag) << "row " << r << " col " << c << " z=" << z;
        if ((rtn & 7u) != roll_mag) ++rtn_differs, guided_fixed += (gm & 7u) == roll_mag;
      }
    // Nearly every element is bracketed (the noise is below one grid step), and the noise moved
    // enough of them across a threshold that the check means something.
    EXPECT_GT(bracketed, rows * cols * 9 / 10);
    EXPECT_GT(rtn_differs, 50);
    EXPECT_EQ(guided_fixed, rtn_differs);
  }
}

TEST_F(GuidanceStoreTest, ExtractRejectsNonNvfp4AndBadWidths) {
  HostQuant h = quantize(QuantFormat::kMxfp8, 2, 64, 1);
  auto r = extract_guidance(h.q, 0, GuidanceMode::kTrace);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("mxfp8"), std::string::npos) << r.status().message();
  HostQuant t = quantize(QuantFormat::kNvfp4TwoLevel, 2, 32, 1);
  EXPECT_FALSE(extract_guidance(t.q, 2, GuidanceMode::kTrace).is_ok());
  auto rec = extract_guidance(t.q, 1, GuidanceMode::kTrace);
  ASSERT_TRUE(rec.is_ok());
  // A record cut short or with a wrong width is data loss naming what was parsed.
  std::vector<uint8_t> cut(rec->begin(), rec->end() - 1);
  auto v = parse_guidance_record(cut, "row 1");
  ASSERT_FALSE(v.is_ok());
  EXPECT_EQ(v.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(v.status().message().find("row 1"), std::string::npos);
  std::vector<uint8_t> bad = *rec;
  bad[4] = 17;  // cols 17
  EXPECT_FALSE(parse_guidance_record(bad, "row 1").is_ok());
  EXPECT_TRUE(parse_guidance_record(*rec, "row 1").is_ok());
  // A record of another version (0: before routed experts had sites) is data loss naming it.
  std::vector<uint8_t> old = *rec;
  EXPECT_EQ(old[2] | (old[3] << 8), kGuidanceRecordVersion);
  old[2] = 0, old[3] = 0;
  auto o = parse_guidance_record(old, "row 1");
  ASSERT_FALSE(o.is_ok());
  EXPECT_EQ(o.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(o.status().message().find("version 0"), std::string::npos) << o.status().message();
}

// The recorder's records from the backend's payload rows (Backend::guidance_payload_rows) are the
// records extract_guidance makes, byte for byte, in both modes; a payload of the wrong size or a
// format without codes is an error.
TEST_F(GuidanceStoreTest, RecordsFromPayloadRowsEqualExtractGuidance) {
  HostQuant h = quantize(QuantFormat::kNvfp4TwoLevel, 5, 144, 7);
  for (auto mode : {GuidanceMode::kTraceFull, GuidanceMode::kTrace}) {
    SCOPED_TRACE(guidance_mode_name(mode));
    const int64_t P = guidance_record_bytes(QuantFormat::kNvfp4TwoLevel, 144, mode) - kGuidanceHeaderBytes;
    std::vector<uint8_t> payload(static_cast<size_t>(5 * P));
    backend::cpu_backend().guidance_payload_rows(payload.data(), h.q, guidance_kind(mode));
    for (int64_t r = 0; r < 5; ++r) {
      auto want = extract_guidance(h.q, r, mode);
      ASSERT_TRUE(want.is_ok());
      auto got = guidance_record_from_payload(QuantFormat::kNvfp4TwoLevel, 144, mode,
                                              std::span<const uint8_t>(payload.data() + r * P, P));
      ASSERT_TRUE(got.is_ok()) << got.status().message();
      EXPECT_EQ(*got, *want) << "row " << r;
    }
    EXPECT_FALSE(guidance_record_from_payload(QuantFormat::kNvfp4TwoLevel, 144, mode,
                                              std::span<const uint8_t>(payload.data(), P - 1))
                     .is_ok());
    EXPECT_FALSE(guidance_record_from_payload(QuantFormat::kMxfp8, 144, mode,
                                              std::span<const uint8_t>(payload.data(), P))
                     .is_ok());
  }
}

// Routed experts' sites: two per expert (gate/up input, down input), distinct from each other and
// from the fixed sites below kRoutedExpertSite0, up to the last id a u16 holds.
TEST(GuidanceSites, RoutedExpertSitesAreDistinctPerExpertAndPart) {
  std::set<uint16_t> seen = {kAttnInput, kAttnOutputInput, kMlpInput,   kMlpDownInput,
                             kKeyCache,  kValueCache,      kSharedExpertDownInput};
  for (int64_t e = 0; e < 300; ++e)
    for (int part : {0, 1}) EXPECT_TRUE(seen.insert(routed_expert_site(e, part)).second) << e << " " << part;
  EXPECT_EQ(routed_expert_site(0, 0), kRoutedExpertSite0);
  EXPECT_EQ(routed_expert_site(kMaxGuidedExperts - 1, 1), 0xFFFF);
}

// A MoE layer's routed-expert records through a store that spills: each token goes to 2 of 4
// experts, whose gate/up input (48 wide) and down input (32 wide) are recorded under the expert's
// sites at the token's position; gathered per expert by its tokens (as the trainer does with the
// dispatch plan) they equal the rollout tensors, in memory or spilled; a token has no record at an
// expert it was not routed to.
TEST_F(GuidanceStoreTest, RoutedExpertRecordsRoundTripThroughTheSpillFile) {
  auto store = open(options(400));  // a few records' worth: most spill
  const int64_t T = 7, E = 4, C = 48, Im = 32;
  const uint64_t seq = 21;
  const uint16_t layer = 2;
  auto routed = [](int64_t t, int64_t x) { return x == t % 4 || x == (t + 1) % 4; };  // 2 experts a token
  std::map<std::pair<int64_t, int>, HostQuant> tensors;                            // (expert, part)
  std::map<int64_t, std::vector<uint32_t>> positions;                              // expert -> its tokens
  for (int64_t x = 0; x < E; ++x) {
    for (int64_t t = 0; t < T; ++t)
      if (routed(t, x)) positions[x].push_back(static_cast<uint32_t>(t));
    const auto rows = static_cast<int64_t>(positions[x].size());
    const std::vector<uint64_t> seqs(static_cast<size_t>(rows), seq);
    for (int part : {0, 1}) {
      auto it = tensors.emplace(std::make_pair(x, part), quantize(QuantFormat::kNvfp4TwoLevel, rows, part == 0 ? C : Im,
                                                                   static_cast<uint64_t>(10 * x + part)));
      ASSERT_TRUE(append_guidance(*store, it.first->second.q, seqs.data(), positions[x].data(), layer,
                                  routed_expert_site(x, part), GuidanceMode::kTraceFull)
                      .is_ok());
    }
  }
  ASSERT_TRUE(store->flush().is_ok());
  EXPECT_GT(store->stats().spilled_records, 0);
  EXPECT_EQ(store->stats().records, 2 * 2 * T);
  for (int64_t x = 0; x < E; ++x)
    for (int part : {0, 1}) {
      const HostQuant& h = tensors.at({x, part});
      const std::vector<uint32_t>& pos = positions[x];
      const std::vector<uint64_t> seqs(pos.size(), seq);
      auto g = gather_guidance(*store, seqs.data(), pos.data(), static_cast<int64_t>(pos.size()), layer,
                               routed_expert_site(x, part));
      ASSERT_TRUE(g.is_ok()) << g.status().message();
      EXPECT_EQ(g->cols, part == 0 ? C : Im);
      EXPECT_EQ(g->guide, h.codes) << "expert " << x << " part " << part;
      EXPECT_EQ(g->scales, h.scales);
      EXPECT_EQ(g->outer, h.outer);
      for (int64_t t = 0; t < T; ++t) {
        const RecordKey key{seq, static_cast<uint32_t>(t), layer, routed_expert_site(x, part)};
        EXPECT_EQ(store->contains(key), routed(t, x)) << record_key_name(key);
        if (!routed(t, x)) {
          EXPECT_EQ(store->read(key).status().code(), StatusCode::kNotFound);
        }
      }
    }
  ASSERT_TRUE(store->close().is_ok());
  EXPECT_FALSE(store->contains(RecordKey{seq, 0, layer, routed_expert_site(0, 0)}));  // closed
}

TEST(GuidanceMode, NamesParse) {
  EXPECT_EQ(parse_guidance_mode("trace").value(), GuidanceMode::kTrace);
  EXPECT_EQ(parse_guidance_mode("trace-full").value(), GuidanceMode::kTraceFull);
  EXPECT_FALSE(parse_guidance_mode("full").is_ok());
  EXPECT_STREQ(guidance_mode_name(GuidanceMode::kTrace), "trace");
}

// ---- bytes per token ----------------------------------------------------------------------------

// One record by hand: 2-level, 256 values: header 8 + scales 16 + outer 2x4 + guide 32 (trace:
// 1 bit/value) or 128 (trace-full: 4 bits/value).
TEST(GuidanceBytes, RecordSizeByHand) {
  EXPECT_EQ(guidance_record_bytes(QuantFormat::kNvfp4TwoLevel, 256, GuidanceMode::kTrace), 8 + 16 + 8 + 32);
  EXPECT_EQ(guidance_record_bytes(QuantFormat::kNvfp4TwoLevel, 256, GuidanceMode::kTraceFull), 8 + 16 + 8 + 128);
  EXPECT_EQ(guidance_record_bytes(QuantFormat::kNvfp4Te, 48, GuidanceMode::kTrace), 8 + 3 + 4 + 6);
}

// Records every site of the later half of a small MoE model's layers for a few tokens from real
// quantized tensors of each site's width; the store's measured payload equals tokens x the figure.
TEST_F(GuidanceStoreTest, BytesPerTokenEqualsMeasuredStoreSize) {
  auto cfg = model::parse_model_config(nlohmann::json::parse(R"({"architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32, "max_position_embeddings": 16,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [3]})"));
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  const std::vector<int64_t> layers = later_half_layers(cfg->num_hidden_layers);
  ASSERT_EQ(layers, (std::vector<int64_t>{2, 3}));
  const int64_t tokens = 5;
  for (QuantFormat f : {QuantFormat::kNvfp4Te, QuantFormat::kNvfp4TwoLevel})
    for (GuidanceMode mode : {GuidanceMode::kTraceFull, GuidanceMode::kTrace}) {
      auto store = open(options(512));  // spills too: the figure counts payload wherever it lives
      std::vector<uint64_t> seq(tokens, 1);
      std::vector<uint32_t> pos(tokens);
      for (int64_t t = 0; t < tokens; ++t) pos[t] = static_cast<uint32_t>(t);
      for (int64_t layer : layers)
        for (const TraceSiteWidth& s : trace_sites(*cfg, layer, true, true)) {
          if (s.rows > 0) {  // a KV site: one record of Hkv rows per token, from its page slot
            ASSERT_TRUE(s.site == kKeyCache || s.site == kValueCache);
            ASSERT_EQ(s.rows, cfg->num_key_value_heads);
            ASSERT_EQ(s.cols, cfg->head_dim);
            HostQuant h = quantize(QuantFormat::kNvfp4TwoLevel, tokens * s.rows, s.cols, 9);
            const std::vector<uint8_t> slots = nvfp4_slots(h.x, tokens, s.rows, s.cols);
            const size_t tb = slots.size() / tokens;
            for (int64_t t = 0; t < tokens; ++t) {
              auto rec = kv_guidance_record(slots.data() + t * tb, s.rows, s.cols, mode);
              ASSERT_TRUE(rec.is_ok()) << rec.status().message();
              ASSERT_TRUE(store->append(RecordKey{1, pos[t], static_cast<uint16_t>(layer), s.site}, std::move(rec).value())
                              .is_ok());
            }
            continue;
          }
          HostQuant h = quantize(f, tokens, s.cols, static_cast<uint64_t>(layer * 100 + s.site));
          ASSERT_TRUE(append_guidance(*store, h.q, seq.data(), pos.data(), static_cast<uint16_t>(layer), s.site, mode)
                          .is_ok());
        }
      ASSERT_TRUE(store->flush().is_ok());
      const int64_t per_token = guidance_bytes_per_token(f, *cfg, layers, mode, true, true);
      const RecordStoreStats st = store->stats();
      EXPECT_EQ(st.payload_bytes, tokens * per_token);
      EXPECT_GT(st.spilled_records, 0);
      EXPECT_EQ(st.spill_file_bytes, (st.payload_bytes - st.memory_bytes) + st.spilled_records * RecordStore::kSpillHeaderBytes);
    }
}

// The paper's comparison (03-rl-and-trace §2.4): mantissa-only guidance on the later half of the
// layers is about 6x smaller than full guidance on every layer (1.5 vs 4.5 bit/value, and half the
// layers). On an OLMo-2 1B-like shape the fixed 12 bytes per record (header + TE amax) keep it
// slightly under 6x, and trace stays within 0.05 bit/value of 1.5.
TEST(GuidanceBytes, MantissaOnlyLaterHalfIsAboutSixTimesSmaller) {
  auto cfg = model::parse_model_config(nlohmann::json::parse(R"({"architectures": ["Olmo2ForCausalLM"],
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16,
    "vocab_size": 100, "max_position_embeddings": 16})"));
  ASSERT_TRUE(cfg.is_ok()) << cfg.status().message();
  std::vector<int64_t> all(16);
  for (int64_t l = 0; l < 16; ++l) all[l] = l;
  const std::vector<int64_t> half = later_half_layers(16);
  const auto f = QuantFormat::kNvfp4Te;
  const double full_all =
      static_cast<double>(guidance_bytes_per_token(f, *cfg, all, GuidanceMode::kTraceFull, true, false));
  const double trace_half = static_cast<double>(guidance_bytes_per_token(f, *cfg, half, GuidanceMode::kTrace, true, false));
  EXPECT_GT(full_all / trace_half, 5.9);
  EXPECT_LT(full_all / trace_half, 6.0);
  const double values_half = 8.0 * (2048 + 2048 + 2048 + 8192);  // 8 layers x the 4 activation sites
  EXPECT_NEAR(8.0 * trace_half / values_half, 1.5, 0.05);
}

// ---- the store ------------------------------------------------------------------------------------

// A budget of 100 bytes forces spills; every record comes back by key and by sequence in key order
// (positions, then layers, then sites), whether in memory or spilled.
TEST_F(GuidanceStoreTest, SpillRoundTripInKeyOrder) {
  auto store = open(options(100));
  std::map<RecordKey, std::vector<uint8_t>> want;
  uint64_t n = 0;
  // Appended out of key order on purpose.
  for (uint16_t site : {uint16_t{2}, uint16_t{0}})
    for (uint32_t pos = 5; pos-- > 0;)
      for (uint16_t layer : {uint16_t{3}, uint16_t{1}})
        for (uint64_t seq : {uint64_t{9}, uint64_t{4}}) {
          RecordKey k{seq, pos, layer, site};
          ++n;
          want[k] = bytes_of(n, 10 + n % 40);
          std::vector<uint8_t> copy = want[k];
          ASSERT_TRUE(store->append(k, std::move(copy)).is_ok());
        }
  ASSERT_TRUE(store->flush().is_ok());
  const RecordStoreStats st = store->stats();
  EXPECT_EQ(st.records, static_cast<int64_t>(want.size()));
  EXPECT_GT(st.spilled_records, 0);
  EXPECT_LE(st.memory_bytes, 100);
  EXPECT_TRUE(fs::exists(store->spill_path()));
  EXPECT_EQ(store->sequences(), (std::vector<uint64_t>{4, 9}));
  for (uint64_t seq : {uint64_t{4}, uint64_t{9}}) {
    std::vector<RecordKey> order;
    Status s = store->for_each_in_sequence(seq, [&](const RecordKey& k, std::span<const uint8_t> p) {
      order.push_back(k);
      EXPECT_EQ(std::vector<uint8_t>(p.begin(), p.end()), want[k]) << record_key_name(k);
      return Status::ok();
    });
    ASSERT_TRUE(s.is_ok()) << s.message();
    ASSERT_EQ(order.size(), want.size() / 2);
    EXPECT_TRUE(std::is_sorted(order.begin(), order.end()));
  }
  for (const auto& [k, v] : want) EXPECT_EQ(store->read(k).value(), v);
  const std::string spill = store->spill_path();
  ASSERT_TRUE(store->close().is_ok());
  EXPECT_FALSE(fs::exists(spill));
  EXPECT_FALSE(fs::exists(dir_ / "spill"));  // the store made it, so the store removes it
}

// Four producers share a queue of 2 records (they block on it) and a budget that spills while they
// append; nothing is lost and each sequence reads back complete and in order.
TEST_F(GuidanceStoreTest, ConcurrentProducersWithBackPressure) {
  auto store = open(options(300, 2));
  constexpr int kProducers = 4, kPerProducer = 150;
  std::vector<std::thread> producers;
  std::atomic<int> failures{0};
  for (int p = 0; p < kProducers; ++p)
    producers.emplace_back([&, p] {
      for (int i = 0; i < kPerProducer; ++i) {
        RecordKey k{static_cast<uint64_t>(p), static_cast<uint32_t>(i / 3), static_cast<uint16_t>(i % 3), 0};
        if (!store->append(k, bytes_of(static_cast<uint64_t>(p * 1000 + i), 24)).is_ok()) ++failures;
      }
    });
  for (auto& t : producers) t.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_TRUE(store->flush().is_ok());
  EXPECT_EQ(store->stats().records, kProducers * kPerProducer);
  EXPECT_GT(store->stats().spilled_records, 0);
  for (int p = 0; p < kProducers; ++p) {
    int i = 0;
    Status s = store->for_each_in_sequence(static_cast<uint64_t>(p), [&](const RecordKey& k, std::span<const uint8_t> d) {
      EXPECT_EQ(k.position, static_cast<uint32_t>(i / 3));
      EXPECT_EQ(k.layer, static_cast<uint16_t>(i % 3));
      EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()), bytes_of(static_cast<uint64_t>(p * 1000 + i), 24));
      ++i;
      return Status::ok();
    });
    ASSERT_TRUE(s.is_ok()) << s.message();
    EXPECT_EQ(i, kPerProducer);
  }
}

// Batches from three producers through a queue of 2 records (a batch larger than the queue still
// goes in once the queue has room) and a budget that spills; read_each then reads a mix of memory
// and spilled records in one pass, in the order asked, reports missing keys through `found` or
// fails naming the first one, and stops at the callback's error.
TEST_F(GuidanceStoreTest, AppendBatchAndReadEach) {
  auto store = open(options(500, 2));
  constexpr int kProducers = 3, kBatches = 20, kPerBatch = 7;
  std::vector<std::thread> producers;
  std::atomic<int> failures{0};
  for (int p = 0; p < kProducers; ++p)
    producers.emplace_back([&, p] {
      for (int b = 0; b < kBatches; ++b) {
        RecordBatch batch;
        for (int i = 0; i < kPerBatch; ++i)
          batch.add(RecordKey{static_cast<uint64_t>(p), static_cast<uint32_t>(b), static_cast<uint16_t>(i), 1},
                    bytes_of(static_cast<uint64_t>(p * 10000 + b * 100 + i), 16 + i));
        if (!store->append_batch(std::move(batch)).is_ok()) ++failures;
      }
    });
  for (auto& t : producers) t.join();
  ASSERT_EQ(failures.load(), 0);
  ASSERT_TRUE(store->append_batch({}).is_ok());  // an empty batch is nothing
  ASSERT_TRUE(store->flush().is_ok());
  EXPECT_EQ(store->stats().records, kProducers * kBatches * kPerBatch);
  EXPECT_GT(store->stats().spilled_records, 0);

  // keys out of order, one missing in the middle
  std::vector<RecordKey> keys{{2, 19, 6, 1}, {0, 0, 0, 1}, {1, 7, 3, 1}, {1, 7, 3, 2}, {0, 19, 6, 1}};
  std::vector<size_t> seen;
  std::vector<uint8_t> found;
  Status s = store->read_each(keys, [&](size_t i, std::span<const uint8_t> payload) {
    const RecordKey& k = keys[i];
    EXPECT_EQ(std::vector<uint8_t>(payload.begin(), payload.end()),
              bytes_of(k.sequence * 10000 + k.position * 100 + k.layer, 16 + k.layer)) << record_key_name(k);
    seen.push_back(i);
    return Status::ok();
  }, &found);
  ASSERT_TRUE(s.is_ok()) << s.message();
  EXPECT_EQ(seen, (std::vector<size_t>{0, 1, 2, 4}));
  EXPECT_EQ(found, (std::vector<uint8_t>{1, 1, 1, 0, 1}));

  Status miss = store->read_each(keys, [](size_t, std::span<const uint8_t>) { return Status::ok(); });
  EXPECT_EQ(miss.code(), StatusCode::kNotFound);
  EXPECT_EQ(miss.message(), "guidance store: no record (sequence 1, position 7, layer 3, site 2)");

  int calls = 0;
  Status stop = store->read_each(keys, [&](size_t, std::span<const uint8_t>) {
    ++calls;
    return invalid_argument("stop here");
  }, &found);
  EXPECT_EQ(stop.message(), "stop here");
  EXPECT_EQ(calls, 1);

  ASSERT_TRUE(store->close().is_ok());
  EXPECT_FALSE(store->read_each(keys, [](size_t, std::span<const uint8_t>) { return Status::ok(); }).is_ok());
  RecordBatch late;
  late.add(RecordKey{5, 0, 0, 0}, bytes_of(1, 4));
  Status after = store->append_batch(std::move(late));
  EXPECT_FALSE(after.is_ok());
  EXPECT_NE(after.message().find("after close"), std::string::npos) << after.message();
}

// gather_guidance with `found`: rows without a record (a routed expert's tokens the rollout sent
// elsewhere) are skipped and reported; the batch equals a gather of only the found rows. Without
// `found` the same rows fail, naming the first missing key.
TEST_F(GuidanceStoreTest, GatherSkipsMissingRowsWhenAsked) {
  const int64_t rows = 6, cols = 48;
  HostQuant h = quantize(QuantFormat::kNvfp4TwoLevel, rows, cols, 31);
  auto store = open(options(int64_t{1} << 20));
  std::vector<uint64_t> seq{0, 1, 2, 3, 4, 5};
  std::vector<uint32_t> pos(rows, 3);
  ASSERT_TRUE(append_guidance(*store, h.q, seq.data(), pos.data(), 2, routed_expert_site(5, 0), GuidanceMode::kTrace)
                  .is_ok());
  // ask for rows 1, 7 (never recorded), 4, 9 (never recorded), 0
  std::vector<uint64_t> ask_seq{1, 7, 4, 9, 0};
  std::vector<uint32_t> ask_pos(5, 3);
  std::vector<uint8_t> found;
  auto g = gather_guidance(*store, ask_seq.data(), ask_pos.data(), 5, 2, routed_expert_site(5, 0), &found);
  ASSERT_TRUE(g.is_ok()) << g.status().message();
  EXPECT_EQ(found, (std::vector<uint8_t>{1, 0, 1, 0, 1}));
  std::vector<uint64_t> only_seq{1, 4, 0};
  auto want = gather_guidance(*store, only_seq.data(), ask_pos.data(), 3, 2, routed_expert_site(5, 0));
  ASSERT_TRUE(want.is_ok());
  EXPECT_EQ(g->rows, 3);
  EXPECT_EQ(g->scales, want->scales);
  EXPECT_EQ(g->outer, want->outer);
  EXPECT_EQ(g->guide, want->guide);
  auto none = gather_guidance(*store, ask_seq.data() + 1, ask_pos.data(), 1, 2, routed_expert_site(5, 0), &found);
  ASSERT_TRUE(none.is_ok());
  EXPECT_EQ(none->rows, 0);
  EXPECT_TRUE(none->guide.empty());
  auto strict = gather_guidance(*store, ask_seq.data(), ask_pos.data(), 5, 2, routed_expert_site(5, 0));
  ASSERT_FALSE(strict.is_ok());
  EXPECT_EQ(strict.status().code(), StatusCode::kNotFound);
  EXPECT_NE(strict.status().message().find("(sequence 7, position 3, layer 2, site 26)"), std::string::npos)
      << strict.status().message();
}

// A duplicate inside one batch is the writer's error (the first record is kept), as for append().
TEST_F(GuidanceStoreTest, DuplicateInsideABatchIsAnError) {
  auto store = open(options(1 << 20));
  RecordBatch batch;
  batch.add(RecordKey{1, 2, 3, 4}, bytes_of(1, 8));
  batch.add(RecordKey{1, 2, 3, 5}, bytes_of(2, 8));
  batch.add(RecordKey{1, 2, 3, 4}, bytes_of(3, 8));
  ASSERT_EQ(batch.size(), 3u);
  EXPECT_EQ(batch.key(2), (RecordKey{1, 2, 3, 4}));
  const std::span<const uint8_t> second = batch.payload(1);
  EXPECT_EQ(std::vector<uint8_t>(second.begin(), second.end()), bytes_of(2, 8));
  ASSERT_TRUE(store->append_batch(std::move(batch)).is_ok());
  Status dup = store->flush();
  EXPECT_NE(dup.message().find("duplicate record (sequence 1, position 2, layer 3, site 4)"), std::string::npos)
      << dup.message();
  EXPECT_EQ(store->read({1, 2, 3, 4}).value(), bytes_of(1, 8));
  EXPECT_EQ(store->read({1, 2, 3, 5}).value(), bytes_of(2, 8));
  EXPECT_FALSE(store->close().is_ok());
}

void overwrite(const std::string& path, int64_t offset, uint8_t byte) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good()) << path;
  f.seekp(offset);
  f.put(static_cast<char>(byte));
}

// A flipped payload byte, a damaged header and a truncated file give data-loss Statuses that name
// the spill file and the key; other records still read.
TEST_F(GuidanceStoreTest, DamagedSpillFileGivesErrorNotCrash) {
  auto store = open(options(0));  // every record spills at once
  for (uint32_t pos = 0; pos < 3; ++pos) ASSERT_TRUE(store->append({1, pos, 0, 0}, bytes_of(pos, 40)).is_ok());
  ASSERT_TRUE(store->flush().is_ok());
  ASSERT_EQ(store->stats().spilled_records, 3);
  const std::string path = store->spill_path();
  const int64_t rec = RecordStore::kSpillHeaderBytes + 40;  // records are in key order

  overwrite(path, 0 * rec + RecordStore::kSpillHeaderBytes + 7, static_cast<uint8_t>(bytes_of(0, 40)[7] ^ 0x10));
  auto r0 = store->read({1, 0, 0, 0});
  ASSERT_FALSE(r0.is_ok());
  EXPECT_EQ(r0.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r0.status().message().find(path), std::string::npos) << r0.status().message();
  EXPECT_NE(r0.status().message().find("(sequence 1, position 0, layer 0, site 0)"), std::string::npos);
  EXPECT_NE(r0.status().message().find("CRC"), std::string::npos) << r0.status().message();

  overwrite(path, 1 * rec + 16, 0x55);  // position field of record 1's header
  auto r1 = store->read({1, 1, 0, 0});
  ASSERT_FALSE(r1.is_ok());
  EXPECT_EQ(r1.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r1.status().message().find("header names"), std::string::npos) << r1.status().message();

  EXPECT_EQ(store->read({1, 2, 0, 0}).value(), bytes_of(2, 40));
  fs::resize_file(path, static_cast<uintmax_t>(2 * rec + 10));
  auto r2 = store->read({1, 2, 0, 0});
  ASSERT_FALSE(r2.is_ok());
  EXPECT_NE(r2.status().message().find("truncated"), std::string::npos) << r2.status().message();
  // Streaming the sequence stops at the first damaged record with its error.
  Status s = store->for_each_in_sequence(1, [](const RecordKey&, std::span<const uint8_t>) { return Status::ok(); });
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
}

TEST_F(GuidanceStoreTest, MissingKeyDuplicateKeyAndClosedStoreAreErrors) {
  auto store = open(options(1 << 20));
  ASSERT_TRUE(store->append({3, 1, 2, 4}, bytes_of(1, 8)).is_ok());
  auto miss = store->read({3, 1, 2, 5});
  ASSERT_FALSE(miss.is_ok());
  EXPECT_EQ(miss.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(miss.status().message(), "guidance store: no record (sequence 3, position 1, layer 2, site 5)");
  EXPECT_EQ(store->for_each_in_sequence(4, [](const RecordKey&, std::span<const uint8_t>) { return Status::ok(); }).code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(store->append({3, 1, 2, 4}, bytes_of(2, 8)).is_ok());  // the writer finds the duplicate
  Status dup = store->flush();
  EXPECT_FALSE(dup.is_ok());
  EXPECT_NE(dup.message().find("duplicate record (sequence 3, position 1, layer 2, site 4)"), std::string::npos);
  EXPECT_FALSE(store->append({3, 2, 0, 0}, bytes_of(3, 8)).is_ok());  // sticky
  EXPECT_EQ(store->read({3, 1, 2, 4}).value(), bytes_of(1, 8));       // the first one is kept
  EXPECT_FALSE(store->close().is_ok());                               // close reports it too
  EXPECT_FALSE(store->read({3, 1, 2, 4}).is_ok());
  EXPECT_FALSE(store->append({9, 0, 0, 0}, bytes_of(4, 8)).is_ok());
  EXPECT_TRUE(store->close().is_ok());  // idempotent
}

TEST_F(GuidanceStoreTest, OverBudgetWithoutSpillDirectoryIsAnError) {
  RecordStoreOptions o = options(16);
  o.spill_dir.clear();
  auto store = open(o);
  ASSERT_TRUE(store->append({0, 0, 0, 0}, bytes_of(1, 16)).is_ok());
  ASSERT_TRUE(store->flush().is_ok());
  ASSERT_TRUE(store->append({0, 1, 0, 0}, bytes_of(2, 1)).is_ok());
  Status s = store->flush();
  EXPECT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("exceed the budget of 16 bytes"), std::string::npos) << s.message();
}

// A spill directory that already exists (with someone else's file) is left with that file; only
// the store's own spill file goes.
TEST_F(GuidanceStoreTest, CloseRemovesOnlyWhatTheStoreCreated) {
  fs::create_directories(dir_ / "spill");
  { std::ofstream(dir_ / "spill" / "foreign.spill") << "not ours"; }
  auto store = open(options(0));
  ASSERT_TRUE(store->append({0, 0, 0, 0}, bytes_of(1, 16)).is_ok());
  ASSERT_TRUE(store->flush().is_ok());
  const std::string spill = store->spill_path();
  ASSERT_TRUE(fs::exists(spill));
  EXPECT_NE(fs::path(spill).filename(), "foreign.spill");
  ASSERT_TRUE(store->close().is_ok());
  EXPECT_FALSE(fs::exists(spill));
  EXPECT_TRUE(fs::exists(dir_ / "spill" / "foreign.spill"));
  // A store destroyed without close() cleans up the same way.
  {
    auto s2 = open(options(0));
    ASSERT_TRUE(s2->append({0, 0, 0, 0}, bytes_of(1, 16)).is_ok());
    ASSERT_TRUE(s2->flush().is_ok());
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir_ / "spill"), fs::directory_iterator{}), 1);
}

// A spill write that fails (here: the file-size limit, as a full disk would) is an I/O error naming
// the spill file; the record stays readable from memory and the process does not crash.
TEST_F(GuidanceStoreTest, FailedSpillWriteIsAnIoError) {
  // The limit is process-wide: a guard restores it (and SIGXFSZ) however the test ends.
  struct FileSizeLimit {
    struct rlimit old {};
    void (*old_handler)(int) = SIG_DFL;
    explicit FileSizeLimit(rlim_t bytes) {
      NIB_CHECK(::getrlimit(RLIMIT_FSIZE, &old) == 0);
      old_handler = ::signal(SIGXFSZ, SIG_IGN);
      struct rlimit lim = old;
      lim.rlim_cur = bytes;
      NIB_CHECK(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
    }
    ~FileSizeLimit() {
      ::setrlimit(RLIMIT_FSIZE, &old);
      ::signal(SIGXFSZ, old_handler);
    }
  };
  auto store = open(options(0));
  Status a, f1, b, f2;
  {
    FileSizeLimit limit(64);  // bytes: the first record (32 + 16) fits, the second does not
    a = store->append({0, 0, 0, 0}, bytes_of(1, 16));
    f1 = store->flush();
    b = store->append({0, 1, 0, 0}, bytes_of(2, 16));
    f2 = store->flush();
  }
  EXPECT_TRUE(a.is_ok() && f1.is_ok() && b.is_ok()) << f1.message();
  ASSERT_FALSE(f2.is_ok());
  EXPECT_EQ(f2.code(), StatusCode::kIoError);
  EXPECT_NE(f2.message().find(store->spill_path()), std::string::npos) << f2.message();
  EXPECT_EQ(store->read({0, 1, 0, 0}).value(), bytes_of(2, 16));
  EXPECT_EQ(store->read({0, 0, 0, 0}).value(), bytes_of(1, 16));
  EXPECT_FALSE(store->close().is_ok());
  EXPECT_FALSE(fs::exists(dir_ / "spill"));
}

}  // namespace
}  // namespace nibble::rollout
