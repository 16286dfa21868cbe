// Chunked XXH3-64 on the GPU, in two kernels over chunk_jobs.hpp and xxh3_parts.hpp (whose
// decomposition the CPU tests run and check against libxxhash):
//   1. block_sums: four threads per 1,024-byte block, each reading 16 bytes of every stripe
//      (so each load of a warp reads eight whole 64-byte stripes, one per block), add up the
//      block's contribution to the eight accumulators, two lanes each; every block of every
//      chunk at once.
//   2. chunk_finish: eight threads per chunk, each folding one accumulator lane over the
//      chunk's block sums in order (the lanes are independent until the tail); the first of
//      them gathers the lanes and hashes the tail; a chunk of 240 bytes or fewer takes the short
//      path.
// With a copy destination per job, the same pass copies the bytes it hashes (block_sums writes
// the bytes it read; chunk_finish copies the bytes after the whole blocks): publishing device
// tensors reads them once.
// The per-tensor step (XXH3 of the chunk digests, a few KiB) runs on the CPU.

#include <cuda_runtime.h>

#include <vector>

#include "cuda/chunk_jobs.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/xxh3_parts.hpp"

namespace wsync::gpu::detail {
namespace {

__constant__ __align__(16) unsigned char secret_c[xxh3::secret_bytes];

constexpr unsigned threads_per_cta = 256;
// chunk_finish holds 64 block sums per thread in registers (xxh3::fold_lane loads the next 32
// while it folds the last 32): 160 registers, so one CTA of 256 per SM; CTAs of 128 fit three.
constexpr unsigned finish_threads_per_cta = 128;
// What the device's default memory pool may keep between calls (the scratch of 4 GiB hashed).
constexpr std::uint64_t scratch_kept_bytes = std::uint64_t{256} << 20;

// No register cap: the kernel takes 90 registers (two CTAs per SM); capped at 80 or 64 it
// spills, and publishing, which copies in the same pass, took about 15 and 30 % longer
// (docs/benchmark.md).
static_assert(sizeof(xxh3::lanes) == 64, "block_sums stores a sum's lanes 16 bytes at a time");

__global__ void block_sums(const chunk_job* jobs, std::size_t n, std::uint64_t blocks,
                           xxh3::lanes* sums) {
  const std::uint64_t g = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
  const std::uint64_t b = g / 4;
  const int t = static_cast<int>(g % 4);
  if (b >= blocks) return;
  const auto& job = jobs[job_of(jobs, n, b)];
  const std::uint64_t at = (b - job.first_block) * xxh3::block_bytes;
  const lane_pair p =
      block_pair(job.data + at, t, secret_c, job.copy_to ? job.copy_to + at : nullptr);
  // Lanes 2t and 2t + 1 together: 16 bytes at a 16-byte offset of the 64-byte sum (the sums
  // come from cudaMalloc(Async), 256-byte aligned).
  reinterpret_cast<ulonglong2*>(sums[b].v)[t] = make_ulonglong2(p.v[0], p.v[1]);
}

__global__ void chunk_finish(const chunk_job* jobs, std::size_t n, const xxh3::lanes* sums,
                             std::uint64_t* digests) {
  // Eight threads per chunk, one accumulator lane each (lanes fold independently); the first
  // of the eight gathers them and hashes the tail.
  const std::uint64_t g = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x;
  const std::uint64_t j = g / 8;
  const int lane = static_cast<int>(g % 8);
  const std::uint64_t mine = j < n ? finish_lane(jobs[j], sums, lane, secret_c) : 0;
  if (j < n) copy_tail(jobs[j], lane);
  xxh3::lanes folded;
  for (int i = 0; i < 8; ++i) folded.v[i] = __shfl_sync(0xFFFFFFFFU, mine, i, 8);
  if (j < n && lane == 0) digests[j] = finish(jobs[j], folded, secret_c);
}

unsigned grid_for(std::uint64_t threads, unsigned per_cta = threads_per_cta) {
  return static_cast<unsigned>((threads + per_cta - 1) / per_cta);
}

}  // namespace

int chunk_digests(const std::vector<chunk_job>& jobs, std::uint64_t blocks, std::uint64_t* digests,
                  void* stream_ptr, const char** what) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // The launches are checked with cudaGetLastError(): clear what an earlier failed call left
  // there (already reported through its own return value), or it would be reported as ours.
  (void)cudaGetLastError();
  chunk_job* jobs_d = nullptr;
  xxh3::lanes* sums_d = nullptr;
  std::uint64_t* digests_d = nullptr;
  cudaError_t rc = cudaSuccess;
  auto step = [&](cudaError_t e, const char* name) {
    if (rc == cudaSuccess && e != cudaSuccess) rc = e, *what = name;
    return rc == cudaSuccess;
  };
  // Stream-ordered scratch where the device has memory pools, plain cudaMalloc where not.
  int device = 0, pools = 0;
  step(cudaGetDevice(&device), "cudaGetDevice");
  step(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device),
       "cudaDeviceGetAttribute(memory pools)");
  if (pools) {
    // The default pool gives its memory back at every synchronisation unless told to keep
    // some: the block sums of 1 GiB are 64 MiB, mapped afresh on every call otherwise.
    cudaMemPool_t pool = nullptr;
    if (cudaDeviceGetDefaultMemPool(&pool, device) == cudaSuccess) {
      std::uint64_t keep = 0;
      cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      if (keep < scratch_kept_bytes) {
        keep = scratch_kept_bytes;
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
      }
    }
  }
  auto alloc = [&](auto** p, std::size_t bytes) {
    void** raw = reinterpret_cast<void**>(p);
    return pools ? cudaMallocAsync(raw, bytes, stream) : cudaMalloc(raw, bytes);
  };
  const std::size_t n = jobs.size();
  if (rc == cudaSuccess &&
      step(cudaMemcpyToSymbolAsync(secret_c, checksum_default_secret(), xxh3::secret_bytes, 0,
                                   cudaMemcpyHostToDevice, stream),
           "cudaMemcpyToSymbolAsync(secret)") &&
      step(alloc(&jobs_d, n * sizeof(chunk_job)), "device allocation (jobs)") &&
      step(alloc(&sums_d, (blocks > 0 ? blocks : 1) * sizeof(xxh3::lanes)),
           "device allocation (block sums)") &&
      step(alloc(&digests_d, n * sizeof(std::uint64_t)), "device allocation (digests)") &&
      step(cudaMemcpyAsync(jobs_d, jobs.data(), n * sizeof(chunk_job), cudaMemcpyHostToDevice,
                           stream),
           "cudaMemcpyAsync(jobs)")) {
    if (blocks > 0) {
      block_sums<<<grid_for(blocks * 4), threads_per_cta, 0, stream>>>(jobs_d, n, blocks, sums_d);
      step(cudaGetLastError(), "block_sums launch");
    }
    chunk_finish<<<grid_for(n * 8, finish_threads_per_cta), finish_threads_per_cta, 0, stream>>>(
        jobs_d, n, sums_d, digests_d);
    step(cudaGetLastError(), "chunk_finish launch");
    step(cudaMemcpyAsync(digests, digests_d, n * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                         stream),
         "cudaMemcpyAsync(digests)");
  }
  // Freed on every path; the synchronisation reports a fault of the kernels too.
  auto release = [&](void* p) {
    if (p) (void)(pools ? cudaFreeAsync(p, stream) : cudaFree(p));
  };
  if (pools) release(digests_d), release(sums_d), release(jobs_d);
  step(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!pools) release(digests_d), release(sums_d), release(jobs_d);
  return static_cast<int>(rc);
}

}  // namespace wsync::gpu::detail
