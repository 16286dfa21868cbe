#pragma once
// NCCL for wsync, in plain C++ (no CUDA or NCCL header here): whether NCCL can run on this
// machine, its unique ids, and one rank's membership in a communicator. The library is loaded at
// run time (libnccl.so.2, or the path in WSYNC_NCCL_LIBRARY), so a CUDA build starts on a machine
// without NCCL and answers blocked there. Communicators run in NCCL's non-blocking mode: no call
// waits past its deadline, and a missed deadline or a peer's failure aborts the communicator
// (ncclCommAbort) instead of hanging.

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "wsync/manifest/result.hpp"

namespace wsync::nccl {

/// The bytes of ncclUniqueId: what every member of one communicator joins with.
inline constexpr std::size_t unique_id_bytes = 128;
using unique_id = std::array<std::byte, unique_id_bytes>;

/// Standard (RFC 4648, padded) base64 of an id: vLLM's init_info.nccl_unique_id_b64.
std::string unique_id_to_base64(const unique_id& id);
/// The id `text` encodes; errc::invalid_argument when it is not standard padded base64 (the
/// URL-safe alphabet is refused, as vLLM does) or does not decode to exactly 128 bytes.
result<unique_id> unique_id_from_base64(std::string_view text);

/// Nothing when NCCL can run here; otherwise errc::blocked with the cause:
/// "blocked: built without CUDA (...)", "blocked: no CUDA device (...)", or
/// "blocked: NCCL library not loadable (<dlerror>); set WSYNC_NCCL_LIBRARY to libnccl.so.2's
/// path".
result<void> ready();

/// The loaded library's version, "2.28.9".
result<std::string> version();

/// A new id (ncclGetUniqueId): made by the root and carried to the other members.
result<unique_id> make_unique_id();

/// One rank's membership in a communicator, on one CUDA device. Not thread-safe: one thread
/// drives it at a time.
class communicator {
 public:
  /// Joins the communicator of `id` as `rank` of `nranks` on CUDA device `device`. Every member
  /// must join at about the same time; at `timeout` the join is aborted and fails with
  /// errc::timeout. Once `*cancel` (when given; it must outlive the communicator) is set, from
  /// any thread, the join and every later wait end: the communicator is aborted and the call
  /// fails with errc::io_error ("cancelled").
  static result<communicator> join(const unique_id& id, int nranks, int rank, int device,
                                   std::chrono::milliseconds timeout,
                                   const std::atomic<bool>* cancel = nullptr);

  communicator();
  communicator(communicator&& other) noexcept;
  communicator& operator=(communicator&& other) noexcept;
  communicator(const communicator&) = delete;
  communicator& operator=(const communicator&) = delete;
  /// Destroys the communicator (aborts it when work may still be queued).
  ~communicator();

  int rank() const;
  int size() const;
  int device() const;
  /// The communicator's own stream (a cudaStream_t): broadcast() and wait() use it when given
  /// nullptr.
  void* stream() const;

  /// vLLM's warm-up after joining: an all-reduce (sum) of one float, waited for.
  result<void> warm_up(std::chrono::milliseconds timeout);

  /// Queues a broadcast of `nbytes` at `data` (device memory of device()) from rank `root` on
  /// `stream`: the root sends its bytes, every other member receives into its own. Queuing may
  /// wait (NCCL connects to the peers at the first collective); at `deadline` the communicator
  /// is aborted and the call fails with errc::timeout.
  result<void> broadcast(void* data, std::uint64_t nbytes, int root,
                         std::chrono::steady_clock::time_point deadline, void* stream = nullptr);

  /// Waits until everything queued on `stream` is done, watching the communicator for a peer's
  /// failure. At `deadline`, or on a failure, the communicator is aborted and the call fails
  /// (errc::timeout or errc::io_error) naming why; every later call then fails the same way.
  result<void> wait(std::chrono::steady_clock::time_point deadline, void* stream = nullptr);

  /// Aborts the communicator (ncclCommAbort): queued collectives end, here and, through NCCL's
  /// error handling, at the peers. `why` becomes the reason later calls give.
  void abort(const std::string& why);

  /// Empty while usable; the reason once aborted.
  const std::string& aborted() const;

  struct state;

 private:
  std::unique_ptr<state> state_;
};

}  // namespace wsync::nccl
