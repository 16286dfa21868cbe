#pragma once
// A JSON lexer for plain text, feeding a SAX handler as nlohmann::json::sax_parse would: the
// manifest decoder's first path (codec.cpp). Private to the manifest library.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

namespace wsync::detail {

// How plain_parse ended.
enum class plain_result {
  accepted,  ///< the whole text, every event taken by the handler
  refused,   ///< the handler said no to an event: nlohmann's lexer would give it the same ones
  other,     ///< the text left the plain subset (or is not JSON): for nlohmann's lexer to judge
};

// A JSON lexer for the text manifest_to_json writes, feeding a SAX handler as
// nlohmann::json::sax_parse would: objects, arrays, non-negative and negative integers, and
// strings of printable ASCII without escapes. Anything else (an escape, a byte above 0x7f, a
// fraction, an exponent, a leading zero, -0, true/false/null, nesting past 16) is `other`,
// and the caller hands the text to nlohmann's lexer, which reads all of JSON. nlohmann's lexer
// reads a character at a time through an iterator and builds each string a byte at a time:
// about 0.5 ms for 290 tensors, on every hop.
template <class Handler>
plain_result plain_parse(std::string_view text, Handler& h) {
  const char* p = text.data();
  const char* const end = p + text.size();
  char open[16];  // '{' or '[' per level
  int depth = 0;
  bool opened = false;  // the last value opened a container: no comma before its first member
  std::string s;
  auto skip_space = [&] {
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) ++p;
  };
  // A string at p (its opening quote) into s.
  auto string = [&] {
    const char* q = ++p;
    for (; q < end; ++q) {
      const auto c = static_cast<unsigned char>(*q);
      if (c == '"') break;
      if (c == '\\' || c < 0x20 || c >= 0x80) return false;
    }
    if (q == end) return false;
    s.assign(p, q);
    p = q + 1;
    return true;
  };
  auto digit = [&](const char* at) {
    return at < end && *at >= '0' && *at <= '9';
  };
  // One value's start at p; containers are opened here and closed in the loop below.
  auto value = [&]() -> plain_result {
    if (p == end) return plain_result::other;
    switch (*p) {
      case '{':
      case '[': {
        if (depth == static_cast<int>(sizeof open)) return plain_result::other;
        const bool object = *p == '{';
        if (!(object ? h.start_object(std::size_t(-1)) : h.start_array(std::size_t(-1)))) {
          return plain_result::refused;
        }
        open[depth++] = *p++;
        opened = true;
        return plain_result::accepted;
      }
      case '"':
        if (!string()) return plain_result::other;
        return h.string(s) ? plain_result::accepted : plain_result::refused;
      default: {
        const bool negative = *p == '-';
        if (negative) ++p;
        if (!digit(p) || (*p == '0' && (negative || digit(p + 1)))) return plain_result::other;
        std::uint64_t v = 0;
        for (; digit(p); ++p) {
          if (__builtin_mul_overflow(v, 10, &v) ||
              __builtin_add_overflow(v, static_cast<std::uint64_t>(*p - '0'), &v)) {
            return plain_result::other;  // nlohmann makes it a float
          }
        }
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E')) return plain_result::other;
        if (!negative) return h.number_unsigned(v) ? plain_result::accepted : plain_result::refused;
        constexpr auto lowest = std::uint64_t{1} << 63;
        if (v > lowest) return plain_result::other;
        const auto n =
            v == lowest ? std::numeric_limits<std::int64_t>::min() : -static_cast<std::int64_t>(v);
        return h.number_integer(n) ? plain_result::accepted : plain_result::refused;
      }
    }
  };
  // An object's key and colon, at p; the value follows.
  auto key = [&]() -> plain_result {
    if (p == end || *p != '"' || !string()) return plain_result::other;
    if (!h.key(s)) return plain_result::refused;
    skip_space();
    if (p == end || *p != ':') return plain_result::other;
    ++p;
    skip_space();
    return plain_result::accepted;
  };

  skip_space();
  bool want_value = true;
  for (;;) {
    if (want_value) {
      if (auto r = value(); r != plain_result::accepted) return r;
      want_value = false;
    }
    skip_space();
    if (depth == 0) return p == end ? plain_result::accepted : plain_result::other;
    if (p == end) return plain_result::other;
    const char top = open[depth - 1];
    if (*p == (top == '{' ? '}' : ']')) {
      ++p;
      --depth;
      if (!(top == '{' ? h.end_object() : h.end_array())) return plain_result::refused;
      opened = false;
      continue;
    }
    if (opened) {  // the first member: no comma before it
      opened = false;
    } else {
      if (*p != ',') return plain_result::other;
      ++p;
      skip_space();
    }
    if (top == '{') {
      if (auto r = key(); r != plain_result::accepted) return r;
    }
    want_value = true;
  }
}

}  // namespace wsync::detail
