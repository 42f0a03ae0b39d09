// SIGINT/SIGTERM as a polled flag. install_interrupt_handlers() makes the first such signal only
// record its number (a lock-free atomic store, async-signal-safe). A repeat within one second is
// the same stop delivered twice (GNU timeout, Slurm and mpirun signal the process and its process
// group) and is ignored; a repeat after that (a second Ctrl-C) ends the process at once with the
// signal's default action. Commands that write check
// interrupt_signal() at safe points of their loops, stop, let their temporaries be removed and
// return cancelled_status(); the CLI, seeing a failure after a signal, exits 128 + signal (130 for
// SIGINT, 143 for SIGTERM).
#pragma once

#include <string>

#include "core/status.h"

namespace nibble {

// Installs the flag-setting handler for SIGINT and SIGTERM (idempotent; re-arms after a signal).
void install_interrupt_handlers();

// The signal received since the handlers were installed (SIGINT or SIGTERM), or 0.
int interrupt_signal();

// Forgets a received signal (tests that raise one and continue).
void clear_interrupt();

// "SIGINT" / "SIGTERM" / "signal N".
std::string signal_name(int sig);

// The status of work stopped by a signal: "interrupted by SIGINT <what>".
Status cancelled_status(const std::string& what);

// The exit code for an interrupted command: 128 + the signal (130 when none was recorded).
int interrupt_exit_code();

}  // namespace nibble
