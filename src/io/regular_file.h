// Opening input files without ever blocking on what is not a regular file. A path given by the
// user may name a FIFO (open() would wait forever for a writer), a character device, a socket or
// a directory; every file-reading path of nibble goes through open_regular_file (or the two
// helpers built on it), which opens with O_NONBLOCK, checks fstat() for a regular file and only
// then switches the descriptor back to blocking reads. The error names the path and its kind.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace nibble::io {

// A read-only descriptor of a regular file, closed on destruction (movable, not copyable).
class RegularFile {
 public:
  RegularFile() = default;
  RegularFile(RegularFile&& other) noexcept : fd_(other.fd_), size_(other.size_) { other.fd_ = -1; }
  RegularFile& operator=(RegularFile&& other) noexcept;
  RegularFile(const RegularFile&) = delete;
  RegularFile& operator=(const RegularFile&) = delete;
  ~RegularFile();

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }  // st_size at open

 private:
  friend Result<RegularFile> open_regular_file(const std::string& path, std::string_view what);
  int fd_ = -1;
  uint64_t size_ = 0;
};

// "regular file", "named pipe (FIFO)", "directory", "character device", "block device",
// "socket" or "symbolic link" for a st_mode.
std::string_view file_kind_name(unsigned mode);

// Opens `path` for reading if it is a regular file (symbolic links followed). Never blocks.
// Errors: kNotFound for a missing path, kIoError for anything else, as one line
// "<what> '<path>' is a named pipe (FIFO), not a regular file" (`what`: e.g. "data file";
// empty: "file").
Result<RegularFile> open_regular_file(const std::string& path, std::string_view what = {});

// The same check without keeping the file open, for libraries that open by name.
Status check_regular_file(const std::string& path, std::string_view what = {});

// The whole content of a regular file (at most max_bytes; larger is a kIoError naming the limit).
Result<std::string> read_regular_file(const std::string& path, std::string_view what = {},
                                      uint64_t max_bytes = uint64_t{1} << 32);

}  // namespace nibble::io
