// open_regular_file and friends (see regular_file.h): open(O_RDONLY | O_NONBLOCK | O_CLOEXEC),
// fstat, refuse anything but S_ISREG, clear O_NONBLOCK, read with EINTR retries.
#include "io/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace nibble::io {

RegularFile& RegularFile::operator=(RegularFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    size_ = other.size_;
    other.fd_ = -1;
  }
  return *this;
}

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string_view file_kind_name(unsigned mode) {
  if (S_ISREG(mode)) return "regular file";
  if (S_ISFIFO(mode)) return "named pipe (FIFO)";
  if (S_ISDIR(mode)) return "directory";
  if (S_ISCHR(mode)) return "character device";
  if (S_ISBLK(mode)) return "block device";
  if (S_ISSOCK(mode)) return "socket";
  if (S_ISLNK(mode)) return "symbolic link";
  return "special file";
}

namespace {

std::string label(std::string_view what) { return what.empty() ? std::string("file") : std::string(what); }

Status not_regular(const std::string& path, std::string_view what, unsigned mode) {
  return io_error("{} '{}' is a {}, not a regular file", label(what), path, file_kind_name(mode));
}

Status open_failed(const std::string& path, std::string_view what, int err) {
  if (err == ENOENT) return not_found("{} '{}' does not exist", label(what), path);
  // A socket cannot be open()ed (ENXIO): say what it is when stat can tell.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) return not_regular(path, what, st.st_mode);
  return io_error("{} '{}': cannot open: {}", label(what), path, std::strerror(err));
}

}  // namespace

Result<RegularFile> open_regular_file(const std::string& path, std::string_view what) {
  // O_NONBLOCK: opening a FIFO for reading returns at once instead of waiting for a writer.
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return open_failed(path, what, errno);
  RegularFile f;
  f.fd_ = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0) return io_error("{} '{}': cannot stat: {}", label(what), path, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) return not_regular(path, what, st.st_mode);
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
    return io_error("{} '{}': cannot set blocking reads: {}", label(what), path, std::strerror(errno));
  f.size_ = static_cast<uint64_t>(st.st_size);
  return f;
}

Status check_regular_file(const std::string& path, std::string_view what) {
  return open_regular_file(path, what).status();
}

Result<std::string> read_regular_file(const std::string& path, std::string_view what, uint64_t max_bytes) {
  NIB_ASSIGN_OR_RETURN(RegularFile f, open_regular_file(path, what));
  if (f.size() > max_bytes)
    return io_error("{} '{}' has {} bytes, more than the limit of {}", label(what), path, f.size(), max_bytes);
  std::string out;
  out.reserve(static_cast<size_t>(f.size()));
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(f.fd(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return io_error("{} '{}': read error: {}", label(what), path, std::strerror(errno));
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_bytes)
      return io_error("{} '{}' has more than the limit of {} bytes", label(what), path, max_bytes);
  }
  return out;
}

}  // namespace nibble::io
