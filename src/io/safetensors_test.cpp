// Tests of the safetensors reader/writer (io/safetensors.h): round trips for every dtype
// (including empty tensors and scalars), metadata, sharded checkpoints, the golden files of
// ../shared/testdata/fp4 (written by the HF library), every malformed-input case the reader must
// refuse with a one-line message naming the problem, and writes that fail without damaging the
// previous file.
#include "io/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>

#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <unistd.h>

#include "io/atomic_file.h"

namespace nibble::io {
namespace {

namespace fs = std::filesystem;

const DType kAllDTypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3,
                            DType::kF8E5M2, DType::kU8, DType::kI32, DType::kI64};

// A fresh folder per test, removed afterwards.
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt::format("nibble_io_{}_{}_{}", info->test_suite_name(), info->name(), ::getpid());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  // Files in the test folder whose name contains ".tmp." (left-over temporaries).
  std::vector<std::string> temporaries(const fs::path& where) const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(where))
      if (e.path().filename().string().find(".tmp.") != std::string::npos) out.push_back(e.path().string());
    return out;
  }
  fs::path dir_;
};

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors image: 8-byte LE `header_len` (default: the header's size), header, data.
std::string image(const std::string& header, const std::string& data = {}, std::optional<uint64_t> header_len = std::nullopt) {
  uint64_t n = header_len ? *header_len : header.size();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

// A tensor whose bytes are a pattern that differs per dtype and position.
Tensor pattern_tensor(DType dtype, Shape shape, uint8_t salt) {
  Tensor t(dtype, std::move(shape));
  auto* p = static_cast<uint8_t*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(i * 37 + salt * 11 + 5);
  return t;
}

void expect_same_tensor(const Tensor& got, const Tensor& want, const std::string& name) {
  ASSERT_TRUE(got.defined()) << name;
  EXPECT_EQ(got.dtype(), want.dtype()) << name;
  EXPECT_EQ(got.shape(), want.shape()) << name;
  ASSERT_EQ(got.nbytes(), want.nbytes()) << name;
  if (want.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0) << name;
  }
}

// parse() must fail, with a one-line message that names the label and contains `what`.
void expect_parse_error(const std::string& bytes, const std::string& what) {
  auto r = SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "bad.safetensors");
  ASSERT_FALSE(r.is_ok()) << "accepted; expected an error containing: " << what;
  const std::string& m = r.status().message();
  EXPECT_NE(m.find("bad.safetensors: "), std::string::npos) << m;
  EXPECT_NE(m.find(what), std::string::npos) << "message: " << m << "\nexpected to contain: " << what;
  EXPECT_EQ(m.find('\n'), std::string::npos) << m;
}

Result<SafetensorsFile> parse_string(const std::string& bytes) {
  return SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "mem.safetensors");
}

// ---- round trips --------------------------------------------------------------------------

TEST_F(SafetensorsTest, RoundTripEveryDTypeWithScalarsAndEmptyTensors) {
  std::vector<NamedTensor> tensors;
  uint8_t salt = 0;
  for (DType t : kAllDTypes) {
    std::string n(dtype_name(t));
    tensors.push_back({n + ".matrix", pattern_tensor(t, {3, 5}, ++salt)});  // 15 elements: odd byte counts for 1-byte dtypes
    tensors.push_back({n + ".scalar", pattern_tensor(t, {}, ++salt)});
    tensors.push_back({n + ".empty", pattern_tensor(t, {0}, ++salt)});
    tensors.push_back({n + ".empty3d", pattern_tensor(t, {2, 0, 3}, ++salt)});
  }
  const std::string file = path("all.safetensors");
  ASSERT_TRUE(write_safetensors(file, tensors).is_ok());
  EXPECT_TRUE(temporaries(dir_).empty());

  auto f = SafetensorsFile::open(file);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  EXPECT_EQ(f->names().size(), tensors.size());
  EXPECT_TRUE(f->metadata().empty());
  for (const NamedTensor& nt : tensors) {
    ASSERT_TRUE(f->contains(nt.name)) << nt.name;
    auto info = f->info(nt.name);
    ASSERT_TRUE(info.is_ok());
    EXPECT_EQ(info->dtype, nt.tensor.dtype());
    EXPECT_EQ(info->shape, nt.tensor.shape());
    EXPECT_EQ(info->data_end - info->data_begin, nt.tensor.nbytes());
    // The writer places larger element sizes first, so every tensor is aligned for its dtype.
    EXPECT_EQ(info->data_begin % dtype_size(nt.tensor.dtype()), 0u) << nt.name;
    auto t = f->get(nt.name);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    expect_same_tensor(*t, nt.tensor, nt.name);
  }
  // Also through parse() of the same bytes (the in-memory path).
  auto m = parse_string(read_bytes(file));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  EXPECT_EQ(m->names(), f->names());
  for (const NamedTensor& nt : tensors) expect_same_tensor(*m->get(nt.name), nt.tensor, nt.name);
}

TEST_F(SafetensorsTest, HeaderIsPaddedAndKeepsTheGivenOrder) {
  std::vector<NamedTensor> tensors = {{"z", pattern_tensor(DType::kU8, {3}, 1)},
                                      {"a", pattern_tensor(DType::kF32, {2}, 2)},
                                      {"m", pattern_tensor(DType::kBF16, {1}, 3)}};
  const std::string file = path("order.safetensors");
  ASSERT_TRUE(write_safetensors(file, tensors, {{"format", "pt"}}).is_ok());
  std::string bytes = read_bytes(file);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ((8 + n) % 8, 0u);  // data section starts at a multiple of 8
  std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  auto j = nlohmann::ordered_json::parse(header);
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"__metadata__", "z", "a", "m"}));
  // Data: F32 first, then BF16, then U8, no gaps, ending at the end of the file.
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::ordered_json::array({0, 8}));
  EXPECT_EQ(j["m"]["data_offsets"], nlohmann::ordered_json::array({8, 10}));
  EXPECT_EQ(j["z"]["data_offsets"], nlohmann::ordered_json::array({10, 13}));
  EXPECT_EQ(bytes.size(), 8 + n + 13);
  auto f = SafetensorsFile::open(file);
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(f->names(), (std::vector<std::string>{"a", "m", "z"}));  // data-offset order
}

TEST_F(SafetensorsTest, MetadataRoundTrip) {
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"config", R"({"d_model": 64})"}, {"empty", ""}, {"uni", "\xc3\xa9t\xc3\xa9"}};
  const std::string file = path("meta.safetensors");
  ASSERT_TRUE(write_safetensors(file, {{"w", pattern_tensor(DType::kF32, {4}, 9)}}, meta).is_ok());
  auto f = SafetensorsFile::open(file);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  EXPECT_EQ(f->metadata(), meta);
}

TEST_F(SafetensorsTest, NoTensorsAtAll) {
  const std::string file = path("empty.safetensors");
  ASSERT_TRUE(write_safetensors(file, {}).is_ok());
  auto f = SafetensorsFile::open(file);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  EXPECT_TRUE(f->names().empty());
  EXPECT_FALSE(f->get("w").is_ok());
}

TEST_F(SafetensorsTest, TensorsViewTheMappingAndOutliveTheFileObject) {
  Tensor w = pattern_tensor(DType::kF32, {64, 3}, 4);
  const std::string file = path("view.safetensors");
  ASSERT_TRUE(write_safetensors(file, {{"w", w}}).is_ok());
  Tensor a, b;
  {
    auto f = SafetensorsFile::open(file);
    ASSERT_TRUE(f.is_ok());
    a = *f->get("w");
    b = *f->get("w");
  }
  // Both views point at the same mapped bytes (no copy) and stay valid after the file object is gone.
  EXPECT_EQ(a.raw(), b.raw());
  expect_same_tensor(a, w, "w");
  auto missing = SafetensorsFile::open(file)->get("nope");
  ASSERT_FALSE(missing.is_ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);
}

TEST_F(SafetensorsTest, UnalignedDataIsCopied) {
  // As another writer may lay it out: a U8 tensor of 3 bytes, then an F32 tensor at offset 3.
  float vals[2] = {1.5f, -2.25f};
  std::string data = "abc" + std::string(reinterpret_cast<const char*>(vals), 8);
  std::string header = R"({"u":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},"f":{"dtype":"F32","shape":[2],"data_offsets":[3,11]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string file = path("unaligned.safetensors");
  write_bytes(file, image(header, data));
  auto f = SafetensorsFile::open(file);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  auto t = f->get("f");
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t->raw()) % 4, 0u);
  EXPECT_EQ(t->data<float>()[0], 1.5f);
  EXPECT_EQ(t->data<float>()[1], -2.25f);
  EXPECT_EQ(std::string(static_cast<const char*>(f->get("u")->raw()), 3), "abc");
  EXPECT_EQ(f->names(), (std::vector<std::string>{"u", "f"}));
}

// ---- golden files written by the HF library -----------------------------------------------

std::string testdata_dir() {
  if (const char* env = std::getenv("NIBBLE_TESTDATA_DIR")) return env;
#ifdef NIBBLE_TESTDATA_DIR
  return NIBBLE_TESTDATA_DIR;
#else
  return "";
#endif
}

TEST(SafetensorsGolden, ReadsEveryFp4GoldenFile) {
  const fs::path dir = fs::path(testdata_dir()) / "fp4";
  ASSERT_TRUE(fs::is_directory(dir)) << dir << " is missing (set NIBBLE_TESTDATA_DIR)";
  const std::map<std::string, DType> torch_names = {{"float32", DType::kF32}, {"uint8", DType::kU8}, {"bfloat16", DType::kBF16}};
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    const std::string file = e.path().string();
    auto f = SafetensorsFile::open(file);
    ASSERT_TRUE(f.is_ok()) << f.status().message();
    ASSERT_TRUE(f->metadata().count("golden")) << file;
    // The metadata describes every tensor (torch dtype names); it must agree with the header.
    auto golden = nlohmann::json::parse(f->metadata().at("golden"));
    const auto& described = golden.at("tensors");
    EXPECT_EQ(described.size(), f->names().size()) << file;
    for (const std::string& name : f->names()) {
      ASSERT_TRUE(described.contains(name)) << file << " " << name;
      auto t = f->get(name);
      ASSERT_TRUE(t.is_ok()) << t.status().message();
      EXPECT_EQ(t->dtype(), torch_names.at(described[name].at("dtype").get<std::string>())) << file << " " << name;
      EXPECT_EQ(t->shape(), described[name].at("shape").get<Shape>()) << file << " " << name;
    }
    // NVFP4 files hold amax = max |x| over the input: a check of the values read, exact since
    // max and fabs are exact in binary32.
    if (f->contains("amax") && f->contains("x")) {
      Tensor x = *f->get("x");
      float m = 0.0f;
      for (int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::fabs(x.data<float>()[i]));
      EXPECT_EQ(f->get("amax")->data<float>()[0], m) << file;
    }
  }
  EXPECT_GE(files, 20);
}

// ---- sharded checkpoints ------------------------------------------------------------------

TEST_F(SafetensorsTest, ShardedRoundTrip) {
  std::vector<NamedTensor> tensors = {
      {"embed", pattern_tensor(DType::kBF16, {16, 8}, 1)},   // 256 B
      {"l0.w", pattern_tensor(DType::kU8, {100}, 2)},        // 100 B
      {"l0.s", pattern_tensor(DType::kF8E4M3, {50}, 3)},     // 50 B
      {"l1.w", pattern_tensor(DType::kF32, {90}, 4)},        // 360 B: alone (> limit)
      {"scalar", pattern_tensor(DType::kI64, {}, 5)},        // 8 B
      {"empty", pattern_tensor(DType::kF16, {0, 4}, 6)},     // 0 B
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "100"}};
  const std::string ckpt = path("ckpt");
  ASSERT_TRUE(write_safetensors_sharded(ckpt, tensors, 300, meta).is_ok());
  // Shards: {embed}, {l0.w, l0.s}, {l1.w}, {scalar, empty}.
  for (int i = 1; i <= 4; ++i) EXPECT_TRUE(fs::exists(fs::path(ckpt) / fmt::format("model-{:05d}-of-00004.safetensors", i))) << i;
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / "model-00005-of-00005.safetensors"));
  EXPECT_TRUE(temporaries(ckpt).empty());
  auto index = nlohmann::json::parse(read_bytes((fs::path(ckpt) / "model.safetensors.index.json").string()));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), 256u + 100 + 50 + 360 + 8);
  EXPECT_EQ(index["weight_map"]["l0.s"], "model-00002-of-00004.safetensors");

  for (const std::string& where : {ckpt, (fs::path(ckpt) / "model.safetensors.index.json").string()}) {
    auto f = SafetensorsFile::open(where);
    ASSERT_TRUE(f.is_ok()) << f.status().message();
    EXPECT_EQ(f->names(), (std::vector<std::string>{"embed", "l0.w", "l0.s", "l1.w", "scalar", "empty"}));
    EXPECT_EQ(f->metadata(), meta);  // total_size is a number and not part of metadata()
    for (const NamedTensor& nt : tensors) expect_same_tensor(*f->get(nt.name), nt.tensor, nt.name);
  }

  // Rewriting the folder as one file removes the stale index and shards.
  ASSERT_TRUE(write_safetensors_sharded(ckpt, tensors, 1 << 20, meta).is_ok());
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(fs::path(ckpt) / "model-00001-of-00004.safetensors"));
  auto single = SafetensorsFile::open(ckpt);
  ASSERT_TRUE(single.is_ok()) << single.status().message();
  EXPECT_EQ(single->names().size(), tensors.size());
  for (const NamedTensor& nt : tensors) expect_same_tensor(*single->get(nt.name), nt.tensor, nt.name);
  EXPECT_FALSE(write_safetensors_sharded(ckpt, tensors, 0).is_ok());
}

TEST_F(SafetensorsTest, ShardedIndexIsValidated) {
  const std::string ckpt = path("ckpt");
  fs::create_directories(ckpt);
  ASSERT_TRUE(write_safetensors((fs::path(ckpt) / "a.safetensors").string(), {{"w", pattern_tensor(DType::kF32, {2}, 1)}}).is_ok());
  const std::string index = (fs::path(ckpt) / "model.safetensors.index.json").string();
  auto expect_index_error = [&](const std::string& text, const std::string& what) {
    write_bytes(index, text);
    auto f = SafetensorsFile::open(ckpt);
    ASSERT_FALSE(f.is_ok()) << text;
    EXPECT_NE(f.status().message().find(what), std::string::npos) << f.status().message() << "\nexpected: " << what;
    EXPECT_EQ(f.status().message().find('\n'), std::string::npos);
  };
  expect_index_error(R"({"weight_map": {"w": "a.safetensors", "v": "a.safetensors"}})", "tensor 'v' is mapped to 'a.safetensors' but that file does not contain it");
  expect_index_error(R"({"weight_map": {"w": "../a.safetensors"}})", "leaves the index's folder");
  expect_index_error(R"({"weight_map": {"w": "sub/../../a.safetensors"}})", "leaves the index's folder");
  expect_index_error(R"({"weight_map": {"w": "/etc/passwd"}})", "absolute path");
  expect_index_error(R"({"weight_map": {"w": ""}})", "empty file name");
  expect_index_error(R"({"weight_map": {"w": 3}})", "not a file name");
  expect_index_error(R"({"weight_map": ["w"]})", "'weight_map' is a JSON array");
  expect_index_error(R"({"metadata": {}})", "no 'weight_map'");
  expect_index_error(R"({"metadata": 5, "weight_map": {}})", "'metadata' is a JSON integer");
  expect_index_error(R"({"weight_map": {"w": "missing.safetensors"}})", "missing.safetensors: no such file");
  expect_index_error(R"({"weight_map": {)", "not valid JSON");
  expect_index_error(R"([])", "not an object");

  // A valid index: only mapped tensors are part of the checkpoint; string metadata is kept.
  write_bytes(index, R"({"metadata": {"total_size": 8, "note": "x"}, "weight_map": {"w": "a.safetensors"}})");
  auto f = SafetensorsFile::open(ckpt);
  ASSERT_TRUE(f.is_ok()) << f.status().message();
  EXPECT_EQ(f->names(), std::vector<std::string>{"w"});
  EXPECT_EQ(f->metadata(), (std::map<std::string, std::string>{{"note", "x"}}));
}

TEST_F(SafetensorsTest, OpenReportsMissingFilesAndFolders) {
  auto a = SafetensorsFile::open(path("nope.safetensors"));
  ASSERT_FALSE(a.is_ok());
  EXPECT_EQ(a.status().code(), StatusCode::kNotFound);
  EXPECT_NE(a.status().message().find("nope.safetensors"), std::string::npos);
  auto b = SafetensorsFile::open(dir_.string());
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("neither"), std::string::npos);
  write_bytes(path("zero.safetensors"), "");
  auto c = SafetensorsFile::open(path("zero.safetensors"));
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("too short"), std::string::npos) << c.status().message();
}

// ---- malformed files ----------------------------------------------------------------------

const char* kGoodEntry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

TEST(SafetensorsMalformed, HeaderLength) {
  expect_parse_error("", "too short");
  expect_parse_error(std::string(7, '\0'), "too short");
  expect_parse_error(image("", "", 0), "header length is 0");
  expect_parse_error(image("{}", "", 100'000'001), "exceeds the limit of 100000000 bytes");
  expect_parse_error(image("{}", "", 3), "header length 3 exceeds the 2 bytes that follow it");
  expect_parse_error(image("{}", "", UINT64_MAX), "header length 18446744073709551615");
}

TEST(SafetensorsMalformed, Json) {
  expect_parse_error(image("{\"w\": "), "header is not valid JSON");
  expect_parse_error(image("{} trailing"), "header is not valid JSON");
  expect_parse_error(image("{\"a\": \"\xff\xfe\"}"), "header is not valid JSON");  // invalid UTF-8
  expect_parse_error(image("[1, 2]"), "header is a JSON array, not an object");
  expect_parse_error(image("\"str\""), "header is a JSON string, not an object");
  expect_parse_error(image("7"), "header is a JSON integer, not an object");
  expect_parse_error(image(std::string("{") + kGoodEntry + "," + kGoodEntry + "}", std::string(8, 'x')), "has the key 'w' twice");
  expect_parse_error(image(R"({"w":{"dtype":"F32","dtype":"U8","shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x')),
                     "twice (in a nested object)");
  // Control characters in names are escaped so that the message stays on one line.
  expect_parse_error(image("{\"a\\nb\": 1}"), "tensor 'a\\x0ab': entry is a JSON integer, not an object");
}

// The reference parser (the Rust crate) takes the header as UTF-8 and hands it to
// serde_json::from_str: only JSON whitespace may pad the object. nlohmann alone would stop at a
// NUL byte as if the input ended there and accept whatever follows it.
TEST(SafetensorsMalformed, HeaderPaddingIsJsonWhitespaceOnly) {
  const std::string entry = std::string("{") + kGoodEntry + "}";
  const std::string data(8, 'x');
  const std::string nul(1, '\0');
  for (const std::string& pad : {nul, std::string(7, '\0'), "  " + nul + "  ", nul + "garbage", std::string(" }")}) {
    SCOPED_TRACE(::testing::PrintToString(pad));
    auto r = parse_string(image(entry + pad, data));
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message().find('\n'), std::string::npos) << r.status().message();
  }
  expect_parse_error(image(entry + nul + " junk", data), "header has a NUL byte at offset " + std::to_string(entry.size()));
  expect_parse_error(image(nul + entry, data), "header has a NUL byte at offset 0");
  // What the reference accepts still parses: space padding (what every writer emits) and JSON
  // whitespace on either side.
  for (const std::string& header : {entry + "       ", entry + "\n", "\t\r\n " + entry + " \t"}) {
    auto r = parse_string(image(header, data));
    ASSERT_TRUE(r.is_ok()) << ::testing::PrintToString(header) << ": " << r.status().message();
    EXPECT_EQ(r->names(), std::vector<std::string>{"w"});
  }
}

TEST(SafetensorsMalformed, MissingOrWrongFields) {
  expect_parse_error(image(R"({"w":{"shape":[2],"data_offsets":[0,8]}})"), "tensor 'w': missing 'dtype'");
  expect_parse_error(image(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})"), "tensor 'w': missing 'shape'");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[2]}})"), "tensor 'w': missing 'data_offsets'");
  expect_parse_error(image(R"({"w":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})"), "'dtype' is a JSON integer, not a string");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})"), "'shape' is a JSON integer, not an array");
  expect_parse_error(image(R"({"w":[1]})"), "tensor 'w': entry is a JSON array, not an object");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})"), "'data_offsets' is [0], not [begin, end]");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":"0,8"}})"), "'data_offsets' is \"0,8\"");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})"), "'data_offsets' is [-1,8]");
}

TEST(SafetensorsMalformed, DTypes) {
  expect_parse_error(image(R"({"w":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", std::string(8, 'x')),
                     "tensor 'w': unknown dtype 'F64' (nibble reads F32, BF16, F16, F8_E4M3, F8_E5M2, U8, I32, I64)");
  expect_parse_error(image(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", "xxxx"), "unknown dtype 'f32'");
}

TEST(SafetensorsMalformed, Shapes) {
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[2,-3],"data_offsets":[0,8]}})"), "shape dimension 1 is negative (-3)");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})"), "shape dimension 0 is not an integer");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})"), "shape dimension 0 is not an integer");
  expect_parse_error(image(R"({"w":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8]}})"),
                     "shape dimension 0 is not an integer in [0, 2^63)");
  expect_parse_error(image(R"({"w":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8]}})"),
                     "has too many elements (64-bit overflow)");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]}})"), "needs more than 2^63 bytes");
  std::string deep = "[1";
  for (int i = 1; i < 65; ++i) deep += ",1";
  deep += "]";
  expect_parse_error(image(R"({"w":{"dtype":"U8","shape":)" + deep + R"(,"data_offsets":[0,1]}})", "x"), "65 dimensions");
}

TEST(SafetensorsMalformed, OffsetsAndSizes) {
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[25],"data_offsets":[0,100]}})", std::string(64, 'x')),
                     "tensor 'w': data_offsets [0, 100] exceed data section of 64 bytes");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[9,9]}})", std::string(8, 'x')),
                     "data_offsets [9, 9] exceed data section of 8 bytes");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", std::string(8, 'x')),
                     "data_offsets [8, 0] begin after they end");
  expect_parse_error(image(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, 'x')),
                     "data_offsets [0, 8] hold 8 bytes but shape [3] of dtype F32 needs 12");
  expect_parse_error(image(R"({"a":{"dtype":"U8","shape":[6],"data_offsets":[0,6]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                           std::string(8, 'x')),
                     "tensors 'a' [0, 6] and 'b' [4, 8] overlap");
  expect_parse_error(image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                           std::string(8, 'x')),
                     "overlap");
  // Empty tensors occupy no bytes, so one "inside" another is fine.
  auto ok = parse_string(image(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
                               std::string(8, 'x')));
  EXPECT_TRUE(ok.is_ok()) << ok.status().message();
}

TEST_F(SafetensorsTest, TruncatedFile) {
  const std::string file = path("t.safetensors");
  ASSERT_TRUE(write_safetensors(file, {{"w", pattern_tensor(DType::kF32, {16}, 1)}}).is_ok());
  std::string bytes = read_bytes(file);
  fs::resize_file(file, bytes.size() - 1);
  auto f = SafetensorsFile::open(file);
  ASSERT_FALSE(f.is_ok());
  EXPECT_NE(f.status().message().find(file + ": tensor 'w': data_offsets [0, 64] exceed data section of 63 bytes"), std::string::npos)
      << f.status().message();
  // Cut inside the header.
  fs::resize_file(file, 20);
  auto g = SafetensorsFile::open(file);
  ASSERT_FALSE(g.is_ok());
  EXPECT_NE(g.status().message().find("exceeds the 12 bytes that follow it"), std::string::npos) << g.status().message();
  // Every prefix of a valid file is refused, and none reads out of bounds (ASan builds check that).
  for (size_t n = 0; n < bytes.size(); ++n) EXPECT_FALSE(parse_string(bytes.substr(0, n)).is_ok()) << n;
}

TEST(SafetensorsMalformed, Metadata) {
  expect_parse_error(image(R"({"__metadata__":{"a":1}})"), "__metadata__ entry 'a' is a JSON integer, not a string");
  expect_parse_error(image(R"({"__metadata__":{"a":null}})"), "__metadata__ entry 'a' is a JSON null, not a string");
  expect_parse_error(image(R"({"__metadata__":["a"]})"), "__metadata__ is a JSON array, not an object of strings");
  expect_parse_error(image(R"({"__metadata__":"a"})"), "__metadata__ is a JSON string");
}

TEST(SafetensorsMalformed, DeepNestingDoesNotOverflowTheStack) {
  // nlohmann parses and destroys iteratively; 200000 levels would overflow a recursive parser.
  const int depth = 200000;
  std::string arrays = std::string(depth, '[') + std::string(depth, ']');
  expect_parse_error(image(arrays), "header is a JSON array, not an object");
  std::string objects;
  for (int i = 0; i < depth; ++i) objects += "{\"a\":";
  objects += "1" + std::string(depth, '}');
  expect_parse_error(image(objects), "tensor 'a': missing 'dtype'");
}

// The seed corpus of the fuzzer: valid_* files parse, bad_* files are refused.
TEST(SafetensorsMalformed, FuzzSeedCorpus) {
  const fs::path dir = fs::path(NIBBLE_SOURCE_DIR) / "fuzz" / "corpus" / "safetensors_fuzz";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  int valid = 0, bad = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    auto f = SafetensorsFile::open(e.path().string());
    if (name.rfind("valid_", 0) == 0) {
      ++valid;
      ASSERT_TRUE(f.is_ok()) << f.status().message();
      for (const std::string& t : f->names()) EXPECT_TRUE(f->get(t).is_ok()) << name << " " << t;
    } else if (name.rfind("bad_", 0) == 0) {
      ++bad;
      EXPECT_FALSE(f.is_ok()) << name;
    }
  }
  EXPECT_GE(valid, 3);
  EXPECT_GE(bad, 5);
}

// ---- writes that fail ---------------------------------------------------------------------

TEST_F(SafetensorsTest, FailedWritesLeaveTheOldFileIntact) {
  const std::string file = path("keep.safetensors");
  ASSERT_TRUE(write_safetensors(file, {{"old", pattern_tensor(DType::kF32, {8}, 1)}}).is_ok());
  const std::string before = read_bytes(file);
  std::vector<NamedTensor> next = {{"new", pattern_tensor(DType::kF32, {1 << 16}, 2)}};  // 256 KiB

  // Bad input: nothing is written.
  Tensor t = pattern_tensor(DType::kU8, {2}, 3);
  for (const auto& bad : std::vector<std::vector<NamedTensor>>{{{"", t}}, {{"__metadata__", t}}, {{"a", t}, {"a", t}}, {{"u", Tensor()}}}) {
    Status s = write_safetensors(file, bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  }
  EXPECT_EQ(read_bytes(file), before);

  // A folder that does not exist.
  Status s = write_safetensors(path("no/such/dir/x.safetensors"), next);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("no/such/dir/x.safetensors"), std::string::npos) << s.message();

  // The target is a folder: the rename fails, the temporary is removed, the folder survives.
  fs::create_directories(path("adir"));
  s = write_safetensors(path("adir"), next);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.message();
  EXPECT_TRUE(fs::is_directory(path("adir")));

  // A write that fails half-way (the file size limit, EFBIG): the old file is untouched.
  struct rlimit old_limit {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old_limit;
  small.rlim_cur = 64 * 1024;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  s = write_safetensors(file, next);
  setrlimit(RLIMIT_FSIZE, &old_limit);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.message();
  EXPECT_NE(s.message().find("write failed"), std::string::npos) << s.message();
  EXPECT_EQ(read_bytes(file), before);
  EXPECT_TRUE(temporaries(dir_).empty());

  // The same write succeeds without the limit and replaces the file.
  ASSERT_TRUE(write_safetensors(file, next).is_ok());
  auto f = SafetensorsFile::open(file);
  ASSERT_TRUE(f.is_ok());
  EXPECT_EQ(f->names(), std::vector<std::string>{"new"});
  EXPECT_TRUE(temporaries(dir_).empty());
}

TEST_F(SafetensorsTest, ReadOnlyFolder) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores folder permissions";
  const std::string ro = path("ro");
  fs::create_directories(ro);
  const std::string file = (fs::path(ro) / "x.safetensors").string();
  ASSERT_TRUE(write_safetensors(file, {{"old", pattern_tensor(DType::kU8, {5}, 1)}}).is_ok());
  const std::string before = read_bytes(file);
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
  Status s = write_safetensors(file, {{"new", pattern_tensor(DType::kU8, {9}, 2)}});
  fs::permissions(ro, fs::perms::owner_all);
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(read_bytes(file), before);

  // A folder that cannot be entered: reading is an I/O error, not "no such file".
  fs::permissions(ro, fs::perms::none);
  auto f = SafetensorsFile::open(file);
  fs::permissions(ro, fs::perms::owner_all);
  ASSERT_FALSE(f.is_ok());
  EXPECT_EQ(f.status().code(), StatusCode::kIoError) << f.status().message();
}

TEST_F(SafetensorsTest, AtomicWriterAbandonsOnDestruction) {
  const std::string file = path("a.bin");
  write_bytes(file, "old");
  {
    auto w = AtomicFileWriter::create(file);
    ASSERT_TRUE(w.is_ok());
    ASSERT_TRUE(w->append("new bytes", 9).is_ok());
    EXPECT_TRUE(fs::exists(w->temp_path()));
  }  // no commit
  EXPECT_EQ(read_bytes(file), "old");
  EXPECT_TRUE(temporaries(dir_).empty());
  ASSERT_TRUE(write_file_atomic(file, "new", 3).is_ok());
  EXPECT_EQ(read_bytes(file), "new");
}

}  // namespace
}  // namespace nibble::io
