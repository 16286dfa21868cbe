#pragma once
// The GPU side of the data plane, in plain C++ (no CUDA header here): whether GPU work can run on
// this machine, device memory for tests and benchmarks, and chunked checksums computed by a CUDA
// kernel. Built with the CUDA toolkit (WSYNC_WITH_CUDA, cmake/wsync_dependencies.cmake); without
// it every call answers errc::blocked naming that.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync::gpu {

/// Nothing when a CUDA device can be used; otherwise errc::blocked with the exact cause:
/// "blocked: built without CUDA (no CUDA toolkit found at configure time)" or
/// "blocked: no CUDA device (<CUDA error name>: <CUDA error text>)".
result<void> ready();

/// Free bytes of device memory on `device` now (cudaMemGetInfo).
result<std::uint64_t> memory_free(int device = 0);

/// "NVIDIA H100 80GB HBM3" and the like, for benchmark rows.
result<std::string> device_name(int device = 0);

/// A device allocation on the current device (RAII).
class device_buffer {
 public:
  static result<device_buffer> make(std::size_t bytes);
  device_buffer() = default;
  device_buffer(device_buffer&& other) noexcept;
  device_buffer& operator=(device_buffer&& other) noexcept;
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer();

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  result<void> upload(const void* host, std::size_t bytes, std::size_t offset = 0);
  result<void> download(void* host, std::size_t bytes, std::size_t offset = 0) const;

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Copies `bytes` between two device allocations and waits for the copy: the device-to-device
/// baseline benchmarks compare with.
result<void> copy_device(void* dst, const void* src, std::size_t bytes);

/// Copies `bytes` from device (or host) memory to host memory and waits for the copy.
result<void> copy_to_host(void* dst, const void* src, std::size_t bytes);

/// A CUDA stream of its own on one device (RAII): the publisher's copies run on it.
class stream {
 public:
  static result<stream> make(int device);
  stream() = default;
  stream(stream&& other) noexcept;
  stream& operator=(stream&& other) noexcept;
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream();

  void* handle() const { return stream_; }  ///< a cudaStream_t
  int device() const { return device_; }
  /// Later work on this stream waits for what `producer` (a cudaStream_t on `producer_device`;
  /// nullptr: that device's legacy default stream) has queued so far; the host does not wait.
  /// Leaves this stream's device current.
  result<void> wait_for(void* producer, int producer_device);
  /// Queues a copy of `bytes` from `src` to `dst`, each in host or device memory.
  result<void> copy(void* dst, const void* src, std::uint64_t bytes);
  /// Waits until everything queued on this stream is done.
  result<void> synchronize();

 private:
  void* stream_ = nullptr;
  int device_ = -1;
};

/// Makes `device` current on the calling thread (kernels and the default stream it then starts
/// run there); returns the device that was current, for the caller to put back.
result<int> set_device(int device);

/// Puts back, when it goes, the CUDA context that was current on this thread when it was made
/// (none included: then none is made, where putting back "device 0" would create a context on
/// a GPU the process never used). The calls that switch devices run on threads that are not
/// wsync's (a trainer's, an HTTP pool's), whose current device belongs to the code around
/// them. Does nothing without CUDA or a driver.
class device_kept {
 public:
  device_kept();
  ~device_kept();
  device_kept(const device_kept&) = delete;
  device_kept& operator=(const device_kept&) = delete;

 private:
  void* context_ = nullptr;  ///< a CUcontext; nullptr: none was current
  bool kept_ = false;        ///< the context could be read, so it is put back
};

/// Makes `device` current for a scope (cudaSetDevice), then puts the caller's context back as
/// device_kept does. status(): the cudaError_t of the switch, 0 when it was made.
class on_device {
 public:
  explicit on_device(int device);
  int status() const { return status_; }

 private:
  device_kept kept_;  // first: reads the caller's context before the switch
  int status_ = 0;
};

/// Whether the calling thread has a CUDA context current (false for a thread that never used
/// CUDA); blocked without CUDA or a driver.
result<bool> context_current();

/// The CUDA device of `p` (a device pointer, or host memory CUDA mapped for a device), or -1 for
/// host memory CUDA does not know.
result<int> device_of(const void* p);

/// Bytes in device memory.
struct device_range {
  const void* data = nullptr;
  std::uint64_t nbytes = 0;
};

/// The checksum of each range by the chunked method (xxh3-64-chunked with `chunk_bytes`; see
/// wsync/manifest/checksum.hpp), computed on the current device on `stream` (a cudaStream_t;
/// nullptr: the default stream). Waits for the result. Scratch: 64 bytes per KiB hashed, in runs
/// of at most 4 GiB hashed (256 MiB).
result<std::vector<std::uint64_t>> chunked_checksums(std::span<const device_range> ranges,
                                                     std::uint64_t chunk_bytes,
                                                     void* stream = nullptr);

/// One range to copy on the device: `src` readable by the device (device memory, or host memory
/// mapped for it), `dst` device memory.
struct device_copy {
  void* dst = nullptr;
  const void* src = nullptr;
  std::uint64_t nbytes = 0;
};

/// Copies every range and returns the xxh3-64-chunked checksum of each, in one pass over the
/// bytes (each read once: the kernel that hashes a block writes it), on `stream`; waits for the
/// result. What publishing device tensors into device slots does.
result<std::vector<std::uint64_t>> copy_with_checksums(std::span<const device_copy> copies,
                                                       std::uint64_t chunk_bytes,
                                                       void* stream = nullptr);

/// The checksum of each range by `method`, computed on the device: xxh3-64-chunked by the
/// kernel; whole-tensor xxh3-64, which cannot be split, on the host from a copy of each range.
result<std::vector<std::uint64_t>> checksums(std::span<const device_range> ranges,
                                             const checksum_method& method, void* stream = nullptr);

}  // namespace wsync::gpu
