#pragma once
// Minimal process-wide logging to stderr: one line per event, "wsync <level>: <text>".

#include <string_view>

namespace wsync {

enum class log_level { debug, info, warn, error, off };

/// Lines below `level` are dropped; the default is info.
void log_set_level(log_level level);
void log_write(log_level level, std::string_view text);
inline void log_info(std::string_view text) {
  log_write(log_level::info, text);
}
inline void log_warn(std::string_view text) {
  log_write(log_level::warn, text);
}
inline void log_error(std::string_view text) {
  log_write(log_level::error, text);
}

}  // namespace wsync
