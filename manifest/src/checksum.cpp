#include "wsync/manifest/checksum.hpp"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <string>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "src/xxh3_kernels.hpp"
#include "wsync/manifest/log.hpp"

namespace wsync {

namespace detail {

xxh3_kernel_list xxh3_kernels_available() {
  static const auto list = [] {
    static const xxh3_kernels* sets[3] = {};
    std::size_t n = 0;
#if defined(WSYNC_XXH3_X86_VARIANTS)
    // libgcc's check asks the OS too (XGETBV): a CPU whose kernel does not save the wide
    // registers does not count.
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) sets[n++] = &xxh3_avx512;
    if (__builtin_cpu_supports("avx2")) sets[n++] = &xxh3_avx2;
#endif
    sets[n++] = &xxh3_baseline;
    return xxh3_kernel_list{sets, n};
  }();
  return list;
}

const xxh3_kernels& xxh3_kernels_in_use() {
  static const xxh3_kernels& chosen = []() -> const xxh3_kernels& {
    const auto list = xxh3_kernels_available();
    const char* wanted = std::getenv("WSYNC_CHECKSUM_ISA");
    if (wanted == nullptr || *wanted == '\0') return *list.sets[0];
    std::string names;
    for (std::size_t i = 0; i < list.count; ++i) {
      if (std::string_view(wanted) == list.sets[i]->isa) return *list.sets[i];
      names += std::string(names.empty() ? "" : ", ") + list.sets[i]->isa;
    }
    log_warn(std::string("WSYNC_CHECKSUM_ISA=") + wanted + " is not one this CPU can run (" +
             names + "): hashing with " + list.sets[0]->isa);
    return *list.sets[0];
  }();
  return chosen;
}

}  // namespace detail

std::string_view checksum_isa() {
  return detail::xxh3_kernels_in_use().isa;
}

std::string checksum_hex(std::uint64_t checksum) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, checksum >>= 4)
    s[static_cast<std::size_t>(i)] = digits[checksum & 15];
  return s;
}

std::uint64_t checksum_compute(const void* data, std::size_t nbytes) {
  return detail::xxh3_kernels_in_use().hash(data, nbytes);
}

std::uint64_t checksum_copy(void* dst, const void* src, std::size_t nbytes) {
  return detail::xxh3_kernels_in_use().hash_copy(dst, src, nbytes);
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
  return checksum_compute(digests, count * sizeof(std::uint64_t));
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

// Chunked with a chunk size to divide by. Validation refuses any other method that says chunked
// (and unknown algorithms); whole-tensor hashing here keeps an unchecked one from dividing by 0.
bool chunked_method(const checksum_method& m) {
  return m.algorithm == checksum_algorithm::xxh3_64_chunked && m.chunk_bytes != 0;
}

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
  if (!chunked_method(method)) return checksum_compute(data, nbytes);
  const auto* p = static_cast<const unsigned char*>(data);
  return chunked(nbytes, method.chunk_bytes,
                 [&](std::size_t off, std::size_t n) { return checksum_compute(p + off, n); });
}

std::uint64_t checksum_copy(void* dst, const void* src, std::size_t nbytes,
                            const checksum_method& method) {
  if (!chunked_method(method)) return checksum_copy(dst, src, nbytes);
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
