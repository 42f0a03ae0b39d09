// A whole file mapped read-only into memory (mmap PROT_READ, MAP_PRIVATE), unmapped when the
// last shared_ptr goes away. The safetensors reader hands out tensors that view such a mapping
// and hold a reference to it. Writing through the mapping faults: the views are read-only.
// Note: a file truncated by another process while mapped makes later reads raise SIGBUS; the
// reader cannot guard against that (neither can any mmap-based reader, e.g. the HF library).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace nibble::io {

class MappedFile {
 public:
  // Maps `path` (a regular file). An empty file maps to size() == 0 and data() == nullptr.
  static Result<std::shared_ptr<MappedFile>> open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }  // data: (size) bytes, page aligned
  size_t size() const { return size_; }

 private:
  MappedFile(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace nibble::io
