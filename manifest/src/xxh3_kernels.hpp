#pragma once
// XXH3-64 compiled once per instruction set (xxh3_kernels.inc), so one binary hashes with the
// widest vectors the CPU has: XXH3's long loop is 2-3x faster with AVX2 or AVX-512 than with the
// SSE2 every x86-64 has, on cache-resident data. checksum.cpp picks one set at first use.
//
// This header and the .inc declare nothing inline with external linkage: a function compiled
// with -mavx2 that the linker could pick for a caller on a CPU without AVX2 would be a SIGILL.

#include <cstddef>
#include <cstdint>

namespace wsync::detail {

struct xxh3_kernels {
  const char* isa;  ///< "avx512", "avx2", "sse2" (x86-64), "neon" (aarch64), "scalar"
  std::uint64_t (*hash)(const void* data, std::size_t nbytes);
  /// Copies while hashing, a cache-sized block at a time (checksum_copy).
  std::uint64_t (*hash_copy)(void* dst, const void* src, std::size_t nbytes);
};

extern const xxh3_kernels xxh3_baseline;
#if defined(WSYNC_XXH3_X86_VARIANTS)
extern const xxh3_kernels xxh3_avx2;
extern const xxh3_kernels xxh3_avx512;
#endif

/// The sets this CPU can run, widest first; the baseline is always last. (Not a std::span:
/// this header is compiled with every instruction set.)
struct xxh3_kernel_list {
  const xxh3_kernels* const* sets;
  std::size_t count;
};
xxh3_kernel_list xxh3_kernels_available();

/// The set checksum_compute and checksum_copy use (checksum_isa() names it).
const xxh3_kernels& xxh3_kernels_in_use();

}  // namespace wsync::detail
