#include <atomic>
#include <utility>

#include "cuda/chunk_jobs.hpp"
#include "wsync/manifest/checksum.hpp"
#include "wsync/transports/gpu.hpp"

#if WSYNC_HAVE_CUDA
#include <cuda.h>  // driver types only: the functions come from cudaGetDriverEntryPointByVersion
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#endif

namespace wsync::gpu {

#if WSYNC_HAVE_CUDA

namespace {

std::string cuda_text(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

error cuda_failure(const std::string& what, cudaError_t e) {
  return {errc::io_error, "CUDA: " + what + " failed (" + cuda_text(e) + ")"};
}

}  // namespace

result<void> ready() {
  // Devices do not come and go under a running process: once seen, not asked again (the query
  // cost about 10 us of every publish).
  static std::atomic<bool> seen{false};
  if (seen.load(std::memory_order_acquire)) return {};
  int devices = 0;
  if (auto e = cudaGetDeviceCount(&devices); e != cudaSuccess) {
    // Without a driver at all the runtime says "insufficient driver": name the missing library.
    std::string driver;
    if (void* lib = ::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
      ::dlclose(lib);
    } else if (const char* why = ::dlerror()) {
      driver = std::string("; no NVIDIA driver: ") + why;
    }
    return make_error(errc::blocked, "blocked: no CUDA device (" + cuda_text(e) + driver + ")");
  }
  if (devices == 0) {
    return make_error(errc::blocked, "blocked: no CUDA device (cudaGetDeviceCount found none)");
  }
  seen.store(true, std::memory_order_release);
  return {};
}

result<std::uint64_t> memory_free(int device) {
  if (auto r = ready(); !r) return r.error();
  if (auto was = set_device(device); !was) return was.error();
  std::size_t free = 0, total = 0;
  if (auto e = cudaMemGetInfo(&free, &total); e != cudaSuccess) {
    return cuda_failure("cudaMemGetInfo", e);
  }
  return static_cast<std::uint64_t>(free);
}

result<std::string> device_name(int device) {
  if (auto r = ready(); !r) return r.error();
  cudaDeviceProp prop{};
  if (auto e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess) {
    return cuda_failure("cudaGetDeviceProperties(" + std::to_string(device) + ")", e);
  }
  return std::string(prop.name);
}

result<device_buffer> device_buffer::make(std::size_t bytes) {
  if (auto r = ready(); !r) return r.error();
  device_buffer b;
  if (auto e = cudaMalloc(&b.data_, bytes > 0 ? bytes : 1); e != cudaSuccess) {
    return cuda_failure("cudaMalloc(" + std::to_string(bytes) + " bytes)", e);
  }
  b.size_ = bytes;
  return b;
}

device_buffer::~device_buffer() {
  if (data_) cudaFree(data_);
}

result<void> device_buffer::upload(const void* host, std::size_t bytes, std::size_t offset) {
  if (offset > size_ || bytes > size_ - offset) {
    return make_error(errc::invalid_argument, "device_buffer: upload past its end");
  }
  if (auto e = cudaMemcpy(static_cast<char*>(data_) + offset, host, bytes, cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return cuda_failure("cudaMemcpy host to device", e);
  }
  return {};
}

result<void> device_buffer::download(void* host, std::size_t bytes, std::size_t offset) const {
  if (offset > size_ || bytes > size_ - offset) {
    return make_error(errc::invalid_argument, "device_buffer: download past its end");
  }
  if (auto e =
          cudaMemcpy(host, static_cast<const char*>(data_) + offset, bytes, cudaMemcpyDeviceToHost);
      e != cudaSuccess) {
    return cuda_failure("cudaMemcpy device to host", e);
  }
  return {};
}

result<void> copy_device(void* dst, const void* src, std::size_t bytes) {
  if (auto e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice); e != cudaSuccess) {
    return cuda_failure("cudaMemcpy device to device", e);
  }
  if (auto e = cudaDeviceSynchronize(); e != cudaSuccess) {
    return cuda_failure("cudaDeviceSynchronize", e);
  }
  return {};
}

result<void> copy_to_host(void* dst, const void* src, std::size_t bytes) {
  if (auto e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault); e != cudaSuccess) {
    return cuda_failure("cudaMemcpy to host", e);
  }
  return {};
}

result<int> set_device(int device) {
  int was = 0;
  if (auto e = cudaGetDevice(&was); e != cudaSuccess) return cuda_failure("cudaGetDevice", e);
  if (auto e = cudaSetDevice(device); e != cudaSuccess) {
    return cuda_failure("cudaSetDevice(" + std::to_string(device) + ")", e);
  }
  return was;
}

namespace {

// The driver's current-context calls, found through the runtime (no link to libcuda); null
// without a driver.
struct context_calls {
  decltype(&cuCtxGetCurrent) get = nullptr;
  decltype(&cuCtxSetCurrent) set = nullptr;
};

const context_calls& context_api() {
  static const context_calls calls = [] {
    context_calls c;
    auto find = [](const char* name) -> void* {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult q{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) != cudaSuccess) {
        return nullptr;
      }
      return p;
    };
    c.get = reinterpret_cast<decltype(c.get)>(find("cuCtxGetCurrent"));
    c.set = reinterpret_cast<decltype(c.set)>(find("cuCtxSetCurrent"));
    if (!c.get || !c.set) c = {};
    return c;
  }();
  return calls;
}

}  // namespace

device_kept::device_kept() {
  const auto& api = context_api();
  CUcontext current = nullptr;
  if (api.get && api.get(&current) == CUDA_SUCCESS) {
    context_ = current;
    kept_ = true;
  }
}

device_kept::~device_kept() {
  if (kept_) (void)context_api().set(static_cast<CUcontext>(context_));
}

on_device::on_device(int device) : status_(static_cast<int>(cudaSetDevice(device))) {}

result<bool> context_current() {
  if (auto r = ready(); !r) return r.error();
  const auto& api = context_api();
  CUcontext current = nullptr;
  if (!api.get || api.get(&current) != CUDA_SUCCESS) {
    return make_error(errc::blocked, "blocked: the CUDA driver gave no cuCtxGetCurrent");
  }
  return current != nullptr;
}

result<int> device_of(const void* p) {
  cudaPointerAttributes a{};
  if (auto e = cudaPointerGetAttributes(&a, p); e != cudaSuccess) {
    return cuda_failure("cudaPointerGetAttributes", e);
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

result<stream> stream::make(int device) {
  if (auto r = ready(); !r) return r.error();
  if (auto e = cudaSetDevice(device); e != cudaSuccess) {
    return cuda_failure("cudaSetDevice(" + std::to_string(device) + ")", e);
  }
  stream s;
  cudaStream_t handle = nullptr;
  if (auto e = cudaStreamCreateWithFlags(&handle, cudaStreamNonBlocking); e != cudaSuccess) {
    return cuda_failure("cudaStreamCreateWithFlags", e);
  }
  s.stream_ = handle;
  s.device_ = device;
  return s;
}

stream::~stream() {
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

result<void> stream::wait_for(void* producer, int producer_device) {
  if (auto e = cudaSetDevice(producer_device); e != cudaSuccess) {
    return cuda_failure("cudaSetDevice(" + std::to_string(producer_device) + ")", e);
  }
  cudaEvent_t ev = nullptr;
  if (auto e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess) {
    return cuda_failure("cudaEventCreateWithFlags", e);
  }
  auto e = cudaEventRecord(ev, static_cast<cudaStream_t>(producer));
  // Back on this stream's device: the wait is queued there, and the work the caller queues next
  // (a kernel on the current device) belongs there too.
  if (e == cudaSuccess) e = cudaSetDevice(device_);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), ev, 0);
  cudaEventDestroy(ev);  // released once the wait is satisfied
  if (e != cudaSuccess) return cuda_failure("waiting for the producer's stream", e);
  return {};
}

result<void> stream::copy(void* dst, const void* src, std::uint64_t bytes) {
  if (auto e = cudaSetDevice(device_); e != cudaSuccess) return cuda_failure("cudaSetDevice", e);
  if (auto e =
          cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(stream_));
      e != cudaSuccess) {
    return cuda_failure("cudaMemcpyAsync of " + std::to_string(bytes) + " bytes", e);
  }
  return {};
}

result<void> stream::synchronize() {
  if (auto e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)); e != cudaSuccess) {
    return cuda_failure("cudaStreamSynchronize", e);
  }
  return {};
}

namespace {

// The chunked checksums of `ranges`, copying range i to copy_to[i] on the way when given.
result<std::vector<std::uint64_t>> run_chunks(std::span<const device_range> ranges,
                                              std::uint64_t chunk_bytes, void* stream,
                                              const std::vector<void*>* copy_to) {
  if (chunk_bytes < checksum_chunk_min || chunk_bytes > checksum_chunk_max ||
      (chunk_bytes & (chunk_bytes - 1)) != 0) {
    return make_error(errc::invalid_argument, "chunked_checksums: chunk_bytes " +
                                                  std::to_string(chunk_bytes) +
                                                  " is not a power of two from 4096 to 2^30");
  }
  if (auto r = ready(); !r) return r.error();
  std::vector<detail::chunk_job> jobs;
  std::vector<std::size_t> first;  // range i's jobs: [first[i], first[i+1])
  detail::plan_jobs(ranges, chunk_bytes, jobs, first, copy_to);
  std::vector<std::uint64_t> digests(jobs.size());
  // In runs of at most 4 Mi blocks (4 GiB hashed, 256 MiB of block sums): one run for any update
  // up to that, so the scratch the memory pool keeps covers it; larger ones take several.
  constexpr std::uint64_t max_blocks = std::uint64_t{4} << 20;
  for (const auto& run : detail::batch_jobs(jobs, max_blocks)) {
    const char* what = "";
    if (int e =
            detail::chunk_digests(run.jobs, run.blocks, digests.data() + run.first, stream, &what);
        e != 0) {
      return cuda_failure(std::string("chunked checksum: ") + what, static_cast<cudaError_t>(e));
    }
  }
  std::vector<std::uint64_t> out(ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    out[i] = checksum_of_chunks(digests.data() + first[i], first[i + 1] - first[i]);
  }
  return out;
}

}  // namespace

result<std::vector<std::uint64_t>> chunked_checksums(std::span<const device_range> ranges,
                                                     std::uint64_t chunk_bytes, void* stream) {
  return run_chunks(ranges, chunk_bytes, stream, nullptr);
}

result<std::vector<std::uint64_t>> copy_with_checksums(std::span<const device_copy> copies,
                                                       std::uint64_t chunk_bytes, void* stream) {
  std::vector<device_range> ranges;
  std::vector<void*> to;
  for (const auto& c : copies) {
    ranges.push_back({c.src, c.nbytes});
    to.push_back(c.dst);
  }
  return run_chunks(ranges, chunk_bytes, stream, &to);
}

#else  // built without CUDA

namespace {

error not_built() {
  return {errc::blocked, "blocked: built without CUDA (no CUDA toolkit found at configure time)"};
}

}  // namespace

result<void> ready() {
  return not_built();
}

result<std::uint64_t> memory_free(int) {
  return not_built();
}

result<std::string> device_name(int) {
  return not_built();
}

result<device_buffer> device_buffer::make(std::size_t) {
  return not_built();
}

device_buffer::~device_buffer() = default;

result<void> device_buffer::upload(const void*, std::size_t, std::size_t) {
  return not_built();
}

result<void> device_buffer::download(void*, std::size_t, std::size_t) const {
  return not_built();
}

result<void> copy_device(void*, const void*, std::size_t) {
  return not_built();
}

result<std::vector<std::uint64_t>> chunked_checksums(std::span<const device_range>, std::uint64_t,
                                                     void*) {
  return not_built();
}

result<void> copy_to_host(void*, const void*, std::size_t) {
  return not_built();
}

result<std::vector<std::uint64_t>> copy_with_checksums(std::span<const device_copy>, std::uint64_t,
                                                       void*) {
  return not_built();
}

result<int> set_device(int) {
  return not_built();
}

device_kept::device_kept() = default;
device_kept::~device_kept() {
  (void)context_, (void)kept_;  // no device was made current: nothing to put back
}

on_device::on_device(int) : status_(-1) {}  // nothing to switch to without CUDA

result<bool> context_current() {
  return not_built();
}

result<int> device_of(const void*) {
  return not_built();
}

result<stream> stream::make(int) {
  return not_built();
}

stream::~stream() = default;

result<void> stream::wait_for(void*, int) {
  return not_built();
}

result<void> stream::copy(void*, const void*, std::uint64_t) {
  return not_built();
}

result<void> stream::synchronize() {
  return not_built();
}

#endif

// Waits for the work queued on `stream` (none given: nothing to wait for).
static result<void> stream_drained(void* stream) {
  if (!stream) return {};
#if WSYNC_HAVE_CUDA
  if (auto e = cudaStreamSynchronize(static_cast<cudaStream_t>(stream)); e != cudaSuccess) {
    return cuda_failure("cudaStreamSynchronize", e);
  }
  return {};
#else
  return not_built();
#endif
}

result<std::vector<std::uint64_t>> checksums(std::span<const device_range> ranges,
                                             const checksum_method& method, void* stream) {
  if (method.algorithm == checksum_algorithm::xxh3_64_chunked) {
    return chunked_checksums(ranges, method.chunk_bytes, stream);
  }
  // Whole tensors are hashed on the host, after what `stream` still writes into them (the host
  // copies below run on the default stream, which a non-blocking stream does not order).
  if (auto ok = stream_drained(stream); !ok) return ok.error();
  std::vector<std::uint64_t> out;
  std::vector<std::byte> host;
  for (const auto& r : ranges) {
    host.resize(r.nbytes);
    if (auto ok = copy_to_host(host.data(), r.data, r.nbytes); !ok) return ok.error();
    out.push_back(checksum_compute(host.data(), host.size()));
  }
  return out;
}

stream::stream(stream&& other) noexcept
    : stream_(std::exchange(other.stream_, nullptr)), device_(std::exchange(other.device_, -1)) {}

stream& stream::operator=(stream&& other) noexcept {
  if (this != &other) {
    stream gone(std::move(*this));
    stream_ = std::exchange(other.stream_, nullptr);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

device_buffer::device_buffer(device_buffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

device_buffer& device_buffer::operator=(device_buffer&& other) noexcept {
  if (this != &other) {
    device_buffer gone(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace wsync::gpu
