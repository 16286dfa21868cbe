#pragma once
// What the point-to-point benchmark (bench.cpp) measures itself against, in the same run: a
// single-thread memcpy and xxh3 over the source tensors, and ucx_perftest between two processes
// on loopback. Also the source memory both the run and the memcpy baseline use.

#include <csignal>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace wsync {

/// Anonymous memory for the source tensors, faulted in up front (huge pages where allowed).
class host_buffer {
 public:
  /// Maps max(n, 1) bytes, zeroed; throws std::bad_alloc when the mapping fails.
  explicit host_buffer(std::uint64_t n);
  ~host_buffer();
  host_buffer(const host_buffer&) = delete;
  host_buffer& operator=(const host_buffer&) = delete;
  std::byte* data() const { return data_; }
  std::uint64_t size() const { return size_; }

 private:
  std::uint64_t size_;
  std::byte* data_;
};

/// `bytes` moved in `seconds`, in GB/s; 0 when no time was measured.
inline double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? bytes / seconds / 1e9 : 0;
}

/// Single-thread memcpy into pre-faulted memory and single-thread xxh3, in GB/s.
struct copy_baselines {
  double memcpy_gbps = 0;
  double hash_gbps = 0;
};

/// Medians of `repeat` rounds of each over the `n` bytes at `source`, after one untimed round.
copy_baselines copy_baselines_measure(const std::byte* source, std::uint64_t n, unsigned repeat);

/// Median seconds of `repeat` rounds (after one untimed) of the real /bin/cp copying a file of
/// the `n` bytes at `source` into a new file of `dir` (the target removed before each round);
/// with `then_sync`, each round also runs `/bin/sync -d` on the copy (cp itself never syncs).
/// nullopt with the reason in *why when a round failed.
std::optional<double> cp_seconds(const std::string& dir, const std::byte* source, std::uint64_t n,
                                 unsigned repeat, bool then_sync, std::string* why);

/// The bandwidth ucx_perftest reports for `test` ("tag_bw", "ucp_get") between two processes on
/// loopback, in GB/s; nullopt with the reason in *why when it could not be measured. Gives up
/// (killing both) once `*stop` is set, when given (the bench's SIGINT/SIGTERM flag).
std::optional<double> perftest_gbps(const std::string& tls, const std::string& test,
                                    std::uint64_t message_bytes, std::string* why,
                                    const volatile sig_atomic_t* stop = nullptr);

}  // namespace wsync
