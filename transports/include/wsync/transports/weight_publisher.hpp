#pragma once
// WeightPublisher: the trainer-side lifecycle over any publisher_transport. Packs tensors into
// 256-byte-aligned segments, copies and checksums them in one pass, builds the manifest,
// enforces monotonic versions and releases memory once every expected consumer is done.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/transports/gpu.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync {

/// A tensor offered for publishing, in host memory or on a CUDA device; its bytes must stay
/// valid while publish() runs.
struct tensor_source {
  std::string name;
  wsync::dtype dtype = wsync::dtype::f32;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  ///< in elements; empty = contiguous row-major
  const std::byte* data = nullptr;    ///< a device address when cuda_device >= 0
  std::uint64_t nbytes = 0;
  int cuda_device = -1;  ///< -1: host memory; N: `data` is on CUDA device N
  /// The cudaStream_t that produces the tensor (device tensors; nullptr: the legacy default
  /// stream): the publisher's copies wait for the work queued on it, the host does not.
  void* stream = nullptr;
};

struct publisher_config {
  std::string model_id;
  std::string source_worker;  ///< empty: "<hostname>:<pid>"
  std::int32_t source_rank = 0;
  std::uint64_t max_segment_bytes = std::uint64_t{256} << 20;
  std::chrono::milliseconds slot_wait{10000};
  unsigned copy_threads = 2;  ///< threads that copy and checksum; 1 disables the pool
  /// How tensor checksums are computed; the chunked method lets consumers (and GPUs) verify one
  /// large tensor on many threads. A transport whose segments live on a GPU always uses the
  /// chunked method (this chunk size, or 1 MiB): whole-tensor xxh3-64 cannot run in parallel.
  checksum_method checksum;
  /// true: memory goes back when every expected consumer released or failed (on_* calls).
  /// false: only release(update_id) gives it back — for a coordinator that does the per-rank
  /// bookkeeping itself.
  bool release_when_answered = true;
  /// true: a coordinator orders the versions (trainer_rank). Publishing the last version again
  /// is then allowed while its earlier publication is still held: the coordinator accepts the
  /// retry once the aborted attempt was released, or refuses it if that version committed.
  bool coordinator_orders_versions = false;
  /// true: where the transport can (publisher_transport::can_lend; nccl), it sends each update
  /// straight from the caller's tensors instead of from a copy in its own memory, so the device
  /// memory the transport holds stays bounded (nccl: buckets x bucket_bytes). The caller then
  /// keeps every tensor valid and unchanged until lent_wait(update_id) or release returned.
  bool lend_sources = false;
};

/// What the publisher knows of one consumer rank for one update.
enum class consumer_outcome { pending, acknowledged, rejected, failed, released };
std::string_view consumer_outcome_name(consumer_outcome o);

struct consumer_report {
  consumer_outcome outcome = consumer_outcome::pending;
  bool acknowledged = false;  ///< kept after release so the final table still shows it
  std::string reason;
};

/// Per-update status: which update it is and each expected consumer's answer. (Not the
/// manifest: publish returned that, and a copy of every tensor's descriptor per update would
/// cost each publish a few hundred allocations for nothing the publisher reads.)
struct publication {
  update_id id;
  std::uint64_t weight_version = 0;
  std::map<std::int32_t, consumer_report> consumers;
  bool memory_released = false;
};

/// Splits tensors into segments of at most `max_segment_bytes` (a larger tensor gets a segment
/// of its own), each tensor 256-byte aligned. Fills descriptors (checksum left 0) and sizes.
result<void> pack_tensors(std::span<const tensor_source> tensors, std::uint64_t max_segment_bytes,
                          std::vector<tensor_descriptor>& descriptors,
                          std::vector<segment_descriptor>& segments);

class weight_publisher {
 public:
  weight_publisher(std::unique_ptr<publisher_transport> transport, std::string transport_name,
                   publisher_config config);
  ~weight_publisher();
  weight_publisher(const weight_publisher&) = delete;
  weight_publisher& operator=(const weight_publisher&) = delete;

  /// Publishes one complete update for `expected_consumers` ranks. Fails with
  /// "weight_version must increase monotonically" when the version is below the last one
  /// published, or equal to it while a publication of it is still held (a retry of a failed
  /// version comes once that publication was released), and with
  /// invalid_argument naming the tensor when a source is inconsistent. Nothing stays acquired
  /// on failure.
  result<weight_update_manifest> publish(std::span<const tensor_source> tensors,
                                         std::uint64_t weight_version,
                                         std::vector<std::int32_t> expected_consumers,
                                         std::map<std::string, std::string> metadata = {});

  /// Records a consumer's answer. Errors: unknown update_id, an unexpected rank, or a second
  /// answer from the same rank.
  result<void> on_acknowledged(const update_id& id, std::int32_t rank);
  result<void> on_rejected(const update_id& id, std::int32_t rank, std::string reason);
  /// The consumer dropped its hold (released) or died (failed); when every expected consumer is
  /// released or failed, the transport memory is released.
  result<void> on_released(const update_id& id, std::int32_t rank);
  result<void> on_failed(const update_id& id, std::int32_t rank, std::string reason);
  /// Waits until the transport stopped reading the tensors of `id` that lend_sources lent it
  /// (its transfer ended); returns at once when nothing was lent.
  result<void> lent_wait(const update_id& id, std::chrono::milliseconds wait);
  /// Releases the update's memory now, whatever consumers said (abort, deadline).
  result<void> release(const update_id& id);

  /// Snapshot of an update's status; unknown_update once it was forgotten.
  result<publication> status(const update_id& id) const;
  /// Highest published version, 0 before the first publish.
  std::uint64_t last_version() const;
  /// Ids whose memory is still held.
  std::vector<update_id> held_updates() const;

 private:
  result<void> report(const update_id& id, std::int32_t rank, consumer_outcome outcome,
                      std::string reason);
  /// Computes each tensor's checksum where it lies (lend_sources), after the work queued on its
  /// producing stream.
  result<void> checksums_in_place(std::span<const tensor_source> tensors,
                                  std::vector<tensor_descriptor>& descs,
                                  const checksum_method& method);
  /// Runs digest(tensor, offset, nbytes) over every checksum piece of `descs` on up to
  /// copy_threads threads and sets each tensor's checksum from its pieces.
  template <class Digest>
  void hash_pieces(std::vector<tensor_descriptor>& descs, const checksum_method& method,
                   Digest digest);
  result<void> copy_all(std::span<const tensor_source> tensors,
                        std::vector<tensor_descriptor>& descs,
                        const std::vector<std::span<std::byte>>& dest,
                        const checksum_method& method);
  /// The device path: copies on the publisher's stream, checksums by the GPU kernel.
  result<void> copy_to_device(std::span<const tensor_source> tensors,
                              std::vector<tensor_descriptor>& descs,
                              const std::vector<std::span<std::byte>>& dest,
                              const checksum_method& method);
  /// The publisher's CUDA stream on `device`, made at first need; mutex_ not held.
  result<gpu::stream*> stream_on(int device);
  void maybe_release_locked(publication& p);
  /// Why `weight_version` may not be published now, or nullopt; mutex_ held.
  std::optional<error> version_refusal_locked(std::uint64_t weight_version,
                                              const weight_update_manifest& m) const;

  std::unique_ptr<publisher_transport> transport_;
  std::string transport_name_;
  publisher_config config_;
  std::mutex stream_mutex_;
  /// Per device, the stream its copies run on (made at first need, kept: concurrent publishes
  /// may hold a pointer to one).
  std::map<int, std::unique_ptr<gpu::stream>> streams_;
  mutable std::mutex mutex_;
  std::uint64_t last_version_ = 0;
  bool published_any_ = false;
  std::map<update_id, publication> updates_;
  std::vector<update_id> order_;  ///< publish order, to forget the oldest finished updates
};

}  // namespace wsync
