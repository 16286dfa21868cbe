#pragma once
// A consumer endpoint's state, shared by the endpoint actor (consumer_actor.cpp) and its node
// leadership steps (consumer_leadership.cpp): leading the node's other endpoints, or attaching to
// the one that leads (docs/cluster.md, "Node leaders"). Heavy (CAF): actor code only.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "consumer_rank.hpp"
#include "protocol.hpp"

namespace wsync::consumer_detail {

using namespace proto;

struct endpoint_state {
  coordinator_actor coordinator;
  std::map<std::int32_t, rank_slot> ranks;
  std::shared_ptr<report_outbox> box;
  std::string token;
  std::string who;            ///< "consumer rank 3" or "consumer ranks 0..1023", for the log
  bool joined = false;        ///< every rank accepted by the current coordinator
  bool reconnecting = false;  ///< a reconnect is scheduled
  std::uint64_t join_round = 0;
  /// Names the current round in the endpoint's own retry messages: random, so that a peer that
  /// forges one cannot make a rank join again.
  std::uint64_t join_nonce = 0;
  std::size_t accepted = 0;  ///< ranks accepted in this round
  std::chrono::milliseconds backoff{200};
  /// Reports taken from the box, not yet sent; answers still owed, by update key.
  std::vector<rank_report> pending;
  std::optional<std::chrono::steady_clock::time_point> pending_since, linger_due;
  std::map<std::string, std::set<std::int32_t>> owed;
  /// Per update key still owed: the ranks that did not install it, each with why (the log says
  /// so once every rank answered).
  std::map<std::string, std::map<std::int32_t, std::string>> rejected;
  /// Per rank: the updates (parsed_update::identity) it was handed lately, newest first, so
  /// that a resend reaches it at most once.
  std::map<std::int32_t, std::deque<std::string>> handed;
  /// Per own rank: what it reported of its latest updates (by key and attempt), newest first.
  /// A resend of an update the rank already answered says the coordinator lacks the answer: a
  /// node leader confirms a batch once it sent it on, and a leader that died right then lost
  /// it. The answer is sent again (the coordinator refuses what it has).
  struct answers_of_update {
    std::string key;
    update_id attempt;
    std::vector<rank_report> reports;
  };
  std::map<std::int32_t, std::deque<answers_of_update>> answers;
  static constexpr std::size_t answers_kept = 16;  ///< updates per rank, as `handed`
  caf::io::middleman_actor connector;              ///< opens connections without blocking
  /// Connects in flight (connect_privately), by the nonce their answer must carry.
  std::map<std::uint64_t, std::function<void(caf::strong_actor_ptr, const std::string&)>> connects;

  // Node leadership (docs/cluster.md, "Node leaders"). An endpoint leads its node, is a member
  // attached to its node's leader, or reports straight to the coordinator.
  std::uint16_t node_port = 0;   ///< where it takes its node's endpoints; 0: not offered
  std::uint64_t lead_epoch = 0;  ///< while it leads: the coordinator's epoch; else 0
  struct member_endpoint {
    consumer_actor handle;
    std::vector<std::int32_t> ranks;
  };
  std::map<caf::actor_addr, member_endpoint> members;  ///< while it leads: endpoints it carries
  /// Attaches for a leadership this endpoint has not heard of (yet): the coordinator tells the
  /// leader and the members in separate messages, so a member's attach may come first. Answered
  /// at this endpoint's next `lead` (accepted when it names that leadership), or dropped once
  /// too many wait (the member's request then times out and it reports straight).
  struct waiting_attach {
    attach_request request;
    consumer_actor handle;
    caf::typed_response_promise<std::string, std::string> promise;
  };
  std::deque<waiting_attach> attaches_waiting;
  static constexpr std::size_t max_attaches_waiting = 64;
  std::map<std::int32_t, caf::actor_addr> carried;  ///< their ranks
  /// Members whose reports sit in `pending`, and the newest batch number taken from each: they
  /// hear it (flushed_atom) once the batch went on to the coordinator.
  std::map<caf::actor_addr, std::uint64_t> unconfirmed_from;
  consumer_actor leader;           ///< as a member: the leader it reports through (or null)
  std::uint64_t member_epoch = 0;  ///< as a member: the leadership it attached (or attaches) to
  std::uint64_t batch_seq = 0;     ///< numbers the batches sent to the leader
  std::deque<report_batch> unconfirmed;  ///< sent to the leader, not yet passed on
};

using endpoint_pointer = consumer_actor::pointer;
using endpoint_state_ptr = std::shared_ptr<endpoint_state>;

/// Connects to host:port from a helper actor of its own and calls `done` on this endpoint with
/// the actor published there (null, and why, when there is none). CAF 0.17 matches a response
/// to its request by message id alone, and an actor's ids count up: a peer connected to this
/// endpoint's node port could answer the endpoint's own connect request with an actor of its
/// choosing, which would then be sent the cluster token (the join, or the attach to a leader).
/// The helper is never shown to a peer, so none can address it, and its answer comes back as a
/// message carrying a nonce only this endpoint knows. (consumer_leadership.cpp)
void connect_privately(endpoint_pointer self, const endpoint_state_ptr& st, std::string host,
                       std::uint16_t port,
                       std::function<void(caf::strong_actor_ptr, const std::string&)> done);

// --- node leadership (consumer_leadership.cpp) ------------------------------------------------

/// This endpoint's own ranks.
std::vector<std::int32_t> own_ranks(const endpoint_state_ptr& st);
/// Stops reporting through the node's leader; what it had not passed on goes straight.
void detach(endpoint_pointer self, const endpoint_state_ptr& st);
/// A member endpoint is carried no more; the coordinator hears it unless `tell` is false.
void member_gone(endpoint_pointer self, const endpoint_state_ptr& st, const caf::actor_addr& addr,
                 bool tell);
/// Stops leading the node: every member is let go.
void stop_leading(endpoint_pointer self, const endpoint_state_ptr& st, bool tell);
/// Attaches this endpoint's ranks to its node's leader at 127.0.0.1:port for leadership `epoch`.
void attach(endpoint_pointer self, const endpoint_state_ptr& st, std::uint16_t port,
            std::uint64_t epoch);
/// Takes a member endpoint's ranks on, for the leadership this endpoint holds: (token, refusal).
std::tuple<std::string, std::string> attach_accept(endpoint_pointer self,
                                                   const endpoint_state_ptr& st,
                                                   const attach_request& req,
                                                   const consumer_actor& handle);
/// Answers the attaches that waited for this endpoint's `lead`, now that it came.
void attaches_settle(endpoint_pointer self, const endpoint_state_ptr& st);

/// Keeps a report of one of this endpoint's own ranks (see endpoint_state::answers).
inline void remember_answer(endpoint_state& st, const rank_report& r) {
  auto& list = st.answers[r.rank];
  auto it = std::find_if(list.begin(), list.end(),
                         [&](const auto& a) { return a.key == r.key && a.attempt == r.update_id; });
  if (it == list.end()) {
    list.push_front({r.key, r.update_id, {}});
    if (list.size() > endpoint_state::answers_kept) list.pop_back();
    it = list.begin();
  }
  it->reports.push_back(r);
}

/// Forgets what `rank` reported of attempt `attempt` of `key`: it is handed that update again
/// (a catch-up of it), and a resend must replay the answers to this delivery, not the last.
inline void forget_answers(endpoint_state& st, std::int32_t rank, const std::string& key,
                           const update_id& attempt) {
  auto list = st.answers.find(rank);
  if (list == st.answers.end()) return;
  std::erase_if(list->second, [&](const auto& a) { return a.key == key && a.attempt == attempt; });
}

/// What rank `rank` reported of attempt `attempt` of `key` (empty: nothing yet, or forgotten).
inline std::vector<rank_report> answers_to(const endpoint_state& st, std::int32_t rank,
                                           const std::string& key, const update_id& attempt) {
  auto list = st.answers.find(rank);
  if (list == st.answers.end()) return {};
  for (const auto& a : list->second) {
    if (a.key == key && a.attempt == attempt) return a.reports;
  }
  return {};
}

/// Drops the update keys no rank owes an answer for any more, with their rejections: a key
/// left owed by nobody otherwise (a rank gone, or moved on) keeps its rejected list for good.
inline void forget_settled(endpoint_state& st) {
  for (auto it = st.owed.begin(); it != st.owed.end();) {
    if (!it->second.empty()) {
      ++it;
      continue;
    }
    st.rejected.erase(it->first);
    it = st.owed.erase(it);
  }
}

}  // namespace wsync::consumer_detail
