// MappedFile (see mmap_file.h): open_regular_file (never blocks on a FIFO) + mmap(PROT_READ,
// MAP_PRIVATE), munmap on destruction.
#include "io/mmap_file.h"

#include <cerrno>
#include <cstring>

#include <sys/mman.h>

#include "io/regular_file.h"

namespace nibble::io {

Result<std::shared_ptr<MappedFile>> MappedFile::open(const std::string& path) {
  // Never blocks: a FIFO, device or socket is refused before any read (regular_file.h).
  auto file = open_regular_file(path);
  if (!file) {
    if (file.status().code() == StatusCode::kNotFound) return not_found("{}: no such file", path);
    return file.status();
  }
  const int fd = file->fd();
  const size_t size = static_cast<size_t>(file->size());
  if (size == 0) return std::shared_ptr<MappedFile>(new MappedFile(nullptr, 0));
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;  // the mapping stays valid after `file` closes the descriptor
  if (p == MAP_FAILED) return io_error("{}: cannot mmap {} bytes: {}", path, size, std::strerror(err));
  return std::shared_ptr<MappedFile>(new MappedFile(static_cast<const uint8_t*>(p), size));
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace nibble::io
