#pragma once
// Test tensors whose every 8-byte word encodes (version, tensor index), so a reader can tell
// exactly which version each tensor came from and spot a torn model.

#include <cstdint>
#include <string>
#include <vector>

#include "wsync/transports/weight_publisher.hpp"

namespace wsync::test {

inline std::uint64_t pattern_word(std::uint64_t version, std::size_t tensor) {
  return version * 0x9e3779b97f4a7c15ull ^ (tensor + 1);
}

class pattern_tensors {
 public:
  pattern_tensors(std::size_t count, std::size_t words_each)
      : storage_(count, std::vector<std::uint64_t>(words_each)) {
    for (std::size_t i = 0; i < count; ++i) {
      sources_.push_back({"model.layers." + std::to_string(i) + ".weight",
                          dtype::i64,
                          {static_cast<std::int64_t>(words_each)},
                          {},
                          reinterpret_cast<const std::byte*>(storage_[i].data()),
                          words_each * sizeof(std::uint64_t)});
    }
  }

  /// Rewrites every tensor with the pattern of `version`.
  const std::vector<tensor_source>& fill(std::uint64_t version) {
    for (std::size_t i = 0; i < storage_.size(); ++i) {
      for (auto& w : storage_[i]) w = pattern_word(version, i);
    }
    return sources_;
  }

  const std::vector<tensor_source>& sources() const { return sources_; }

 private:
  std::vector<std::vector<std::uint64_t>> storage_;
  std::vector<tensor_source> sources_;
};

/// Number of words in `data` that do not carry the pattern of (version, tensor).
inline std::size_t pattern_mismatches(const std::byte* data, std::uint64_t nbytes,
                                      std::uint64_t version, std::size_t tensor) {
  std::size_t bad = 0;
  const auto want = pattern_word(version, tensor);
  for (std::uint64_t off = 0; off + 8 <= nbytes; off += 8) {
    std::uint64_t w;
    __builtin_memcpy(&w, data + off, 8);
    bad += w != want;
  }
  return bad;
}

}  // namespace wsync::test
