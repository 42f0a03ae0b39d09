// Atomic outputs of a run: a file written whole or not at all (temporary in the same folder,
// fsync, rename), and a folder built under a temporary name and renamed into place, so a
// reader (or a resumed run after a crash) never sees a half-written checkpoint or shard.
// Mirrors the "write tmp + rename" pattern of safetensors/io/atomic_file and torch.save users.
#pragma once

#include <string>
#include <string_view>

#include "core/status.h"

namespace nibble::train {

// Writes `bytes` to `path` atomically: `<path>.tmp.<pid>`, fsync, rename over `path`. Like
// AtomicDir::create, it first removes what killed writers of `path` left (io/output_guard.h).
Status write_file_atomic(const std::string& path, std::string_view bytes);

// Creates `path` and its missing parents (like mkdir -p); ok if it already exists as a folder.
Status make_dirs(const std::string& path);

// A folder that appears at `final_path` only when commit() succeeds. Files are written into
// temp_path() (`<final_path>.tmp.<pid>`); commit() fsyncs and renames it into place, replacing an
// existing folder at `final_path` (which is first moved aside to `<final_path>.old.<pid>` and then
// removed). Destroying an uncommitted AtomicDir removes the temporary folder.
class AtomicDir {
 public:
  static Result<AtomicDir> create(const std::string& final_path);
  AtomicDir(AtomicDir&& o) noexcept;
  AtomicDir& operator=(AtomicDir&&) = delete;
  AtomicDir(const AtomicDir&) = delete;
  ~AtomicDir();

  const std::string& temp_path() const { return temp_path_; }
  const std::string& final_path() const { return final_path_; }
  Status commit();

 private:
  AtomicDir(std::string final_path, std::string temp_path)
      : final_path_(std::move(final_path)), temp_path_(std::move(temp_path)) {}
  std::string final_path_, temp_path_;
  bool done_ = false;
};

}  // namespace nibble::train
