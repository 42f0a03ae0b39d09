// Atomic file replacement: bytes go to `<path>.tmp.<pid>.<n>` in the same folder; commit()
// fsyncs it, renames it over `path` and fsyncs the folder, so a reader sees either the old file
// or the complete new one, also after a crash. Any failure (or destruction without commit)
// removes the temporary file and leaves whatever was at `path` untouched. Creating one first
// removes the temporaries of `path` that killed writers left (io/output_guard.h); a writer asked
// to stop_on_interrupt() abandons its file when SIGINT/SIGTERM arrives (core/interrupt.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/status.h"

namespace nibble::io {

class AtomicFileWriter {
 public:
  // Creates the temporary file next to `path` (mode 0644 & ~umask).
  static Result<AtomicFileWriter> create(const std::string& path);
  AtomicFileWriter(AtomicFileWriter&& o) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&&) = delete;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();  // abandons (unlinks the temporary) unless commit() succeeded

  // data: (bytes) bytes appended to the file. After stop_on_interrupt(), a received SIGINT/SIGTERM
  // abandons the file (the temporary is removed) and returns an "interrupted by ..." status.
  Status append(const void* data, size_t bytes);
  void stop_on_interrupt() { stop_on_interrupt_ = true; }
  // fsync, close, rename over the target, fsync the folder. After a failure the temporary is gone.
  Status commit();
  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }
  uint64_t bytes_written() const { return written_; }

 private:
  AtomicFileWriter(std::string path, std::string temp_path, int fd)
      : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}
  void abandon();
  std::string path_, temp_path_;
  int fd_ = -1;
  bool done_ = false;
  bool stop_on_interrupt_ = false;
  uint64_t written_ = 0;
};

// Writes `bytes` to `path` atomically (one AtomicFileWriter).
Status write_file_atomic(const std::string& path, const void* data, size_t bytes);

// fsync of a folder, so that a rename or unlink inside it is durable.
Status fsync_dir(const std::string& dir);

}  // namespace nibble::io
