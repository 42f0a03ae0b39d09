// AtomicFileWriter (see atomic_file.h): POSIX open(O_EXCL)/write/fsync/rename/fsync(dir).
#include "io/atomic_file.h"

#include "core/interrupt.h"
#include "io/output_guard.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace nibble::io {

namespace {
std::atomic<uint64_t> g_temp_counter{0};

std::string parent_dir(const std::string& path) {
  std::filesystem::path p(path);
  std::filesystem::path parent = p.parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}
}  // namespace

Status fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return io_error("{}: cannot open folder for fsync: {}", dir, std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  // Some file systems do not support fsync on folders (EINVAL); the rename itself still happened.
  if (rc != 0 && err != EINVAL) return io_error("{}: fsync of folder failed: {}", dir, std::strerror(err));
  return Status::ok();
}

Result<AtomicFileWriter> AtomicFileWriter::create(const std::string& path) {
  if (path.empty()) return invalid_argument("empty output path");
  remove_stale_temporaries(path);
  std::string temp = fmt::format("{}.tmp.{}.{}", path, static_cast<long>(::getpid()), g_temp_counter.fetch_add(1));
  int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("{}: cannot create temporary file {}: {}", path, temp, std::strerror(errno));
  return AtomicFileWriter(path, std::move(temp), fd);
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& o) noexcept
    : path_(std::move(o.path_)), temp_path_(std::move(o.temp_path_)), fd_(o.fd_), done_(o.done_),
      stop_on_interrupt_(o.stop_on_interrupt_), written_(o.written_) {
  o.fd_ = -1;
  o.done_ = true;
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!done_) abandon();
}

void AtomicFileWriter::abandon() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!temp_path_.empty()) ::unlink(temp_path_.c_str());
  done_ = true;
}

Status AtomicFileWriter::append(const void* data, size_t bytes) {
  if (done_ || fd_ < 0) return io_error("{}: write after the file was closed", path_);
  if (stop_on_interrupt_ && interrupt_signal() != 0) {
    abandon();
    return cancelled_status(fmt::format("while writing {}", path_));
  }
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Linux writes at most ~2 GiB per call; ask for 1 GiB pieces.
    size_t chunk = std::min<size_t>(bytes, size_t{1} << 30);
    ssize_t n = ::write(fd_, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      abandon();
      return io_error("{}: write failed after {} bytes: {}", path_, written_, std::strerror(err));
    }
    if (n == 0) {
      abandon();
      return io_error("{}: write made no progress after {} bytes", path_, written_);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
  return Status::ok();
}

Status AtomicFileWriter::commit() {
  if (done_ || fd_ < 0) return io_error("{}: commit after the file was closed", path_);
  if (::fsync(fd_) != 0) {
    int err = errno;
    abandon();
    return io_error("{}: fsync failed: {}", path_, std::strerror(err));
  }
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    int err = errno;
    abandon();
    return io_error("{}: close failed: {}", path_, std::strerror(err));
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    abandon();
    return io_error("{}: cannot rename {} over it: {}", path_, temp_path_, std::strerror(err));
  }
  done_ = true;
  return fsync_dir(parent_dir(path_));
}

Status write_file_atomic(const std::string& path, const void* data, size_t bytes) {
  NIB_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::create(path));
  NIB_RETURN_IF_ERROR(w.append(data, bytes));
  return w.commit();
}

}  // namespace nibble::io
