#pragma once
// The nccl transport: a publisher (NCCL rank 0) broadcasts each wsync update to a fixed set of
// consumer ranks over one communicator, in bucket_bytes slices, into the consumers' own pooled
// device memory. The communicator's unique id travels in the transport handle, so the
// coordinator carries it inside the manifest, never in tensor data.
//
// A broadcast is collective: every member takes part in every update, in the order the
// publisher exposed them. Each update goes out behind a 64-byte header (its sequence number and
// size), so a consumer that skipped an update (it rejected it, or a catch-up jumped past it)
// receives and drops it on the way to the one it asked for, and a consumer can never take one
// update's bytes for another's. A member that fails or misses the deadline aborts the
// communicator; every member's call then fails with the reason, and the publisher's next update
// builds a new communicator (a new epoch in the handle) with the same members.
//
// The group is an interface (group_fabric): NCCL on a CUDA device in production (cuda_fabric),
// host memory and threads in the tests, so the whole protocol runs in CI.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "wsync/manifest/result.hpp"
#include "wsync/transports/nccl.hpp"
#include "wsync/transports/nccl_receiver.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync::nccl {

/// One member's hold on a joined group. Collectives run in the order they were queued; one
/// thread drives a member at a time.
class group_member {
 public:
  virtual ~group_member() = default;
  /// Queues a broadcast of `nbytes` at `data` (the fabric's memory) from rank `root`: the root
  /// sends, every other member receives into its own `data`. Queuing that is still waiting (for
  /// the peers' connections) at `deadline` aborts the group.
  virtual result<void> broadcast(std::byte* data, std::uint64_t nbytes, int root,
                                 std::chrono::steady_clock::time_point deadline) = 0;
  /// Queues a copy of `nbytes` from `src` (host memory, or device memory this device can read)
  /// to `dst` (the fabric's memory), after everything queued before it.
  virtual result<void> copy(std::byte* dst, const std::byte* src, std::uint64_t nbytes) = 0;
  /// Waits for everything queued. At `deadline`, or when a member failed, the group is aborted
  /// and the call fails naming why; every later call fails the same way.
  virtual result<void> wait(std::chrono::steady_clock::time_point deadline) = 0;
  /// Aborts the group (ncclCommAbort): queued work ends here and fails at the peers. When it
  /// returns, no queued copy still reads its source.
  virtual void abort(const std::string& why) = 0;
  /// Empty while usable; why not once aborted.
  virtual std::string broken() const = 0;
};

/// Where groups are joined and their memory allocated.
class group_fabric {
 public:
  virtual ~group_fabric() = default;
  /// Where allocate()'s memory lives.
  virtual memory_location memory() const = 0;
  /// A new group's id, made by its rank 0.
  virtual result<unique_id> make_id() = 0;
  /// Joins the group of `id` as `rank` of `world`; fails at `timeout` when not every member
  /// came. Once `*cancel` (when not null; it outlives the member) is set, from any thread, the
  /// join and every later wait of the member end promptly: the group is aborted and the call
  /// fails naming that.
  virtual result<std::unique_ptr<group_member>> join(const unique_id& id, int world, int rank,
                                                     std::chrono::milliseconds timeout,
                                                     const std::atomic<bool>* cancel) = 0;
  virtual result<block> allocate(std::uint64_t nbytes) = 0;
  /// Copies host bytes into memory(); done (visible to every stream) when it returns.
  virtual result<void> write(std::byte* dst, const void* src, std::uint64_t nbytes) = 0;
  /// Copies memory() bytes, which no queued work still writes, to the host.
  virtual result<void> read(void* dst, const std::byte* src, std::uint64_t nbytes) = 0;
  /// Waits for the reads the importing program queued on memory()'s default stream (where
  /// imports are read), so a released buffer can be received into again. Host memory has none.
  virtual void reads_done() {}
};

/// NCCL on CUDA device `device`. errc::blocked where NCCL cannot run here (nccl::ready()).
result<std::shared_ptr<group_fabric>> cuda_fabric(int device);

/// Makes the fabric for the `device` option.
using fabric_factory = std::function<result<std::shared_ptr<group_fabric>>(int device)>;

/// The transport's settings (docs/transports.md, "NCCL").
struct transport_settings {
  std::vector<std::int32_t> consumers{0};  ///< wsync ranks receiving, NCCL ranks 1.. in order
  int device = 0;
  std::uint64_t slots = 2;                                ///< pooled update buffers per side
  std::uint64_t bucket_bytes = std::uint64_t{256} << 20;  ///< most bytes one broadcast moves
  unsigned buckets = 2;                                   ///< broadcasts queued before each wait
  std::chrono::milliseconds timeout{60000};               ///< join plus one update, per member
};

/// Reads the options: consumers (comma-separated wsync consumer ranks, default "0"), device
/// (0), slots (1-64, 2), bucket_bytes (1 MiB-16 GiB, 256 MiB), buckets (1-16, 2), timeout_ms
/// (1-3600000, 60000). An unknown key or a bad value is errc::invalid_argument naming it.
result<transport_settings> settings_read(const transport_options& options);

/// The transport over the fabric `make_fabric(settings.device)` gives.
result<std::unique_ptr<transport>> make_transport(const transport_options& options,
                                                  const fabric_factory& make_fabric);

}  // namespace wsync::nccl
