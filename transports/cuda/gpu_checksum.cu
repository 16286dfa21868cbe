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

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "cuda/chunk_jobs.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/manifest/xxh3_parts.hpp"

namespace wsync::gpu::detail {
namespace {

__constant__ __align__(16) unsigned char secret_c[xxh3::secret_bytes];

// block_sums in CTAs of 128: at its 90 registers five fit an SM (640 threads) where two of 256
// did (512); on an H200 the copying form took 523 instead of 563 us for 988 MB, and
// hash-only throughput rose 0.94 -> 1.05 x a device-to-device copy (docs/benchmark.md).
constexpr unsigned threads_per_cta = 128;
// chunk_finish holds 64 block sums per thread in registers (xxh3::fold_lane loads the next 32
// while it folds the last 32): 160 registers, so one CTA of 256 per SM; CTAs of 128 fit three.
constexpr unsigned finish_threads_per_cta = 128;

// No register cap: the kernel takes 90 registers; capped at 80 or 64 it
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

// The secret in constant memory, copied once per device (every call used to copy it again,
// from pageable memory, ahead of the kernels).
cudaError_t load_secret(int device) {
  static std::mutex mu;
  static std::vector<bool> loaded;
  std::lock_guard lock(mu);
  if (device >= 0 && static_cast<std::size_t>(device) < loaded.size() && loaded[device]) {
    return cudaSuccess;
  }
  auto e = cudaMemcpyToSymbol(secret_c, checksum_default_secret(), xxh3::secret_bytes);
  // From pageable memory the copy returns once the bytes are staged, not landed; it runs on
  // the legacy stream, which the callers' non-blocking streams do not wait for. A kernel
  // launched next could read part of the secret: wait for it once, here.
  if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
  if (e == cudaSuccess && device >= 0) {
    if (loaded.size() <= static_cast<std::size_t>(device)) loaded.resize(device + 1);
    loaded[device] = true;
  }
  return e;
}

constexpr std::size_t scratch_align = 256;

std::size_t align_up(std::size_t v, std::size_t a) {
  return (v + a - 1) / a * a;
}

// A call's working memory, kept for the next call on the same device: device memory for the
// jobs, digests and block sums (64 bytes per KiB hashed: 64 MiB for 1 GiB, at most 256 MiB, a
// run's bound in gpu_support.cpp), and pinned host memory for the jobs and digests, so that
// both small copies are plain DMA. Allocating these per call (stream-ordered, with pageable
// copies) kept the GPU waiting about 175 us before the first kernel of every publish on an H200.
// One per concurrent caller on a device, grown as needed, held for the process's life (freed
// only after a failed call): freeing at exit would race the CUDA runtime's own teardown.
struct scratch {
  int device = 0;
  void* device_mem = nullptr;
  std::size_t device_bytes = 0;
  void* host_mem = nullptr;
  std::size_t host_bytes = 0;

  cudaError_t reserve(std::size_t dev, std::size_t host) {
    if (dev > device_bytes) {
      const std::size_t want = std::max(dev, device_bytes + device_bytes / 2);
      if (device_mem) cudaFree(device_mem);
      device_mem = nullptr, device_bytes = 0;
      if (auto e = cudaMalloc(&device_mem, want); e != cudaSuccess) return e;
      device_bytes = want;
    }
    if (host > host_bytes) {
      if (host_mem) cudaFreeHost(host_mem);
      host_mem = nullptr, host_bytes = 0;
      const std::size_t want = std::max<std::size_t>(host, 64 << 10);
      if (auto e = cudaMallocHost(&host_mem, want); e != cudaSuccess) return e;
      host_bytes = want;
    }
    return cudaSuccess;
  }
  void release() {
    if (device_mem) cudaFree(device_mem);
    if (host_mem) cudaFreeHost(host_mem);
    device_mem = host_mem = nullptr;
    device_bytes = host_bytes = 0;
  }
};

struct scratch_pool {
  std::mutex mu;
  std::vector<scratch*> idle;
};

scratch_pool& pool() {
  static auto* p = new scratch_pool;  // never destroyed: see scratch
  return *p;
}

scratch* scratch_take(int device) {
  auto& p = pool();
  {
    std::lock_guard lock(p.mu);
    for (auto it = p.idle.begin(); it != p.idle.end(); ++it) {
      if ((*it)->device == device) {
        scratch* s = *it;
        p.idle.erase(it);
        return s;
      }
    }
  }
  auto* s = new scratch;
  s->device = device;
  return s;
}

void scratch_give_back(scratch* s) {
  auto& p = pool();
  std::lock_guard lock(p.mu);
  p.idle.push_back(s);
}

void scratch_drop(scratch* s) {
  s->release();
  delete s;
}

}  // namespace

int chunk_digests(const std::vector<chunk_job>& jobs, std::uint64_t blocks, std::uint64_t* digests,
                  void* stream_ptr, const char** what) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // The launches are checked with cudaGetLastError(): clear what an earlier failed call left
  // there (already reported through its own return value), or it would be reported as ours.
  (void)cudaGetLastError();
  cudaError_t rc = cudaSuccess;
  auto step = [&](cudaError_t e, const char* name) {
    if (rc == cudaSuccess && e != cudaSuccess) rc = e, *what = name;
    return rc == cudaSuccess;
  };
  int device = 0;
  if (!step(cudaGetDevice(&device), "cudaGetDevice") ||
      !step(load_secret(device), "cudaMemcpyToSymbol(secret)")) {
    return static_cast<int>(rc);
  }
  const std::size_t n = jobs.size();
  const std::size_t jobs_bytes = n * sizeof(chunk_job);
  const std::size_t digests_at = align_up(jobs_bytes, scratch_align);
  const std::size_t sums_at = digests_at + align_up(n * sizeof(std::uint64_t), scratch_align);
  const std::size_t host_bytes = digests_at + n * sizeof(std::uint64_t);
  scratch* sc = scratch_take(device);
  if (!step(sc->reserve(sums_at + blocks * sizeof(xxh3::lanes), host_bytes),
            "scratch allocation (block sums and jobs)")) {
    scratch_drop(sc);
    return static_cast<int>(rc);
  }
  auto* jobs_d = static_cast<chunk_job*>(sc->device_mem);
  auto* digests_d =
      reinterpret_cast<std::uint64_t*>(static_cast<char*>(sc->device_mem) + digests_at);
  auto* sums_d = reinterpret_cast<xxh3::lanes*>(static_cast<char*>(sc->device_mem) + sums_at);
  auto* digests_h = reinterpret_cast<std::uint64_t*>(static_cast<char*>(sc->host_mem) + digests_at);
  std::memcpy(sc->host_mem, jobs.data(), jobs_bytes);
  if (step(cudaMemcpyAsync(jobs_d, sc->host_mem, jobs_bytes, cudaMemcpyHostToDevice, stream),
           "cudaMemcpyAsync(jobs)")) {
    if (blocks > 0) {
      block_sums<<<grid_for(blocks * 4, threads_per_cta), threads_per_cta, 0, stream>>>(
          jobs_d, n, blocks, sums_d);
      step(cudaGetLastError(), "block_sums launch");
    }
    chunk_finish<<<grid_for(n * 8, finish_threads_per_cta), finish_threads_per_cta, 0, stream>>>(
        jobs_d, n, sums_d, digests_d);
    step(cudaGetLastError(), "chunk_finish launch");
    step(cudaMemcpyAsync(digests_h, digests_d, n * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                         stream),
         "cudaMemcpyAsync(digests)");
  }
  // Always waited for: the scratch goes back to the pool idle, and the synchronisation reports
  // a fault of the kernels too.
  step(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (rc == cudaSuccess) {
    std::memcpy(digests, digests_h, n * sizeof(std::uint64_t));
    scratch_give_back(sc);
  } else {
    scratch_drop(sc);  // after a fault the context may be unusable: keep nothing of it
  }
  return static_cast<int>(rc);
}

}  // namespace wsync::gpu::detail
