#pragma once
// Reproducible pseudo-random bytes for tests (xorshift64): the same seed gives the same bytes on
// every machine, so a failing size or offset can be replayed.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace wsync::test {

inline std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::vector<unsigned char> v(n);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& b : v) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    b = static_cast<unsigned char>(x >> 24);
  }
  return v;
}

}  // namespace wsync::test
