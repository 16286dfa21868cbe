#pragma once
// The control-plane protocol in one place: message structs, atoms, the CAF type-ID block and
// the typed interfaces of the coordinator and of the two rank endpoints. Manifests travel as
// their JSON form (manifest_to_json); tensor bytes never travel through CAF. Heavy (CAF): include
// only from actor code.

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace wsync::proto {

/// A random 64-bit value: the nonces and epochs peers cannot guess (join rounds, ticks, node
/// leaderships).
inline std::uint64_t random_u64() {
  std::random_device rd;
  return (std::uint64_t{rd()} << 32) | rd();
}

/// Whether a message's token is the cluster's, compared in time that does not depend on where the
/// two first differ: a peer that times refusals learns nothing of the token but its length.
inline bool token_matches(const std::string& given, const std::string& token) {
  if (given.size() != token.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < token.size(); ++i) {
    diff |= static_cast<unsigned char>(given[i] ^ token[i]);
  }
  return diff == 0;
}

/// First message of every rank: who it is, and the cluster token.
struct rank_hello {
  std::string token;
  std::int32_t rank = 0;
  std::string role;  ///< "publisher" | "consumer"
  std::string node;
  std::string model_id;
  std::vector<std::string> transports;
  std::int32_t publisher_ranks = 0;  ///< publishers: how many ranks publish shards of the model
  /// consumers: the version it serves (a restarted coordinator learns versions from this)
  std::uint64_t active_weight_version = 0;
  /// update keys whose memory it still holds. Consumers: installed or still being imported; a
  /// restarted coordinator passes their releases on to the publishers once every holder let
  /// go. Publishers: one entry per attempt held (a retried version twice), its update id in
  /// `held_ids`; the coordinator tells it to give back an attempt it released while the rank
  /// was away, or does not know, once no consumer holds the key (after the rejoin grace).
  std::vector<std::string> held;
  std::vector<std::string> held_ids;  ///< publishers: the update id of each entry of `held`
  /// consumers: where other consumers pull what it imports (its relay address); empty when its
  /// transport cannot relay
  std::string address;
  /// consumers: the loopback port on which its endpoint takes the other consumer endpoints of
  /// its node when it leads them (0: it does not offer to lead)
  std::uint16_t node_port = 0;
  /// consumers: the manifests (JSON) of the version it serves, one per shard: a coordinator
  /// that restarted knows none, and takes the version from them as the catch-up source
  /// (coordinator_book::adopt)
  std::vector<std::string> active_manifests;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_hello& x) {
  return f(caf::meta::type_name("rank_hello"), x.token, x.rank, x.role, x.node, x.model_id,
           x.transports, x.publisher_ranks, x.active_weight_version, x.held, x.held_ids, x.address,
           x.node_port, x.active_manifests);
}

/// A hello for a rank on the data plane `transport`.
inline rank_hello hello_make(std::string token, std::int32_t rank, std::string role,
                             std::string node, std::string model_id,
                             std::string transport = "shared-memory") {
  rank_hello h;
  h.token = std::move(token);
  h.rank = rank;
  h.role = std::move(role);
  h.node = std::move(node);
  h.model_id = std::move(model_id);
  h.transports = {std::move(transport)};
  return h;
}

/// Coordinator -> consumer endpoint: install this update (every shard). One message reaches an
/// endpoint for all of its `ranks` that import the same manifests from the same hop.
struct update_available {
  std::string token;                   ///< the cluster token: a consumer obeys nobody else
  std::string key;                     ///< "<model_id>@<weight_version>"
  std::vector<std::string> manifests;  ///< JSON, one per publisher shard
  std::string received_from;           ///< the hop the bytes come from
  std::vector<std::int32_t> ranks;     ///< the endpoint's ranks this is for
  /// Sent again because the node leader that carried it went away: a rank that already has it
  /// (importing, or answered) ignores it; its answer reaches the coordinator anyway.
  bool resend = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, update_available& x) {
  return f(caf::meta::type_name("update_available"), x.token, x.key, x.manifests, x.received_from,
           x.ranks, x.resend);
}

/// Consumer -> coordinator: progress on one update.
struct rank_report {
  std::string token;
  std::string key;
  std::int32_t rank = 0;
  /// "importing" | "acknowledged" | "rejected" | "waiting" (the bytes were gone; it waits for
  /// the next version) | "released"
  std::string state;
  std::string reason;  ///< importing: the hop it imports from; rejected / waiting: why
  std::uint64_t active_weight_version = 0;
  double seconds = 0;  ///< acknowledged / rejected: the rank's import-to-answer time
  /// acknowledged: the hop the bytes came from (a peer on the node, when one gave them); an
  /// acknowledgement needs no "importing" report before it
  std::string received_from;
  /// One shard's update id of the attempt reported on: a report of an aborted attempt, replayed
  /// late, must not land on the retry of its key. Empty: not known (the coordinator takes it).
  std::string update_id = {};
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, rank_report& x) {
  return f(caf::meta::type_name("rank_report"), x.token, x.key, x.rank, x.state, x.reason,
           x.active_weight_version, x.seconds, x.received_from, x.update_id);
}

/// Consumer endpoint -> coordinator: the reports of its ranks, in the order they happened. An
/// endpoint holding many ranks (a node's rollout process) sends one batch where its ranks would
/// have sent one report each.
struct report_batch {
  std::string token;
  std::vector<rank_report> reports;
  std::uint64_t seq = 0;  ///< member -> node leader: numbers the batch (flushed_atom answers)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, report_batch& x) {
  return f(caf::meta::type_name("report_batch"), x.token, x.reports, x.seq);
}

/// Member endpoint -> its node's leader: carry these ranks for leadership `epoch`.
struct attach_request {
  std::string token;
  std::uint64_t epoch = 0;
  std::vector<std::int32_t> ranks;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, attach_request& x) {
  return f(caf::meta::type_name("attach_request"), x.token, x.epoch, x.ranks);
}

/// To the coordinator: the node leader of `epoch` carries `ranks` of another endpoint of its node
/// from now on (carried), or no longer (said by the leader or by the ranks' own endpoint).
struct carry_notice {
  std::string token;
  std::uint64_t epoch = 0;
  std::vector<std::int32_t> ranks;
  bool carried = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, carry_notice& x) {
  return f(caf::meta::type_name("carry_notice"), x.token, x.epoch, x.ranks, x.carried);
}

}  // namespace wsync::proto

CAF_BEGIN_TYPE_ID_BLOCK(wsync, caf::first_custom_type_id)
CAF_ADD_TYPE_ID(wsync, (wsync::proto::rank_hello))
CAF_ADD_TYPE_ID(wsync, (wsync::proto::update_available))
CAF_ADD_TYPE_ID(wsync, (wsync::proto::rank_report))
CAF_ADD_TYPE_ID(wsync, (wsync::proto::report_batch))
CAF_ADD_TYPE_ID(wsync, (wsync::proto::attach_request))
CAF_ADD_TYPE_ID(wsync, (wsync::proto::carry_notice))
CAF_END_TYPE_ID_BLOCK(wsync)

namespace wsync::proto {

using join_atom = caf::atom_constant<caf::atom("join")>;
using publish_atom = caf::atom_constant<caf::atom("publish")>;
using report_atom = caf::atom_constant<caf::atom("report")>;
using status_atom = caf::atom_constant<caf::atom("status")>;
using update_atom = caf::atom_constant<caf::atom("update")>;
using drop_atom = caf::atom_constant<caf::atom("drop")>;
using release_atom = caf::atom_constant<caf::atom("release")>;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using reconnect_atom = caf::atom_constant<caf::atom("reconnect")>;
using flush_atom = caf::atom_constant<caf::atom("flush")>;
using lead_atom = caf::atom_constant<caf::atom("lead")>;
using attach_atom = caf::atom_constant<caf::atom("attach")>;
using carry_atom = caf::atom_constant<caf::atom("carry")>;
using flushed_atom = caf::atom_constant<caf::atom("flushed")>;
using members_atom = caf::atom_constant<caf::atom("members")>;
using connected_atom = caf::atom_constant<caf::atom("connected")>;

// Authentication: CAF 0.17 lets a connected peer write a routed message's sender itself, so
// the sender proves nothing. Every message that changes state, and every reply to one, carries
// the cluster token; the actors behind these interfaces are guarded (guard.hpp) against exit,
// error and stream messages. Without TLS the token crosses the network in the clear: use TLS
// on networks you do not trust.

/// The coordinator, published on the cluster port.
using coordinator_actor = caf::typed_actor<
    // A rank joins; the reply is (token, "") or (token, refusal). The sender becomes that
    // rank's endpoint. A wrong token gets ("", refusal).
    caf::replies_to<join_atom, rank_hello>::with<std::string, std::string>,
    // (token, a publisher rank's shard as manifest JSON); the reply, once the update is
    // committed or aborted, is (token, the outcome as JSON or {"error": ...}).
    caf::replies_to<publish_atom, std::string, std::string>::with<std::string, std::string>,
    // A consumer rank's progress, alone or in its endpoint's batch.
    caf::reacts_to<report_atom, rank_report>, caf::reacts_to<report_atom, report_batch>,
    // (token) -> the per-rank status table as JSON (docs/cluster.md, "The status object").
    caf::replies_to<status_atom, std::string>::with<std::string>,
    // Its own timer, with a nonce only it knows: a peer's tick would start another timer chain.
    caf::reacts_to<tick_atom, std::uint64_t>,
    // Who carries a node's ranks (docs/cluster.md, "Node leaders").
    caf::reacts_to<carry_atom, carry_notice>,
    // (token, model_id, transport) -> the live consumer ranks of that model speaking that
    // transport, as a JSON list (or {"error": ...}): whom a collective transport's publisher
    // broadcasts its next update to.
    caf::replies_to<members_atom, std::string, std::string, std::string>::with<std::string>>;

/// The endpoint of a process's consumer ranks: (token, update) to install, (token, key) of an
/// aborted update. reconnect and flush are its own timers; one that a peer forges only makes it
/// look for the coordinator, or send the reports it has, a little early. (reconnect, rank, nonce)
/// retries one rank's join; it carries a random nonce of the join round, so a forged one is
/// ignored. (join) starts it once its process published it for its node. The rest is the node
/// leader's relay (docs/cluster.md, "Node leaders"): the coordinator names each node's leader
/// with a random epoch, the other endpoints of the node attach to it, and it carries their
/// updates and reports.
using consumer_actor = caf::typed_actor<
    caf::reacts_to<update_atom, update_available>,
    caf::reacts_to<drop_atom, std::string, std::string>, caf::reacts_to<reconnect_atom>,
    caf::reacts_to<reconnect_atom, std::int32_t, std::uint64_t>, caf::reacts_to<flush_atom>,
    caf::reacts_to<join_atom>,
    // Coordinator -> endpoint (token, port, epoch): the node's leader takes
    // endpoints on 127.0.0.1:port; port 0: this endpoint leads.
    caf::reacts_to<lead_atom, std::string, std::uint16_t, std::uint64_t>,
    // Member -> leader -> (token, refusal or "").
    caf::replies_to<attach_atom, attach_request>::with<std::string, std::string>,
    // Member -> leader: its ranks' reports, numbered (seq); leader -> member
    // (token, seq): every batch up to that number went on to the coordinator.
    caf::reacts_to<report_atom, report_batch>,
    caf::reacts_to<flushed_atom, std::string, std::uint64_t>,
    // Its own connect helper -> (nonce, the actor published there or null,
    // why not): see connect_privately in consumer_endpoint.hpp.
    caf::reacts_to<connected_atom, std::uint64_t, caf::strong_actor_ptr, std::string>>;

/// A publisher rank's endpoint: the trainer thread asks it to publish; the coordinator tells it
/// when an update's memory may be reused.
using publisher_actor = caf::typed_actor<
    // (token, update key, update_id, manifest JSON) -> outcome JSON
    caf::replies_to<publish_atom, std::string, std::string, std::string,
                    std::string>::with<std::string>,
    // (token, update key, the update ids of that attempt's shards; empty: the key's oldest)
    caf::reacts_to<release_atom, std::string, std::string, std::vector<std::string>>>;

}  // namespace wsync::proto
