// Output-path guards and stale-temporary removal (see output_guard.h).
#include "io/output_guard.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>
#include <vector>

namespace nibble::io {

namespace fs = std::filesystem;

namespace {

// The non-empty components of a resolved path ("/a/b/" -> {"/", "a", "b"}).
std::vector<std::string> components(const std::string& path) {
  std::vector<std::string> out;
  for (const auto& c : fs::path(resolved_path(path)))
    if (!c.empty()) out.push_back(c.string());
  return out;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// The pid of a `<base>.tmp.<pid>[.<n>]` / `<base>.old.<pid>` name, or -1.
long temporary_pid(const std::string& name, const std::string& base) {
  if (name.size() <= base.size() + 5 || name.compare(0, base.size(), base) != 0) return -1;
  std::string rest = name.substr(base.size());
  bool old = rest.rfind(".old.", 0) == 0;
  if (!old && rest.rfind(".tmp.", 0) != 0) return -1;
  rest = rest.substr(5);
  std::string pid = rest, counter;
  if (auto dot = rest.find('.'); dot != std::string::npos) {
    if (old) return -1;
    pid = rest.substr(0, dot);
    counter = rest.substr(dot + 1);
    if (!all_digits(counter)) return -1;
  }
  if (!all_digits(pid) || pid.size() > 9) return -1;
  return std::stol(pid);
}

}  // namespace

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

std::string resolved_path(const std::string& path) {
  std::error_code ec;
  fs::path abs = fs::absolute(path.empty() ? fs::path(".") : fs::path(path), ec);
  if (ec) return path;
  fs::path r = fs::weakly_canonical(abs, ec);
  return (ec ? abs.lexically_normal() : r).string();
}

bool path_within(const std::string& inner, const std::string& outer) {
  const std::vector<std::string> in = components(inner), out = components(outer);
  if (out.size() > in.size()) return false;
  for (size_t i = 0; i < out.size(); ++i)
    if (in[i] != out[i]) return false;
  return true;
}

bool process_alive(long pid) {
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

int remove_stale_temporaries(const std::string& path, bool any_pid) {
  std::string trimmed = path;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const fs::path p(trimmed);
  const std::string base = p.filename().string();
  if (base.empty() || base == "." || base == "..") return 0;
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  const long mine = static_cast<long>(::getpid());
  std::error_code ec;
  std::vector<fs::path> stale;  // collected first: no removal while the folder is being listed
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const long pid = temporary_pid(it->path().filename().string(), base);
    if (pid < 0 || pid == mine) continue;
    if (any_pid || !process_alive(pid)) stale.push_back(it->path());
  }
  int removed = 0;
  for (const fs::path& s : stale) {
    fs::remove_all(s, ec);
    if (!ec) ++removed;
  }
  return removed;
}

}  // namespace nibble::io
