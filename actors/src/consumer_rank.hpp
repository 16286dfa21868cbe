#pragma once
// A consumer rank's side of consumer_actor.cpp: its rollout side (consumer, executor, runtime),
// the outbox its reports wait in for the endpoint, and the worker actor that installs each
// update the endpoint hands it. The endpoint (consumer_actor.cpp) joins the coordinator, fans
// updates out to its workers and batches their reports. Heavy (CAF): actor code only.

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "protocol.hpp"
#include "wsync/actors/node.hpp"
#include "wsync/manifest/codec.hpp"
#include "wsync/runtime/reference_runtime.hpp"
#include "wsync/runtime/rollout_executor.hpp"

namespace wsync {

/// An update as a consumer endpoint parsed it, once for all the ranks it hands it to (parsing
/// the manifests was most of a rank's fixed cost per update). Never leaves the process.
struct parsed_update {
  std::string token, key, received_from;
  std::string identity;  ///< the key and every shard's update id: a retry has new ids
  std::vector<weight_update_manifest> shards;
  std::string error;  ///< a manifest that did not parse: every rank rejects it with this
};
using parsed_update_ptr = std::shared_ptr<const parsed_update>;

}  // namespace wsync

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(wsync::parsed_update_ptr)

namespace wsync::consumer_detail {

// The rollout side of one rank. Its rank worker installs and keeps key_of; the endpoint reads
// what it holds when it (re)joins, hence the lock. It installs through its own reference runtime
// (`wsync consumer`) or through an adapter and gate the embedding program brings (rollout_rank).
struct rollout_side {
  std::string relay_address;  ///< where other consumers pull from this rank (first: taken
                              ///< from the transport before the consumer owns it)
  weight_consumer consumer;
  std::unique_ptr<reference_runtime> own_runtime;  ///< null when the program brings an adapter
  rollout_executor executor;
  std::atomic<bool> joined{false};
  std::atomic<bool> refused{false};  ///< the coordinator refused the rank (bad token, ...)

  rollout_side(std::unique_ptr<consumer_transport> t, std::int32_t rank, bool verify)
      : rollout_side(std::move(t), rank, verify, std::make_unique<reference_runtime>()) {}
  rollout_side(std::unique_ptr<consumer_transport> t, std::int32_t rank, bool verify,
               install_adapter& adapter, generation_gate& gate)
      : relay_address(t->relay_address()),
        consumer(std::move(t), consumer_config{rank, 2}),
        executor(consumer, adapter, gate, executor_config{verify}) {}

  std::uint64_t active_version() const { return executor.active_weight_version().value_or(0); }

  /// Update keys whose memory the rank still holds: installed as views, or being imported (a
  /// coordinator that restarted meanwhile must not have the publishers reuse that memory).
  std::vector<std::string> held() const {
    std::lock_guard lock(mu_);
    std::set<std::string> keys(importing_.begin(), importing_.end());
    for (const auto& [id, key] : key_of_) keys.insert(key);
    return {keys.begin(), keys.end()};
  }
  /// Whether the rank holds any attempt of `key`: serves it as views, or has another delivery
  /// of it handed and not yet settled.
  bool holds_key(const std::string& key) const {
    std::lock_guard lock(mu_);
    return importing_.count(key) != 0 ||
           std::any_of(key_of_.begin(), key_of_.end(),
                       [&](const auto& e) { return e.second == key; });
  }
  /// Whether the rank holds (serves as views) a shard of `shards`: an attempt, not only a key.
  bool holds_any(const std::vector<weight_update_manifest>& shards) const {
    std::lock_guard lock(mu_);
    return std::any_of(shards.begin(), shards.end(),
                       [&](const weight_update_manifest& m) { return key_of_.count(m.update_id); });
  }
  /// `key` was handed to the rank's worker (by its endpoint, before the worker's mailbox holds
  /// it): held() names it until the worker settles it, or drops it unread. A re-join in
  /// between must name it, or a restarted coordinator would have the publishers reuse memory
  /// the rank is about to serve.
  void importing(const std::string& key) {
    std::lock_guard lock(mu_);
    importing_.insert(key);
  }
  /// The worker let go of `key` without importing it (its manifests did not parse).
  void dropped(const std::string& key) {
    std::lock_guard lock(mu_);
    forget_import_locked(key);
  }
  /// After installing `key`: forgets the shards the executor let go of and returns the keys
  /// they belonged to, each with one of its shard ids (the rank reports them released), and
  /// remembers the new shards when the rank holds them (a view install; one that copied
  /// released them at once). The import of `key` ends here, in the same step: held() never
  /// misses a key between the two.
  std::map<std::string, update_id> settle(const rollout_report& r, const std::string& key) {
    std::lock_guard lock(mu_);
    forget_import_locked(key);
    std::map<std::string, update_id> keys;
    for (const auto& id : r.released) {
      if (auto it = key_of_.find(id); it != key_of_.end()) {
        keys.emplace(it->second, id);
        key_of_.erase(it);
      }
    }
    if (r.acknowledged && !r.released_self) {
      for (const auto& id : r.shard_ids) key_of_[id] = key;
    }
    return keys;
  }
  /// The update the rank acknowledged last, so serves: its manifests go with every join.
  void serving(parsed_update_ptr u) {
    std::lock_guard lock(mu_);
    served_ = std::move(u);
  }
  /// The version the rank serves (0: none) and, when it got that version from its publishers,
  /// its manifests (JSON): as sent by a relay they would send a restarted coordinator's
  /// catch-ups to that relay first (ucx), and what the publishers hold is what a catch-up needs.
  std::pair<std::uint64_t, std::vector<std::string>> active_served() const {
    parsed_update_ptr u;
    {
      std::lock_guard lock(mu_);
      u = served_;
    }
    std::pair<std::uint64_t, std::vector<std::string>> out{active_version(), {}};
    if (!u || out.first == 0 || u->received_from.rfind("publisher:", 0) != 0) return out;
    for (const auto& m : u->shards) {
      if (m.weight_version != out.first) return {out.first, {}};  // not the one it serves
      out.second.push_back(manifest_to_json(m));
    }
    return out;
  }

 private:
  rollout_side(std::unique_ptr<consumer_transport> t, std::int32_t rank, bool verify,
               std::unique_ptr<reference_runtime> runtime)
      : rollout_side(std::move(t), rank, verify, *runtime, runtime->gate()) {
    own_runtime = std::move(runtime);
  }
  void forget_import_locked(const std::string& key) {
    if (auto it = importing_.find(key); it != importing_.end()) importing_.erase(it);
  }
  mutable std::mutex mu_;
  std::map<update_id, std::string> key_of_;  ///< shard id -> update key, for release reports
  std::multiset<std::string> importing_;     ///< keys of the imports in progress
  parsed_update_ptr served_;                 ///< the update acknowledged last
};

// Reports the rank workers leave for their endpoint: the only thing the two kinds of actor
// share besides the rollout sides. A worker pokes the endpoint when it finds the box empty, so
// the reports that pile up meanwhile travel together.
struct report_outbox {
  std::mutex mu;
  std::vector<proto::rank_report> reports;
  caf::actor_addr endpoint;  ///< weak: the endpoint owns the box, not the other way round

  void put(std::vector<proto::rank_report> more) {
    caf::actor poke;
    {
      std::lock_guard lock(mu);
      if (reports.empty()) poke = caf::actor_cast<caf::actor>(endpoint);
      for (auto& r : more) reports.push_back(std::move(r));
    }
    if (poke) caf::anon_send(poke, proto::flush_atom::value);
  }
  std::vector<proto::rank_report> take() {
    std::lock_guard lock(mu);
    return std::exchange(reports, {});
  }
};

// A consumer rank as its endpoint knows it.
struct rank_slot {
  std::shared_ptr<rollout_side> side;
  proto::rank_hello hello;
  caf::actor worker;
};

/// The worker of one rank: installs each update its endpoint hands it and leaves the reports in
/// `box`.
caf::behavior rank_worker(caf::event_based_actor*, std::shared_ptr<rollout_side> side,
                          proto::rank_hello hello, std::shared_ptr<report_outbox> box,
                          consumer_observer* observer);

}  // namespace wsync::consumer_detail
