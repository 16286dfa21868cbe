#include "wsync/manifest/log.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

#include "src/utf8.hpp"

namespace wsync {
namespace {
std::atomic<log_level> threshold{log_level::info};
}  // namespace

void log_set_level(log_level level) {
  threshold.store(level);
}

void log_write(log_level level, std::string_view text) {
  if (level < threshold.load(std::memory_order_relaxed)) return;
  static constexpr const char* names[] = {"debug", "info", "warn", "error", "off"};
  // One fputs per line so lines from several threads do not interleave. One event is one line,
  // whatever the text holds: texts quote what peers sent (keys, states, reasons), and a newline
  // or a terminal escape there would forge lines or rewrite the terminal. Control bytes (C0,
  // DEL, C1) and bytes that are not UTF-8 are written as \xNN, and a line past 8 KiB is cut,
  // saying so.
  constexpr std::size_t most = 8192;
  std::string line = std::string("wsync ") + names[static_cast<int>(level)] + ": ";
  line.reserve(line.size() + std::min(text.size(), most) + 32);
  std::size_t taken = 0;
  for (; taken < text.size() && taken < most; ++taken) {
    const auto c = static_cast<unsigned char>(text[taken]);
    if (c >= 0x20 && c < 0x7f) {
      line.push_back(static_cast<char>(c));
    } else if (std::size_t len = c >= 0x80 ? detail::utf8_length(text, taken) : 0; len > 0) {
      line.append(text.substr(taken, len));
      taken += len - 1;
    } else if (c == '\t') {
      line.push_back(' ');
    } else {
      static constexpr char hex[] = "0123456789abcdef";
      line += "\\x";
      line.push_back(hex[c >> 4]);
      line.push_back(hex[c & 15]);
    }
  }
  if (taken < text.size()) {
    line += " ... (" + std::to_string(text.size() - taken) + " more bytes not logged)";
  }
  line.push_back('\n');
  std::fputs(line.c_str(), stderr);
}

}  // namespace wsync
