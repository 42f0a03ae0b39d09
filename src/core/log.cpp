// Logging setup (see log.h).
#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace nibble {

void init_logging(bool verbose, bool quiet) {
  auto logger = spdlog::stderr_color_mt("nibble");
  logger->set_pattern("[nibble] %^%l%$: %v");
  logger->set_level(quiet ? spdlog::level::warn : verbose ? spdlog::level::debug : spdlog::level::info);
  spdlog::set_default_logger(logger);
}

}  // namespace nibble
