#include "wsync/manifest/log.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>

namespace wsync {
namespace {
std::atomic<log_level> threshold{log_level::info};

// The length of the UTF-8 character at text[i] (lead byte c >= 0x80), or 0 where the bytes are
// not one, or are a C1 control (U+0080..U+009F: U+009B opens an escape sequence as ESC [ does).
std::size_t utf8_length(std::string_view text, std::size_t i) {
  const auto c = static_cast<unsigned char>(text[i]);
  std::size_t len = 0;
  unsigned char lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
    if (c == 0xc2) lo = 0xa0;
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;
    if (c == 0xed) hi = 0x9f;
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;
    if (c == 0xf4) hi = 0x8f;
  } else {
    return 0;
  }
  if (i + len > text.size()) return 0;
  const auto second = static_cast<unsigned char>(text[i + 1]);
  if (second < lo || second > hi) return 0;
  for (std::size_t k = 2; k < len; ++k) {
    if ((static_cast<unsigned char>(text[i + k]) >> 6) != 2) return 0;
  }
  return len;
}

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
    } else if (std::size_t len = c >= 0x80 ? utf8_length(text, taken) : 0; len > 0) {
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
