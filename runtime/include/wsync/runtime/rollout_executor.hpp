#pragma once
// The consumer-side entry point: import -> verify -> install -> activate -> acknowledge ->
// release the previous update (readers switch before the coordinator hears of it). On any failure:
// reject with the reason, release the new update, keep the previous version active.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "wsync/runtime/generation_gate.hpp"
#include "wsync/runtime/install_adapter.hpp"
#include "wsync/transports/weight_consumer.hpp"

namespace wsync {

/// Seconds each stage took for one update_weights() call.
struct stage_timings {
  double import = 0, verify = 0, install = 0, ack = 0, release = 0, total = 0;
};

/// What update_weights() did, for the caller to report to the publisher / coordinator.
struct rollout_report {
  update_id id;  ///< the update's name: the update_id of its lowest source rank's shard
  std::vector<update_id> shard_ids;  ///< every shard, in the order given
  std::uint64_t weight_version = 0;
  /// Readers serve the update (even when the consumer's own acknowledge then failed, which only
  /// a concurrent caller on the same weight_consumer causes: logged).
  bool acknowledged = false;
  std::optional<wsync::error> failure;  ///< set when rejected
  std::vector<update_id> released;      ///< shards of the previous update released by this call
  bool released_self = false;           ///< the new shards were released too (rejected, or copied)
  stage_timings timings;
};

struct executor_config {
  bool verify = true;  ///< recompute checksums before installing
};

class rollout_executor {
 public:
  rollout_executor(weight_consumer& consumer, install_adapter& adapter, generation_gate& gate,
                   executor_config config = {});
  ~rollout_executor();

  /// Installs one update — the shards of every publisher rank at one version, switched to
  /// together — or rejects it and keeps the previous version. Never throws. The shards are
  /// kept while the update is imported: shared ones are not copied.
  rollout_report update_weights(std::span<const manifest_ptr> shards);
  rollout_report update_weights(std::span<const weight_update_manifest> shards);
  rollout_report update_weights(const weight_update_manifest& manifest) {
    return update_weights(std::span<const weight_update_manifest>(&manifest, 1));
  }

  /// Version readers see; nullopt before the first successful update. Never waits for an
  /// update in flight, so a reader may call it inside the gate.
  std::optional<std::uint64_t> active_weight_version() const;
  std::optional<update_id> active_update() const;

  /// Releases the imports still held for the active weights (at shutdown) and returns their
  /// ids, for the caller to report. Waits for the generations in flight, like an install's
  /// switch, so never call it from inside one. An adapter whose weights view those imports
  /// is deactivated first; where that leaves readers no weights, the active version is
  /// cleared too.
  std::vector<update_id> release_active();

 private:
  result<void> import_and_stage(std::span<const manifest_ptr> shards, rollout_report& report,
                                std::vector<update_id>& imported_ids,
                                std::chrono::steady_clock::time_point& t);

  weight_consumer& consumer_;
  install_adapter& adapter_;
  generation_gate& gate_;
  executor_config config_;
  mutable std::mutex mutex_;  ///< one update at a time
  /// Guards the two below, which change under the exclusive gate; never held while waiting.
  mutable std::mutex active_mutex_;
  std::optional<std::uint64_t> active_version_;
  std::optional<update_id> active_id_;
  std::vector<update_id> held_;  ///< imports kept alive for the active weights
};

}  // namespace wsync
