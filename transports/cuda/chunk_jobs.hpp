#pragma once
// The chunked checksum's work as the GPU kernels split it, in host-and-device code: the job list
// (one job per chunk, with where its 1 KiB blocks' sums go), which job a block belongs to, and
// what one of a block's four threads computes. The kernels (gpu_checksum.cu) are thin loops over
// these; run_on_cpu() runs the same pieces in the same decomposition on the CPU, so the tests
// check everything but the CUDA launch itself on machines without a GPU.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "wsync/manifest/xxh3_parts.hpp"

namespace wsync::gpu::detail {

/// One chunk: its bytes, the index of its first block among all jobs' blocks, and where its
/// bytes are copied to while they are hashed (nullptr: hashed only).
struct chunk_job {
  const unsigned char* data;
  std::uint64_t len;
  std::uint64_t first_block;
  unsigned char* copy_to = nullptr;
};

/// Stores 8 bytes (little-endian), aligned or not.
WSYNC_HD inline void write64(unsigned char* p, std::uint64_t v) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<std::uintptr_t>(p) & 7) == 0) {
    *reinterpret_cast<std::uint64_t*>(p) = v;
    return;
  }
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

/// Whole 1 KiB blocks a chunk of `len` bytes contributes (none on the short path).
WSYNC_HD inline std::uint64_t blocks_of(std::uint64_t len) {
  return len > xxh3::short_max ? xxh3::long_blocks(static_cast<std::size_t>(len)) : 0;
}

/// The job holding block `b` of `n` jobs sorted by first_block: the last whose first_block <= b
/// (a job without blocks shares its index with the next and is never chosen for one).
WSYNC_HD inline std::size_t job_of(const chunk_job* jobs, std::size_t n, std::uint64_t b) {
  std::size_t lo = 0, hi = n;
  while (lo < hi) {
    std::size_t mid = (lo + hi) / 2;
    if (jobs[mid].first_block <= b) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo - 1;
}

/// Stores 16 bytes (little-endian: `lo` first), aligned or not.
WSYNC_HD inline void write128(unsigned char* p, std::uint64_t lo, std::uint64_t hi) {
#if defined(__CUDA_ARCH__)
  if ((reinterpret_cast<std::uintptr_t>(p) & 15) == 0) {
    *reinterpret_cast<ulonglong2*>(p) = make_ulonglong2(lo, hi);
    return;
  }
#endif
  write64(p, lo);
  write64(p + 8, hi);
}

/// Lanes 2t and 2t + 1 of a block's sum: what thread `t` (0..3) of the block's four computes.
/// XXH3 adds each word to its partner lane (i ^ 1) and the word's keyed product to its own lane;
/// lanes 2t and 2t + 1 are partners, so the thread that reads words 2t and 2t + 1 of every
/// stripe (16 bytes, one load) has both lanes' whole share.
struct lane_pair {
  std::uint64_t v[2] = {0, 0};
};

/// `to`, when not null, receives the bytes the thread read (its share of copying the block).
WSYNC_HD inline lane_pair block_pair(const unsigned char* block, int t, const unsigned char* secret,
                                     unsigned char* to = nullptr) {
  // Half a block at a time, its eight loads first, then the arithmetic: eight 16-byte loads in
  // flight per thread for half the registers sixteen would take (an aligned block, the usual
  // case, takes vector loads).
  constexpr std::size_t half = xxh3::stripes_per_block / 2;
  lane_pair p;
  for (std::size_t h = 0; h < 2; ++h) {
    const unsigned char* in = block + h * half * xxh3::stripe_bytes + 16 * t;
    std::uint64_t lo[half], hi[half];
#if defined(__CUDA_ARCH__)
    if ((reinterpret_cast<std::uintptr_t>(in) & 15) == 0) {
      WSYNC_UNROLL
      for (std::size_t s = 0; s < half; ++s) {
        const ulonglong2 x = *reinterpret_cast<const ulonglong2*>(in + s * xxh3::stripe_bytes);
        lo[s] = x.x;
        hi[s] = x.y;
      }
    } else
#endif
    {
      WSYNC_UNROLL
      for (std::size_t s = 0; s < half; ++s) {
        lo[s] = xxh3::read64(in + s * xxh3::stripe_bytes);
        hi[s] = xxh3::read64(in + s * xxh3::stripe_bytes + 8);
      }
    }
    WSYNC_UNROLL
    for (std::size_t s = 0; s < half; ++s) {
      const std::size_t stripe = h * half + s;
      if (to) write128(to + stripe * xxh3::stripe_bytes + 16 * t, lo[s], hi[s]);
      const std::uint64_t klo = lo[s] ^ xxh3::read64(secret + stripe * 8 + 16 * t);
      const std::uint64_t khi = hi[s] ^ xxh3::read64(secret + stripe * 8 + 16 * t + 8);
      p.v[0] += hi[s] + (klo & 0xFFFFFFFFULL) * (klo >> 32);
      p.v[1] += lo[s] + (khi & 0xFFFFFFFFULL) * (khi >> 32);
    }
  }
  return p;
}

/// What thread `lane` (0..7) of a job's eight contributes to its digest: its lane of the folded
/// blocks (xxh3::fold_lane; nothing on the short path).
WSYNC_HD inline std::uint64_t finish_lane(const chunk_job& job, const xxh3::lanes* sums, int lane,
                                          const unsigned char* secret) {
  return job.len <= xxh3::short_max
             ? 0
             : xxh3::fold_lane(lane, sums + job.first_block, blocks_of(job.len), secret);
}

/// Thread `lane`'s share of copying what the blocks do not cover: the job's bytes after its
/// whole blocks (all of a short job), every eighth 8-byte word and then at most one byte.
/// Every load comes before the first store: a load may not pass a store to memory that may be
/// the same, so a load-store loop waits a whole memory latency per step, and this copy sits on
/// the kernel's serial path.
WSYNC_HD inline void copy_tail(const chunk_job& job, int lane) {
  if (!job.copy_to) return;
  // A tail is at most one block: XXH3 leaves 1 to 1,024 bytes of a long input to its tail
  // (xxh3::long_blocks), and a short job is 240 bytes or fewer.
  constexpr std::uint64_t words_per_lane = xxh3::block_bytes / 8 / 8;
  const std::uint64_t from = blocks_of(job.len) * xxh3::block_bytes;
  const unsigned char* in = job.data + from;
  unsigned char* out = job.copy_to + from;
  const std::uint64_t n = job.len - from;
  const std::uint64_t words = n / 8;
  std::uint64_t w[words_per_lane] = {};
  WSYNC_UNROLL
  for (std::uint64_t k = 0; k < words_per_lane; ++k) {
    const std::uint64_t i = lane + 8 * k;
    if (i < words) w[k] = xxh3::read64(in + 8 * i);
  }
  const std::uint64_t last = 8 * words + lane;
  const unsigned char byte = last < n ? in[last] : 0;
  WSYNC_UNROLL
  for (std::uint64_t k = 0; k < words_per_lane; ++k) {
    const std::uint64_t i = lane + 8 * k;
    if (i < words) write64(out + 8 * i, w[k]);
  }
  if (last < n) out[last] = byte;
}

/// A job's digest from its eight folded lanes (finish_lane): the tail and the merge.
WSYNC_HD inline std::uint64_t finish(const chunk_job& job, const xxh3::lanes& folded,
                                     const unsigned char* secret) {
  return job.len <= xxh3::short_max
             ? xxh3::hash_short(job.data, static_cast<std::size_t>(job.len), secret)
             : xxh3::long_tail(folded, job.data, static_cast<std::size_t>(job.len), secret);
}

/// The jobs for `ranges` (elements with .data and .nbytes) cut into `chunk` bytes; `first[i]` is
/// range i's first job (first.size() == ranges + 1). With `copy_to`, range i's bytes are copied
/// to copy_to[i] as they are hashed. Returns the total of whole blocks.
template <class Ranges>
std::uint64_t plan_jobs(const Ranges& ranges, std::uint64_t chunk, std::vector<chunk_job>& jobs,
                        std::vector<std::size_t>& first,
                        const std::vector<void*>* copy_to = nullptr) {
  jobs.clear();
  first.assign(ranges.size() + 1, 0);
  std::uint64_t blocks = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const auto* p = static_cast<const unsigned char*>(ranges[i].data);
    for (std::uint64_t off = 0; off < ranges[i].nbytes; off += chunk) {
      const std::uint64_t len = ranges[i].nbytes - off < chunk ? ranges[i].nbytes - off : chunk;
      auto* to = copy_to ? static_cast<unsigned char*>((*copy_to)[i]) + off : nullptr;
      jobs.push_back({p + off, len, blocks, to});
      blocks += blocks_of(len);
    }
    first[i + 1] = jobs.size();
  }
  return blocks;
}

/// A run of consecutive jobs, rebased so that its first job's first block is 0, with the whole
/// blocks it holds and the index of its first job among all.
struct job_batch {
  std::vector<chunk_job> jobs;
  std::uint64_t blocks = 0;
  std::size_t first = 0;
};

/// Splits `jobs` (as plan_jobs made them) into runs of at most `max_blocks` whole blocks (a job
/// larger than that is a run of its own): the kernels' scratch, one sum per block, is then
/// bounded by a run, not by the update (64 bytes per KiB: 2.5 GiB for a 40 GiB update).
inline std::vector<job_batch> batch_jobs(const std::vector<chunk_job>& jobs,
                                         std::uint64_t max_blocks) {
  std::vector<job_batch> out;
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    const std::uint64_t b = blocks_of(jobs[j].len);
    if (out.empty() || (out.back().blocks + b > max_blocks && !out.back().jobs.empty())) {
      out.push_back({{}, 0, j});
    }
    auto& run = out.back();
    chunk_job job = jobs[j];
    job.first_block = run.blocks;
    run.jobs.push_back(job);
    run.blocks += b;
  }
  return out;
}

/// Runs the kernels (gpu_checksum.cu, built with CUDA only): one digest per job into `digests`
/// (host memory). Returns a cudaError_t (0 = success) and, on failure, what failed.
int chunk_digests(const std::vector<chunk_job>& jobs, std::uint64_t blocks, std::uint64_t* digests,
                  void* stream, const char** what);

/// The kernels' two phases on the CPU, thread by thread as the GPU splits them (for tests).
inline std::vector<std::uint64_t> run_on_cpu(const std::vector<chunk_job>& jobs,
                                             std::uint64_t blocks, const unsigned char* secret) {
  std::vector<xxh3::lanes> sums(blocks);
  for (std::uint64_t b = 0; b < blocks; ++b) {
    const auto& job = jobs[job_of(jobs.data(), jobs.size(), b)];
    const std::uint64_t at = (b - job.first_block) * xxh3::block_bytes;
    for (int t = 0; t < 4; ++t) {
      const auto p = block_pair(job.data + at, t, secret, job.copy_to ? job.copy_to + at : nullptr);
      sums[b].v[2 * t] = p.v[0];
      sums[b].v[2 * t + 1] = p.v[1];
    }
  }
  std::vector<std::uint64_t> digests(jobs.size());
  for (std::size_t j = 0; j < jobs.size(); ++j) {
    xxh3::lanes folded{};
    for (int lane = 0; lane < 8; ++lane) {
      folded.v[lane] = finish_lane(jobs[j], sums.data(), lane, secret);
      copy_tail(jobs[j], lane);
    }
    digests[j] = finish(jobs[j], folded, secret);
  }
  return digests;
}

}  // namespace wsync::gpu::detail
