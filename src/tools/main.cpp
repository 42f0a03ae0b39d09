// `nibble`: the command line entry point. Collects the registered commands (command.h), parses
// with CLI11, runs the chosen one, and turns any escaped exception into one line on stderr and
// a non-zero exit (the library reports recoverable errors as Status; see core/status.h). Exit
// codes: 2 for a bad command line (CLI11 errors, unknown commands), else the command's own.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <new>
#include <string>

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

namespace {

// What is wrong with the command words of argv[first..] under `app`: the first word that is not
// an option and names none of `app`'s subcommands (`word`), or no word where one is needed
// (`missing`). `app`s that take subcommands have only flags, so no option value can sit between.
struct CommandWords {
  CLI::App* parent = nullptr;  // the app whose subcommand is unknown or missing
  std::string path;            // the command words before it, each followed by a space
  std::string word;            // the unknown word
  bool missing = false;
};

CommandWords check_command_words(CLI::App& app, int argc, char** argv, int first, std::string path) {
  if (app.get_subcommands({}).empty()) return {};
  for (int i = first; i < argc; ++i) {
    const std::string word = argv[i];
    if (word == "--help" || word == "-h" || word == "--version") return {};  // CLI11 answers these
    if (word.empty() || word[0] == '-') continue;
    CLI::App* sub = nullptr;
    for (CLI::App* s : app.get_subcommands({}))
      if (s->check_name(word)) sub = s;
    if (sub == nullptr) return {&app, path, word, false};
    return check_command_words(*sub, argc, argv, i + 1, path + word + " ");
  }
  return {&app, path, "", true};
}

std::string subcommand_names(CLI::App& app) {
  std::string names;
  for (CLI::App* s : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + s->get_name();
  return names;
}

}  // namespace

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
  // `nibble frobnicate`: name the word and list the commands (CLI11 would say "A subcommand is
  // required", or take the word for an extra argument); `nibble` alone: list them too.
  if (CommandWords cw = check_command_words(app, argc, argv, 1, ""); cw.parent != nullptr) {
    const std::string names = subcommand_names(*cw.parent);
    if (cw.missing) {
      std::fprintf(stderr, "nibble: a %scommand is required (commands: %s; see nibble %s--help)\n", cw.path.c_str(),
                   names.c_str(), cw.path.c_str());
    } else {
      std::fprintf(stderr, "nibble: unknown %scommand '%s' (commands: %s; see nibble %s--help)\n", cw.path.c_str(),
                   cw.word.c_str(), names.c_str(), cw.path.c_str());
    }
    return 2;
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
    } catch (const std::bad_alloc&) {
      std::fprintf(stderr, "nibble %s: out of memory\n", sub->get_name().c_str());
      return 1;
    } catch (const std::exception& e) {
      // A failed op (a CUDA error or out-of-memory names the op, its shapes and the device) stays
      // one line on stderr.
      std::string what = e.what();
      for (char& c : what)
        if (c == '\n' || c == '\r') c = ' ';
      std::fprintf(stderr, "nibble %s: %s\n", sub->get_name().c_str(), what.c_str());
      return 1;
    }
  }
  return 2;
}
