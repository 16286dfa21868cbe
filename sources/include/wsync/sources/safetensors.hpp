#pragma once
// Reads a .safetensors checkpoint (8-byte little-endian header length, JSON header, tensor
// bytes) by mapping it read-only: the tensors point into the mapping, nothing is copied.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/result.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {

/// Parses the bytes of a whole .safetensors file (`where` names it in errors): the tensors in
/// file order, pointing into `file`. Every offset is checked against the file; never throws.
result<std::vector<tensor_source>> safetensors_index(std::span<const std::byte> file,
                                                     const std::string& where);

class safetensors_file {
 public:
  /// Maps and parses `path`; a malformed file is errc::invalid_argument naming the tensor and
  /// field.
  static result<std::unique_ptr<safetensors_file>> open(const std::string& path);
  ~safetensors_file();
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;

  /// The tensors in file order; valid while this object lives.
  const std::vector<tensor_source>& tensors() const { return tensors_; }

 private:
  safetensors_file() = default;
  void* map_ = nullptr;
  std::uint64_t size_ = 0;
  std::vector<tensor_source> tensors_;
};

}  // namespace wsync
