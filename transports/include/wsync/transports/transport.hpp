#pragma once
// The data-plane contract. A transport implements only how segment bytes are exported and
// imported; the lifecycle (versions, acks, releases) lives once, above it, in WeightPublisher
// and WeightConsumer.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "wsync/manifest/manifest.hpp"
#include "wsync/manifest/result.hpp"

namespace wsync {

/// What a transport can honestly do; the selector trusts these.
struct transport_caps {
  bool cpu_memory = false;
  bool gpu_memory = false;
  bool cross_process = false;  ///< publisher and consumer may be different processes
  bool cross_node = false;     ///< ... on different hosts
  bool zero_copy_import = false;
  /// Every consumer takes part in each transfer (a broadcast): the publisher must name an
  /// update's consumers (publisher_transport::consumers_set), and a rank it did not name cannot
  /// import it.
  bool collective = false;
};

/// Where a transport's segments live: host memory, or the memory of one CUDA device. The spans
/// of acquire() and import_segments() then hold device addresses (valid in this process, never
/// to be dereferenced on the host).
struct memory_location {
  int cuda_device = -1;  ///< -1: host memory
  bool host() const { return cuda_device < 0; }
  /// As a tensor descriptor's `device` field says it: "cpu" or "cuda:N".
  std::string text() const { return host() ? "cpu" : "cuda:" + std::to_string(cuda_device); }
  friend bool operator==(const memory_location&, const memory_location&) = default;
};

/// Bytes of an update that stay in the caller's memory (publisher_transport::lend): `nbytes` at
/// `data` (host memory, or CUDA device `cuda_device`) are the update's bytes at `offset` of
/// segment `segment`.
struct lent_range {
  std::uint32_t segment = 0;
  std::uint64_t offset = 0;
  const std::byte* data = nullptr;
  std::uint64_t nbytes = 0;
  int cuda_device = -1;
};

/// Transport settings as text key/value pairs (from config files or flags); each transport
/// refuses keys it does not know, naming them.
using transport_options = std::map<std::string, std::string>;

/// Publisher half: owns the memory it handed out until release().
class publisher_transport {
 public:
  virtual ~publisher_transport() = default;

  /// Where acquire()'s spans live (default: host memory).
  virtual memory_location memory() const { return {}; }

  /// Reserves writable memory (memory()) for the segments of update `id`, one span per entry of
  /// `segment_bytes`. Waits up to `wait` for pooled memory to come free, then fails with
  /// errc::timeout. The spans are the caller's to fill until expose() or release().
  virtual result<std::vector<std::span<std::byte>>> acquire(
      const update_id& id, std::span<const std::uint64_t> segment_bytes,
      std::chrono::milliseconds wait) = 0;

  /// The consumer ranks the caller expects to import update `id` (acquired, not yet exposed),
  /// sorted and distinct; called only when the caller knows them. A transport whose consumers
  /// all take part in every transfer (nccl) forms its group from them. Default: nothing to do.
  virtual result<void> consumers_set(const update_id& /*id*/,
                                     std::span<const std::int32_t> /*consumers*/) {
    return {};
  }

  /// Whether lend() works here: the transport sends an update straight from the caller's
  /// memory, with no copy of it in its own (nccl packs it into bucket buffers as it goes).
  virtual bool can_lend() const { return false; }

  /// In place of acquire(): the update's segments, of `segment_bytes`, are `ranges` of the
  /// caller's memory (every byte a tensor holds; gaps are padding). The caller keeps those bytes
  /// valid and unchanged until lent_wait(id) or release(id) returned; release() waits for the
  /// transport to stop reading them. Device memory: what produces it has finished.
  virtual result<void> lend(const update_id& id, std::span<const std::uint64_t> /*segment_bytes*/,
                            std::vector<lent_range> /*ranges*/) {
    return make_error(errc::invalid_argument,
                      "this transport cannot send from the caller's "
                      "memory (update_id=" +
                          id + ")");
  }

  /// Waits until the transport no longer reads the memory lent for update `id` (its transfer
  /// ended, well or not); errc::timeout after `wait`. Nothing to wait for: returns at once.
  virtual result<void> lent_wait(const update_id& /*id*/, std::chrono::milliseconds /*wait*/) {
    return {};
  }

  /// Seals what the caller wrote and returns the opaque handle consumers import with. Device
  /// memory: the caller's writes must have completed (its streams synchronized, as
  /// weight_publisher does); expose orders consumers after nothing else.
  virtual result<std::string> expose(const update_id& id) = 0;

  /// Called by weight_publisher once the manifest is built around expose()'s handle and its
  /// version accepted, before publish() returns it: a transport that announces updates itself
  /// (file-mmap's CURRENT state file) does it here. An error fails the publish, and the caller
  /// then releases the update. Default: nothing to announce.
  virtual result<void> announce(const weight_update_manifest& /*manifest*/) { return {}; }

  /// Gives the update's memory back; called exactly once per acquired update, after every
  /// consumer released it or when publishing failed. Unknown ids are ignored.
  virtual void release(const update_id& id) = 0;

  /// The owner is closing: the releases of everything still held follow, then destruction. A
  /// transfer still in flight may end now, failed, rather than at its deadline (nccl aborts a
  /// broadcast whose members never came). Default: nothing to do.
  virtual void closing() {}
};

/// Consumer half: imported views stay valid until release().
class consumer_transport {
 public:
  virtual ~consumer_transport() = default;

  /// Where import_segments()'s spans live (default: host memory).
  virtual memory_location memory() const { return {}; }

  /// Makes the segments of an update readable in this process, one span per manifest segment,
  /// each exactly manifest.segments[i].nbytes long. The manifest has been validated. Device
  /// memory is ready for work on the device's legacy default stream (and every stream that
  /// synchronises with it) when this returns.
  virtual result<std::vector<std::span<const std::byte>>> import_segments(
      const weight_update_manifest& manifest) = 0;

  /// Drops this process's hold on the update; its spans become invalid.
  virtual void release(const update_id& id) = 0;

  /// Whether an imported update's bytes are still the ones published. A transport whose memory
  /// its publisher may rewrite under a reader that the coordinator no longer counts (the
  /// shared-memory ring, after a catch-up raced a release, or a reader frozen past the
  /// heartbeat) answers unknown_update once that started; checked after the bytes were
  /// copied, a yes means the copy is whole. Default: always (nothing rewrites them).
  virtual result<void> intact(const update_id& /*id*/) const { return {}; }

  /// The consumer rank this transport serves (weight_consumer calls it once, at construction),
  /// for transports that name their readers in shared state (file-mmap's leases).
  virtual void rank_set(std::int32_t /*rank*/) {}

  /// Where the bytes of a recent import came from when not from its publisher, as the status
  /// table shows it (shared memory: "rank:3 (shared memory)", a peer on this node that still
  /// mapped a slot its publisher had unlinked); empty otherwise.
  virtual std::string import_source(const update_id& /*id*/) const { return {}; }

  /// Where other consumers reach this one to pull, chunk by chunk, the updates it imports (it
  /// relays them while its own import is still running); empty when this transport cannot
  /// relay. Valid for the consumer's lifetime.
  virtual std::string relay_address() const { return {}; }

  /// The owner is shutting down, from another thread than an import that may be running: that
  /// import, and any that starts after, may end now, failed, rather than at its deadline (nccl
  /// stops waiting for a publisher that never comes). Default: nothing to do.
  virtual void closing() {}
};

/// One configured transport: makes publisher and consumer halves that can talk to each other.
class transport {
 public:
  virtual ~transport() = default;
  virtual std::string_view name() const = 0;
  virtual transport_caps caps() const = 0;
  virtual result<std::unique_ptr<publisher_transport>> make_publisher() = 0;
  virtual result<std::unique_ptr<consumer_transport>> make_consumer() = 0;

  /// The handle a consumer imports with to pull the update of `handle` from the relay at
  /// `relay_address` (another consumer's relay_address()) instead of from its publisher.
  /// errc::invalid_argument when this transport cannot relay.
  virtual result<std::string> handle_via_relay(const std::string& handle,
                                               const std::string& relay_address) const;

  /// One handle that pulls chunk i of the update from the source of handles[i % n] (each
  /// handle of the same update, pointed at a different relay): how a striped plan spreads the
  /// relaying over several trees. errc::invalid_argument when this transport cannot.
  virtual result<std::string> handle_striped(const std::vector<std::string>& handles) const;
};

/// Reads transport_options strictly: typed getters with defaults, and finish() refuses any key
/// that no getter asked for.
class options_reader {
 public:
  options_reader(std::string transport, const transport_options& options)
      : transport_(std::move(transport)), options_(options) {}

  result<std::uint64_t> get_uint(const std::string& key, std::uint64_t fallback, std::uint64_t min,
                                 std::uint64_t max);
  std::string get_string(const std::string& key, std::string fallback);
  result<void> finish() const;

 private:
  std::string transport_;
  const transport_options& options_;
  std::vector<std::string> seen_;
};

}  // namespace wsync
