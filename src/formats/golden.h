// Test helper: loads the golden vectors of ../shared/testdata/fp4/ (safetensors files written by
// the public reference quantizers; README there). Header-only so CPU tests (formats) and GPU
// tests (backend/cuda) share it. The folder is $NIBBLE_TESTDATA_DIR if set, else the compile-time
// NIBBLE_TESTDATA_DIR macro that test targets define. Uses a tiny self-contained safetensors
// reader (header JSON + raw little-endian bytes) so the formats library stays independent of io.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace nibble::formats::golden {

struct Tensor {
  std::string dtype;            // "F32", "U8", "BF16"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;   // raw little-endian data

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  template <typename T>
  std::vector<T> as() const {
    if (bytes.size() % sizeof(T) != 0) throw std::runtime_error("golden: tensor size not a multiple of the element size");
    std::vector<T> v(bytes.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  }
};

struct File {
  std::string path;
  std::map<std::string, Tensor> tensors;
  nlohmann::json meta;  // parsed __metadata__.golden (may be null)

  bool has(const std::string& name) const { return tensors.count(name) != 0; }
  const Tensor& at(const std::string& name) const {
    auto it = tensors.find(name);
    if (it == tensors.end()) throw std::runtime_error("golden: " + path + " has no tensor " + name);
    return it->second;
  }
};

// <testdata>/fp4
inline std::string fp4_dir() {
  const char* env = std::getenv("NIBBLE_TESTDATA_DIR");
  std::string base = env && *env ? env :
#ifdef NIBBLE_TESTDATA_DIR
                                 NIBBLE_TESTDATA_DIR;
#else
                                 "";
#endif
  return base + "/fp4";
}

// Reads <fp4_dir>/<name>.safetensors; throws std::runtime_error on any problem.
inline File load(const std::string& name) {
  File f;
  f.path = fp4_dir() + "/" + name + ".safetensors";
  std::ifstream in(f.path, std::ios::binary);
  if (!in) throw std::runtime_error("golden: cannot open " + f.path);
  std::vector<uint8_t> all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (all.size() < 8) throw std::runtime_error("golden: short file " + f.path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | all[static_cast<size_t>(i)];
  if (8 + n > all.size()) throw std::runtime_error("golden: bad header length in " + f.path);
  nlohmann::json h = nlohmann::json::parse(all.begin() + 8, all.begin() + 8 + static_cast<int64_t>(n));
  size_t data0 = 8 + n;
  for (auto& [key, val] : h.items()) {
    if (key == "__metadata__") {
      if (val.contains("golden")) f.meta = nlohmann::json::parse(val["golden"].get<std::string>());
      continue;
    }
    Tensor t;
    t.dtype = val["dtype"].get<std::string>();
    t.shape = val["shape"].get<std::vector<int64_t>>();
    uint64_t b = val["data_offsets"][0].get<uint64_t>(), e = val["data_offsets"][1].get<uint64_t>();
    if (b > e || data0 + e > all.size()) throw std::runtime_error("golden: bad offsets for " + key);
    t.bytes.assign(all.begin() + static_cast<int64_t>(data0 + b), all.begin() + static_cast<int64_t>(data0 + e));
    f.tensors.emplace(key, std::move(t));
  }
  return f;
}

}  // namespace nibble::formats::golden
