// The multi-process subcommands of `nibble bench` (cmd_bench_dist.cpp): `bench collectives` and
// `bench weight-sync`, added to the bench command by cmd_bench.cpp's setup.
#pragma once

#include "tools/command.h"

namespace nibble::tools {

// Adds `collectives` and `weight-sync` to `bench`; the returned function runs the one parsed, or
// returns -1 when neither was.
CommandRun setup_dist_benches(CLI::App& bench);

}  // namespace nibble::tools
