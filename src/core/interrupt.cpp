// The SIGINT/SIGTERM flag of interrupt.h: a sigaction handler that stores the first signal in a
// lock-free atomic int, ignores repeats within kRepeatGraceNs (the same signal sent to the process
// and to its process group, as GNU timeout, Slurm and mpirun do) and ends the process at a repeat
// after that (a second Ctrl-C), with the signal's default action.
#include "core/interrupt.h"

#include <atomic>
#include <csignal>
#include <ctime>

namespace nibble {

namespace {

std::atomic<int> g_signal{0};
std::atomic<long long> g_first_ns{0};  // CLOCK_MONOTONIC of the recorded signal
static_assert(std::atomic<int>::is_always_lock_free, "the signal flag must be lock-free (async-signal-safe)");
static_assert(std::atomic<long long>::is_always_lock_free, "the signal time must be lock-free (async-signal-safe)");

constexpr long long kRepeatGraceNs = 1'000'000'000;  // 1 s: one delivery fanned out, not a user's second Ctrl-C

long long monotonic_ns() {  // clock_gettime is async-signal-safe (POSIX.1-2008)
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<long long>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void record_interrupt(int sig) {
  const long long now = monotonic_ns();
  if (g_signal.load(std::memory_order_relaxed) == 0) {
    g_first_ns.store(now, std::memory_order_relaxed);
    g_signal.store(sig, std::memory_order_relaxed);
    return;
  }
  if (now - g_first_ns.load(std::memory_order_relaxed) < kRepeatGraceNs) return;  // the same stop, delivered twice
  signal(sig, SIG_DFL);  // a deliberate second signal: end now, as the default action does
  raise(sig);
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa {};
  sa.sa_handler = record_interrupt;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);  // one handler at a time: the two signals never interleave
  sigaddset(&sa.sa_mask, SIGTERM);
  sa.sa_flags = SA_RESTART;  // writes to a terminal or pipe are resumed, not failed with EINTR
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int interrupt_signal() { return g_signal.load(std::memory_order_relaxed); }

void clear_interrupt() { g_signal.store(0, std::memory_order_relaxed); }

std::string signal_name(int sig) {
  if (sig == SIGINT) return "SIGINT";
  if (sig == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(sig);
}

Status cancelled_status(const std::string& what) {
  return Status(StatusCode::kInternal, "interrupted by " + signal_name(interrupt_signal()) + " " + what);
}

int interrupt_exit_code() {
  const int sig = interrupt_signal();
  return 128 + (sig > 0 ? sig : SIGINT);
}

}  // namespace nibble
