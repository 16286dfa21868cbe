#pragma once
// WeightConsumer: the rollout-side lifecycle over any consumer_transport. Validates manifests,
// enforces monotonic versions, imports, verifies checksums and walks each update through the
// one lifecycle state machine (wsync/manifest/lifecycle.hpp).

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/lifecycle.hpp"
#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"
#include "wsync/transports/transport.hpp"

namespace wsync {

/// Read-only view of one imported tensor; valid until its update is released.
struct tensor_view {
  const tensor_descriptor* descriptor = nullptr;
  const std::byte* data = nullptr;  ///< a device address when the update's memory is a device
};

/// A manifest several holders read: the ranks of one process import one decoded manifest each,
/// and none copies it.
using manifest_ptr = std::shared_ptr<const weight_update_manifest>;

/// An imported update: the manifest and its tensors, zero-copy where the transport allows.
struct imported_update {
  explicit imported_update(manifest_ptr m) : shared(std::move(m)), manifest(*shared) {}
  imported_update(const imported_update&) = delete;
  imported_update& operator=(const imported_update&) = delete;

  memory_location memory;     ///< where segments and tensor views live (the transport's memory())
  const manifest_ptr shared;  ///< keeps `manifest` alive
  const weight_update_manifest& manifest;
  std::vector<std::span<const std::byte>> segments;
  std::vector<tensor_view> tensors;  ///< same order as manifest.tensors
};

struct consumer_config {
  std::int32_t rank = 0;
  unsigned verify_threads = 2;  ///< threads that recompute checksums in verify() (large updates)
};

/// Thread-safe bookkeeping, but one update's calls must not overlap: verify() reads the bytes
/// without the lock, so release() of the same update must wait for it (the rollout executor
/// serialises them).
class weight_consumer {
 public:
  weight_consumer(std::unique_ptr<consumer_transport> transport, consumer_config config);
  ~weight_consumer();
  weight_consumer(const weight_consumer&) = delete;
  weight_consumer& operator=(const weight_consumer&) = delete;

  /// Validates the manifest, applies the version rule, and imports the bytes. The rule, per
  /// model: the version must be above the active one (the highest acknowledged), not below one
  /// still being imported, and a source rank's shard of a version is taken once while it is
  /// held. A rejected or released version may therefore come again (a retry, with new update
  /// ids). The returned pointer stays valid until release(update_id). The first form copies the
  /// manifest; the second keeps a reference to it.
  result<const imported_update*> import_update(const weight_update_manifest& manifest);
  result<const imported_update*> import_update(manifest_ptr manifest);
  /// Recomputes every tensor checksum (device memory: on that device); a difference is "tensor
  /// checksum mismatch" naming the tensor.
  result<void> verify(const update_id& id);
  /// Whether the imported bytes are still the ones published (consumer_transport::intact):
  /// after copying them out, a success means the copy is whole.
  result<void> intact(const update_id& id) const;
  /// Records that the install adapter took the update.
  result<void> mark_installed(const update_id& id);
  result<void> acknowledge(const update_id& id);
  /// Records a failure reason; the update may then only be released.
  result<void> reject(const update_id& id, std::string reason);
  /// Gives the bytes back to the transport; the update's views become invalid.
  result<void> release(const update_id& id);

  result<update_state> state(const update_id& id) const;
  std::int32_t rank() const { return config_.rank; }
  /// The owner shuts down (consumer_transport::closing): an import still running in another
  /// thread may end now, failed, and later ones fail at once.
  void closing() { transport_->closing(); }
  /// consumer_transport::import_source of a recent import.
  std::string import_source(const update_id& id) const { return transport_->import_source(id); }

 private:
  struct entry {
    update_state state = update_state::announced;
    std::unique_ptr<imported_update> update;
    std::string reason;
    bool verify_failed = false;  ///< a checksum differed: never installed or acknowledged
  };
  result<void> step(const update_id& id, update_event event);
  /// Every tensor's checksum by the manifest's method.
  result<std::vector<std::uint64_t>> checksums_of(const imported_update& u) const;
  std::string context(const update_id& id) const;

  std::unique_ptr<consumer_transport> transport_;
  consumer_config config_;
  mutable std::mutex mutex_;
  std::map<update_id, entry> updates_;
  struct model_versions {
    std::optional<std::uint64_t> active;  ///< the highest acknowledged version
    /// Versions imported and neither acknowledged, rejected nor released: source ranks held.
    std::map<std::uint64_t, std::multiset<std::int32_t>> held;
  };
  /// The update left the "held" set (acknowledged, rejected or released); mutex_ held.
  void version_done_locked(const imported_update& u, bool acknowledged);
  /// Takes one hold of m's version and shard back (a failed import, or version_done_locked).
  void unhold_locked(const weight_update_manifest& m);
  std::map<std::string, model_versions> versions_;           ///< per model_id
  std::deque<std::pair<update_id, update_state>> finished_;  ///< recent terminal states
};

}  // namespace wsync
