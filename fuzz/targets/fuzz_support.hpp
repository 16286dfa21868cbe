#pragma once
// What the fuzz targets share: the property check that turns a broken promise into a crash
// libFuzzer records, and splitting one input into the several texts a target feeds.

#include <cstdio>
#include <cstdlib>
#include <string_view>
#include <vector>

namespace wsync::fuzz {

/// A promise the code under test broke: print it and abort, so the fuzzer keeps the input.
inline void expect(bool ok, const char* promise) {
  if (ok) return;
  std::fprintf(stderr, "fuzz: broken promise: %s\n", promise);
  std::abort();
}

/// `input` cut at every `separator`; a target that calls several decoders gives each a part.
inline std::vector<std::string_view> split(std::string_view input, char separator) {
  std::vector<std::string_view> parts;
  while (true) {
    auto at = input.find(separator);
    parts.push_back(input.substr(0, at));
    if (at == std::string_view::npos) return parts;
    input.remove_prefix(at + 1);
  }
}

/// The bytes libFuzzer hands over, as text.
inline std::string_view text(const unsigned char* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace wsync::fuzz
