// The TCP rendezvous of an env-launched world (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0
// listens, every other rank connects (retrying until the deadline: rank 0 may start later) and
// sends {rank, world size}; once all have arrived rank 0 answers each with a status byte and the
// payload (the NCCL unique id). Wire: little-endian i32 pairs and raw bytes. See process_group.h.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "dist/process_group.h"

namespace nibble::dist {

namespace {

using Clock = std::chrono::steady_clock;

struct Fd {
  int fd = -1;
  explicit Fd(int f = -1) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      if (fd >= 0) ::close(fd);
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int ms_left(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return ms > 0 ? static_cast<int>(std::min<long long>(ms, 1 << 30)) : 0;
}

// Waits for `events` on fd until the deadline: true when ready.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int rc = ::poll(&p, 1, ms_left(deadline));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) return false;
  }
}

Status send_all(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLOUT, deadline)) return io_error("rendezvous: timed out sending");
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return io_error("rendezvous: send failed: {}", std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
  return Status::ok();
}

Status recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) return io_error("rendezvous: timed out receiving");
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k == 0) return io_error("rendezvous: the peer closed the connection");
    if (k < 0) return io_error("rendezvous: receive failed: {}", std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
  return Status::ok();
}

Result<addrinfo*> resolve(const LaunchEnv& env, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(env.master_port);
  const int rc = ::getaddrinfo(passive ? nullptr : env.master_addr.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) return invalid_argument("MASTER_ADDR={}: {}", env.master_addr, gai_strerror(rc));
  return res;
}

Status serve(const LaunchEnv& env, void* bytes, int64_t n, Clock::time_point deadline) {
  NIB_ASSIGN_OR_RETURN(addrinfo * res, resolve(env, true));
  Fd listener;
  int last_errno = 0;
  for (addrinfo* a = res; a != nullptr && listener.fd < 0; a = a->ai_next) {
    Fd s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
    if (s.fd < 0) continue;
    int one = 1;
    ::setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(s.fd, 128) == 0) listener = std::move(s);
    else last_errno = errno;
  }
  ::freeaddrinfo(res);
  if (listener.fd < 0)
    return io_error("rendezvous: rank 0 cannot listen on port {}: {}", env.master_port, std::strerror(last_errno));
  std::vector<Fd> peers(static_cast<size_t>(env.world_size));
  int joined = 1;
  std::string error;
  while (joined < env.world_size) {
    if (!wait_fd(listener.fd, POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < env.world_size; ++r)
        if (peers[static_cast<size_t>(r)].fd < 0) {
          if (!missing.empty()) missing += ',';
          missing += std::to_string(r);
        }
      return io_error("rendezvous: timed out on port {} waiting for rank(s) {}", env.master_port, missing);
    }
    Fd c(::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
    if (c.fd < 0) continue;
    int32_t hello[2] = {0, 0};
    if (!recv_all(c.fd, hello, sizeof hello, deadline)) continue;
    const int r = hello[0];
    if (hello[1] != env.world_size && error.empty())
      error = fmt::format("rank {} was started with WORLD_SIZE={}, rank 0 with {}", r, hello[1], env.world_size);
    if (r <= 0 || r >= env.world_size || peers[static_cast<size_t>(r)].fd >= 0) {
      if (error.empty()) error = fmt::format("two processes claim RANK={} (or it is outside the world)", r);
      // still answer it below, so it fails with the message rather than a timeout
      const char bad = 1;
      const int32_t len = static_cast<int32_t>(error.size());
      (void)send_all(c.fd, &bad, 1, deadline);
      (void)send_all(c.fd, &len, sizeof len, deadline);
      (void)send_all(c.fd, error.data(), error.size(), deadline);
      continue;
    }
    peers[static_cast<size_t>(r)] = std::move(c);
    ++joined;
  }
  for (int r = 1; r < env.world_size; ++r) {
    const int fd = peers[static_cast<size_t>(r)].fd;
    const char ok = error.empty() ? 0 : 1;
    NIB_RETURN_IF_ERROR(send_all(fd, &ok, 1, deadline));
    if (ok == 0) {
      NIB_RETURN_IF_ERROR(send_all(fd, bytes, static_cast<size_t>(n), deadline));
    } else {
      const int32_t len = static_cast<int32_t>(error.size());
      NIB_RETURN_IF_ERROR(send_all(fd, &len, sizeof len, deadline));
      NIB_RETURN_IF_ERROR(send_all(fd, error.data(), error.size(), deadline));
    }
  }
  if (!error.empty()) return invalid_argument("rendezvous: {}", error);
  return Status::ok();
}

Status join(const LaunchEnv& env, void* bytes, int64_t n, Clock::time_point deadline) {
  std::string last = "no attempt";
  while (Clock::now() < deadline) {
    NIB_ASSIGN_OR_RETURN(addrinfo * res, resolve(env, false));
    Fd s;
    for (addrinfo* a = res; a != nullptr && s.fd < 0; a = a->ai_next) {
      Fd t(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (t.fd >= 0 && ::connect(t.fd, a->ai_addr, a->ai_addrlen) == 0) s = std::move(t);
      else last = std::strerror(errno);
    }
    ::freeaddrinfo(res);
    if (s.fd < 0) {  // rank 0 not listening yet
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      continue;
    }
    const int32_t hello[2] = {env.rank, env.world_size};
    NIB_RETURN_IF_ERROR(send_all(s.fd, hello, sizeof hello, deadline));
    char ok = 1;
    NIB_RETURN_IF_ERROR(recv_all(s.fd, &ok, 1, deadline));
    if (ok == 0) return recv_all(s.fd, bytes, static_cast<size_t>(n), deadline);
    int32_t len = 0;
    NIB_RETURN_IF_ERROR(recv_all(s.fd, &len, sizeof len, deadline));
    std::string msg(static_cast<size_t>(std::max<int32_t>(0, std::min<int32_t>(len, 4096))), '\0');
    NIB_RETURN_IF_ERROR(recv_all(s.fd, msg.data(), msg.size(), deadline));
    return invalid_argument("rendezvous: {}", msg);
  }
  return io_error("rendezvous: timed out reaching rank 0 at {}:{} ({})", env.master_addr, env.master_port, last);
}

}  // namespace

Status tcp_broadcast_from_rank0(const LaunchEnv& env, void* bytes, int64_t n, double timeout_s) {
  if (n < 0) return invalid_argument("rendezvous: negative size {}", n);
  if (env.world_size <= 1) return Status::ok();
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  return env.rank == 0 ? serve(env, bytes, n, deadline) : join(env, bytes, n, deadline);
}

}  // namespace nibble::dist
