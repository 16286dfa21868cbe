#pragma once
// XXH3-64 (seed 0) taken apart so that a GPU can compute it in parallel, in code that compiles
// both for the CPU and, under nvcc, for the device. The CPU tests compare every path with
// libxxhash's XXH3_64bits over all short lengths and many long ones, so the arithmetic a CUDA
// kernel runs is checked on machines without a GPU.
//
// XXH3's long path (inputs over 240 bytes) consumes 1,024-byte blocks: within a block, each
// 64-byte stripe adds to eight 64-bit accumulators; after the block, the accumulators are
// scrambled. The additions commute, so a block's contribution (the sum of its 16 stripes) can be
// computed by any thread in any order; only the scramble chain from block to block is serial,
// and it touches 64 bytes per block instead of 1,024. `long_block_sum` is the parallel part,
// `long_finish` the serial one; `hash` runs both in one thread for any length.
//
// `secret` is XXH3's default 192-byte secret (checksum_default_secret() on the CPU; a kernel
// copies it to constant memory).

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WSYNC_HD __host__ __device__
#else
#define WSYNC_HD
#endif

#if defined(__CUDA_ARCH__)  // the device pass only: the host compiler does not know the pragma
#define WSYNC_UNROLL _Pragma("unroll")
#else
#define WSYNC_UNROLL
#endif

namespace wsync::xxh3 {

inline constexpr std::size_t secret_bytes = 192;
inline constexpr std::size_t stripe_bytes = 64;
inline constexpr std::size_t stripes_per_block = (secret_bytes - stripe_bytes) / 8;  // 16
inline constexpr std::size_t block_bytes = stripe_bytes * stripes_per_block;         // 1024
inline constexpr std::size_t short_max = 240;  ///< longer inputs take the block path

inline constexpr std::uint64_t p32_1 = 0x9E3779B1U;
inline constexpr std::uint64_t p32_2 = 0x85EBCA77U;
inline constexpr std::uint64_t p32_3 = 0xC2B2AE3DU;
inline constexpr std::uint64_t p64_1 = 0x9E3779B185EBCA87ULL;
inline constexpr std::uint64_t p64_2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr std::uint64_t p64_3 = 0x165667B19E3779F9ULL;
inline constexpr std::uint64_t p64_4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr std::uint64_t p64_5 = 0x27D4EB2F165667C5ULL;
inline constexpr std::uint64_t mx_1 = 0x165667919E3779F9ULL;
inline constexpr std::uint64_t mx_2 = 0x9FB21C651E98DF25ULL;

/// Eight accumulators: a block's contribution, or the running state.
struct lanes {
  std::uint64_t v[8];
};

WSYNC_HD inline std::uint64_t read64(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<std::uintptr_t>(p) & 7) == 0)
    return *reinterpret_cast<const std::uint64_t*>(p);
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
#else
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);  // little-endian hosts only (x86-64, aarch64)
  return v;
#endif
}

WSYNC_HD inline std::uint32_t read32(const unsigned char* p) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
#else
  std::uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

WSYNC_HD inline std::uint64_t rotl(std::uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

WSYNC_HD inline std::uint64_t swap64(std::uint64_t x) {
  x = ((x << 8) & 0xFF00FF00FF00FF00ULL) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
  x = ((x << 16) & 0xFFFF0000FFFF0000ULL) | ((x >> 16) & 0x0000FFFF0000FFFFULL);
  return (x << 32) | (x >> 32);
}

/// The 128-bit product of a and b, its halves xor-ed.
WSYNC_HD inline std::uint64_t mul_fold(std::uint64_t a, std::uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  __extension__ using u128 = unsigned __int128;  // GCC and Clang; -Wpedantic knows it is not ISO
  u128 p = static_cast<u128>(a) * b;
  return static_cast<std::uint64_t>(p) ^ static_cast<std::uint64_t>(p >> 64);
#endif
}

WSYNC_HD inline std::uint64_t avalanche(std::uint64_t h) {
  h ^= h >> 37;
  h *= mx_1;
  return h ^ (h >> 32);
}

WSYNC_HD inline std::uint64_t avalanche_xxh64(std::uint64_t h) {
  h ^= h >> 33;
  h *= p64_2;
  h ^= h >> 29;
  h *= p64_3;
  return h ^ (h >> 32);
}

WSYNC_HD inline std::uint64_t mix16(const unsigned char* in, const unsigned char* secret) {
  return mul_fold(read64(in) ^ read64(secret), read64(in + 8) ^ read64(secret + 8));
}

/// Inputs of 0 to 240 bytes.
WSYNC_HD inline std::uint64_t hash_short(const unsigned char* in, std::size_t len,
                                         const unsigned char* secret) {
  const std::uint64_t n = len;
  if (len == 0) return avalanche_xxh64(read64(secret + 56) ^ read64(secret + 64));
  if (len <= 3) {
    std::uint32_t combined =
        static_cast<std::uint32_t>(in[0]) << 16 | static_cast<std::uint32_t>(in[len >> 1]) << 24 |
        static_cast<std::uint32_t>(in[len - 1]) | static_cast<std::uint32_t>(len) << 8;
    std::uint64_t flip = read32(secret) ^ read32(secret + 4);
    return avalanche_xxh64(combined ^ flip);
  }
  if (len <= 8) {
    std::uint64_t flip = read64(secret + 8) ^ read64(secret + 16);
    std::uint64_t v =
        (read32(in + len - 4) + (static_cast<std::uint64_t>(read32(in)) << 32)) ^ flip;
    v ^= rotl(v, 49) ^ rotl(v, 24);
    v *= mx_2;
    v ^= (v >> 35) + n;
    v *= mx_2;
    return v ^ (v >> 28);
  }
  if (len <= 16) {
    std::uint64_t lo = read64(in) ^ (read64(secret + 24) ^ read64(secret + 32));
    std::uint64_t hi = read64(in + len - 8) ^ (read64(secret + 40) ^ read64(secret + 48));
    return avalanche(n + swap64(lo) + hi + mul_fold(lo, hi));
  }
  std::uint64_t acc = n * p64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) {
          acc += mix16(in + 48, secret + 96);
          acc += mix16(in + len - 64, secret + 112);
        }
        acc += mix16(in + 32, secret + 64);
        acc += mix16(in + len - 48, secret + 80);
      }
      acc += mix16(in + 16, secret + 32);
      acc += mix16(in + len - 32, secret + 48);
    }
    acc += mix16(in, secret);
    acc += mix16(in + len - 16, secret + 16);
    return avalanche(acc);
  }
  for (std::size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, secret + 16 * i);
  std::uint64_t tail = mix16(in + len - 16, secret + 136 - 17);
  acc = avalanche(acc);
  for (std::size_t i = 8; i < len / 16; ++i) tail += mix16(in + 16 * i, secret + 16 * (i - 8) + 3);
  return avalanche(acc + tail);
}

/// Adds `stripes` 64-byte stripes from `in` to `acc`, the s-th with the secret at 8 * s.
WSYNC_HD inline void accumulate(lanes& acc, const unsigned char* in, std::size_t stripes,
                                const unsigned char* secret) {
  for (std::size_t s = 0; s < stripes; ++s) {
    const unsigned char* stripe = in + s * stripe_bytes;
    const unsigned char* key = secret + s * 8;
    for (int i = 0; i < 8; ++i) {
      std::uint64_t data = read64(stripe + 8 * i);
      std::uint64_t keyed = data ^ read64(key + 8 * i);
      acc.v[i ^ 1] += data;
      acc.v[i] += (keyed & 0xFFFFFFFFULL) * (keyed >> 32);
    }
  }
}

/// The parallel part: what one whole 1,024-byte block adds to the accumulators.
WSYNC_HD inline lanes long_block_sum(const unsigned char* block, const unsigned char* secret) {
  lanes sum{};
  accumulate(sum, block, stripes_per_block, secret);
  return sum;
}

/// How many whole blocks a long input of `len` bytes has before its tail.
WSYNC_HD inline std::size_t long_blocks(std::size_t len) {
  return (len - 1) / block_bytes;
}

/// Accumulator lane i's starting value. A switch, not a table: a GPU thread whose lane is only
/// known at run time would read a table from local memory, a memory latency on the serial path.
WSYNC_HD inline std::uint64_t lane_init(int i) {
  switch (i) {
    case 0:
      return p32_3;
    case 1:
      return p64_1;
    case 2:
      return p64_2;
    case 3:
      return p64_3;
    case 4:
      return p64_4;
    case 5:
      return p32_2;
    case 6:
      return p64_5;
    default:
      return p32_1;
  }
}

/// The serial part, one lane at a time: lane i of the accumulators after the first `blocks`
/// block sums. Lanes never mix until the tail, so eight threads can fold one input's lanes.
WSYNC_HD inline std::uint64_t fold_lane(int i, const lanes* sums, std::size_t blocks,
                                        const unsigned char* secret) {
  const std::uint64_t key = read64(secret + secret_bytes - stripe_bytes + 8 * i);
  std::uint64_t acc = lane_init(i);
  auto step = [&](std::uint64_t sum) {
    std::uint64_t a = acc + sum;
    a ^= a >> 47;
    a ^= key;
    acc = a * p32_1;
  };
  // In batches of 32 sums, each batch's loads issued before the previous batch's steps, so a
  // GPU thread's loads wait while it computes, not between batches (or, without batches, at
  // every block). The last batch may be partial: its loads are issued together too (a 1 MiB chunk
  // has 1,023 whole blocks, 31 of them in the last batch).
  constexpr std::size_t ahead = 32;
  std::uint64_t next[ahead];
  auto load = [&](std::size_t from) {
    if (from + ahead <= blocks) {
      WSYNC_UNROLL
      for (std::size_t k = 0; k < ahead; ++k) next[k] = sums[from + k].v[i];
    } else {
      WSYNC_UNROLL
      for (std::size_t k = 0; k < ahead; ++k) next[k] = from + k < blocks ? sums[from + k].v[i] : 0;
    }
  };
  load(0);
  for (std::size_t b = 0; b < blocks; b += ahead) {
    std::uint64_t now[ahead];
    WSYNC_UNROLL
    for (std::size_t k = 0; k < ahead; ++k) now[k] = next[k];
    if (b + ahead < blocks) load(b + ahead);
    const std::size_t n = blocks - b < ahead ? blocks - b : ahead;
    WSYNC_UNROLL
    for (std::size_t k = 0; k < ahead; ++k) {
      if (k < n) step(now[k]);
    }
  }
  return acc;
}

/// The end of a long input of `len` bytes once its whole blocks are folded into `acc`: the
/// tail stripes read from `in`, then the merge.
WSYNC_HD inline std::uint64_t long_tail(lanes acc, const unsigned char* in, std::size_t len,
                                        const unsigned char* secret) {
  const std::size_t done = long_blocks(len) * block_bytes;
  accumulate(acc, in + done, ((len - 1) - done) / stripe_bytes, secret);
  accumulate(acc, in + len - stripe_bytes, 1, secret + secret_bytes - stripe_bytes - 7);
  std::uint64_t h = static_cast<std::uint64_t>(len) * p64_1;
  for (int i = 0; i < 4; ++i) {
    h += mul_fold(acc.v[2 * i] ^ read64(secret + 11 + 16 * i),
                  acc.v[2 * i + 1] ^ read64(secret + 11 + 16 * i + 8));
  }
  return avalanche(h);
}

/// The serial part, for an input of `len` > 240 bytes: folds the blocks' sums in order
/// (`sums[b]` for b < long_blocks(len)), then the tail read from `in`.
WSYNC_HD inline std::uint64_t long_finish(const unsigned char* in, std::size_t len,
                                          const lanes* sums, const unsigned char* secret) {
  lanes acc;
  for (int i = 0; i < 8; ++i) acc.v[i] = fold_lane(i, sums, long_blocks(len), secret);
  return long_tail(acc, in, len, secret);
}

/// XXH3-64 of any input in one thread. `sums` is scratch for long_blocks(len) lanes (unused for
/// inputs of 240 bytes or fewer).
WSYNC_HD inline std::uint64_t hash(const unsigned char* in, std::size_t len,
                                   const unsigned char* secret, lanes* sums) {
  if (len <= short_max) return hash_short(in, len, secret);
  for (std::size_t b = 0; b < long_blocks(len); ++b) {
    sums[b] = long_block_sum(in + b * block_bytes, secret);
  }
  return long_finish(in, len, sums, secret);
}

}  // namespace wsync::xxh3
