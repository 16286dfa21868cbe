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

struct stat;

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

  /// Whether the file at the path is still the one mapped, untouched (same inode, size and
  /// modification time). The mapping shows a rewrite as it happens: a version copied meanwhile
  /// mixes two checkpoints under checksums that match, and a truncation faults. So a publisher
  /// asks before and after each version and stops on a change, naming the path.
  result<void> unchanged() const;

 private:
  safetensors_file() = default;
  std::string path_;
  struct identity {
    std::uint64_t dev = 0, ino = 0, size = 0;
    std::int64_t mtime_s = 0, mtime_ns = 0;
    bool operator==(const identity&) const = default;
  } identity_;
  static identity identity_of(const struct ::stat& st);
  void* map_ = nullptr;
  std::uint64_t size_ = 0;
  std::vector<tensor_source> tensors_;
};

}  // namespace wsync
