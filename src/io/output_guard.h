// Guards for commands that write an output path, so that nothing a user owns is overwritten
// without being asked: whether two paths are the same file (device and inode, so hard links and
// symlinks count), whether a path lies inside (or is) a folder being read (real paths), and the
// removal of temporaries that killed writers left next to an output (`NAME.tmp.<pid>[.<n>]`,
// `NAME.old.<pid>`), only when their process is gone (or when the caller holds the run lock).
#pragma once

#include <string>

namespace nibble::io {

// True when `a` and `b` both exist and are the same file (same st_dev and st_ino).
bool same_file(const std::string& a, const std::string& b);

// `path` made absolute with symlinks resolved as far as it exists (std::filesystem::weakly_canonical).
std::string resolved_path(const std::string& path);

// True when `inner` resolves to `outer` or to a path below it.
bool path_within(const std::string& inner, const std::string& outer);

// True when a process with this pid exists (kill(pid, 0) succeeds or fails with EPERM).
bool process_alive(long pid);

// Removes the leftovers of killed atomic writes of `path` from its folder: entries named
// `<name>.tmp.<pid>`, `<name>.tmp.<pid>.<n>` or `<name>.old.<pid>` (files or folders) whose pid
// is not this process and, unless `any_pid`, is not a live process. Returns how many were removed.
int remove_stale_temporaries(const std::string& path, bool any_pid = false);

}  // namespace nibble::io
