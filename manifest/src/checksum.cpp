#include "wsync/manifest/checksum.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace wsync {
namespace {

// Hash and copy in blocks that stay in L2 between the two passes, so the source is read from
// memory once.
constexpr std::size_t block_bytes = 128 * 1024;

// Copies a cache-hot block with streaming stores: the destination lines are written without
// being read first (a plain store reads each line for ownership, one more pass over memory).
void copy_block(unsigned char* dst, const unsigned char* src, std::size_t n) {
#if defined(__x86_64__)
  if ((reinterpret_cast<std::uintptr_t>(dst) & 15) == 0) {
    std::size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    if (i < n) std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace

std::string checksum_hex(std::uint64_t checksum) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, checksum >>= 4)
    s[static_cast<std::size_t>(i)] = digits[checksum & 15];
  return s;
}

std::uint64_t checksum_compute(const void* data, std::size_t nbytes) {
  return XXH3_64bits(data, nbytes);
}

std::uint64_t checksum_copy(void* dst, const void* src, std::size_t nbytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  if (nbytes <= block_bytes) {
    std::uint64_t h = XXH3_64bits(s, nbytes);
    if (nbytes > 0) std::memcpy(d, s, nbytes);  // an empty tensor may have no storage at all
    return h;
  }
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (std::size_t off = 0; off < nbytes; off += block_bytes) {
    std::size_t n = nbytes - off < block_bytes ? nbytes - off : block_bytes;
    XXH3_64bits_update(&state, s + off, n);
    copy_block(d + off, s + off, n);
  }
#if defined(__x86_64__)
  _mm_sfence();  // streaming stores are weakly ordered; publish only after they are visible
#endif
  return XXH3_64bits_digest(&state);
}

std::string_view checksum_algorithm_name(checksum_algorithm a) {
  return a == checksum_algorithm::xxh3_64_chunked ? "xxh3-64-chunked" : "xxh3-64";
}

std::optional<checksum_algorithm> checksum_algorithm_parse(std::string_view name) {
  if (name == "xxh3-64") return checksum_algorithm::xxh3_64;
  if (name == "xxh3-64-chunked") return checksum_algorithm::xxh3_64_chunked;
  return std::nullopt;
}

std::uint64_t checksum_of_chunks(const std::uint64_t* digests, std::size_t count) {
  static_assert(std::endian::native == std::endian::little, "digests hash as little-endian words");
  return XXH3_64bits(digests, count * sizeof(std::uint64_t));
}

checksum_pieces::checksum_pieces(const std::vector<std::uint64_t>& tensor_bytes,
                                 const checksum_method& method)
    : bytes_(tensor_bytes),
      first_(tensor_bytes.size() + 1, 0),
      chunk_(method.algorithm == checksum_algorithm::xxh3_64_chunked ? method.chunk_bytes : 0) {
  for (std::size_t i = 0; i < bytes_.size(); ++i) {
    first_[i + 1] = first_[i] + (chunk_ ? checksum_chunks(bytes_[i], chunk_) : 1);
  }
}

checksum_pieces::piece checksum_pieces::at(std::size_t k) const {
  if (!chunk_) return {k, 0, bytes_[k]};
  // The tensor of piece k: the last whose first piece is at or before k (empty tensors have none).
  const auto i =
      static_cast<std::size_t>(std::upper_bound(first_.begin(), first_.end(), k) - first_.begin()) -
      1;
  const std::uint64_t offset = (k - first_[i]) * chunk_;
  return {i, offset, std::min(chunk_, bytes_[i] - offset)};
}

std::uint64_t checksum_pieces::fold(std::size_t tensor, const std::uint64_t* digests) const {
  if (!chunk_) return digests[tensor];
  return checksum_of_chunks(digests + first_[tensor], first_[tensor + 1] - first_[tensor]);
}

namespace {

template <class PerChunk>
std::uint64_t chunked(std::size_t nbytes, std::uint64_t chunk, PerChunk&& per_chunk) {
  const auto count = static_cast<std::size_t>(checksum_chunks(nbytes, chunk));
  std::vector<std::uint64_t> digests(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t off = i * chunk;
    digests[i] = per_chunk(off, std::min<std::size_t>(chunk, nbytes - off));
  }
  return checksum_of_chunks(digests.data(), count);
}

}  // namespace

std::uint64_t checksum_compute(const void* data, std::size_t nbytes,
                               const checksum_method& method) {
  if (method.algorithm == checksum_algorithm::xxh3_64) return checksum_compute(data, nbytes);
  const auto* p = static_cast<const unsigned char*>(data);
  return chunked(nbytes, method.chunk_bytes,
                 [&](std::size_t off, std::size_t n) { return checksum_compute(p + off, n); });
}

std::uint64_t checksum_copy(void* dst, const void* src, std::size_t nbytes,
                            const checksum_method& method) {
  if (method.algorithm == checksum_algorithm::xxh3_64) return checksum_copy(dst, src, nbytes);
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  return chunked(nbytes, method.chunk_bytes, [&](std::size_t off, std::size_t n) {
    return checksum_copy(d + off, s + off, n);
  });
}

const unsigned char* checksum_default_secret() {
  static_assert(sizeof(XXH3_kSecret) == 192);
  return XXH3_kSecret;
}

}  // namespace wsync
