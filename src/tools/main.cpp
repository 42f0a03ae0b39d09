// `nibble`: the command line entry point. Collects the registered commands (command.h), parses
// with CLI11, runs the chosen one, and turns any escaped exception into one line on stderr and
// a non-zero exit (the library reports recoverable errors as Status; see core/status.h).
#include <algorithm>
#include <cstdio>
#include <exception>

#include "core/interrupt.h"
#include "core/log.h"
#include "tools/command.h"

namespace nibble::tools {

std::vector<Command>& command_registry() {
  static std::vector<Command> commands;
  return commands;
}

int report_error(const std::string& command, const Status& status) {
  std::fprintf(stderr, "nibble %s: %s\n", command.c_str(), status.message().c_str());
  if (interrupt_signal() != 0) return interrupt_exit_code();  // stopped by SIGINT/SIGTERM: 130/143
  return status.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace nibble::tools

int main(int argc, char** argv) {
  using namespace nibble::tools;
  CLI::App app{"nibble: 4-bit (NVFP4/MXFP4) LLM training and RL rollouts, CPU and CUDA", "nibble"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "nibble 0.1.0");
  bool verbose = false, quiet = false;
  app.add_flag("-v,--verbose", verbose, "More log output");
  app.add_flag("-q,--quiet", quiet, "Only warnings and errors");

  auto& commands = command_registry();
  std::sort(commands.begin(), commands.end(), [](const Command& a, const Command& b) { return a.name < b.name; });
  std::vector<std::pair<CLI::App*, CommandRun>> runs;
  for (auto& c : commands) {
    CLI::App* sub = app.add_subcommand(c.name, c.summary);
    runs.emplace_back(sub, c.setup(*sub));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
    std::fprintf(stderr, "nibble: %s (see nibble --help)\n", e.what());
    return 2;
  }
  nibble::init_logging(verbose, quiet);
  for (auto& [sub, run] : runs) {
    if (!sub->parsed()) continue;
    try {
      return run();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "nibble %s: %s\n", sub->get_name().c_str(), e.what());
      return 1;
    }
  }
  return 2;
}
