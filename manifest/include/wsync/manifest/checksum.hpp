#pragma once
// Per-tensor checksums (XXH3-64, header-only inline build) and the fused copy-and-hash used when
// packing tensors into segments.

#include <cstddef>
#include <cstdint>
#include <string>

namespace wsync {

/// XXH3-64 of a byte range (seed 0).
std::uint64_t checksum_compute(const void* data, std::size_t nbytes);

/// Copies nbytes from src to dst and returns checksum_compute(src, nbytes), reading src once:
/// each cache-sized block is hashed and then copied while it is still in cache.
std::uint64_t checksum_copy(void* dst, const void* src, std::size_t nbytes);

/// A checksum as 16 lower-case hex digits, as manifests and error messages show it.
std::string checksum_hex(std::uint64_t checksum);

}  // namespace wsync
