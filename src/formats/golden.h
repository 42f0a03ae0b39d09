// Test helper: loads the golden vectors of ../shared/testdata/fp4/ (safetensors files written by
// the public reference quantizers; README there). Header-only so CPU tests (formats) and GPU
// tests (backend/cuda) share it. The folder is $NIBBLE_TESTDATA_DIR if set, else the compile-time
// NIBBLE_TESTDATA_DIR macro that test targets define. Reads with nibble::io (tests link
// nibble_io; the nibble_formats library itself does not depend on io).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

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

// Reads <fp4_dir>/<name>.safetensors through nibble::io::SafetensorsFile; throws
// std::runtime_error on any problem (tests only).
inline File load(const std::string& name) {
  File f;
  f.path = fp4_dir() + "/" + name + ".safetensors";
  auto opened = io::SafetensorsFile::open(f.path);
  if (!opened.is_ok()) throw std::runtime_error("golden: cannot open " + f.path + ": " + opened.status().message());
  const io::SafetensorsFile& st = opened.value();
  auto meta = st.metadata().find("golden");
  if (meta != st.metadata().end()) f.meta = nlohmann::json::parse(meta->second);
  for (const std::string& n : st.names()) {
    auto t = st.get(n);
    if (!t.is_ok()) throw std::runtime_error("golden: " + f.path + ": " + t.status().message());
    Tensor g;
    g.dtype = std::string(dtype_name(t->dtype()));
    g.shape = t->shape();
    const uint8_t* p = static_cast<const uint8_t*>(t->raw());
    g.bytes.assign(p, p + t->nbytes());
    f.tensors.emplace(n, std::move(g));
  }
  return f;
}

}  // namespace nibble::formats::golden
