// Atomic file and folder writes for run artefacts (see atomic_dir.h).
#include "train/atomic_dir.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "io/output_guard.h"

namespace nibble::train {
namespace fs = std::filesystem;

namespace {

std::string parent_or_dot(const std::string& path) {
  fs::path p = fs::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

Status fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return io_error("cannot open {} for fsync: {}", path, std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0 && !(directory && (err == EINVAL || err == EROFS)))
    return io_error("fsync {} failed: {}", path, std::strerror(err));
  return Status::ok();
}

}  // namespace

Status write_file_atomic(const std::string& path, std::string_view bytes) {
  io::remove_stale_temporaries(path);  // `path.tmp.<pid>` of killed writers
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return io_error("cannot create {}: {}", tmp, std::strerror(errno));
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return io_error("write to {} failed: {}", tmp, std::strerror(err));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return io_error("cannot finish writing {}: {}", tmp, std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return io_error("cannot rename {} to {}: {}", tmp, path, std::strerror(err));
  }
  return fsync_path(parent_or_dot(path), true);
}

Status make_dirs(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec) return io_error("cannot create folder {}: {}", path, ec.message());
  if (!fs::is_directory(path, ec)) return io_error("{} exists and is not a folder", path);
  return Status::ok();
}

Result<AtomicDir> AtomicDir::create(const std::string& final_path) {
  if (final_path.empty()) return invalid_argument("empty folder path");
  std::string trimmed = final_path;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  NIB_RETURN_IF_ERROR(make_dirs(parent_or_dot(trimmed)));
  io::remove_stale_temporaries(trimmed);  // `.tmp.<pid>` / `.old.<pid>` folders of killed writers
  std::string tmp = trimmed + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(tmp, ec);  // a leftover of an earlier crashed run with the same pid
  if (!fs::create_directory(tmp, ec) || ec)
    return io_error("cannot create folder {}: {}", tmp, ec ? ec.message() : "exists");
  return AtomicDir(trimmed, tmp);
}

AtomicDir::AtomicDir(AtomicDir&& o) noexcept
    : final_path_(std::move(o.final_path_)), temp_path_(std::move(o.temp_path_)), done_(o.done_) {
  o.done_ = true;
}

AtomicDir::~AtomicDir() {
  if (done_) return;
  std::error_code ec;
  fs::remove_all(temp_path_, ec);
}

Status AtomicDir::commit() {
  if (done_) return invalid_argument("folder {} already committed", final_path_);
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(temp_path_, ec))
    if (entry.is_regular_file()) NIB_RETURN_IF_ERROR(fsync_path(entry.path().string(), false));
  NIB_RETURN_IF_ERROR(fsync_path(temp_path_, true));
  std::string old = final_path_ + ".old." + std::to_string(::getpid());
  bool had_old = fs::exists(final_path_, ec);
  if (had_old) {
    fs::remove_all(old, ec);
    if (::rename(final_path_.c_str(), old.c_str()) != 0)
      return io_error("cannot move {} aside: {}", final_path_, std::strerror(errno));
  }
  if (::rename(temp_path_.c_str(), final_path_.c_str()) != 0) {
    int err = errno;
    if (had_old) ::rename(old.c_str(), final_path_.c_str());
    return io_error("cannot rename {} to {}: {}", temp_path_, final_path_, std::strerror(err));
  }
  done_ = true;
  if (had_old) fs::remove_all(old, ec);
  return fsync_path(parent_or_dot(final_path_), true);
}

}  // namespace nibble::train
