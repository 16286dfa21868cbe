#pragma once
// `wsync bench`: times one transport end to end (publish -> import -> verify -> install -> ack ->
// release) against baselines measured in the same run, and prints JSON rows (docs/benchmark.md).

#include <cstdint>
#include <ostream>
#include <string>

namespace wsync {

struct bench_options {
  /// "local", "shared-memory", "file-mmap", "ucx", or a GPU mode: "cuda-ipc", "cuda-vmm",
  /// "nccl", "gpu-checksum"
  std::string mode = "shared-memory";
  bool smoke = false;       ///< small and quick: 8 MiB in 16 tensors, 3 repeats
  std::string layout;       ///< model layout name; empty: qwen2.5-0.5b or --bytes
  std::uint64_t bytes = 0;  ///< synthetic layout size (with `tensors`)
  std::uint64_t tensors = 0;
  unsigned repeat = 5;
  bool verify = true;
  unsigned copy_threads = 2;
  unsigned slots = 2;  ///< slots of the ring (file-mmap: buffers)
  /// file-mmap mode: where to make the run's directory (a fresh fmm-bench-* folder inside it,
  /// removed afterwards); /dev/shm measures tmpfs, /var/tmp a disk.
  std::string dir = "/var/tmp";
  /// ucx mode: UCX_TLS of both processes and of the ucx_perftest baseline; empty runs two rows,
  /// "tcp" and "sm" (shared memory).
  std::string ucx_tls;
  std::uint64_t ucx_chunk_bytes = 0;  ///< ucx mode: pull chunk size; 0 = the transport's default
  /// Tensor checksums by the chunked method with this chunk size (0: xxh3-64 of whole tensors;
  /// gpu-checksum mode: 0 means 1 MiB).
  std::uint64_t checksum_chunk_bytes = 0;
};

/// Runs the benchmark; prints one JSON row per timed update and the result row last.
/// Returns 0 for "pass", 1 for "fail", 2 for "blocked".
int bench_run(const bench_options& options, std::ostream& out);

}  // namespace wsync
