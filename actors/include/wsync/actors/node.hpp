#pragma once
// Entry points of the cluster processes, free of CAF headers so apps/ stays light. Each runs
// until its work is done or SIGINT/SIGTERM/SIGHUP arrives, and returns a process exit code.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "wsync/manifest/result.hpp"
#include "wsync/sources/shard.hpp"
#include "wsync/transports/weight_publisher.hpp"

namespace wsync {

/// TLS between cluster processes (CAF's OpenSSL module). Off when `certificate` is empty; when
/// on, every process of the cluster needs it, and a peer without it cannot connect.
struct tls_settings {
  std::string certificate;  ///< PEM file: this process's certificate
  std::string key;          ///< PEM file: its private key
  std::string ca_file;      ///< PEM file: the CA that signed every peer's certificate
  bool enabled() const { return !certificate.empty(); }
};

struct endpoint {
  std::string host = "127.0.0.1";
  std::uint16_t port = 0;
  std::string token;
  tls_settings tls;
};

/// A rank as the coordinator's router sees it.
struct route_member {
  std::int32_t rank = 0;
  std::string node;
  std::string address;  ///< consumers: where other consumers pull from it (relay address)
};

/// What one consumer rank imports for an update: the shards' manifests, their handles pointed at
/// its source, and that source as the status table shows it.
struct routed_update {
  std::vector<weight_update_manifest> manifests;
  std::string received_from;
};

/// Routes an update across nodes (cluster/ provides the fan-out planner's): from the shards'
/// manifests, the consumer ranks to reach and the publisher ranks, what each consumer imports.
/// An empty map means everyone pulls straight from the publishers (a transport that cannot
/// relay); an error is logged and means the same.
using update_router = std::function<result<std::map<std::int32_t, routed_update>>(
    const std::vector<weight_update_manifest>& shards, const std::vector<route_member>& consumers,
    const std::vector<route_member>& publishers)>;

struct coordinator_options {
  endpoint listen;        ///< port 0: pick one
  std::string port_file;  ///< written once listening (for launchers)
  std::chrono::milliseconds update_deadline{
      30000};                                     ///< first shard to the last; then to every answer
  std::uint32_t history_per_model = 16;           ///< finished updates kept for status
  std::chrono::milliseconds heartbeat{200};       ///< CAF heartbeat; peers time out at 5x
  std::chrono::milliseconds rejoin_grace{10000};  ///< book_config::rejoin_grace
  update_router router;                           ///< empty: every rank from the publishers
  /// Listen on a non-loopback address without TLS anyway (refused otherwise).
  bool insecure = false;
};

/// True when every address `host` resolves to is a loopback one (127.0.0.0/8, ::1); false for
/// "", 0.0.0.0 and anything that reaches beyond this machine.
bool host_is_loopback(const std::string& host);
int coordinator_run(const coordinator_options& options);

class reference_runtime;
class install_adapter;
class generation_gate;
struct rollout_report;

/// Watches the ranks of a consumer process (the HTTP surface uses it for /status, /metrics and
/// generation). Calls come from consumer_run's thread (rank_started, before the rank joins) and
/// from each rank's actor (update_done); implementations must be thread-safe.
class consumer_observer {
 public:
  virtual ~consumer_observer() = default;
  /// `runtime` lives until consumer_run returns.
  virtual void rank_started(std::int32_t rank, reference_runtime& runtime) = 0;
  /// After each update the coordinator sent: what the rank did with it.
  virtual void update_done(std::int32_t rank, const std::string& key, const rollout_report& report,
                           std::uint64_t bytes) = 0;
  /// The ranks stopped; their runtimes go once this returns.
  virtual void stopping() = 0;
};

struct consumer_options {
  endpoint coordinator;
  std::int32_t rank = 0;
  std::int32_t count = 1;  ///< consumer ranks in this process: rank .. rank + count - 1
  std::string node = "n0";
  std::string model_id;
  std::string transport = "shared-memory";  ///< the data plane, with its options
  transport_options transport_settings;
  bool verify = true;
  std::chrono::milliseconds heartbeat{200};
  consumer_observer* observer = nullptr;  ///< optional; must outlive consumer_run
  /// Offer to lead the node's consumer endpoints (one loopback port): the coordinator names one
  /// leader per node, which carries the updates and reports of the node's other consumer
  /// processes (docs/cluster.md, "Node leaders"). Off: this process always talks to the
  /// coordinator itself, though it still attaches to another process that leads.
  bool node_leader = true;
};
int consumer_run(const consumer_options& options);

struct publisher_options {
  endpoint coordinator;
  std::int32_t rank = 0;
  std::int32_t ranks = 1;  ///< publisher ranks sharing the model: this one takes tensor i when
                           ///< i % ranks == rank
  std::string node = "n0";
  std::string transport = "shared-memory";  ///< the data plane, with its options
  transport_options transport_settings;
  std::string layout = "qwen2.5-0.5b";  ///< model layout, or "synthetic:<bytes>:<tensors>"
  std::string safetensors;              ///< publish this checkpoint file instead of a layout
  std::string model_id;                 ///< empty: the layout name
  std::uint64_t first_version = 1;
  std::uint64_t versions = 5;  ///< publishes first_version .. first_version + versions - 1
  std::chrono::milliseconds interval{0};
  /// Above two default update deadlines (assembly, then distribution), with room to spare.
  std::chrono::milliseconds outcome_timeout{90000};
  std::chrono::milliseconds heartbeat{200};
  bool json = false;  ///< print each outcome as one JSON line
};
int publisher_run(const publisher_options& options);

/// Which tensors the rank publishes (sources/shard.hpp), and the model id it announces: --model,
/// else what it publishes.
shard_spec publisher_shard(const publisher_options& options);
std::string publisher_model_id(const publisher_options& options);

/// What a trainer rank needs to join a cluster.
struct trainer_options {
  endpoint coordinator;
  std::int32_t rank = 0;
  std::int32_t ranks = 1;  ///< trainer ranks that each publish a shard of every version
  std::string node = "n0";
  std::string transport = "shared-memory";  ///< the data plane, with its options
  transport_options transport_settings;
  std::string model_id;
  /// Above two default update deadlines (assembly, then distribution), with room to spare.
  std::chrono::milliseconds outcome_timeout{90000};
  std::chrono::milliseconds heartbeat{200};
  /// Where the transport can (nccl): send each version from the tensors themselves, with no copy
  /// of it in transport memory (publish() still returns only once nothing reads them).
  bool lend_sources = false;
};

/// How one version ended, as the coordinator saw it.
struct publish_outcome {
  bool committed = false;
  std::string error;         ///< set when the publish failed before an outcome
  std::string error_code;    ///< errc_name() of that failure ("" when there is none)
  std::string outcome_json;  ///< the coordinator's table: phase, reason, every rank's state
  double publish_s = 0;      ///< this rank's copy + checksum + expose time
  void fail(const wsync::error& e) {
    error = e.message;
    error_code = std::string(errc_name(e.code));
  }
};

/// The library API of a trainer rank: join the cluster, then publish this rank's shard of each
/// version and get the per-rank outcome. Publishes over shared memory; slots return to the ring
/// when the coordinator says every consumer released them. Not thread-safe: one caller.
class trainer_rank {
 public:
  static result<std::unique_ptr<trainer_rank>> connect(const trainer_options& options);
  ~trainer_rank();

  /// Publishes and waits for the version's outcome (committed, or aborted with the reason).
  /// The tensors must stay valid until it returns.
  publish_outcome publish(std::span<const tensor_source> tensors, std::uint64_t weight_version,
                          std::map<std::string, std::string> metadata = {});
  /// The versions whose memory this rank still holds (ascending; a retried version once): given
  /// back when the coordinator says no consumer holds them any more. Unlike publish, may be
  /// called from another thread while a publish runs.
  std::vector<std::uint64_t> held_versions() const;

 private:
  struct impl;
  explicit trainer_rank(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

/// What a rollout rank embedded in another program (the Python module's RolloutRank) needs to
/// join a cluster; the program brings its own install adapter and generation gate.
struct rollout_options {
  endpoint coordinator;
  std::int32_t rank = 0;
  std::string node = "n0";
  std::string model_id;
  std::string transport = "shared-memory";  ///< the data plane, with its options
  transport_options transport_settings;
  bool verify = true;
  std::chrono::milliseconds join_timeout{10000};
  std::chrono::milliseconds heartbeat{200};
  bool node_leader = true;  ///< as consumer_options::node_leader
};

/// The library API of a consumer rank: joins the coordinator and, on the actor system's
/// threads, installs every update it is sent through `adapter` under `gate`, reporting to the
/// coordinator as `wsync consumer` does. `adapter`, `gate` and `observer` (optional) must
/// outlive it; `observer->rank_started` is not called (there is no reference runtime).
class rollout_rank {
 public:
  /// Returns once the coordinator accepted the rank (or with why it did not within
  /// join_timeout).
  static result<std::unique_ptr<rollout_rank>> connect(const rollout_options& options,
                                                       install_adapter& adapter,
                                                       generation_gate& gate,
                                                       consumer_observer* observer = nullptr);
  /// Leaves the cluster in order (the coordinator sees the rank go), then releases what the
  /// active version still holds.
  ~rollout_rank();

  /// The version readers see; 0 before the first install.
  std::uint64_t active_weight_version() const;
  /// Whether the rank is joined to a coordinator now (false while it reconnects).
  bool joined() const;

 private:
  struct impl;
  explicit rollout_rank(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

/// Asks a coordinator for its status table (the JSON object docs/cluster.md describes). Empty
/// string on failure, with the reason in `error`.
std::string coordinator_status(const endpoint& coordinator, std::string& error);

}  // namespace wsync
