#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync {

/// Limits a manifest must respect; the defaults refuse absurd sizes early.
struct manifest_limits {
  std::uint64_t max_total_bytes = std::uint64_t{1} << 42;  ///< 4 TiB
  std::uint64_t max_tensors = 1u << 20;
  std::uint64_t max_rank = 1u << 24;
  std::uint64_t max_name_bytes = 1024;
  std::uint64_t max_dims = 16;
  std::uint64_t max_handle_bytes = 1u << 20;
};

/// Checks every field and every cross-field rule. On failure the error is errc::invalid_manifest
/// with "invalid manifest: <field>: <why> (update_id=... rank=...)". `known_transport` decides
/// which transport names are accepted; nullptr accepts any non-empty name.
result<void> manifest_validate(const weight_update_manifest& m,
                               bool (*known_transport)(std::string_view) = nullptr,
                               const manifest_limits& limits = {});

/// Bytes a tensor spans given shape, strides and itemsize: (sum (dim-1)*stride + 1) * itemsize,
/// or 0 for an empty tensor. False if it overflows 64 bits.
bool tensor_span_bytes(const tensor_descriptor& t, std::uint64_t& out);

/// Number of elements, false on negative dimension or overflow.
bool tensor_element_count(const tensor_descriptor& t, std::uint64_t& out);

/// The names seen so far, for duplicate checks over the tensors of a manifest or an update: one
/// open-addressed table of views, so checking N names costs no allocation per name (every rank
/// of a process checks every update). The names must outlive the set.
class name_set {
 public:
  explicit name_set(std::size_t expected = 0);
  /// False if `name` is already in the set.
  bool insert(std::string_view name);
  bool contains(std::string_view name) const;

 private:
  std::size_t find(std::string_view name) const;
  void grow();
  std::vector<std::string_view> slots_;  ///< a default view (null data) marks a free slot
  std::size_t size_ = 0;
};

}  // namespace wsync
