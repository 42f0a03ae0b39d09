// The `nibble` CLI's command registry. Each command lives in its own file (cmd_<name>.cpp) and
// registers itself with NIBBLE_REGISTER_COMMAND; main.cpp builds one CLI11 app from all of
// them. A command's `setup` adds its options to the subcommand and returns the function that
// runs it; that function returns the process exit code and reports errors as one line.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/status.h"

namespace nibble::tools {

using CommandRun = std::function<int()>;

struct Command {
  std::string name;
  std::string summary;
  // Adds options to `app` (the subcommand); returns what runs it once parsed.
  std::function<CommandRun(CLI::App& app)> setup;
};

std::vector<Command>& command_registry();

struct CommandRegistrar {
  explicit CommandRegistrar(Command c) { command_registry().push_back(std::move(c)); }
};

// Prints "nibble <command>: <message>" on stderr and returns the exit code for it: 2 for
// kInvalidArgument (a bad command line or config value), 1 for every other code (a missing,
// unreadable or malformed input, a failed write; docs/cli.md "Exit codes"); 128 + signal once
// SIGINT/SIGTERM was received (core/interrupt.h).
int report_error(const std::string& command, const Status& status);

}  // namespace nibble::tools

#define NIBBLE_REGISTER_COMMAND(var, ...) \
  static const ::nibble::tools::CommandRegistrar var{::nibble::tools::Command{__VA_ARGS__}}
