#pragma once
// Per-tensor checksums (XXH3-64, header-only inline build) and the fused copy-and-hash used when
// packing tensors into segments. Two methods (manifest.hpp's checksum_method): XXH3-64 over the
// whole tensor, and the chunked form, which threads and GPU kernels compute in parallel: the
// XXH3-64 of each chunk_bytes chunk (the last may be shorter), then the XXH3-64 of those
// digests as little-endian 64-bit words. An empty tensor has no chunks.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/manifest/manifest.hpp"

namespace wsync {

/// XXH3-64 of a byte range (seed 0).
std::uint64_t checksum_compute(const void* data, std::size_t nbytes);

/// Copies nbytes from src to dst and returns checksum_compute(src, nbytes), reading src once:
/// each cache-sized block is hashed and then copied while it is still in cache.
std::uint64_t checksum_copy(void* dst, const void* src, std::size_t nbytes);

/// The instruction set the two above hash with: the widest this CPU runs ("avx512", "avx2",
/// else "sse2" on x86-64; "neon" on aarch64), or the one the environment variable
/// WSYNC_CHECKSUM_ISA names, where the CPU runs it (else a warning, and the widest). Every
/// set gives the same digests; only the speed differs.
std::string_view checksum_isa();

/// The name manifests use: "xxh3-64" or "xxh3-64-chunked"; and back (nullopt when unknown).
std::string_view checksum_algorithm_name(checksum_algorithm a);
std::optional<checksum_algorithm> checksum_algorithm_parse(std::string_view name);

/// Smallest and largest chunk of the chunked method (both powers of two).
inline constexpr std::uint64_t checksum_chunk_min = std::uint64_t{4} << 10;
inline constexpr std::uint64_t checksum_chunk_max = std::uint64_t{1} << 30;

/// Chunks of a tensor of `nbytes` under the chunked method.
inline std::uint64_t checksum_chunks(std::uint64_t nbytes, std::uint64_t chunk_bytes) {
  return nbytes == 0 ? 0 : (nbytes - 1) / chunk_bytes + 1;
}

/// The chunked method's final step: XXH3-64 of `count` chunk digests.
std::uint64_t checksum_of_chunks(const std::uint64_t* digests, std::size_t count);

/// The pieces tensors are hashed in under a method, numbered tensor by tensor: each whole tensor
/// (xxh3-64), or each chunk of each tensor (xxh3-64-chunked). Threads hash pieces in any order,
/// one digest each; fold() turns a tensor's digests into its checksum. The publisher's copy and
/// the consumer's verify share this plan.
class checksum_pieces {
 public:
  checksum_pieces(const std::vector<std::uint64_t>& tensor_bytes, const checksum_method& method);

  struct piece {
    std::size_t tensor = 0;
    std::uint64_t offset = 0;  ///< inside the tensor
    std::uint64_t nbytes = 0;
  };
  std::size_t size() const { return first_.back(); }
  piece at(std::size_t k) const;
  /// Tensor `tensor`'s checksum from `digests` (one per piece, indexed as at()).
  std::uint64_t fold(std::size_t tensor, const std::uint64_t* digests) const;

 private:
  std::vector<std::uint64_t> bytes_;
  std::vector<std::size_t> first_;  ///< tensor i's pieces: [first_[i], first_[i + 1])
  std::uint64_t chunk_ = 0;         ///< 0: whole tensors
};

/// The checksum of a byte range by `method`, in the calling thread.
std::uint64_t checksum_compute(const void* data, std::size_t nbytes, const checksum_method& method);

/// checksum_copy by `method`.
std::uint64_t checksum_copy(void* dst, const void* src, std::size_t nbytes,
                            const checksum_method& method);

/// XXH3's default 192-byte secret, for xxh3_parts.hpp (a GPU kernel copies it to the device).
const unsigned char* checksum_default_secret();

/// A checksum as 16 lower-case hex digits, as manifests and error messages show it.
std::string checksum_hex(std::uint64_t checksum);

}  // namespace wsync
