// Logging: spdlog's default logger to stderr, with nibble's format ("[nibble] level: msg").
// Library code logs progress and warnings here; errors go back to the caller as Status.
#pragma once

#include <spdlog/spdlog.h>

namespace nibble {

void init_logging(bool verbose = false, bool quiet = false);

}  // namespace nibble

#define NIB_LOG_INFO(...) ::spdlog::info(__VA_ARGS__)
#define NIB_LOG_WARN(...) ::spdlog::warn(__VA_ARGS__)
#define NIB_LOG_DEBUG(...) ::spdlog::debug(__VA_ARGS__)
#define NIB_LOG_ERROR(...) ::spdlog::error(__VA_ARGS__)
