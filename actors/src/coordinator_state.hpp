#pragma once
// The coordinator actor's state and the steps its handlers take (coordinator_steps.cpp):
// carrying out the book's effects (distributing updates, outcomes, releases), node leadership,
// reports and the status document. The handlers themselves are in coordinator_actor.cpp.
// Heavy (CAF): actor code only.

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "protocol.hpp"
#include "wsync/actors/coordinator_book.hpp"
#include "wsync/actors/node.hpp"

namespace wsync::coordinator_detail {

using namespace proto;

/// A joined actor: a publisher rank's endpoint, or the endpoint of one or more consumer ranks
/// (every consumer rank of a process shares one).
struct member {
  rank_role role;
  std::set<std::int32_t> ranks;
  std::string node;             ///< consumers: the node its first rank named
  std::uint16_t node_port = 0;  ///< consumers: where it takes its node's endpoints if it leads
};

/// The consumer endpoint that leads a node: the other endpoints of the node attach to it, and it
/// carries their updates and reports (docs/cluster.md, "Node leaders").
struct node_lead {
  caf::actor_addr addr;
  consumer_actor handle;
  std::uint64_t epoch = 0;  ///< random per leadership: a stale attach or notice names another
};

/// An update the book does not know (from before a coordinator restart), or an attempt of one it
/// let go of while the attempt's publisher was away, that ranks said they hold.
struct orphan {
  std::set<std::int32_t> holders;  ///< consumer ranks that said they hold its key
  /// Publisher rank -> the update ids of the key it holds and is told to give back, exactly
  /// those (a retry of the version under the same key is not touched).
  std::map<std::int32_t, std::set<std::string>> attempts;
};

/// Which leader carries a consumer rank of another endpoint, and since which leadership. An
/// entry goes with its leader (endpoint_gone), so it always names a live one.
struct carried_by {
  caf::actor_addr leader;
  consumer_actor handle;
  std::uint64_t epoch = 0;
};

struct coordinator_state {
  coordinator_book book;
  std::string token;
  std::map<caf::actor_addr, member> members;  ///< by endpoint
  std::map<std::int32_t, consumer_actor> consumers;
  std::map<std::int32_t, publisher_actor> publishers;
  using outcome_promise = caf::typed_response_promise<std::string, std::string>;
  std::map<std::string, std::vector<outcome_promise>> waiting;
  /// A shard retrying an aborted version that ranks still hold, and since when it waits.
  struct deferred_retry {
    weight_update_manifest manifest;
    outcome_promise promise;
    coord_clock::time_point since;
  };
  /// By key: taken when the book releases the old attempt at the publishers (or refuses the
  /// retry for good, the version served), refused once it waited an update deadline.
  std::map<std::string, std::vector<deferred_retry>> deferred;
  std::map<std::int32_t, std::uint64_t> active_version;  ///< per consumer rank
  std::uint64_t committed = 0;                           ///< updates committed since start
  std::uint64_t tick_nonce = 0;  ///< what the coordinator's own ticks carry (random)
  /// By key. Once no consumer holds one, its publishers are told to give back their attempts,
  /// but not before `orphans_settle_at`: a rank still reconnecting may hold it.
  std::map<std::string, orphan> orphans;
  coord_clock::time_point orphans_settle_at;  ///< the start plus book_config::rejoin_grace
  bool orphans_settled = false;               ///< past orphans_settle_at (seen by a tick)
  /// "<key>/<rank>" of every adoption tried (adopt_served): a rank's manifests are parsed, and
  /// a refusal logged, once.
  std::set<std::string> adoption_tried;
  update_router router;  ///< how updates cross nodes; empty: from the publishers
  std::map<std::string, node_lead> leaders;     ///< by node
  std::map<std::int32_t, carried_by> carriers;  ///< consumer rank -> its node's leader
  /// Control-plane messages, for `wsync status` and the cluster benchmark: update messages sent
  /// to consumer endpoints, report messages (single or batch) received and the reports in them.
  struct message_counts {
    std::uint64_t updates_sent = 0, report_messages = 0, reports = 0;
  } messages;
  static inline const char* name = "wsync.coordinator";
};

using coordinator_base = caf::stateful_actor<coordinator_state, coordinator_actor::base>;
using coordinator_pointer = coordinator_base*;

/// What a refused publish answers: the message and its error code, as JSON text.
std::string refusal_text(const std::string& why, errc code);
/// Carries out the book's effects: distributions, drops, outcomes, publisher releases.
void run_effects(coordinator_pointer self, const std::vector<book_effect>& effects);
/// Hands a publish to the book and carries out what it decides; `rp` hears the outcome. False
/// when the book refused it (`rp` heard why).
bool accept_publish(coordinator_pointer self, const weight_update_manifest& m,
                    coordinator_state::outcome_promise rp);
/// Parks a retry of the aborted version `m` names until the old attempt is let go.
void defer_retry(coordinator_pointer self, weight_update_manifest m,
                 coordinator_state::outcome_promise rp);
/// The retries of `key` that waited, once they need not wait: the old attempt was let go, or a
/// rank installed it late and the book refuses them for good.
void take_deferred(coordinator_pointer self, const std::string& key);
/// Refuses the retries that waited an update deadline (its ranks still hold the old attempt).
void expire_deferred(coordinator_pointer self, coord_clock::time_point now);
/// A consumer joined serving a version the book has no record of (this coordinator restarted):
/// the version is taken from the manifests it sent (coordinator_book::adopt), its catch-ups
/// appended to `effects`. Manifests that do not parse or do not fit are logged and ignored.
void adopt_served(coordinator_pointer self, const proto::rank_hello& hello,
                  std::vector<book_effect>& effects);
/// Consumer `rank` let go of `key` (or left); the orphan's attempts go back once nobody holds it.
void orphan_release(coordinator_pointer self, const std::string& key, std::int32_t rank);
/// Publisher `rank` joined holding attempt `id` of `key` that the book does not track: given
/// back at once when no consumer holds the key and the rejoin grace is over, else when so.
void orphan_published(coordinator_pointer self, const std::string& key, std::int32_t rank,
                      const std::string& id);
/// Ends the rejoin grace once it is over: the orphans nobody holds are released.
void orphans_settle(coordinator_pointer self);
/// Names a leader for `node` when it has none; `newcomer`: only it is told where to attach.
void lead_node(coordinator_pointer self, const std::string& node,
               std::optional<caf::actor_addr> newcomer = std::nullopt);
/// Forgets what endpoint `addr` (`m` was its entry) carried or was carried as; the ranks it
/// carried go to `orphaned`. True when it led its node.
bool endpoint_gone(coordinator_state& st, const caf::actor_addr& addr, const member& m,
                   std::vector<std::int32_t>& orphaned);
/// Whether `sender` leads the node of consumer rank `rank`.
bool leads_rank(const coordinator_state& st, const caf::actor_addr& sender, std::int32_t rank);
/// Sends `ranks`, which lost their leader, what they have not answered of the updates in flight
/// and of their catch-ups.
void resend_unanswered(coordinator_pointer self, const std::vector<std::int32_t>& ranks);
/// The document `wsync status` prints.
std::string status_json(coordinator_state& st);
/// One consumer rank's report, from an endpoint that joined it.
void take_report(coordinator_pointer self, const rank_report& r);
/// The member entry of the current message's sender, or null.
const member* sender_member(coordinator_pointer self);

}  // namespace wsync::coordinator_detail
