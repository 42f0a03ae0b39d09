// The exclusive lock of a run folder: every command that writes into RUN_DIR (`nibble pretrain`,
// fresh or --resume, and the data preparation it runs) holds flock(LOCK_EX) on RUN_DIR/nibble.lock
// while it works, so a second writer gets one clear error instead of corrupting the first one's
// checkpoints and metrics. The kernel drops a flock when its process exits however it exits, so a
// crash never leaves a stale lock; the file (holding the owner's pid, for the message) is removed
// when released. Readers (eval, generate, export) take no lock: they read complete checkpoints.
// On a file system without flock (ENOLCK, EOPNOTSUPP) the run goes on unlocked, with a warning.
#pragma once

#include <string>

#include "core/status.h"

namespace nibble::train {

inline constexpr const char* kRunLockName = "nibble.lock";

class RunLock {
 public:
  // Locks the existing folder `run_dir`. Held by another process: kIoError naming its pid. No
  // flock on this file system: a warning and a lock that holds nothing (path() empty).
  static Result<RunLock> acquire(const std::string& run_dir);
  RunLock(RunLock&& o) noexcept;
  RunLock& operator=(RunLock&&) = delete;
  RunLock(const RunLock&) = delete;
  ~RunLock();

  // Removes the lock file and unlocks (idempotent; the destructor calls it).
  void release();
  const std::string& path() const { return path_; }

 private:
  RunLock(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

}  // namespace nibble::train
