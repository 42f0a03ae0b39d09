// The SIGINT/SIGTERM flag of interrupt.h: sigaction with SA_RESETHAND, a lock-free atomic int.
#include "core/interrupt.h"

#include <atomic>
#include <csignal>

namespace nibble {

namespace {

std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal flag must be lock-free (async-signal-safe)");

void record_interrupt(int sig) { g_signal.store(sig, std::memory_order_relaxed); }

}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa {};
  sa.sa_handler = record_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | SA_RESTART;  // writes to a terminal or pipe are resumed, not failed with EINTR
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
