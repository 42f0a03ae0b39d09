// RunLock (see run_lock.h): open(O_CREAT) + flock(LOCK_EX | LOCK_NB), checked against the path's
// current inode (a releasing owner unlinks the file; whoever locked the unlinked inode retries).
#include "train/run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/log.h"

namespace nibble::train {

namespace {

std::string read_owner_pid(int fd) {
  char buf[32] = {};
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  std::string s = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? std::string("unknown") : s;
}

}  // namespace

Result<RunLock> RunLock::acquire(const std::string& run_dir) {
  const std::string path = (std::filesystem::path(run_dir) / kRunLockName).string();
  for (int attempt = 0; attempt < 16; ++attempt) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return io_error("cannot create the run lock {}: {}", path, std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      std::string owner = err == EWOULDBLOCK ? read_owner_pid(fd) : "";
      ::close(fd);
      if (err == EWOULDBLOCK)
        return io_error("run folder '{}' is in use by another nibble process (pid {}, lock {}): wait for it to end or "
                        "choose another --out",
                        run_dir, owner, path);
      if (err == ENOLCK || err == EOPNOTSUPP) {  // a file system without locks (some network mounts)
        NIB_LOG_WARN("cannot lock {} ({}): running without the run lock; start one writer at a time", path,
                     std::strerror(err));
        ::unlink(path.c_str());
        return RunLock("", -1);
      }
      return io_error("cannot lock {}: {}", path, std::strerror(err));
    }
    struct stat held {}, now {};
    if (::fstat(fd, &held) != 0 || ::stat(path.c_str(), &now) != 0 || held.st_ino != now.st_ino ||
        held.st_dev != now.st_dev) {
      ::close(fd);  // the owner released (unlinked) it between our open and flock: try the new file
      continue;
    }
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
      // The pid is only for messages; the lock itself is held.
    }
    return RunLock(path, fd);
  }
  return io_error("cannot lock {}: it keeps being replaced", path);
}

RunLock::RunLock(RunLock&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_) { o.fd_ = -1; }

RunLock::~RunLock() { release(); }

void RunLock::release() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // while still holding it: a waiter that opened this inode sees it replaced
  ::close(fd_);
  fd_ = -1;
}

}  // namespace nibble::train
