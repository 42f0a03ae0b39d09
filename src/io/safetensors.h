// safetensors reading and writing (https://github.com/huggingface/safetensors format: 8-byte
// little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}, optional
// "__metadata__": {str: str}}, then the raw little-endian data). Reading validates everything
// (header length, JSON, dtype names, offsets in range and non-overlapping, shape x dtype size ==
// byte length) and returns a Status naming the problem; it never reads out of bounds. Large
// files are mmap'ed. Writing is atomic: a temporary file in the same folder, fsync, rename.
// Sharded checkpoints (`model.safetensors.index.json` with a weight_map) are read as one.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"

namespace nibble::io {

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t data_begin = 0;  // byte offsets into the data section
  uint64_t data_end = 0;
};

// An opened safetensors file (or a sharded set). Tensors returned by get() are CPU tensors that
// view the mmap'ed file (read-only use) and keep it alive.
class SafetensorsFile {
 public:
  // Opens a .safetensors file, or a sharded checkpoint given either its index .json file or the
  // folder holding `model.safetensors.index.json` (or a single `model.safetensors`).
  static Result<SafetensorsFile> open(const std::string& path);
  // Parses a file image held in memory (used by the fuzzer and tests); `bytes` is copied.
  static Result<SafetensorsFile> parse(const uint8_t* bytes, size_t size, const std::string& label = "<memory>");

  // Tensor names in file order (sorted by data offset; shards in index order).
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;
  Result<TensorInfo> info(const std::string& name) const;
  Result<Tensor> get(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The files read: the index (sharded sets) and every shard, as opened.
  std::vector<std::string> files() const;

 private:
  struct Shard;
  // A one-file SafetensorsFile over the image [image, image + size) kept alive by `owner`.
  static Result<SafetensorsFile> from_image(const std::string& label, std::shared_ptr<void> owner,
                                            const uint8_t* image, size_t size);
  std::vector<std::shared_ptr<Shard>> shards_;
  std::map<std::string, std::pair<size_t, TensorInfo>> index_;  // name -> (shard, info)
  std::vector<std::string> order_;
  std::map<std::string, std::string> metadata_;
  std::string index_path_;  // sharded sets: the index file read
};

// Tensors to write, in the order given. CUDA tensors are copied to the host first.
struct NamedTensor {
  std::string name;
  Tensor tensor;
};

// Writes `tensors` (+ optional string metadata) to `path` atomically. Names must be unique and
// non-empty; "__metadata__" is reserved.
// stop_on_interrupt: a SIGINT/SIGTERM received while writing abandons the file ("interrupted by ...").
Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {}, bool stop_on_interrupt = false);

// Writes a sharded checkpoint into `dir`: files model-0000i-of-0000n.safetensors of at most
// `max_shard_bytes` each, plus model.safetensors.index.json; a single model.safetensors when it
// fits in one shard. Atomic per file; the index is written last.
Status write_safetensors_sharded(const std::string& dir, const std::vector<NamedTensor>& tensors,
                                 uint64_t max_shard_bytes,
                                 const std::map<std::string, std::string>& metadata = {});

}  // namespace nibble::io
