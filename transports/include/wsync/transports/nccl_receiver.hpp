#pragma once
// The receiving side of vLLM's NCCL weight transfer: a rollout rank joined the trainer's group
// (the trainer is rank 0), and each /update_weights names tensors (names / dtype_names /
// shapes) that the trainer broadcasts in names order, one broadcast per tensor or, packed, one
// per group of tensors (transports/nccl/plan.hpp). receive_tensors() lands them in one segment of
// the rank's own memory, each tensor at a 256-byte-aligned offset, ready to become a wsync
// update. The communicator side is an interface: NCCL in production (join_endpoint), an
// in-process trainer in the tests, so the pipeline is tested on machines without a GPU.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/dtype.hpp"
#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/transports/nccl.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync::nccl {

/// One tensor of an update_info, in names order.
struct tensor_spec {
  std::string name;
  wsync::dtype dtype = wsync::dtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t nbytes = 0;
};

/// How the trainer broadcasts (vLLM's init_info / update_info fields).
struct packing {
  bool packed = false;                                  ///< packed
  std::uint64_t buffer_bytes = std::uint64_t{1} << 30;  ///< packed_buffer_size_bytes
  unsigned buffers = 2;                                 ///< packed_num_buffers (trainer side)
};

/// Memory an endpoint allocated; freed when the last copy of `owner` goes.
struct block {
  std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
  std::shared_ptr<void> owner;
};

/// The receiving member of a group whose rank 0 broadcasts. Work is queued in order and runs
/// in that order; wait() waits for all of it.
class broadcast_endpoint {
 public:
  virtual ~broadcast_endpoint() = default;
  /// Where allocate()'s memory lives.
  virtual memory_location memory() const = 0;
  virtual result<block> allocate(std::uint64_t nbytes) = 0;
  /// Queues receiving rank 0's next broadcast, which must be exactly into.size() bytes; queuing
  /// still waiting at `deadline` aborts the group.
  virtual result<void> receive(std::span<std::byte> into,
                               std::chrono::steady_clock::time_point deadline) = 0;
  /// Queues a copy inside memory(), after everything queued before it. A copy that cannot be
  /// queued aborts the group (the receives queued before it would otherwise land in memory the
  /// caller then frees).
  virtual result<void> copy(std::byte* dst, const std::byte* src, std::uint64_t nbytes) = 0;
  /// Waits for everything queued. At `deadline`, or when a member fails, the group is aborted:
  /// the call fails and so does every later one.
  virtual result<void> wait(std::chrono::steady_clock::time_point deadline) = 0;
  /// The checksum of each range (in memory(), after wait()) by `method`.
  virtual result<std::vector<std::uint64_t>> checksums(
      std::span<const std::span<const std::byte>> ranges, const checksum_method& method) = 0;
  /// Aborts the group (this member's side): every later call fails. For a receiver that can no
  /// longer take rank 0's broadcasts in step (it could not allocate, say): matching later
  /// broadcasts to the wrong receives would install the wrong bytes.
  virtual void abort(const std::string& why) = 0;
  /// Empty while usable; why not once the group was aborted.
  virtual std::string broken() const = 0;
  /// "NCCL rank 1 of 2 on cuda:0" and the like, for messages.
  virtual std::string describe() const = 0;
};

/// Joins the NCCL group of `id` as `rank` of `world` on CUDA device `device` and runs vLLM's
/// warm-up (a one-element all_reduce), within `timeout`. errc::blocked where NCCL cannot run
/// here (nccl::ready()). Once `*cancel` (when given; it must outlive the endpoint) is set, from
/// any thread, the join and every later wait fail at once with errc::io_error ("cancelled").
result<std::unique_ptr<broadcast_endpoint>> join_endpoint(
    const unique_id& id, int world, int rank, int device, std::chrono::milliseconds timeout,
    const std::atomic<bool>* cancel = nullptr);

/// One /update_weights' tensors, received.
struct received_tensors {
  block segment;                       ///< every tensor, at offsets[i]
  std::vector<std::uint64_t> offsets;  ///< per spec, 256-byte aligned
  std::vector<std::uint64_t> checksums;
  std::uint64_t staging_bytes = 0;  ///< memory used beyond the segment (packed: one group)
};

/// Receives `specs` as the trainer broadcasts them under `how` (packed: into one staging buffer
/// of the largest group, each tensor then copied to its place), waits for the last byte, and
/// computes each tensor's checksum by `method`. On failure nothing is kept.
result<received_tensors> receive_tensors(broadcast_endpoint& endpoint,
                                         std::span<const tensor_spec> specs, const packing& how,
                                         const checksum_method& method,
                                         std::chrono::steady_clock::time_point deadline);

}  // namespace wsync::nccl
