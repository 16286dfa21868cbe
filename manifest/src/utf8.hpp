#pragma once
// One UTF-8 character, strictly (RFC 3629), and never a C1 control: what the manifest takes as
// text (validate.cpp) and what the log writes unescaped (log.cpp).

#include <cstddef>
#include <string_view>

namespace wsync::detail {

/// The length of the UTF-8 character at s[i] (a lead byte >= 0x80), or 0 where the bytes are
/// not one (an overlong form, a surrogate, past U+10FFFF, cut short) or are a C1 control
/// (U+0080..U+009F: U+009B opens an escape sequence as ESC [ does).
inline std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  // The lead byte gives the length and the range the second byte must fall in.
  std::size_t len = 0;
  unsigned char lo = 0x80, hi = 0xbf;
  if (c >= 0xc2 && c <= 0xdf) {
    len = 2;
    if (c == 0xc2) lo = 0xa0;  // the C1 controls
  } else if (c >= 0xe0 && c <= 0xef) {
    len = 3;
    if (c == 0xe0) lo = 0xa0;  // overlong
    if (c == 0xed) hi = 0x9f;  // surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    len = 4;
    if (c == 0xf0) lo = 0x90;  // overlong
    if (c == 0xf4) hi = 0x8f;  // past U+10FFFF
  } else {
    return 0;  // a continuation byte, an overlong lead (C0, C1) or F5..FF
  }
  if (i + len > s.size()) return 0;
  const auto second = static_cast<unsigned char>(s[i + 1]);
  if (second < lo || second > hi) return 0;
  for (std::size_t k = 2; k < len; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return 0;
  }
  return len;
}

}  // namespace wsync::detail
