#include "wsync/manifest/log.hpp"

#include <atomic>
#include <cstdio>
#include <string>

namespace wsync {
namespace {
std::atomic<log_level> threshold{log_level::info};
}

void log_set_level(log_level level) {
  threshold.store(level);
}

void log_write(log_level level, std::string_view text) {
  if (level < threshold.load(std::memory_order_relaxed)) return;
  static constexpr const char* names[] = {"debug", "info", "warn", "error", "off"};
  // One fputs per line so lines from several threads do not interleave.
  std::string line = std::string("wsync ") + names[static_cast<int>(level)] + ": ";
  line.append(text);
  line.push_back('\n');
  std::fputs(line.c_str(), stderr);
}

}  // namespace wsync
